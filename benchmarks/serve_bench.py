"""The server benchmark: `speculative serve` driven by N concurrent `openai` clients.

For each setting (a target and its draft), two real server processes on 127.0.0.1: one
with the draft, one with `--draft none` (plain continuous batching through the same
server, the baseline). Only one of them works at a time: every round runs each N on the
speculative server, then on the plain one, so the two see the same machine state, and
ratios are medians over rounds of same-round ratios.

Each client sends its share of the requests one after another (greedy, streaming). Per
request: time to first token (TTFT), and time per output token after the first
(finish - first token) / (tokens - 1), the inter-token latency a reader sees (ITL; a
speculative step delivers several tokens at once). Throughput: all tokens over the span
from the first request to the last answer. Greedy outputs of the two servers are compared
token for token.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import openai


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))] if ordered else 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess on 127.0.0.1; `model` is the name its requests carry (None: the
    setting's target). Its stderr goes to a file, not a pipe, so a chatty server never blocks."""

    def __init__(self, command: list[str], port: int, env: dict, model: str | None = None):
        self.url, self.model = f"http://127.0.0.1:{port}", model
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self.log, env={**os.environ, **env})

    @classmethod
    def ours(cls, args: list[str], threads: int) -> "ServerProcess":
        port = free_port()
        return cls([sys.executable, "-m", "speculative.entrypoints.cli", "serve", "--port", str(port),
                    "--threads", str(threads), "--max-batch-size", "16", *args],
                   port, {"OMP_NUM_THREADS": str(threads)})

    @classmethod
    def transformers(cls, directory: str, threads: int) -> "ServerProcess":
        """`transformers serve` (transformers' own OpenAI-compatible server) with continuous
        batching, on the same model directory, offline, float32 on the CPU."""
        port = free_port()
        command = os.path.join(os.path.dirname(sys.executable), "transformers")
        return cls([command, "serve", directory, "--continuous-batching", "--device", "cpu", "--dtype", "float32",
                    "--host", "127.0.0.1", "--port", str(port)], port,
                   {"OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
                   model=directory)

    def wait(self, deadline: float = 600) -> "ServerProcess":
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited: {self.log.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("server not healthy in time")

    def close(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def drive(url: str, model: str, prompts: list, clients: int, max_tokens: int, token_ids: bool = True) -> dict:
    """`clients` concurrent clients share the prompts (client c sends prompts c, c + N, ...).
    Tokens are counted from the streamed token ids (ours) or, for a peer that does not send
    them, from the usage of the last chunk."""
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=1800)
    records: dict[int, dict] = {}

    async def one(index: int) -> None:
        sent = time.perf_counter()
        first, tokens, count = None, [], None
        stream = await api.completions.create(model=model, prompt=prompts[index], max_tokens=max_tokens,
                                              temperature=0, stream=True, stream_options={"include_usage": True},
                                              extra_body={"return_token_ids": True} if token_ids else None)
        async for chunk in stream:
            if chunk.usage is not None:
                count = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            if token_ids and chunk.choices[0].token_ids or not token_ids and chunk.choices[0].text:
                first = first or time.perf_counter()
                tokens += chunk.choices[0].token_ids if token_ids else [chunk.choices[0].text]
        count = len(tokens) if token_ids or count is None else count
        records[index] = {"sent": sent, "first": first, "finish": time.perf_counter(), "tokens": tokens,
                          "count": count}

    async def client(c: int) -> None:
        for index in range(c, len(prompts), clients):
            await one(index)

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    span = time.perf_counter() - start
    await api.close()
    done = [records[i] for i in range(len(prompts))]
    total = sum(r["count"] for r in done)
    ttft = [r["first"] - r["sent"] for r in done]
    itl = [(r["finish"] - r["first"]) / (r["count"] - 1) for r in done if r["count"] > 1]
    return {"tokens_per_second": total / span, "tokens": total, "seconds": span,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99),
            "outputs": [r["tokens"] for r in done]}


def compare(setting: dict, prompts: list, clients: tuple[int, ...], requests: int, max_tokens: int, runs: int,
            threads: int, peer: tuple[str, list[str]] | None = None, log=print) -> dict:
    """One setting: {"name", "target", "draft"}; prompts are text or token ids. `peer`: a
    transformers model directory and the same prompts as text, for `transformers serve`."""
    servers = {name: ServerProcess.ours(["--target", setting["target"], "--draft", draft], threads)
               for name, draft in (("speculative", setting["draft"]), ("plain", "none"))}
    if peer:
        servers["transformers"] = ServerProcess.transformers(peer[0], threads)
    try:
        for server in servers.values():
            server.wait(1200)
        work = {name: [(peer[1] if name == "transformers" else prompts)[i % len(prompts)] for i in range(requests)]
                for name in servers}
        for name, s in servers.items():  # warm-up: first-request costs (kernel choice, buffers) stay out
            asyncio.run(drive(s.url, s.model or setting["target"], work[name][:1], 1, 4,
                              token_ids=name != "transformers"))
        rounds: dict[int, list[dict]] = {n: [] for n in clients}
        for round_ in range(runs):
            for n in clients:
                result = {name: asyncio.run(drive(s.url, s.model or setting["target"], work[name], n, max_tokens,
                                                  token_ids=name != "transformers"))
                          for name, s in servers.items()}
                rounds[n].append(result)
                log(f"  {setting['name']} round {round_ + 1} N={n}: " + ", ".join(
                    f"{name} {r['tokens_per_second']:.1f} tok/s" for name, r in result.items()))
    finally:
        for server in servers.values():
            server.close()
    report = {}
    for n, results in rounds.items():
        entry = {}
        for name in servers:
            entry[name] = {key: statistics.median(r[name][key] for r in results)
                           for key in ("tokens_per_second", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")}
        entry["speedup"] = statistics.median(r["speculative"]["tokens_per_second"] / r["plain"]["tokens_per_second"]
                                             for r in results)
        if peer:
            entry["vs_transformers"] = statistics.median(
                r["speculative"]["tokens_per_second"] / r["transformers"]["tokens_per_second"] for r in results)
        entry["identical"] = all(r["speculative"]["outputs"] == r["plain"]["outputs"] for r in results)
        report[str(n)] = entry
    return report


def render(report: dict) -> list[str]:
    parts = [f"### {report['title']}\n",
             "Total tokens/s (speedup over the same server with `--draft none`), time to first token and "
             "inter-token latency (per token after the first) p50 / p99 in milliseconds, medians over "
             "the rounds; identical: greedy outputs equal token for token.\n"]
    for name, rows in report["settings"].items():
        rounds = report.get("rounds", {}).get(name, report["runs"])
        peer = any("transformers" in e for e in rows.values())
        parts += [f"{name}, {rounds} round{'s' if rounds > 1 else ''}:\n",
                  "| clients | speculative tok/s | plain tok/s | speculative TTFT | plain TTFT | speculative ITL "
                  "| plain ITL | identical |" + (" transformers serve tok/s (ours vs it) | its TTFT | its ITL |" if peer
                                                  else ""),
                  "| --- " * (11 if peer else 8) + "|"]
        for n, e in rows.items():
            s, p = e["speculative"], e["plain"]
            ms = lambda x, k: f"{x[k + '_p50'] * 1000:.0f} / {x[k + '_p99'] * 1000:.0f}"  # noqa: E731
            line = (f"| {n} | {s['tokens_per_second']:.1f} ({e['speedup']:.2f}x) | {p['tokens_per_second']:.1f}"
                    f" | {ms(s, 'ttft')} | {ms(p, 'ttft')} | {ms(s, 'itl')} | {ms(p, 'itl')} | "
                    f"{'yes' if e['identical'] else 'NO'} |")
            if peer:
                t = e["transformers"]
                line += f" {t['tokens_per_second']:.1f} ({e['vs_transformers']:.2f}x) | {ms(t, 'ttft')} | {ms(t, 'itl')} |"
            parts.append(line)
        parts.append("")
    if report.get("peers"):
        parts.append(f"{report['peers']}\n")
    return parts


if __name__ == "__main__":  # a quick look: python benchmarks/serve_bench.py
    prompts = [json.loads(line)["prompt"] for line in open(os.path.join(os.path.dirname(__file__),
                                                                        "code_completion.jsonl"))]
    print(json.dumps(compare({"name": "shipped", "target": "default", "draft": "default-draft+ngram"}, prompts,
                             (1, 4), 8, 32, 1, 2), indent=1)[:2000])
