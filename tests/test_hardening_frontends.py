"""Issue 33 for the front-ends (export, batch, serve, the command line, train, loading), each
tested as a class of failure:

- an export completes or leaves its destination exactly as it was (links, failures at each
  step), with the user's umask, and names the extra it needs;
- a batch OUTPUT that is its INPUT (by any path or link), or that cannot be resumed from, is
  refused before either file is touched;
- every malformed body gets a 400 (or 413) in OpenAI's error format, from a real server that
  goes on serving the requests around it;
- what `serve` is told (address, port, chat template, key) is checked before it serves;
- options that do nothing with the chosen draft are refused, on every front-end;
- strings that are not Unicode text in JSON-lines input fail naming the line;
- a closed stdout exits 141 quietly, Ctrl-C before a command runs exits 130 on one line;
- train's time budget holds inside its long steps;
- bad model configs and corrupt weight files fail naming the file and the field.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from speculative import save_model
from speculative.entrypoints.cli import main
from speculative.models.loading import ASSETS
from tests.helpers import tiny
from tests.serving import TIMEOUT, Server
from tests.test_cli_errors import command, environment, error_line, refused, refused_in_process, speculative

pytestmark = pytest.mark.skipif(not (ASSETS / "verifier" / "config.json").is_file(),
                                reason="the shipped models are not in this checkout")


def snapshot(root: Path) -> dict:
    """Everything under `root` (links not followed): path -> (kind, mode, content or link)."""
    seen = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                seen[str(path.relative_to(root))] = ("link", os.readlink(path))
            elif stat.S_ISDIR(info.st_mode):
                seen[str(path.relative_to(root))] = ("dir", stat.S_IMODE(info.st_mode))
            else:
                seen[str(path.relative_to(root))] = ("file", stat.S_IMODE(info.st_mode), path.read_bytes())
    return seen


# --- export: complete, or the destination exactly as it was --------------------------------

@pytest.fixture
def llama_export():
    pytest.importorskip("transformers")
    from speculative.entrypoints.export import export_llama

    return export_llama


def exported(directory: Path) -> bool:
    return (directory / "config.json").is_file() and (directory / "model.safetensors").is_file()


def test_export_with_force_onto_a_link_replaces_what_it_points_to_and_keeps_the_link(tmp_path, llama_export):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "old.bin").write_bytes(b"x")
    (tmp_path / "link").symlink_to("real")
    assert llama_export(tiny("decoder_only"), tmp_path / "link", force=True) == tmp_path / "link"
    assert os.readlink(tmp_path / "link") == "real" and exported(tmp_path / "real")
    assert not (tmp_path / "real" / "old.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # nothing stray beside them


@pytest.mark.parametrize("target", ["nowhere", "loop"])
def test_export_onto_a_broken_link_is_refused_and_changes_nothing(tmp_path, llama_export, target):
    (tmp_path / "link").symlink_to(target)
    (tmp_path / "loop").symlink_to("loop")
    before = snapshot(tmp_path)
    with pytest.raises(FileNotFoundError, match="link is a symbolic link to .*which does not exist"):
        llama_export(tiny("decoder_only"), tmp_path / "link", force=True)
    assert snapshot(tmp_path) == before


def test_export_onto_a_link_to_a_file_is_refused(tmp_path, llama_export):
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to("file")
    before = snapshot(tmp_path)
    with pytest.raises(FileExistsError, match="link is a file"):
        llama_export(tiny("decoder_only"), tmp_path / "link", force=True)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("where", ["the current directory", "a directory that holds it"])
def test_export_never_replaces_the_directory_it_runs_in(tmp_path, llama_export, monkeypatch, where):
    (tmp_path / "work" / "sub").mkdir(parents=True)
    (tmp_path / "work" / "sub" / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path / "work" / "sub")
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match="the current directory or one that holds it"):
        llama_export(tiny("decoder_only"), Path(".") if where == "the current directory" else tmp_path / "work",
                     force=True)
    assert snapshot(tmp_path) == before


def failing_at(step: str, monkeypatch):
    """Make one step of replacing the destination fail, as a full disk or a race would."""
    import shutil

    from speculative.entrypoints import export

    real_rename, real_rmtree = Path.rename, shutil.rmtree
    if step == "moving the old directory aside":
        monkeypatch.setattr(Path, "rename", lambda self, to: (_ for _ in ()).throw(OSError("rename refused"))
                            if str(to).endswith(".old") else real_rename(self, to))
    elif step == "moving the new directory in":
        monkeypatch.setattr(Path, "rename", lambda self, to: (_ for _ in ()).throw(OSError("rename refused"))
                            if str(self).endswith(".partial") else real_rename(self, to))
    elif step == "removing the old directory":
        monkeypatch.setattr(export.shutil, "rmtree", lambda path, *a, **k: (_ for _ in ()).throw(
            OSError("busy")) if str(path).endswith(".old") else real_rmtree(path, *a, **k))


@pytest.mark.parametrize("step", ["moving the old directory aside", "moving the new directory in"])
@pytest.mark.parametrize("through_link", [False, True])
def test_an_export_that_fails_while_replacing_leaves_the_destination_as_it_was(tmp_path, llama_export, monkeypatch,
                                                                              step, through_link):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    if through_link:
        (tmp_path / "link").symlink_to("out")
    before = snapshot(tmp_path)
    failing_at(step, monkeypatch)
    with pytest.raises(OSError, match="rename refused"):
        llama_export(tiny("decoder_only"), tmp_path / ("link" if through_link else "out"), force=True)
    assert snapshot(tmp_path) == before


def test_an_old_copy_that_cannot_be_removed_does_not_turn_a_complete_export_into_a_failure(tmp_path, llama_export,
                                                                                          monkeypatch, caplog):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    failing_at("removing the old directory", monkeypatch)
    assert llama_export(tiny("decoder_only"), tmp_path / "out", force=True) == tmp_path / "out"
    assert exported(tmp_path / "out") and not (tmp_path / "out" / "keep.txt").exists()
    old = [p for p in tmp_path.iterdir() if p.name != "out"]
    assert len(old) == 1 and str(old[0]) in caplog.text and "could not be removed" in caplog.text


def test_exported_files_follow_the_umask(tmp_path, llama_export):
    previous = os.umask(0o027)
    try:
        llama_export(tiny("decoder_only"), tmp_path / "out")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o750
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o640}, modes


def test_export_without_transformers_names_the_extra_before_loading_anything(tmp_path):
    (tmp_path / "out").mkdir()
    refused(speculative("export", "default-draft", tmp_path / "out", block="transformers"),
            "needs transformers", "pip install 'speculative[hf]'")
    assert list((tmp_path / "out").iterdir()) == []


# --- batch: OUTPUT is never INPUT ----------------------------------------------------------

RECORDS = [{"id": 1, "prompt": "def f():"}, {"id": 2, "prompt": "import os"}]


def make_input(tmp_path: Path) -> Path:
    (tmp_path / "data").mkdir()
    path = tmp_path / "data" / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS)[:-1])  # no newline at the end, as editors leave it
    return path


OUTPUTS = {
    "the same path": lambda path: path,
    "another spelling": lambda path: path.parent / ".." / "data" / "." / path.name,
    "a relative path": lambda path: Path(os.path.relpath(path)),
    "a symbolic link": lambda path: (path.parent / "link.jsonl").symlink_to(path.name) or path.parent / "link.jsonl",
    "a hard link": lambda path: os.link(path, path.parent / "hard.jsonl") or path.parent / "hard.jsonl",
}


@pytest.mark.parametrize("how", OUTPUTS)
def test_batch_refuses_an_output_that_is_its_input_before_touching_either(tmp_path, capsys, how):
    path = make_input(tmp_path)
    output = OUTPUTS[how](path)
    before = snapshot(tmp_path)
    words = ["is INPUT", "give another file"] + (["through a link"] if "link" in how else [])
    refused_in_process(capsys, ["batch", str(path), str(output), "--no-progress"], *words)
    assert snapshot(tmp_path) == before


def test_batch_refuses_the_same_file_in_the_library_and_on_ray_too(tmp_path):
    from speculative.entrypoints.batch import ModelSpec, run_local

    path = make_input(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match="is INPUT"):
        run_local(path, path, ModelSpec(), show_progress=False)
    pytest.importorskip("ray")
    from speculative.entrypoints.batch_ray import run_ray

    with pytest.raises(ValueError, match="is INPUT"):
        run_ray(path, path, ModelSpec(), show_progress=False)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("output", ["pipe", "/dev/null"])
def test_batch_refuses_an_output_it_cannot_read_back_instead_of_waiting_forever(tmp_path, output):
    path = make_input(tmp_path)
    os.mkfifo(tmp_path / "pipe")
    # A real process with a deadline: reading back a pipe nobody writes to would wait forever.
    result = subprocess.run(command("batch", path, tmp_path / output), capture_output=True, env=environment(),
                            timeout=120)
    refused(result, "is not a regular file", "give a file path")


# --- strings that are not Unicode text in JSON lines ---------------------------------------

SURROGATE_LINE = '{"id": 2, "prompt": "caf\\udce9"}'


@pytest.mark.parametrize("front_end", ["generate", "batch", "bench"])
def test_a_lone_surrogate_in_a_jsonl_file_is_refused_naming_the_line(tmp_path, capsys, front_end):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": 1, "prompt": "ok"}\n\n' + SURROGATE_LINE + "\n")
    args = {"generate": ["generate", "--prompt-file", str(path)],
            "batch": ["batch", str(path), str(tmp_path / "out.jsonl")],
            "bench": ["bench", "--prompts", str(path)]}[front_end]
    refused_in_process(capsys, args, "p.jsonl line 3", '"prompt" is not Unicode text', "lone surrogate")
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("line, words", [
    ('{"id": "\\ud800", "prompt": "x"}', ['"id" is not Unicode text']),
    ('{"id": 3, "messages": [{"role": "user", "content": "\\udfff"}]}', ['"messages"[0]["content"]']),
    ('{"id": 3, "prompt": "x", "stop": ["\\ud800"]}', ['"stop"[0]']),
    ('{"id": 3, "prompt": "x", "\\ud800": 1}', ["a key of the object"]),
    ('{"id": 3, "prompt": "x", "temperature": NaN}', ["line 2 is not plain JSON", "NaN"]),
    ('{"id": 3, "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", ["line 2 is nested too deeply"]),
], ids=["id", "message", "stop", "key", "NaN", "nesting"])
def test_batch_input_lines_that_no_output_could_hold_are_refused_with_their_line(tmp_path, capsys, line, words):
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": 1, "prompt": "ok"}\n' + line + "\n")
    refused_in_process(capsys, ["batch", str(path), str(tmp_path / "out.jsonl")], "in.jsonl line 2", *words)
    assert not (tmp_path / "out.jsonl").exists()


def test_batch_record_errors_name_the_record_fields_not_the_engine_ones(tmp_path):
    from speculative.entrypoints.batch import ModelSpec, run_local

    rows = [{"id": "huge", "prompt": "x", "max_tokens": 10 ** 12},
            {"id": "long", "prompt": "x = 1\n" * 200, "max_tokens": 400},
            {"id": "ok", "prompt": "def f():", "max_tokens": 2}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_local(tmp_path / "in.jsonl", tmp_path / "out.jsonl", ModelSpec(), show_progress=False)
    out = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert out["huge"]["error"].startswith('"max_tokens" must be an integer in 0..')
    assert '"max_tokens" is 400' in out["long"]["error"] and 'allowed "max_tokens" <=' in out["long"]["error"]
    assert all("max_new_tokens" not in r.get("error", "") for r in out.values())
    assert len(out["ok"]["token_ids"]) == 2


# --- options that do nothing with the chosen draft ------------------------------------------

MODEL_OPTIONS = [["--draft-vocab", "64"], ["--draft-dtype", "float32"], ["--draft-temperature", "0.5"]]
DRAFTING = [["-k", "3"], ["--fixed-k"], ["--tree-top-k", "2"]]


def front_end_args(front_end: str, tmp_path: Path) -> list[str]:
    if front_end == "generate":
        return ["generate", "--max-new-tokens", "2"]
    if front_end == "batch":
        path = tmp_path / "in.jsonl"
        path.write_text(json.dumps(RECORDS[0]) + "\n")
        return ["batch", str(path), str(tmp_path / "out.jsonl"), "--no-progress"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return ["serve", "--port", str(port)]


@pytest.mark.parametrize("front_end", ["generate", "batch", "serve"])
@pytest.mark.parametrize("draft, option", [(d, o) for d in ("ngram", "suffix", "none") for o in MODEL_OPTIONS]
                         + [("none", o) for o in DRAFTING])
def test_options_that_do_nothing_with_the_draft_are_refused_before_loading(tmp_path, capsys, monkeypatch,
                                                                           front_end, draft, option):
    import speculative as package

    monkeypatch.setattr(package, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    refused_in_process(capsys, [*front_end_args(front_end, tmp_path), "--draft", draft, *option],
                       option[0], f"nothing with --draft {draft}")
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("front_end", ["generate", "batch", "serve"])
@pytest.mark.parametrize("option, words", [
    (["--draft-vocab-corpus", "x.jsonl"], ["--draft-vocab-corpus applies with --draft-vocab N"]),
    (["--tree-max-tokens", "8"], ["--tree-max-tokens applies to token trees", "--tree-top-k 2 or more"]),
])
def test_options_that_need_another_option_are_refused(tmp_path, capsys, monkeypatch, front_end, option, words):
    import speculative as package

    monkeypatch.setattr(package, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    refused_in_process(capsys, [*front_end_args(front_end, tmp_path), "--draft", "default-draft", *option], *words)


def test_the_same_options_with_a_draft_model_still_run(capsys):
    assert main(["generate", "--draft", "default-draft", "--draft-vocab", "512", "--draft-dtype", "float32",
                 "--draft-temperature", "0.5", "--tree-top-k", "2", "--tree-max-tokens", "8", "--max-new-tokens",
                 "8"]) == 0
    assert "8 tokens in" in capsys.readouterr().out


# --- the process: closed stdout, Ctrl-C, --help ----------------------------------------------

@pytest.mark.parametrize("args", [["generate", "--max-new-tokens", "3"],
                                  ["generate", "--max-new-tokens", "3", "--stream"]])
def test_a_closed_stdout_exits_141_quietly(args):
    result = subprocess.run(command(*args), capture_output=False, stderr=subprocess.PIPE, env=environment(),
                            timeout=300, preexec_fn=lambda: os.close(1))
    assert (result.returncode, result.stderr) == (141, b"")


def test_ctrl_c_before_the_command_runs_exits_130_on_one_line(capsys, monkeypatch):
    from speculative.entrypoints import train_head_command

    def interrupted(sub):
        raise KeyboardInterrupt  # as Ctrl-C while main imports the commands' modules

    monkeypatch.setattr(train_head_command, "add_train_head", interrupted)
    assert main(["generate"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_help_lists_every_exit_status():
    help_text = " ".join(speculative("--help").stdout.decode().split())
    for status in ("0 done", "1 failed", "2 bad usage", "3 the port to serve on is in use", "130 interrupted",
                   "143 terminated", "141 stdout closed"):
        assert status in help_text, status


# --- serve: checked before serving -----------------------------------------------------------

def test_a_port_out_of_range_is_refused_at_once():
    refused(speculative("serve", "--port", "70000"), "argument --port: must be an integer in 1..65535, got 70000")


def test_a_busy_port_exits_3_before_loading_a_model(capsys, monkeypatch):
    import speculative as package

    monkeypatch.setattr(package, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 3
        assert error_line(3, capsys.readouterr().err, f"port {port} on 127.0.0.1 is in use")
        result = speculative("serve", "--port", port)  # the real process, as a script sees it
        assert result.returncode == 3 and error_line(3, result.stderr.decode(), "is in use")


@pytest.mark.parametrize("args, words", [
    (["--host", "no-such-host.invalid"], ["--host 'no-such-host.invalid' is not an address"]),
    (["--host", "192.0.2.1"], ["cannot serve on --host 192.0.2.1"]),  # an address of no machine here
    (["--api-key", " "], ["--api-key is empty"]),
])
def test_bad_addresses_and_keys_are_refused_before_loading_a_model(capsys, monkeypatch, args, words):
    import speculative as package

    monkeypatch.setattr(package, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    refused_in_process(capsys, ["serve", *args], *words)


@pytest.mark.parametrize("template, words", [
    ("{% for m in messages %}{{ m.content }", ["line 1 is not a Jinja template"]),
    ("{{ messages | nosuchfilter }}", ["cannot render a chat of one user turn", "nosuchfilter"]),
    ("{{ messages[3].content }}", ["cannot render a chat of one user turn", "UndefinedError"]),
    ("{{ raise_exception('only system turns') }}", ["cannot render", "only system turns"]),
    ("{% if false %}x{% endif %}", ["renders a chat of one user turn as no tokens"]),
])
def test_a_broken_chat_template_is_refused_at_start_up(tmp_path, capsys, monkeypatch, template, words):
    from speculative.entrypoints.serve import command

    monkeypatch.setattr(command, "warm_up", lambda *a: pytest.fail("the server started with a broken template"))
    (tmp_path / "t.jinja").write_text(template)
    refused_in_process(capsys, [*front_end_args("serve", tmp_path), "--chat-template", str(tmp_path / "t.jinja")],
                       "--chat-template", *words)


# --- serve: a malformed-body corpus against a real server -----------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
# A template that refuses system turns, as many do: a client error, not a server one.
TEMPLATE = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
            "<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def raw(text: str) -> bytes:
    return text.encode("utf-8")


MALFORMED = [  # (path, body, status, param, words)
    (COMPLETIONS, raw('{"model": "default", "prompt": "\\ud800", "max_tokens": 2}'), 400, "prompt", ["lone surrogate"]),
    (COMPLETIONS, raw('{"model": "default", "prompt": ["ok", "\\udfff"]}'), 400, "prompt[1]", ["lone surrogate"]),
    (COMPLETIONS, raw('{"model": "\\ud800", "prompt": "x"}'), 400, "model", ["lone surrogate"]),
    (COMPLETIONS, raw('{"model": "default", "prompt": "x", "stop": "\\ud800"}'), 400, "stop", ["lone surrogate"]),
    (COMPLETIONS, raw('{"model": "default", "prompt": "x", "\\ud800": 1}'), 400, None, ["key"]),
    (CHAT, raw('{"model": "default", "messages": [{"role": "user", "content": "\\ud83d"}]}'), 400,
     "messages[0].content", ["lone surrogate"]),
    (COMPLETIONS, b'{"model": "default", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None,
     ["nested too deeply"]),
    (COMPLETIONS, b"[" * 100_000, 400, None, ["nested too deeply"]),
    (COMPLETIONS, b'{"model": "default", "prompt": ' + b"[" * 500 + b"1" + b"]" * 500 + b"}", 400, "prompt",
     ["nested too deeply"]),
    (COMPLETIONS, b'{"a": ' * 5000 + b"1" + b"}" * 5000, 400, None, ["nested too deeply"]),
    (COMPLETIONS, raw('{"model": "default", "prompt": "x", "temperature": NaN}'), 400, None, ["NaN"]),
    (COMPLETIONS, raw('{"model": "default", "prompt": "x", "max_tokens": -Infinity}'), 400, None, ["Infinity"]),
    (COMPLETIONS, raw('{"model": "default", "prompt": "x", "seed": ' + "9" * 5000 + "}"), 400, None,
     ["more than 4300 digits"]),
    (COMPLETIONS, raw('{"model": "default", "prompt": [1, ' + "9" * 5000 + "]}"), 400, None, ["digits"]),
    (COMPLETIONS, b'{"model": "default", "prompt": "\xff\xfe"}', 400, None, ["not UTF-8"]),
    (COMPLETIONS, b"", 400, None, ["not valid JSON"]),
    (COMPLETIONS, b'{"model": "default", "prompt": "x"', 400, None, ["not valid JSON"]),
    (COMPLETIONS, b"null", 400, None, ["must be a JSON object, got null"]),
    (COMPLETIONS, b'"text"', 400, None, ["got string"]),
    (COMPLETIONS, {"model": "default", "prompt": "x", "n": True}, 400, "n", ["n must be an integer in 1..128"]),
    (COMPLETIONS, {"model": "default", "prompt": "x", "echo": 0}, 400, "echo", ["echo must be true or false"]),
    (COMPLETIONS, {"model": "default", "prompt": "x", "best_of": 1.5}, 400, "best_of", ["not supported"]),
    (COMPLETIONS, {"model": "default", "prompt": "x", "presence_penalty": False}, 400, "presence_penalty",
     ["presence_penalty must be a number"]),
    (CHAT, {"model": "default", "messages": HI, "n": True}, 400, "n", ["n must be an integer"]),
    (CHAT, {"model": "default", "messages": HI, "max_tokens": 5, "max_completion_tokens": 7}, 400, "max_tokens",
     ["disagree", "max_completion_tokens alone"]),
    (COMPLETIONS, {"model": "default", "prompt": "x", "max_tokens": 10 ** 12}, 400, "max_tokens",
     ["max_tokens must be an integer in 1.."]),
    (CHAT, {"model": "default", "messages": HI, "max_completion_tokens": 10 ** 12}, 400, "max_completion_tokens",
     ["max_completion_tokens must be an integer in 1.."]),
    (COMPLETIONS, {"model": "default", "prompt": "x", "max_tokens": 100_000}, 400, "prompt",
     ["max_tokens is 100000", "allowed max_tokens <= 511"]),
    (COMPLETIONS, {"model": "default", "prompt": ["x", "y " * 600], "max_tokens": 2}, 400, "prompt[1]",
     ["prompt[1] has", "give a shorter prompt"]),
    (CHAT, {"model": "default", "messages": HI, "max_completion_tokens": 100_000}, 400, "messages",
     ["max_completion_tokens is 100000", "allowed max_completion_tokens <="]),
    (CHAT, {"model": "default", "messages": HI, "max_tokens": 100_000}, 400, "messages", ["max_tokens is 100000"]),
    (COMPLETIONS, {"model": "default", "prompt": [1, 2, 10 ** 9]}, 400, "prompt", ["token id 1000000000",
                                                                                   "allowed 0..4095"]),
    (COMPLETIONS, {"model": "default", "prompt": "x", "stop_token_ids": [10 ** 9]}, 400, "stop_token_ids",
     ["token id 1000000000", "allowed 0..4095"]),  # the engine's refusal, without the engine's request id
    (COMPLETIONS, {"model": "default", "prompt": ["a"] * 4, "max_tokens": 1}, 413, "prompt",
     ["4 prompts", "at most 3 at once"]),
    (CHAT, {"model": "default", "messages": [{"role": "system", "content": "be brief"}, *HI]}, 400, "messages",
     ["no system turns"]),
]


def check_error(response: httpx.Response, status: int, param, words) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]
    assert "max_new_tokens" not in error["message"] and "request 'cmpl" not in error["message"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A plain server (no draft) of capacity 3, a chat template that refuses system turns."""
    template = tmp_path_factory.mktemp("template") / "t.jinja"
    template.write_text(TEMPLATE)
    server = Server("--draft", "none", "--max-batch-size", "2", "--max-waiting", "1", "--chat-template",
                    str(template))
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


def test_every_malformed_body_gets_a_400_and_the_requests_around_it_are_served(server):
    valid = {"model": "default", "prompt": "def add(a, b):", "max_tokens": 40, "temperature": 0}
    alone = server.post(COMPLETIONS, valid).json()["choices"][0]["text"]
    streamed = {}

    def stream():  # a request that runs while the corpus is sent
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
        chunks = client.completions.create(stream=True, **valid)
        streamed["text"] = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)

    thread = threading.Thread(target=stream)
    thread.start()
    for path, body, status, param, words in MALFORMED:
        check_error(server.post(path, body), status, param, words)
    thread.join(TIMEOUT)
    assert streamed["text"] == alone
    assert server.post(COMPLETIONS, valid).json()["choices"][0]["text"] == alone
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).json() == {"status": "ok"}


def test_the_official_client_reads_the_errors(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="default", messages=HI, max_tokens=3, max_completion_tokens=4)
    assert caught.value.body["param"] == "max_tokens"
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model="default", prompt=["a"] * 9, max_tokens=1)
    assert caught.value.status_code == 413 and caught.value.body["code"] == "too_many_prompts"
    same = client.chat.completions.create(model="default", messages=HI, max_tokens=3, max_completion_tokens=3)
    assert same.usage.completion_tokens == 3  # equal values are one budget


def test_the_server_logs_each_request_its_draft_and_its_shutdown(server):
    server.post(COMPLETIONS, {"model": "default", "prompt": "import os", "max_tokens": 5})
    server.post(COMPLETIONS, b"{")
    deadline = time.monotonic() + TIMEOUT  # a request's line is written after its reply is sent
    while '"POST /v1/completions" 400 ' not in server.output() and time.monotonic() < deadline:
        time.sleep(0.01)
    lines = server.output().splitlines()
    assert "(draft: none (plain decoding: the target alone)" in lines[0]
    assert any('"POST /v1/completions" 200 tokens 2+5 ' in line for line in lines), lines
    assert any('"POST /v1/completions" 400 ' in line for line in lines), lines
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(TIMEOUT) == 0
    after = server.output().splitlines()[len(lines):]
    assert any("shutting down (SIGTERM)" in line for line in after[:-1]) and "stopped after" in after[-1], after


# --- train: the budget holds inside long steps ----------------------------------------------

def test_a_phase_stops_when_its_seconds_are_spent_and_trains_nothing_past_the_deadline(tmp_path):
    from speculative import build_model
    from speculative.train.loop import PhaseConfig, train_phase

    data = torch.randint(0, 50, (5000,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))

    def model():
        return build_model("decoder_only", 50, {"hidden_size": 16, "num_layers": 1, "num_heads": 2}, seed=0)

    shape = dict(batch_size=2, seq_len=16, bf16=False)
    assert train_phase(model(), data, PhaseConfig("a", seconds=0, **shape), tmp_path / "a.pt")["steps"] == 1
    past = train_phase(model(), data, PhaseConfig("b", seconds=60, steps=50, deadline=0.0, **shape), tmp_path / "b.pt")
    assert past["steps"] == 0 and past["final_loss"] is None


def test_the_data_and_the_report_stop_at_the_deadline():
    from speculative.train import corpus
    from speculative.train.report import acceptance, perplexity

    files = corpus.split_files(60)[0]
    tokenizer = corpus.train_tokenizer(files, 300, deadline=0.0)  # the first file only
    assert tokenizer.get_vocab_size() <= corpus.train_tokenizer(files[:1], 300).get_vocab_size()
    cut = corpus.encode_files(tokenizer, files, deadline=0.0, min_tokens=10)
    assert 10 <= len(cut) < len(corpus.encode_files(tokenizer, files))
    target, draft = tiny("decoder_only", seed=1), tiny("decoder_only", seed=2)
    result = acceptance(target, draft, [[1, 2, 3]] * 4, max_new_tokens=200, deadline=0.0)
    assert result["prompts"] == 1 and result["identical_to_target"] is True
    data = torch.randint(0, 64, (4000,), generator=torch.Generator().manual_seed(0))
    assert perplexity(target, data, 32, deadline=0.0) == perplexity(target, data[:33], 32)


def test_train_with_a_budget_shorter_than_one_step_trains_at_most_one(tmp_path, capsys):
    from tests.test_train import TINY

    assert main(["train", "--out", str(tmp_path / "run"), "--max-minutes", "0.0005", *TINY]) == 0
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert all(entry["training"]["steps"] <= 1 for entry in report["models"].values()), report["models"]
    if any(entry["training"]["steps"] == 0 for entry in report["models"].values()):
        assert "budget was spent before" in capsys.readouterr().err


# --- loading: configs and weight files, named ---------------------------------------------

@pytest.mark.parametrize("model_type, field, value, words", [
    ("decoder_only", "rope_theta", "abc", ["rope_theta must be a finite number > 0, got 'abc'"]),
    ("decoder_only", "rope_theta", 0, ["rope_theta must be a finite number > 0"]),
    ("decoder_only", "max_seq_len", 10 ** 12, ["max_seq_len must be an integer in 1..1048576"]),
    ("decoder_only", "max_seq_len", 1e12, ["max_seq_len must be an integer", "got 1000000000000.0"]),
    ("decoder_only", "vocab_size", 10 ** 12, ["vocab_size must be an integer in 1..4194304"]),
    ("decoder_only", "tie_embeddings", "yes", ["tie_embeddings must be true or false, got 'yes'"]),
    ("decoder_only", "rms_norm_eps", -1e-5, ["rms_norm_eps must be a finite number >= 0"]),
    ("decoder_only", "num_kv_heads", "2", ["num_kv_heads must be an integer"]),
    ("decoder_only", "intermediate_size", 1.5, ["intermediate_size must be an integer"]),
    ("decoder_only", "attention_bias", 1, ["attention_bias must be true or false"]),
    ("decoder_only", "vocab_size", 100_000, ["describes a decoder_only model of", "do not match"]),
    ("decoder_only", "num_layers", 1000, ["describes a decoder_only model of"]),
    ("s4d", "state_dim", 10 ** 9, ["state_dim must be an integer in 1..4096"]),
    ("s4d", "dt_min", "small", ["dt_min must be a finite number >= 0"]),
    ("s4d", "tie_embeddings", None, ["tie_embeddings must be true or false"]),
    ("s4d", "hidden_size", 4096, ["describes a s4d model of"]),
])
def test_a_bad_config_value_is_refused_naming_the_file_and_the_field(tmp_path, model_type, field, value, words):
    from speculative import load_model

    save_model(tiny(model_type), tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config[field] = value
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as caught:
        load_model(tmp_path / "m")
    assert str(caught.value).startswith(str(tmp_path / "m" / "config.json")), caught.value
    for word in words:
        assert word in str(caught.value)


def corrupt_header(data: bytes, change) -> bytes:
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    name = next(n for n in header if n != "__metadata__")
    change(header[name])
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data[8 + length:]


@pytest.mark.parametrize("damage, words", [
    (lambda d: d[:len(d) // 2], ["is truncated"]),
    (lambda d: d[:5], ["is truncated or not a safetensors file"]),
    (lambda d: corrupt_header(d, lambda e: e.update(dtype="Q9")), ["is not a valid safetensors file"]),
    (lambda d: corrupt_header(d, lambda e: e.update(shape=[3, 3])), ["is not a valid safetensors file"]),
    (lambda d: corrupt_header(d, lambda e: e.update(data_offsets=[9, 3])), ["is not a valid safetensors file"]),
])
@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_a_corrupt_safetensors_file_is_named(tmp_path, damage, words, dtype):
    from speculative import load_model

    save_model(tiny("decoder_only"), tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(ValueError) as caught:
        load_model(tmp_path / "m", dtype=dtype)
    assert str(caught.value).startswith(str(weights)), caught.value
    for word in words:
        assert word in str(caught.value)


@pytest.mark.parametrize("size", [4, 30, 200])
def test_a_truncated_gguf_file_is_named(tmp_path, size):
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from speculative import load_model

    # A GGUF header: magic, version 3, 2 tensors, 3 metadata entries, and the start of the first key.
    head = b"GGUF" + (3).to_bytes(4, "little") + (2).to_bytes(8, "little") + (3).to_bytes(8, "little")
    head += (20).to_bytes(8, "little") + b"general.architecture" + (8).to_bytes(4, "little")
    (tmp_path / "m.gguf").write_bytes((head + bytes(400))[:size])
    with pytest.raises(ValueError) as caught:
        load_model(tmp_path / "m.gguf")
    assert str(tmp_path / "m.gguf") in str(caught.value)


# --- the second probe (dev/probes.py): settings a file does not take, ids no job writes ------

@pytest.mark.parametrize("front_end", ["generate", "bench"])
@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens", "messages", "temperature", "top_k", "top_p",
                                 "seed", "stop", "stop_token_ids"])
def test_a_prompt_line_with_a_setting_it_does_not_take_is_refused_naming_it(tmp_path, capsys, monkeypatch,
                                                                            front_end, key):
    """Batch records and the server take these per prompt; a prompt line would be generated
    without them, so it is refused (other keys, such as labels, are still ignored)."""
    import speculative as package
    from speculative.entrypoints.prompt_files import NOT_LINE_SETTINGS

    monkeypatch.setattr(package, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "kind": "a label"}) + "\n" + json.dumps({"prompt": "x", key: 1}) + "\n")
    args = ["generate", "--prompt-file", str(path)] if front_end == "generate" else ["bench", "--prompts", str(path)]
    refused_in_process(capsys, args, "p.jsonl line 2", f'"{key}" is not a setting of a prompt line',
                       NOT_LINE_SETTINGS[key])


@pytest.mark.parametrize("key", ["max_new_tokens", "max_completion_tokens", "chat", "top_k", "top_p",
                                 "stop_token_ids"])
def test_a_record_with_a_setting_records_do_not_take_gets_an_error_naming_it(key):
    from speculative import load_tokenizer
    from speculative.entrypoints.batch import NOT_RECORD_SETTINGS, ModelSpec, request_of

    tokenizer = load_tokenizer("default")
    with pytest.raises(ValueError, match=f'"{key}" is not a field of a record') as caught:
        request_of({"id": 1, "prompt": "x", key: 5}, tokenizer, ModelSpec())
    assert NOT_RECORD_SETTINGS[key] in str(caught.value)
    # null is left out (a Parquet column other rows fill), and other keys are labels, ignored
    ids, params, _ = request_of({"id": 1, "prompt": "x", key: None, "source": "a label"}, tokenizer, ModelSpec())
    assert ids == tokenizer.encode("x") and params.max_new_tokens == ModelSpec().max_new_tokens


@pytest.mark.parametrize("line", ['{"id": [1]}', '{"id": {"a": 1}}', '{"id": 1.0}', '{"id": true}', '{"id": null}',
                                  '{"text": "no id"}'])
def test_an_output_line_with_an_id_no_job_writes_is_refused_and_the_output_left_as_it_was(tmp_path, capsys, line):
    """A float id 1.0 would pass for the record 1 and skip it; a list cannot be an id at all."""
    path = make_input(tmp_path)
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": 2, "text": "ok"}\n' + line.encode() + b'\n{"id": 1, "te')  # a last line cut short
    before = snapshot(tmp_path)
    refused_in_process(capsys, ["batch", str(path), str(out), "--no-progress"], "out.jsonl line 2",
                       "a string or integer id")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("value", ["0", "-0.1", "1.5", "nan", "inf"])
def test_a_top_p_outside_its_range_is_refused_naming_the_option(capsys, value):
    refused_in_process(capsys, ["generate", "--temperature", "1", "--top-p", value], "--top-p", "> 0 and <= 1")


@pytest.mark.parametrize("kind", ["a device", "a pipe"])
def test_a_device_or_a_pipe_as_a_model_is_refused_without_reading_it(tmp_path, kind):
    from speculative import load_model

    path = Path("/dev/null") if kind == "a device" else tmp_path / "pipe"
    if kind == "a pipe":
        os.mkfifo(path)  # reading it would wait forever
    with pytest.raises(ValueError, match=f"{path} is neither a model directory nor a .gguf file"):
        load_model(path)


@pytest.mark.parametrize("out, words", [("/proc/speculative-export", ["cannot write in /proc"]),
                                        ("file/sub", ["file is a file", "file/sub cannot be made inside it"])])
def test_an_export_where_nothing_can_be_made_is_refused_before_loading(tmp_path, capsys, monkeypatch, out, words):
    """Root passes every permission check, even where nothing can be made (/proc)."""
    pytest.importorskip("transformers")
    import speculative as package

    monkeypatch.setattr(package, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("x")
    before = snapshot(tmp_path)
    refused_in_process(capsys, ["export", "default-draft", out], *words)
    assert snapshot(tmp_path) == before
