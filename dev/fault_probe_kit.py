"""What the fault probe's cases share (dev/fault_probe.py): running, killing and timing
processes, full and read-only folders, and the table of results."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

PY = sys.executable
REPO = Path(__file__).resolve().parent.parent
RESULTS: list[tuple[int, str, str, str, str]] = []
KERNELS = str(Path(os.environ.get("SPECULATIVE_CACHE", Path.home() / ".cache" / "speculative")) / "kernels")
BASE_ENV = {**os.environ, "SPECULATIVE_KERNEL_CACHE": os.environ.get("SPECULATIVE_KERNEL_CACHE", KERNELS),
            "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src"), "TQDM_DISABLE": "1"}


def record(group: str, what: str, got: str, ok: bool) -> None:
    RESULTS.append((len(RESULTS) + 1, group, what, " ".join(got.split())[:200], "ok" if ok else "BAD"))
    n, group, what, got, verdict = RESULTS[-1]
    print(f"{n:2d} {group:6s} {what:60s} -> {got} [{verdict}]", flush=True)


def probe(group: str, what: str, case) -> None:
    """Runs `case()` -> (ok, got); an exception of the probe itself is recorded as BAD, with its text."""
    try:
        ok, got = case()
    except Exception as error:  # noqa: BLE001 - the probe goes on
        ok, got = False, f"probe error {type(error).__name__}: {error}"
    record(group, what, got, ok)


def start(args: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**BASE_ENV, **(env or {})}, **kw)


def finish(process: subprocess.Popen, timeout: float) -> tuple[int | None, str, str]:
    """(exit status, stdout, stderr); status None where it did not end in `timeout` (killed then: a hang)."""
    try:
        out, err = process.communicate(timeout=timeout)
        return process.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        return None, out, err


def run(args: list[str], env: dict | None = None, timeout: float = 600) -> tuple[int | None, str, str]:
    return finish(start(args, env), timeout)


def killed_at(args: list[str], env: dict, seconds: float, sig=signal.SIGKILL, group: bool = True):
    """Runs `args`, sends `sig` after `seconds` (to its process group: its compiler with it), and
    waits; (status, stdout, stderr)."""
    process = start(args, env)
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, sig) if group else process.send_signal(sig)
    return finish(process, 120)


def last_line(text: str) -> str:
    lines = [line for line in text.strip().replace("\r", "\n").splitlines() if line.strip() and "%|" not in line]
    return lines[-1] if lines else "(nothing on stderr)"


def partials(folder: Path) -> list[Path]:
    return [path for path in folder.rglob("*") if "partial" in path.name] if folder.exists() else []


@contextmanager
def tmpfs(size: str):
    """A folder on a tmpfs of `size` (a disk that fills), or None without root."""
    folder = Path(tempfile.mkdtemp(prefix="probe-full-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True).returncode == 0
    try:
        yield folder if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], check=False)


@contextmanager
def read_only(folder: Path):
    """`folder` made immutable (root ignores modes)."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["chattr", "+i", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def markdown(path: Path) -> None:
    lines = ["| # | group | case | what it got | verdict |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {n} | {group} | {what} | {got.replace('|', '/')} | {verdict} |"
              for n, group, what, got, verdict in RESULTS]
    path.write_text("\n".join(lines) + "\n")


