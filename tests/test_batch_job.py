"""`speculative batch` in this process: records in, one output line per id, each greedy record
equal to its prompt decoded alone by the target; bad records get errors; a killed job resumes
without writing an id twice. (On Ray: test_batch_ray.py.)"""

import json
import os
import signal
import subprocess
import time

import pytest

from speculative import autoregressive_generate, load_model, load_tokenizer
from speculative.entrypoints.batch import ModelSpec, request_of, run_local
from speculative.entrypoints.batch_files import OutputFile
from speculative.entrypoints.cli import main
from speculative.models.loading import ASSETS
from tests.test_cli_errors import command, environment

pytestmark = pytest.mark.skipif(not (ASSETS / "verifier" / "config.json").is_file(),
                                reason="the shipped models are not in this checkout")

STARTS = ["def read_lines(path):\n    ", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
          "    for i in range(10):\n        ", "def parse(text):\n    \"\"\"Parse the text.\"\"\"\n",
          "    if not isinstance(value, int):\n        raise ", "from collections import ", "    return self."]


def records(count: int, max_tokens: int = 16, sampled_every: int = 0) -> list[dict]:
    """`count` greedy records of varied prompts and budgets (every `sampled_every`-th one
    sampled with its own seed instead)."""
    rows = []
    for i in range(count):
        row = {"id": f"r{i}", "prompt": STARTS[i % len(STARTS)] + f"# {i}\n", "max_tokens": max_tokens + i % 5}
        if sampled_every and i % sampled_every == 0:
            row.update(temperature=0.8, seed=100 + i)
        rows.append(row)
    return rows


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def read_output(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def pair():
    return load_model("default"), load_tokenizer("default")


def alone(pair, row: dict) -> list[int]:
    """The target's own greedy tokens for one record, decoded alone."""
    target, tokenizer = pair
    ids = row["prompt"] if isinstance(row["prompt"], list) else tokenizer.encode(row["prompt"])
    return autoregressive_generate(target, ids, row["max_tokens"], eos_token_id=tokenizer.eos_token_ids or None)


def test_every_greedy_record_equals_its_prompt_alone(tmp_path, pair):
    rows = records(10) + [{"id": 7, "prompt": pair[1].encode("def main():\n"), "max_tokens": 12}]
    write_jsonl(tmp_path / "in.jsonl", rows)
    summary = run_local(tmp_path / "in.jsonl", tmp_path / "out.jsonl", ModelSpec(max_batch_size=4),
                        show_progress=False)
    out = {row["id"]: row for row in read_output(tmp_path / "out.jsonl")}
    assert sorted(out, key=str) == sorted((row["id"] for row in rows), key=str)
    assert summary.records == 11 and summary.errors == 0 and summary.tokens == sum(len(r["token_ids"])
                                                                                   for r in out.values())
    for row in rows:
        got = out[row["id"]]
        assert got["token_ids"] == alone(pair, row), row["id"]
        assert got["text"] == pair[1].decode(got["token_ids"])
        assert got["finish_reason"] == "length" and len(got["token_ids"]) == row["max_tokens"]
        assert 0 <= got["accepted"] <= got["drafted"] and 1 <= got["target_forwards"] <= row["max_tokens"]
    assert 0 < summary.step_seconds <= summary.seconds
    assert 0 < summary.ready_seconds < summary.first_record_seconds < summary.seconds


def test_seeded_sampled_records_do_not_depend_on_the_batch(tmp_path):
    rows = records(8, sampled_every=1)
    write_jsonl(tmp_path / "in.jsonl", rows)
    outs = []
    for size in (1, 8):
        run_local(tmp_path / "in.jsonl", tmp_path / f"out{size}.jsonl", ModelSpec(max_batch_size=size),
                  show_progress=False)
        outs.append({row["id"]: row["token_ids"] for row in read_output(tmp_path / f"out{size}.jsonl")})
    assert outs[0] == outs[1]
    assert len({tuple(tokens) for tokens in outs[0].values()}) == len(rows)  # the rows are not all alike


def test_bad_records_get_errors_and_the_others_succeed(tmp_path, capsys):
    bad = {
        "no-prompt": ({"id": "no-prompt", "max_tokens": 4}, "needs either \"prompt\""),
        "wrong-type": ({"id": "wrong-type", "prompt": 5}, "\"prompt\" must be a string or a list of token ids"),
        "too-long": ({"id": "too-long", "prompt": [1] * 500, "max_tokens": 20},
                     "exceed the models' maximum length of 512"),
        "out-of-range": ({"id": "out-of-range", "prompt": [1, 99999]}, "token id 99999, outside the vocabulary"),
        "budget": ({"id": "budget", "prompt": "x", "max_tokens": "ten"}, "\"max_tokens\" must be an integer"),
        "temperature": ({"id": "temperature", "prompt": "x", "temperature": -1}, "\"temperature\" must be"),
        "seed": ({"id": "seed", "prompt": "x", "temperature": 1, "seed": 1.5}, "\"seed\" must be an integer"),
        "stop": ({"id": "stop", "prompt": "x", "stop": [""]}, "\"stop\" must be a string or a list"),
        "both": ({"id": "both", "prompt": "x", "messages": []}, "not both"),
        "chat": ({"id": "chat", "messages": [{"role": "user", "content": "hi"}]}, "has no chat template"),
    }
    good = records(3, max_tokens=8)
    rows = [good[0], *(row for row, _ in bad.values()), *good[1:]]
    write_jsonl(tmp_path / "in.jsonl", rows)
    assert main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--no-progress"]) == 0
    assert f"{len(rows)} records ({len(bad)} with errors" in capsys.readouterr().err
    out = {row["id"]: row for row in read_output(tmp_path / "out.jsonl")}
    assert len(out) == len(rows)
    for name, (_, message) in bad.items():
        assert set(out[name]) == {"id", "error", "request_hash"} and message in out[name]["error"], out[name]
    for row in good:
        assert len(out[row["id"]]["token_ids"]) == row["max_tokens"] and "error" not in out[row["id"]]


def test_a_job_whose_records_all_fail_says_so(tmp_path, capsys):
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": 5}, {"id": 2}])
    assert main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--no-progress"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("error: all 2 records failed; the first: id 1: \"prompt\" must be"), err
    assert len(read_output(tmp_path / "out.jsonl")) == 2


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "x"}'], "line 1 has no \"id\""),
    (['{"id": 1, "prompt": "x"}', "", '{"id": 1, "prompt": "y"}'], "line 3: id 1 is already used by"),
    (['{"id": 1, "prompt": "x"}', "{oops"], "line 2 is not JSON"),
    (['{"id": [1], "prompt": "x"}'], "\"id\" must be a string or an integer"),
])
def test_input_that_cannot_be_answered_by_id_is_refused_whole(tmp_path, capsys, lines, message):
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "out.jsonl").exists()  # refused before any work


def test_stop_strings_cut_text_and_tokens(tmp_path, pair):
    row = {"id": "s", "prompt": STARTS[0], "max_tokens": 24}
    tokens = alone(pair, row)
    text = pair[1].decode(tokens)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = next(n for n in range(1, len(tokens) + 1) if stop in pair[1].decode(tokens[:n]))
    write_jsonl(tmp_path / "in.jsonl", [{**row, "stop": ["never appears", stop]}, records(1)[0]])
    run_local(tmp_path / "in.jsonl", tmp_path / "out.jsonl", ModelSpec(), show_progress=False)
    out = {r["id"]: r for r in read_output(tmp_path / "out.jsonl")}
    assert out["s"]["finish_reason"] == "stop" and out["s"]["text"] == text[:text.index(stop)]
    assert out["s"]["token_ids"] == tokens[:cut] and cut < len(tokens)
    assert out["r0"]["finish_reason"] == "length"


def test_parquet_input_gives_what_jsonl_gives(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = records(4, sampled_every=2)
    write_jsonl(tmp_path / "in.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    for name in ("in.jsonl", "in.parquet"):
        run_local(tmp_path / name, tmp_path / f"{name}.out", ModelSpec(), show_progress=False)
    assert read_output(tmp_path / "in.jsonl.out") == read_output(tmp_path / "in.parquet.out")


def test_messages_go_through_the_chat_template(pair):
    transformers = pytest.importorskip("transformers")
    from speculative.models.text import TextTokenizer

    backend = transformers.PreTrainedTokenizerFast(tokenizer_file=str(ASSETS / "tokenizer.json"))
    backend.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    tokenizer = TextTokenizer(backend, "shipped with a template", eos_token_ids=[])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f():"}]
    ids, params, stops = request_of({"id": 1, "messages": messages, "max_tokens": 5}, tokenizer, ModelSpec())
    assert ids == tokenizer.encode("<system>Be brief.\n<user>def f():\n<assistant>")
    assert params.max_new_tokens == 5 and params.temperature == 0 and stops == ()
    with pytest.raises(ValueError, match="messages must be a non-empty list"):
        request_of({"id": 1, "messages": [{"role": "user"}]}, tokenizer, ModelSpec())


@pytest.mark.slow  # long end to end: a real job killed, then run again
def test_resume_after_a_killed_job_writes_every_id_once(tmp_path):
    """A real job killed (SIGKILL) after a few records, a partly written line left behind,
    then the same command again: every id exactly once, as an uninterrupted job gives."""
    rows = records(24, max_tokens=24)
    write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    job = ["batch", tmp_path / "in.jsonl", out, "--max-batch-size", "2", "--no-progress"]
    process = subprocess.Popen(command(*job), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=environment())
    try:
        deadline = time.monotonic() + 120
        while (not out.exists() or out.read_text().count("\n") < 3) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    written = out.read_text().count("\n")
    assert 3 <= written < len(rows), "the job was not killed midway"
    with open(out, "a") as f:
        f.write('{"id": "r23", "text": "half')  # as if killed in the middle of a line
    assert OutputFile(out).done == {row["id"] for row in read_output_complete(out)}
    result = subprocess.run(command(*job), capture_output=True, env=environment(), timeout=300)
    assert result.returncode == 0, result.stderr.decode()
    assert "already done" in result.stderr.decode()
    ids = [row["id"] for row in read_output(out)]
    assert sorted(ids) == sorted(row["id"] for row in rows)  # each once, none missing
    run_local(tmp_path / "in.jsonl", tmp_path / "whole.jsonl", ModelSpec(max_batch_size=2), show_progress=False)
    whole = {row["id"]: row["token_ids"] for row in read_output(tmp_path / "whole.jsonl")}
    assert {row["id"]: row["token_ids"] for row in read_output(out)} == whole


def read_output_complete(path) -> list[dict]:
    """The records of the complete lines only."""
    text = path.read_text()
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]
