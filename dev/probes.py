"""Issue 33's second probe: hostile inputs over the library, the command line, `batch` and the
server, each with what it got and a verdict: "ok" for a clear refusal (one line that says what
is wrong) or correct output, "BAD" otherwise. Then the server, after every probe, must still
answer a valid greedy request with the tokens it gave before them (the target's greedy ones).

    .venv/bin/python dev/probes.py [--markdown dev/probes.md]

Exit status 1 when any probe is BAD. A few minutes on 2 cores: each command is a process of
its own, and the server is started once (the shipped default model, --draft ngram).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from speculative import (Engine, NGramProposer, SamplingParams, SpeculativeConfig, SpeculativeDecoder,
                         autoregressive_generate, load_model)

SCRIPT = Path(sys.executable).with_name("speculative")
KEY = "sk-probe"
PROMPT = "def read_lines(path):\n"
RESULTS: list[tuple[int, str, str, str, str]] = []


def record(front: str, what: str, got: str, ok: bool) -> None:
    RESULTS.append((len(RESULTS) + 1, front, what, " ".join(got.split())[:140], "ok" if ok else "BAD"))
    n, front, what, got, verdict = RESULTS[-1]
    print(f"{n:2d} {front:7s} {what:58s} -> {got} [{verdict}]", flush=True)


def clear(message: str) -> bool:
    """A refusal a user can act on: one line, that says something."""
    return bool(message.strip()) and "\n" not in message.strip() and "Traceback" not in message


# --- library ------------------------------------------------------------------------------

def refused(what: str, call) -> None:
    try:
        value = call()
    except (ValueError, TypeError) as error:
        return record("library", what, f"{type(error).__name__}: {error}", clear(str(error)))
    except Exception as error:  # noqa: BLE001 - any other exception is not a refusal
        return record("library", what, f"{type(error).__name__}: {error}", False)
    record("library", what, f"accepted: {value!r}"[:150], False)


def gives(what: str, call, check) -> None:
    try:
        value = call()
    except Exception as error:  # noqa: BLE001
        return record("library", what, f"{type(error).__name__}: {error}", False)
    ok, got = check(value)
    record("library", what, got, ok)


def run_engine(engine: Engine) -> dict:
    outputs: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            entry = outputs.setdefault(out.request_id, {"tokens": [], "reason": None})
            entry["tokens"] += out.new_token_ids
            entry["reason"] = out.finish_reason or entry["reason"]
    return outputs


def library_probes() -> None:
    target, draft = load_model("default"), load_model("default-draft")
    vocab = target.vocab_size
    prompt = target.tokenizer.encode(PROMPT)
    reference = autoregressive_generate(target, prompt, 12)
    decoder = SpeculativeDecoder(target, draft, SpeculativeConfig())

    refused("load_model('/dev/null')", lambda: load_model("/dev/null"))
    refused("load_model('default', device='cuda:7')", lambda: load_model("default", device="cuda:7"))
    refused("load_model('default', dtype='float8')", lambda: load_model("default", dtype="float8"))
    refused("SamplingParams(top_k=0)", lambda: SamplingParams(top_k=0))
    refused("SamplingParams(top_p=0)", lambda: SamplingParams(top_p=0))
    refused("SamplingParams(top_p=1.5)", lambda: SamplingParams(top_p=1.5))
    refused("SamplingParams(temperature=-1)", lambda: SamplingParams(temperature=-1))
    refused("SpeculativeConfig(seed=-1)", lambda: SpeculativeConfig(seed=-1))

    def seeded_twice():
        runs = []
        for _ in range(2):
            engine = Engine(target, draft, SpeculativeConfig(), max_batch_size=2)
            engine.add_request(prompt, SamplingParams(12, temperature=1.0, seed=-1), "a")
            runs.append(run_engine(engine)["a"]["tokens"])
        return runs
    gives("Engine request with SamplingParams(seed=-1), sampled, twice", seeded_twice,
          lambda runs: (runs[0] == runs[1] and len(runs[0]) == 12, f"the same {len(runs[0])} tokens both times"
                        if runs[0] == runs[1] else f"different tokens: {runs}"))
    gives("generate(2-D int64 tensor of 2 prompts)", lambda: decoder.generate(torch.tensor([prompt, prompt]), 12),
          lambda out: (out == [reference, reference], "2 rows, each the target's greedy tokens"
                       if out == [reference, reference] else f"rows differ from the greedy tokens: {out}"))
    refused("generate([1.0, 2.0]) (float token ids)", lambda: decoder.generate([1.0, 2.0], 4))
    refused("generate([[]]) (a batch of one empty prompt)", lambda: decoder.generate([[]], 4))
    refused("generate([5, -1]) (negative token id)", lambda: decoder.generate([5, -1], 4))
    refused(f"generate(prompt, eos_token_id={vocab})", lambda: decoder.generate(prompt, 4, eos_token_id=vocab))
    refused("generate(prompt, max_new_tokens=2**21)", lambda: decoder.generate(prompt, 2 ** 21))
    refused("SamplingParams(stop_token_ids=[-1])", lambda: SamplingParams(stop_token_ids=[-1]))

    engine = Engine(target, NGramProposer(), SpeculativeConfig(), max_batch_size=4)
    refused(f"add_request(stop_token_ids=[{vocab}]) (outside the vocabulary)",
            lambda: engine.add_request(prompt, SamplingParams(4, stop_token_ids=[vocab]), "x"))

    def duplicate():
        engine.add_request(prompt, SamplingParams(12), "dup")
        try:
            engine.add_request(prompt, SamplingParams(3), "dup")
        except ValueError as error:
            out = run_engine(engine)["dup"]["tokens"]
            return str(error), out
        return None, run_engine(engine)["dup"]["tokens"]
    gives("add_request twice with the id 'dup'", duplicate,
          lambda r: (r[0] is not None and clear(r[0]) and r[1] == reference,
                     f"ValueError: {r[0]}; the first 'dup' still got the greedy tokens" if r[1] == reference
                     else f"{r[0]}; first 'dup' got {r[1]}"))
    gives("abort('never-added')", lambda: (engine.abort("never-added"), engine.has_unfinished()),
          lambda r: (r == (False, False), f"returns {r[0]}, nothing unfinished: {not r[1]}"))
    gives("step() with nothing queued", engine.step, lambda r: (r == [], f"returns {r!r}"))
    refused("add_request(request_id=1.5)", lambda: engine.add_request(prompt, None, 1.5))


# --- the command line and batch ----------------------------------------------------------

def speculative(*args, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    command = [str(SCRIPT)] if SCRIPT.is_file() else [sys.executable, "-m", "speculative.entrypoints.cli"]
    return subprocess.run(command + [str(a) for a in args], input=stdin, capture_output=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})


def summary(result: subprocess.CompletedProcess) -> str:
    err = result.stderr.decode(errors="replace").strip().splitlines()
    errors = [line for line in err if line.startswith("error") or "Error" in line]
    return f"exit {result.returncode}: " + (errors[0] if errors else err[-1] if err else "(nothing on stderr)")


def cli_refused(front: str, what: str, *args, words: str = "", status: int = 2) -> subprocess.CompletedProcess:
    """The command refuses on one line of stderr (naming `words`), with `status`, printing
    nothing on stdout."""
    result = speculative(*args)
    err = result.stderr.decode(errors="replace")
    record(front, what, summary(result), result.returncode == status and not result.stdout and clear(err)
           and words in err)
    return result


def cli_probes(tmp: Path) -> None:
    (tmp / "empty.txt").write_text("")
    (tmp / "empty.jsonl").write_text("\n\n")
    (tmp / "keys.jsonl").write_text(json.dumps({"prompt": PROMPT, "max_tokens": 3, "temperature": 0.7}) + "\n")
    (tmp / "negative.jsonl").write_text(json.dumps({"prompt": PROMPT, "max_new_tokens": -1}) + "\n")
    cli_refused("cli", "generate --prompt ''", "generate", "--prompt", "")
    cli_refused("cli", "generate --prompt-file EMPTY.txt", "generate", "--prompt-file", tmp / "empty.txt")
    cli_refused("cli", "generate --prompt-file BLANK-LINES.jsonl", "generate", "--prompt-file", tmp / "empty.jsonl")
    cli_refused("cli", "generate --target /dev/null", "generate", "--target", "/dev/null", words="neither")
    cli_refused("cli", "generate --device cuda:7", "generate", "--device", "cuda:7")
    cli_refused("cli", 'generate --prompt-file with {"max_tokens", "temperature"}', "generate", "--prompt-file",
                tmp / "keys.jsonl", words="max_tokens")
    cli_refused("cli", 'generate --prompt-file with "max_new_tokens": -1', "generate", "--prompt-file",
                tmp / "negative.jsonl")
    cli_refused("cli", "generate --top-p 1.5", "generate", "--top-p", "1.5", "--temperature", "1",
                words="--top-p")
    cli_refused("cli", "generate --top-k 0", "generate", "--top-k", "0")
    cli_refused("cli", "generate --seed -1", "generate", "--seed", "-1")
    cli_refused("cli", "bench --limit 0", "bench", "--limit", "0")
    destination = Path("/proc/speculative-probe")
    cli_refused("cli", f"export default {destination}", "export", "default", destination, words="cannot write in")
    cli_refused("cli", "train --max-minutes -1", "train", "--max-minutes", "-1", "--out", tmp / "train")


def jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def batch_errors(what: str, tmp: Path, bad: dict, words: str) -> None:
    """A bad record gets an error line naming what was wrong; the good one beside it its text."""
    good = {"id": "good", "prompt": PROMPT, "max_tokens": 4}
    out = tmp / f"out-{len(RESULTS)}.jsonl"
    result = speculative("batch", jsonl(tmp / f"in-{len(RESULTS)}.jsonl", [good, {"id": "bad", **bad}]), out,
                         "--no-progress", "--draft", "ngram")
    rows = {r["id"]: r for r in lines_of(out)}
    error, tokens = rows.get("bad", {}).get("error", ""), len(rows.get("good", {}).get("token_ids", []))
    ok = result.returncode == 0 and words in error and clear(error) and tokens == 4
    record("batch", what, f"exit {result.returncode}; bad: {error or rows.get('bad')}; good: {tokens} tokens", ok)


def batch_probes(tmp: Path) -> None:
    records = [{"id": 1, "prompt": PROMPT, "max_tokens": 6}, {"id": 2, "prompt": "import os\n", "max_tokens": 6}]
    missing = tmp / "no-such-folder" / "out.jsonl"
    cli_refused("batch", "batch EMPTY.jsonl OUT", "batch", jsonl(tmp / "e.jsonl", []), tmp / "o.jsonl")
    cli_refused("batch", "batch IN no-such-folder/OUT", "batch", jsonl(tmp / "in.jsonl", records), missing)
    dup = jsonl(tmp / "dup.jsonl", [records[0], {**records[1], "id": 1}])
    result = cli_refused("batch", "batch IN OUT, two records with id 1", "batch", dup, tmp / "dup-out.jsonl")
    if (tmp / "dup-out.jsonl").exists():
        record("batch", "  ...and OUT is not created", "OUT was created", False)
    binary = tmp / "binary.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)
    cli_refused("batch", "batch BINARY.jsonl OUT", "batch", binary, tmp / "bin-out.jsonl")
    batch_errors('record with "temperature": "hot"', tmp, {"prompt": PROMPT, "temperature": "hot"}, "temperature")
    batch_errors('record with "seed": 2**70', tmp, {"prompt": PROMPT, "temperature": 1, "seed": 2 ** 70}, "seed")
    batch_errors('record with "prompt": [-1, 5]', tmp, {"prompt": [-1, 5]}, "-1")
    batch_errors('record with "top_p": 0.5 (not a record field)', tmp,
                 {"prompt": PROMPT, "temperature": 1, "top_p": 0.5}, "top_p")
    odd = tmp / "odd-out.jsonl"
    odd.write_text(json.dumps({"id": [1], "text": "x"}) + "\n")
    result = speculative("batch", tmp / "in.jsonl", odd, "--no-progress", "--draft", "ngram")
    err = result.stderr.decode(errors="replace")
    record("batch", 'OUT holding {"id": [1]} (an id no job writes)', summary(result),
           result.returncode == 2 and clear(err) and "line 1" in err)
    # Resume: a job killed while writing leaves a last line without its end; rerunning gives
    # each record exactly once, as a run in one go does.
    whole, cut = tmp / "whole.jsonl", tmp / "cut.jsonl"
    speculative("batch", tmp / "in.jsonl", whole, "--no-progress", "--draft", "ngram")
    first, second = whole.read_text().splitlines(keepends=True)[:2]
    cut.write_text(first + second[:len(second) // 2])
    result = speculative("batch", tmp / "in.jsonl", cut, "--no-progress", "--draft", "ngram")
    output = lambda path: sorted((r["id"], r["text"], r["token_ids"], r["finish_reason"]) for r in lines_of(path))
    same = output(cut) == output(whole)  # drafted/accepted follow timings (adaptive drafting): not compared
    record("batch", "resume from OUT whose last line is cut in half", f"exit {result.returncode}; "
           f"{len(lines_of(cut))} records, equal to one whole run: {same}", result.returncode == 0 and same)


# --- the server ---------------------------------------------------------------------------

class Server:
    def __init__(self, *args: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="probe-serve-", suffix=".log", delete=False)
        command = [sys.executable, "-m", "speculative.entrypoints.cli", "serve", "--port", str(self.port),
                   "--threads", "1", *args]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "OMP_NUM_THREADS": "1"})
        end = time.monotonic() + 300
        while time.monotonic() < end and self.process.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server did not start:\n{Path(self.log.name).read_text()}")

    def request(self, method: str, path: str, body=None, key: str | None = KEY, **headers) -> httpx.Response:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
                   **headers}
        content = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
        return httpx.request(method, self.url + path, content=content, headers=headers, timeout=300)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        os.unlink(self.log.name)


def http(server: Server, what: str, path: str, body, status: int | tuple, method: str = "POST", **kwargs) -> dict:
    """A request answered with `status` (a refusal: OpenAI's error object, on one line)."""
    try:
        response = server.request(method, path, body, **kwargs)
    except httpx.HTTPError as error:
        record("server", what, f"{type(error).__name__}: {error}", False)
        return {}
    try:
        answer = response.json()
    except ValueError:
        answer = {}
    statuses = status if isinstance(status, tuple) else (status,)
    message = (answer.get("error") or {}).get("message", "") if isinstance(answer, dict) else ""
    ok = response.status_code in statuses and (response.status_code < 400 or clear(message) and "request '" not in
                                                message)  # the engine's ids are not the client's
    choices = answer.get("choices") if isinstance(answer, dict) else None
    detail = message or (f"text {choices[0]['text']!r}" if choices else response.text[:100])
    record("server", what, f"{response.status_code}: {detail}", ok)
    return answer


def server_probes(tmp: Path) -> None:
    target = load_model("default")
    ids = target.tokenizer.encode(PROMPT)
    greedy = autoregressive_generate(target, ids, 16)
    server = Server("--draft", "ngram", "--api-key", KEY, "--max-body-bytes", "65536")
    valid = {"model": "default", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    try:
        before = server.request("POST", "/v1/completions", valid).json()["choices"][0]["token_ids"]
        base = {"model": "default", "prompt": PROMPT, "max_tokens": 4}
        chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
        answer = http(server, "Content-Type: text/plain, a valid greedy body", "/v1/completions", valid, (200, 415),
                      **{"Content-Type": "text/plain"})
        if answer.get("choices") and answer["choices"][0]["token_ids"] != greedy:
            record("server", "  ...its tokens", "differ from the target's greedy tokens", False)
        http(server, "a body of 70,000 bytes (--max-body-bytes 65536)", "/v1/completions",
             {**base, "user": "x" * 70_000}, 413)
        http(server, "17 stop strings", "/v1/completions", {**base, "stop": [f"s{i}" for i in range(17)]}, 400)
        http(server, '"stream": "yes"', "/v1/completions", {**base, "stream": "yes"}, 400)
        http(server, '"prompt": [[]]', "/v1/completions", {**base, "prompt": [[]]}, 400)
        http(server, '"prompt": [1, "a"]', "/v1/completions", {**base, "prompt": [1, "a"]}, 400)
        http(server, '"temperature": 1e309', "/v1/completions",
             json.dumps(base)[:-1] + ', "temperature": 1e309}', 400)
        http(server, '"model": "gpt-4"', "/v1/completions", {**base, "model": "gpt-4"}, (400, 404))
        seeded = [http(server, f'"seed": -1, "temperature": 1 (run {i})', "/v1/completions",
                       {**base, "seed": -1, "temperature": 1, "max_tokens": 8}, 200) for i in (1, 2)]
        texts = [a.get("choices", [{}])[0].get("text") for a in seeded]
        if texts[0] != texts[1]:
            record("server", '  ..."seed": -1 twice', f"different text: {texts}", False)
        http(server, "GET /v1/completions", "/v1/completions", None, 405, method="GET")
        http(server, 'chat, "role": "tool"', "/v1/chat/completions",
             {**chat, "messages": [{"role": "tool", "content": "x"}]}, 400)
        http(server, 'chat, "messages": []', "/v1/chat/completions", {**chat, "messages": []}, 400)
        http(server, '"logprobs": 21 (at most 20)', "/v1/completions", {**base, "logprobs": 21}, 400)
        http(server, "no Authorization header (--api-key set)", "/v1/completions", base, 401, key=None)
        http(server, "a wrong API key", "/v1/completions", base, 401, key="sk-wrong")
        http(server, '"stop_token_ids": [1000000000]', "/v1/completions", {**base, "stop_token_ids": [10 ** 9]},
             400)
        answer = http(server, '"top_k": 0, "temperature": 0 (0 = no limit)', "/v1/completions",
                      {**valid, "top_k": 0}, 200)
        if answer.get("choices") and answer["choices"][0]["token_ids"] != greedy:
            record("server", "  ...its tokens", "differ from the target's greedy tokens", False)
        http(server, '"prompt": [[5, 6], [5, 99999999]]', "/v1/completions",
             {**base, "prompt": [[5, 6], [5, 99_999_999]]}, 400)
        after = server.request("POST", "/v1/completions", valid).json()["choices"][0]["token_ids"]
        record("server", "the valid greedy request again, after every probe",
               f"{len(after)} tokens, as before: {after == before}; the target's greedy ones: {after == greedy}",
               after == before == greedy)
    finally:
        server.stop()


def markdown(path: Path) -> None:
    rows = ["| # | front end | input | what it got | verdict |", "| --- | --- | --- | --- | --- |"]
    rows += [f"| {n} | {front} | {what.replace('|', '/')} | {got.replace('|', '/')} | {verdict} |"
             for n, front, what, got, verdict in RESULTS]
    path.write_text("\n".join(rows) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="probes-") as folder:
        library_probes()
        cli_probes(Path(folder))
        batch_probes(Path(folder))
        server_probes(Path(folder))
    bad = sum(verdict == "BAD" for *_, verdict in RESULTS)
    print(f"{len(RESULTS)} probes, {bad} BAD, in {time.perf_counter() - started:.0f} s")
    if args.markdown:
        markdown(args.markdown)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
