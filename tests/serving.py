"""A real `speculative serve` process for the server tests, and what they compare it with.

The server runs as a subprocess on 127.0.0.1 and a free port, on one torch thread; every
wait has a deadline, so a broken server fails a test instead of hanging it.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

KEY = "sk-test-key"
# Seconds any one HTTP call may take: a guard against a hang, not a timing (a shared machine
# running benchmarks can slow these processes down a hundredfold).
TIMEOUT = 300
# A minimal chat template for the shipped tokenizer, which has none of its own.
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def chat_text(messages: list[dict]) -> str:
    """What TEMPLATE renders, written out by hand: the reference for chat prompts."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str, key: str | None = None, template: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = key
        self.log = tempfile.NamedTemporaryFile(prefix="serve-", suffix=".log", delete=False)
        extra = list(args) + (["--api-key", key] if key else [])
        if template:
            path = Path(self.log.name).with_suffix(".jinja")
            path.write_text(TEMPLATE)
            extra += ["--chat-template", str(path)]
        command = [sys.executable, "-m", "speculative.entrypoints.cli", "serve", "--port", str(self.port),
                   "--threads", "1", *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    # Deadlines are generous: they stop a hang, and a shared machine can be slow to start a process.
    def wait_healthy(self, deadline: float = 300.0) -> "Server":
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server was not healthy within {deadline} s:\n{self.output()}")

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def post(self, path: str, body, **kwargs) -> httpx.Response:
        """A raw POST (for what the openai client cannot send); `body` bytes go as they are."""
        headers = {**self.headers(), "Content-Type": "application/json", **kwargs.pop("headers", {})}
        if isinstance(body, (bytes, str)):
            return httpx.post(self.url + path, content=body, headers=headers, timeout=TIMEOUT, **kwargs)
        return httpx.post(self.url + path, json=body, headers=headers, timeout=TIMEOUT, **kwargs)

    def metrics(self) -> dict[str, float]:
        """The Prometheus samples, by name with labels."""
        text = httpx.get(f"{self.url}/metrics", timeout=TIMEOUT).text
        samples = {}
        for line in text.splitlines():
            match = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
            if match:
                samples[match.group(1)] = float(match.group(2))
        return samples

    def wait_metric(self, name: str, value: float, deadline: float = TIMEOUT) -> float:
        end = time.monotonic() + deadline
        while True:
            seen = self.metrics().get(name)
            if seen == value or time.monotonic() > end:
                return seen
            time.sleep(0.05)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        os.unlink(self.log.name)
        return self.process.returncode
