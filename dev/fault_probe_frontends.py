"""The fault probe's cases on `speculative batch` and `speculative serve` (dev/fault_probe.py):
jobs killed and resumed, jobs racing on one OUTPUT, full and read-only outputs; servers
killed or stopped under load, clients that leave, bursts at the context limit and past the queue."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx

from fault_probe_kit import PY, finish, last_line, probe, read_only, run, start, tmpfs

CLI = [PY, "-m", "speculative.entrypoints.cli"]
PROMPT = "def read_lines(path):\n"


# --- batch ---------------------------------------------------------------------------------

def answers(path: Path) -> tuple[dict, list[str]]:
    """{id: token_ids} of OUTPUT's whole lines, and what is wrong with it (ids twice, lines cut)."""
    got, wrong = {}, []
    for n, line in enumerate(path.read_text().splitlines() if path.exists() else [], 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            wrong.append(f"line {n} is not JSON")
            continue
        if record["id"] in got:
            wrong.append(f"id {record['id']} twice")
        got[record["id"]] = record.get("token_ids")
    return got, wrong


def batch_probes(tmp: Path, rng) -> None:
    folder = tmp / "batch"
    folder.mkdir()
    source = folder / "in.jsonl"
    source.write_text("".join(json.dumps({"id": i, "prompt": f"def function_{i}(x):\n"}) + "\n" for i in range(24)))

    def job(out: Path, *more: str) -> list[str]:
        return [*CLI, "batch", str(source), str(out), "--max-new-tokens", "32", "--threads", "1", "--no-progress",
                *more]

    status, _, err = run(job(folder / "clean.jsonl"))
    assert status == 0, err
    reference, _ = answers(folder / "clean.jsonl")

    def same(out: Path) -> tuple[bool, str]:
        got, wrong = answers(out)
        equal = got == reference
        return equal and not wrong, (f"{len(got)}/24 ids, {'equal to a clean run' if equal else 'NOT equal'}"
                                     f"{'; ' + ', '.join(wrong[:3]) if wrong else ''}")

    for n, sig in enumerate([signal.SIGKILL, signal.SIGKILL, signal.SIGKILL, signal.SIGINT, signal.SIGTERM]):
        lines = rng.randrange(0, 17)  # the signal comes once OUTPUT holds this many lines (0: while loading)
        out = folder / f"killed-{n}.jsonl"

        def case():
            process = start(job(out))
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and process.poll() is None and (
                    not out.exists() if lines == 0 else len(answers(out)[0]) < lines):
                time.sleep(0.01)
            os.killpg(process.pid, sig) if sig == signal.SIGKILL else process.send_signal(sig)
            killed = finish(process, 120)
            said = "" if sig == signal.SIGKILL else f", said: {last_line(killed[2])}"
            before = len(answers(out)[0])
            status, _, err = run(job(out))
            ok, got = same(out)
            quiet = sig == signal.SIGKILL or killed[0] == 0 or last_line(killed[2]) != "(nothing on stderr)"
            return (ok and status == 0 and quiet and "Traceback" not in killed[2] and killed[0] != 0,
                    f"{signal.Signals(sig).name} once {lines} lines were written: exit {killed[0]}{said}; "
                    f"{before} done; resumed: exit {status}, {got}")
        probe("batch", f"{signal.Signals(sig).name} at a random point of the job, then the same command", case)

    def racing(stop_first: bool):
        out = folder / f"race-{stop_first}.jsonl"
        first = start(job(out))
        lock = out.with_name(out.name + ".lock")
        deadline = time.monotonic() + 120
        while not lock.exists() and time.monotonic() < deadline:  # the first holds OUTPUT
            time.sleep(0.05)
        if stop_first:
            os.killpg(first.pid, signal.SIGSTOP)
        second = run(job(out), timeout=120)
        if stop_first:
            os.killpg(first.pid, signal.SIGCONT)
        done = finish(first, 600)
        ok, got = same(out)
        return (ok and done[0] == 0 and second[0] not in (0, None) and str(first.pid) in second[2],
                f"second: exit {second[0]}: {last_line(second[2])[:120]}; first: exit {done[0]}, {got}")
    probe("batch", "a second job on the same OUTPUT while the first runs", lambda: racing(False))
    probe("batch", "a second job on the same OUTPUT while the first is stopped (SIGSTOP)", lambda: racing(True))

    def cut_line():
        out = folder / "cut.jsonl"
        lines = (folder / "clean.jsonl").read_text().splitlines(keepends=True)
        out.write_text("".join(lines[:10]) + lines[10][:len(lines[10]) // 2])
        status, _, err = run(job(out))
        ok, got = same(out)
        return ok and status == 0, f"exit {status}, said: {last_line(err)[:100]}; {got}"
    probe("batch", "OUTPUT's last line cut in half (a kill mid-write)", cut_line)

    def changed_input():
        out = folder / "changed.jsonl"
        out.write_text((folder / "clean.jsonl").read_text())
        edited = folder / "edited.jsonl"
        edited.write_text(source.read_text().replace('"def function_3(x):\\n"', '"def other_3(y):\\n"'))
        command = job(out)
        command[command.index(str(source))] = str(edited)
        status, _, err = run(command)
        warned = "changed" in err
        redo = run([*command, "--redo-changed"])
        got, wrong = answers(out)
        redone = got[3] != reference[3] and all(got[i] == reference[i] for i in range(24) if i != 3)
        return (status == 0 and warned and redo[0] == 0 and redone and not wrong,
                f"said: {last_line(err)[:110]}; --redo-changed: exit {redo[0]}, id 3 "
                f"{'answered anew' if redone else 'NOT redone'}, {len(wrong)} problems")
    probe("batch", "INPUT edited after the job (one prompt changed)", changed_input)

    with tmpfs("8k") as full:
        def disk_full():
            out = full / "out.jsonl"
            status, _, err = run(job(out))
            got, wrong = answers(out)
            subprocess.run(["mount", "-o", "remount,size=10m", str(full)], check=True)
            again = run(job(out))
            ok, after = same(out)
            return (status not in (0, None) and "space" in err.lower() and not wrong and again[0] == 0 and ok,
                    f"exit {status}: {last_line(err)[:100]}; {len(got)} whole lines kept; room made, resumed: "
                    f"exit {again[0]}, {after}")
        if full is not None:
            probe("batch", "OUTPUT on an 8 KB disk that fills, then room made", disk_full)

    with read_only(folder / "ro") as ro:
        def read_only_output():
            status, _, err = run(job(ro / "out.jsonl"))
            return status == 2 and "Traceback" not in err, f"exit {status}: {last_line(err)[:150]}"
        probe("batch", "OUTPUT in a read-only folder", read_only_output)


# --- serve ---------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(*args: str, wait: bool = True) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = start([*CLI, "serve", "--port", str(port), "--threads", "1", "--no-access-log", *args])
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 300
    while wait and time.monotonic() < end and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    return process, url


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    finish(process, 60)


def complete(url: str, prompt=PROMPT, max_tokens: int = 32, **more) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0, **more}, timeout=300)


def stream(url: str, ends: list, prompt=PROMPT, max_tokens: int = 64, leave_after: int | None = None) -> None:
    """One streamed completion; appends how it ended: the finish reason, "left", or the error's name."""
    reason, chunks = None, 0
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=httpx.Timeout(60, connect=10),
                          json={"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "stream": True}) as r:
            if r.status_code != 200:
                ends.append(f"http {r.status_code}")
                return
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    reason = json.loads(line[6:])["choices"][0].get("finish_reason") or reason
                    if leave_after is not None and chunks >= leave_after:
                        ends.append("left")
                        return
            ends.append(reason or "no finish_reason")
    except httpx.HTTPError as error:
        ends.append(type(error).__name__)


def clients(url: str, n: int, **kw) -> tuple[list, list[threading.Thread]]:
    ends: list = []
    threads = [threading.Thread(target=stream, args=(url, ends), kwargs=kw, daemon=True) for _ in range(n)]
    for thread in threads:
        thread.start()
    return ends, threads


def joined(threads: list[threading.Thread], seconds: float) -> int:
    """How many threads are still running after `seconds` (hung clients)."""
    end = time.monotonic() + seconds
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    return sum(thread.is_alive() for thread in threads)


def in_flight(url: str) -> float:
    """Requests running or waiting, from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(("speculative_num_requests_running", "speculative_num_requests_waiting")))


def serve_probes(tmp: Path, rng) -> None:
    process, url = serve("--max-batch-size", "8")
    reference = complete(url).json()["choices"][0]["text"]

    def signal_under_load(sig):
        server, address = serve("--max-batch-size", "8") if sig != signal.SIGKILL else (process, url)
        n = 8 if sig != signal.SIGKILL else 16
        ends, threads = clients(address, n, max_tokens=160)
        deadline = time.monotonic() + 120
        while in_flight(address) < n and time.monotonic() < deadline:  # every stream admitted or queued
            time.sleep(0.1)
        time.sleep(rng.uniform(0.2, 1.5))
        os.killpg(server.pid, sig) if sig == signal.SIGKILL else server.send_signal(sig)
        hung = joined(threads, 90)
        status = finish(server, 90)[0]
        clean = all(end in ("length", "stop") for end in ends) if sig != signal.SIGKILL else True
        return (hung == 0 and clean and (sig == signal.SIGKILL or status == 0),
                f"server exit {status}; {len(ends)} clients ended ({', '.join(sorted(set(map(str, ends))))}), "
                f"{hung} hung")

    def clients_leave():
        ends, threads = clients(url, 24, leave_after=3)
        hung = joined(threads, 120)
        deadline, running = time.monotonic() + 30, None
        while time.monotonic() < deadline:
            running = in_flight(url)
            if running == 0:
                break
            time.sleep(0.5)
        after = complete(url).json()["choices"][0]["text"]
        return (hung == 0 and running == 0 and after == reference,
                f"{ends.count('left')} left, {hung} hung; requests in flight after: {running}; the next greedy "
                f"request {'equal to before' if after == reference else 'DIFFERENT'}")
    probe("serve", "24 streaming clients leave after 3 chunks", clients_leave)

    def context_burst():
        from speculative import load_tokenizer

        tokenizer = load_tokenizer("default")
        ids = (tokenizer.encode("def read_lines(path):\n    return open(path).read()\n") * 60)[:480]
        ends, threads = clients(url, 40, prompt=ids, max_tokens=31)
        hung = joined(threads, 600)
        return (hung == 0 and all(end in ("length", "stop") for end in ends),
                f"{len(ends)} ended: {', '.join(f'{e} x{ends.count(e)}' for e in sorted(set(map(str, ends))))}; "
                f"{hung} hung")
    probe("serve", "40 streams of 480 prompt tokens + 31 new (context 512), batch 8", context_burst)

    def slow_body():
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
            began = time.monotonic()
            others = [complete(url).json()["choices"][0]["text"] for _ in range(4)]
            took = time.monotonic() - began
        return (all(text == reference for text in others),
                f"4 requests beside a body stalled mid-way: {'all equal' if len(set(others)) == 1 else 'DIFFERENT'}"
                f" in {took:.1f} s")
    probe("serve", "a client stalls mid-body while others are served", slow_body)

    def memory_burst():
        rss = lambda: int(Path(f"/proc/{process.pid}/status").read_text().split("VmRSS:")[1].split()[0]) // 1024
        before, codes = rss(), []
        def one():
            try:
                codes.append(complete(url, max_tokens=8).status_code)
            except httpx.HTTPError as error:
                codes.append(type(error).__name__)
        threads = [threading.Thread(target=one, daemon=True) for _ in range(200)]
        for thread in threads:
            thread.start()
        hung = joined(threads, 600)
        after = rss()
        return (hung == 0 and set(codes) <= {200, 429} and after - before < 300,
                f"{codes.count(200)} answered, {codes.count(429)} refused (429), {hung} hung; "
                f"RSS {before} -> {after} MB")
    probe("serve", "a burst of 200 requests at once (default --max-queued)", memory_burst)

    def full_queue():
        server, address = serve("--max-batch-size", "2", "--max-queued", "4")
        replies = []
        def one():
            try:
                r = complete(address)
                replies.append((r.status_code, r.headers.get("retry-after"), r.json()))
            except (httpx.HTTPError, ValueError) as error:
                replies.append((type(error).__name__, None, {}))
        threads = [threading.Thread(target=one, daemon=True) for _ in range(30)]
        for thread in threads:
            thread.start()
        hung = joined(threads, 600)
        stop(server)
        answered = [body for code, _, body in replies if code == 200]
        refused = [(retry, body) for code, retry, body in replies if code == 429]
        ok = (hung == 0 and len(answered) + len(refused) == 30
              and all(retry and "error" in body for retry, body in refused)
              and all(body["choices"][0]["text"] == reference for body in answered))
        return ok, f"{len(answered)} answered (equal: {ok}), {len(refused)} refused 429 with Retry-After, {hung} hung"
    probe("serve", "30 requests at once on --max-batch-size 2 --max-queued 4", full_queue)

    def killed_while_starting():
        at = rng.uniform(0.5, 3.0)
        first, _ = serve(wait=False)
        time.sleep(at)
        stop(first)
        server, address = serve()
        try:
            text = complete(address).json()["choices"][0]["text"]
        finally:
            stop(server)
        return text == reference, (f"SIGKILL at {at:.1f} s of start-up; started again, answer "
                                   f"{'equal' if text == reference else 'DIFFERENT'}")
    probe("serve", "SIGKILL while the server loads its models, then start again", killed_while_starting)

    for sig in (signal.SIGTERM, signal.SIGINT):
        probe("serve", f"{signal.Signals(sig).name} with 8 streams in flight", lambda: signal_under_load(sig))
    probe("serve", "SIGKILL with 16 streams in flight", lambda: signal_under_load(signal.SIGKILL))
    stop(process)
