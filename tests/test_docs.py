"""Every code block of README.md and docs/*.md runs here, so that no example shows a wrong
command or output.

Python blocks run in a fresh interpreter and bash blocks in bash (`set -euo pipefail`, with
this venv's `speculative` first on PATH), each in an empty folder, on one torch thread. A
bash block of `speculative serve` lines starts each server, waits for /health and stops it;
blocks that talk to a server on port 8000 run against one started here, on a free port.
A block that cannot run in CI says why in an HTML comment right above it
(`<!-- not run: REASON -->`); its `speculative` options are still checked against --help.
Running the blocks is slow (CI runs it, `make test` leaves it out); the checks of links,
markers and options are quick.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->")
FENCE = re.compile(r"^```(\S*)\s*$")
SERVER_PORT = "8000"  # what the examples say; the tests substitute a free port
BLOCK_TIMEOUT = 600  # a guard against a hang, not a timing: a shared machine can be very slow
MAX_NOT_RUN = 8  # blocks left out of CI stay few


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    not_run: str | None  # the reason given, when the block is not run

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def needs_server(self) -> bool:
        return bool(re.search(rf"(127\.0\.0\.1|localhost):{SERVER_PORT}\b", self.code))

    @property
    def starts_servers(self) -> bool:
        return self.language == "bash" and any(line.startswith("speculative serve") and "--print-config" not in line
                                               for line in commands(self.code))  # --print-config prints and exits


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page, with the `not run` reason from the line right above each."""
    lines = page.read_text().splitlines()
    found, index = [], 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if not match:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
        above = lines[index - 1] if index else ""
        reason = NOT_RUN.search(above)
        found.append(Block(page, index + 1, match.group(1), "\n".join(lines[index + 1:end]) + "\n",
                           reason.group(1) if reason else None))
        index = end + 1
    return found


ALL = [block for page in PAGES for block in blocks(page)]
RUNNABLE = [b for b in ALL if b.not_run is None and b.language in ("python", "bash")]


def commands(code: str) -> list[str]:
    """A bash block's command lines, continuations joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    lines = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment() -> dict:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


# Quick checks: every block is run or says why, links resolve, and options exist.

def test_every_block_is_python_bash_or_text():
    wrong = [b.name for b in ALL if b.language not in ("python", "bash", "text")]
    assert not wrong, f"blocks need a language (python, bash, or text for output that is not run): {wrong}"


def test_blocks_not_run_say_why_and_are_few():
    left_out = [b for b in ALL if b.not_run is not None]
    vague = [b.name for b in left_out if len(b.not_run) < 10]
    assert not vague, f"say why these blocks are not run: {vague}"
    assert len(left_out) <= MAX_NOT_RUN, [b.name for b in left_out]
    assert len(RUNNABLE) >= 20, "the pages have lost their examples"


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(target)
    assert not broken, f"{page.name}: links to nothing: {broken}"


HELP_SCRIPT = """
import contextlib, io, sys
from importlib.metadata import entry_points
main = entry_points(group="console_scripts")["speculative"].load()
for command in sys.argv[1:]:
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        try:
            main([command, "--help"])
        except SystemExit:
            pass
    print(f"=== {command}\\n{text.getvalue()}")
"""


def options_of(commands: set[str]) -> dict[str, frozenset[str]]:
    """The options each command's --help lists, from one interpreter (seven would take half a minute)."""
    result = subprocess.run([sys.executable, "-c", HELP_SCRIPT, *sorted(commands)], capture_output=True, text=True,
                            env=environment(), timeout=BLOCK_TIMEOUT)
    assert result.returncode == 0, result.stderr[-2000:]
    parts = re.split(r"^=== (\S+)$", result.stdout, flags=re.M)[1:]
    found = {name: frozenset(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", text))
             for name, text in zip(parts[::2], parts[1::2])}
    assert set(found) == commands and all(len(o) > 2 for o in found.values()), found
    return found


def speculative_lines() -> list[tuple[str, str]]:
    """(block name, command line) for every `speculative` command in a bash block, run or not."""
    found = []
    for block in ALL:
        if block.language == "bash":
            for line in commands(block.code):
                for part in re.split(r"\|\||&&|\|", line):
                    part = part.strip()
                    if part.startswith("speculative "):
                        found.append((block.name, part))
    return found


def test_speculative_options_exist():
    """Every option a page shows exists on that command, even in blocks CI does not run."""
    lines = [(name, shlex.split(line, comments=True)) for name, line in speculative_lines()]
    assert lines
    known = options_of({words[1] for _, words in lines})
    unknown = [f"{name}: speculative {words[1]} {w}" for name, words in lines for w in words[2:]
               if re.match(r"--?[a-zA-Z]", w) and w.split("=")[0] not in known[words[1]]]
    assert not unknown, unknown


# Slow: the blocks themselves.

def run_in(folder: Path, block: Block, port: int | None) -> subprocess.CompletedProcess:
    code = block.code if port is None else re.sub(rf"\b{SERVER_PORT}\b", str(port), block.code)
    if block.language == "python":
        argv = [sys.executable, "-c", code]
    else:
        argv = ["bash", "-c", "set -euo pipefail\n" + code]
    return subprocess.run(argv, cwd=folder, env=environment(), capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT)


def wait_healthy(port: int, process: subprocess.Popen, log: Path) -> None:
    end = time.monotonic() + BLOCK_TIMEOUT
    while time.monotonic() < end:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"no /health from the server: {log.read_text()[-3000:]}")


def serve(line: str, folder: Path) -> tuple[subprocess.Popen, int, Path]:
    """Starts one `speculative serve` line of a page on a free port."""
    port = free_port()
    words = shlex.split(line, comments=True)
    if "--port" in words:
        words[words.index("--port") + 1] = str(port)
    else:
        words += ["--port", str(port)]
    log = folder / f"serve-{port}.log"
    with open(log, "w") as out:
        process = subprocess.Popen([str(BIN / "speculative"), *words[1:], "--threads", "1"], cwd=folder,
                                   env=environment(), stdout=out, stderr=subprocess.STDOUT)
    wait_healthy(port, process, log)
    return process, port, log


def stop(process: subprocess.Popen) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    """The server the client examples talk to: the shipped pair, as README's example starts it."""
    process, port, log = serve("speculative serve --api-key sk-local", tmp_path_factory.mktemp("server"))
    yield port
    assert stop(process) == 0, log.read_text()[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.name)
def test_block_runs(block, tmp_path, request):
    if block.starts_servers:
        for line in commands(block.code):
            assert line.startswith("speculative serve"), f"{block.name}: keep servers in blocks of their own"
            process, _, log = serve(line, tmp_path)
            assert stop(process) == 0, f"{block.name}: {line}\n{log.read_text()[-3000:]}"
        return
    port = request.getfixturevalue("shared_server") if block.needs_server else None
    result = run_in(tmp_path, block, port)
    assert result.returncode == 0, (f"{block.name} failed with {result.returncode}:\n{block.code}\n"
                                    f"stdout: {result.stdout[-3000:]}\nstderr: {result.stderr[-3000:]}")
