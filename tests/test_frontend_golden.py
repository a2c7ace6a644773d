"""The front-ends' outputs on fixed inputs, compared with what the code gave before their
engines were built through EngineArgs (tests/golden/frontends.json).

Compared: generated texts, exit statuses, error lines, batch output records, the keys of
`bench --json` and of a server response; never timings. `SPECULATIVE_WRITE_GOLDEN=1`
rewrites the file from the code as it is (only on purpose: it is the reference).
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

import pytest

from speculative.entrypoints.cli import main
from speculative.models.loading import ASSETS

pytestmark = pytest.mark.skipif(not (ASSETS / "verifier" / "config.json").is_file(),
                                reason="the shipped models are not in this checkout")
GOLDEN = Path(__file__).parent / "golden" / "frontends.json"
WRITE = os.environ.get("SPECULATIVE_WRITE_GOLDEN") == "1"
STATS = re.compile(r"^\[\d+ tokens in [\d.]+ s: [\d.]+ tokens/s \| acceptance rate [\d.]+ \| [\d.]+ tokens per "
                   r"target forward\]$")
RECORDS = [{"id": "text", "prompt": "def add(a, b):", "max_tokens": 12},
           {"id": "ids", "prompt": [1, 2, 3], "max_tokens": 4},
           {"id": "stop", "prompt": "import os\nimport sys\n", "max_tokens": 24, "stop": ["\n\n"]},
           {"id": "chat", "messages": [{"role": "user", "content": "hi"}]},
           {"id": "bad-seed", "prompt": "x", "temperature": 1, "seed": 1.5},
           {"id": "bad-budget", "prompt": "x", "max_tokens": -1}]
# The same mistakes on each front-end: (name, options); `{}` is where a front-end's own arguments go.
MISTAKES = [("lookup with vocab", ["--draft", "ngram", "--draft-vocab", "8"]),
            ("none with K", ["--draft", "none", "-k", "3"]),
            ("ngram sizes for a model", ["--draft", "default-draft", "--ngram-min", "2"]),
            ("ngram sizes crossed", ["--ngram-min", "5", "--ngram-max", "2"]),
            ("tree nodes without trees", ["--tree-max-tokens", "8"]),
            ("corpus without vocab", ["--draft-vocab-corpus", "x.txt"]),
            ("meta device", ["--device", "meta"]),
            ("bad device", ["--device", "tpu"]),
            ("K zero", ["-k", "0"]),
            ("K above the bound", ["-k", "65"]),
            ("bad dtype", ["--dtype", "float64"]),
            ("negative vocab", ["--draft", "default-draft", "--draft-vocab", "-1"])]
BENCH_MISTAKES = [("meta device", ["--device", "meta"]), ("bad dtype", ["--dtype", "float64"]),
                  ("trees of one child", ["--tree-top-k", "1"]), ("K list", ["--k", "0,2"])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(capsys, argv: list[str]) -> dict:
    capsys.readouterr()
    status = main(argv)
    out = capsys.readouterr()
    return {"status": status, "stdout": out.out, "stderr": out.err}


def front_ends(tmp_path) -> dict:
    """Each front-end's arguments before the options of a mistake."""
    records = tmp_path / "in.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return {"generate": ["generate", "--max-new-tokens", "4"],
            "serve": ["serve", "--port", str(free_port())],
            "batch": ["batch", str(records), str(tmp_path / "mistake.jsonl"), "--no-progress"]}


def generate_texts(capsys, tmp_path) -> dict:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "class Stack:", "max_new_tokens": 6}\n')
    cases = {"default": ["--max-new-tokens", "16"],
             "none": ["--draft", "none", "--max-new-tokens", "16"],
             "ngram": ["--draft", "ngram", "--max-new-tokens", "16", "--prompt", "def f(x):\n    return x\n"],
             "s4d fixed": ["--draft", "s4d", "--fixed-k", "-k", "3", "--max-new-tokens", "16"],
             "tree": ["--tree-top-k", "2", "--tree-max-tokens", "6", "--max-new-tokens", "16"],
             "stream": ["--stream", "--max-new-tokens", "8"],
             "sampled": ["--temperature", "0.8", "--seed", "3", "--fixed-k", "--max-new-tokens", "12"],
             "jsonl": ["--prompt-file", str(prompts), "--max-new-tokens", "8"]}
    found = {}
    for name, options in cases.items():
        result = run(capsys, ["generate", *options])
        lines = (result["stdout"] if name != "jsonl" else result["stderr"]).rstrip("\n").split("\n")
        assert STATS.match(lines[-1]), lines[-1]
        found[name] = {"status": result["status"],
                       "stdout": result["stdout"] if name == "jsonl" else "\n".join(lines[:-1])}
    return found


def batch_records(capsys, tmp_path) -> dict:
    records = tmp_path / "in.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    found = {}
    for name, options in {"default": [], "none": ["--draft", "none"], "fixed": ["--fixed-k", "-k", "2"]}.items():
        out = tmp_path / f"{name.replace(' ', '-')}.jsonl"
        result = run(capsys, ["batch", str(records), str(out), "--no-progress", "--max-batch-size", "2", *options])
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        found[name] = {"status": result["status"], "stderr": re.sub(r"[\d.]+ s: [\d.]+ tokens/s", "T",
                                                                    result["stderr"]),
                       "records": sorted(({k: v for k, v in r.items() if k not in ("drafted", "accepted",
                                                                                    "target_forwards")}
                                          | {"keys": sorted(r)} for r in lines), key=lambda r: r["id"])}
    return found


def bench_keys(capsys, tmp_path) -> dict:
    found = {}
    cases = {"default": ["--limit", "1", "--runs", "1", "--k", "2", "--max-new-tokens", "6", "--no-peers", "--json"],
             "trees": ["--limit", "1", "--runs", "1", "--k", "3", "--max-new-tokens", "6", "--no-peers", "--json",
                       "--draft", "default-draft", "--draft-vocab", "256", "--tree-top-k", "2", "--tree-max-tokens",
                       "4", "--no-adaptive", "--no-ngram"]}
    for name, options in cases.items():
        result = run(capsys, ["bench", *options])
        report = json.loads(result["stdout"].splitlines()[-1])
        found[name] = {"status": result["status"], "keys": sorted(report),
                       "target": report["target"], "prompts": report["prompts"], "runs": report["runs"],
                       "max_new_tokens": report["max_new_tokens"],
                       "methods": [[m["name"], m["draft"], m["k"], m["adaptive"], m["identical"], sorted(m)]
                                   for m in report["methods"]]}
    return found


def mistakes(capsys, tmp_path) -> dict:
    found = {}
    for front, argv in front_ends(tmp_path).items():
        for name, options in MISTAKES:
            found[f"{front}: {name}"] = run(capsys, [*argv, *options])
    for name, options in BENCH_MISTAKES:
        found[f"bench: {name}"] = run(capsys, ["bench", "--limit", "1", *options])
    for name, options in [("negative", ["--seed", "-3"]), ("past 64 bits", ["--seed", str(2 ** 64)])]:
        found[f"generate: seed {name}"] = run(capsys, ["generate", "--max-new-tokens", "4", *options])
    return found


def server_replies(tmp_path) -> dict:
    """One server's JSON: a completion, a chat refused (no template), a bad seed, the models."""
    from tests.serving import Server

    server = Server("--max-batch-size", "2")
    try:
        server.wait_healthy()
        done = server.post("/v1/completions", {"model": "default", "prompt": "def add(a, b):", "max_tokens": 8,
                                                "temperature": 0}).json()
        chat = server.post("/v1/chat/completions", {"model": "default", "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": "hi"}]})
        seed = server.post("/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 2, "seed": 1.5})
        import httpx

        models = httpx.get(server.url + "/v1/models").json()
    finally:
        assert server.stop() == 0
    return {"completion keys": sorted(done), "choice keys": sorted(done["choices"][0]),
            "text": done["choices"][0]["text"], "usage": done["usage"], "speculative keys": sorted(done["speculative"]),
            "chat": [chat.status_code, chat.json()], "seed": [seed.status_code, seed.json()],
            "models": [sorted(models), sorted(models["data"][0]), models["data"][0]["max_model_len"]]}


SECTIONS = {"generate": generate_texts, "batch": batch_records, "bench": bench_keys, "mistakes": mistakes}


@pytest.fixture(scope="module")
def golden() -> dict:
    return {} if WRITE else json.loads(GOLDEN.read_text())


def normalized(found: dict) -> dict:
    """JSON-able, with this checkout's asset folder (named in some errors) as ASSETS."""
    return json.loads(json.dumps(found).replace(json.dumps(str(ASSETS))[1:-1], "ASSETS"))


def record(section: str, found: dict) -> None:
    data = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {}
    data[section] = found
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("section", SECTIONS)
def test_front_end_output_is_what_it_was(section, capsys, tmp_path, golden, monkeypatch):
    monkeypatch.chdir(tmp_path)  # paths in errors are the ones given, relative ones alike
    found = normalized(SECTIONS[section](capsys, tmp_path))
    if WRITE:
        return record(section, found)
    expected = golden[section]
    assert sorted(found) == sorted(expected)
    for name in expected:
        assert found[name] == expected[name], name


def test_server_json_is_what_it_was(tmp_path, golden):
    found = normalized(server_replies(tmp_path))
    if WRITE:
        return record("serve", found)
    assert found == golden["serve"]
