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
import time

import httpx
import openai


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))] if ordered else 0.0


class ServerProcess:
    def __init__(self, args: list[str], threads: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([sys.executable, "-m", "speculative.cli", "serve", "--port", str(self.port),
                                         "--threads", str(threads), "--max-batch-size", "16", *args],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        env={**os.environ, "OMP_NUM_THREADS": str(threads)})

    def wait(self, deadline: float = 600) -> "ServerProcess":
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.process.stderr.read().decode()[-2000:]}")
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


async def drive(url: str, model: str, prompts: list, clients: int, max_tokens: int) -> dict:
    """`clients` concurrent clients share the prompts (client c sends prompts c, c + N, ...)."""
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    records: dict[int, dict] = {}

    async def one(index: int) -> None:
        sent = time.perf_counter()
        first, tokens = None, []
        stream = await api.completions.create(model=model, prompt=prompts[index], max_tokens=max_tokens,
                                              temperature=0, stream=True, extra_body={"return_token_ids": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].token_ids:
                first = first or time.perf_counter()
                tokens += chunk.choices[0].token_ids
        records[index] = {"sent": sent, "first": first, "finish": time.perf_counter(), "tokens": tokens}

    async def client(c: int) -> None:
        for index in range(c, len(prompts), clients):
            await one(index)

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    span = time.perf_counter() - start
    await api.close()
    done = [records[i] for i in range(len(prompts))]
    total = sum(len(r["tokens"]) for r in done)
    ttft = [r["first"] - r["sent"] for r in done]
    itl = [(r["finish"] - r["first"]) / (len(r["tokens"]) - 1) for r in done if len(r["tokens"]) > 1]
    return {"tokens_per_second": total / span, "tokens": total, "seconds": span,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99),
            "outputs": [r["tokens"] for r in done]}


def compare(setting: dict, prompts: list, clients: tuple[int, ...], requests: int, max_tokens: int, runs: int,
            threads: int, log=print) -> dict:
    """One setting: {"name", "target", "draft"}; prompts are text or token ids."""
    servers = {name: ServerProcess(["--target", setting["target"], "--draft", draft], threads)
               for name, draft in (("speculative", setting["draft"]), ("plain", "none"))}
    try:
        for server in servers.values():
            server.wait()
        work = [prompts[i % len(prompts)] for i in range(requests)]
        rounds: dict[int, list[dict]] = {n: [] for n in clients}
        for round_ in range(runs):
            for n in clients:
                result = {name: asyncio.run(drive(s.url, setting["target"], work, n, max_tokens))
                          for name, s in servers.items()}
                rounds[n].append(result)
                log(f"  {setting['name']} round {round_ + 1} N={n}: speculative "
                    f"{result['speculative']['tokens_per_second']:.1f} tok/s, plain "
                    f"{result['plain']['tokens_per_second']:.1f} tok/s")
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
        entry["identical"] = all(r["speculative"]["outputs"] == r["plain"]["outputs"] for r in results)
        report[str(n)] = entry
    return report


def render(report: dict) -> list[str]:
    parts = [f"### {report['title']}\n",
             "Total tokens/s (speedup over the same server with `--draft none`), time to first token and "
             "inter-token latency (per token after the first) p50 / p99 in milliseconds, medians over "
             f"{report['runs']} rounds; identical: greedy outputs equal token for token.\n"]
    for name, rows in report["settings"].items():
        parts += [f"{name}:\n", "| clients | speculative tok/s | plain tok/s | speculative TTFT | plain TTFT "
                  "| speculative ITL | plain ITL | identical |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for n, e in rows.items():
            s, p = e["speculative"], e["plain"]
            ms = lambda x, k: f"{x[k + '_p50'] * 1000:.0f} / {x[k + '_p99'] * 1000:.0f}"  # noqa: E731
            parts.append(f"| {n} | {s['tokens_per_second']:.1f} ({e['speedup']:.2f}x) | {p['tokens_per_second']:.1f}"
                         f" | {ms(s, 'ttft')} | {ms(p, 'ttft')} | {ms(s, 'itl')} | {ms(p, 'itl')} | "
                         f"{'yes' if e['identical'] else 'NO'} |")
        parts.append("")
    if report.get("peers"):
        parts.append(f"{report['peers']}\n")
    return parts


if __name__ == "__main__":  # a quick look: python benchmarks/serve_bench.py
    prompts = [json.loads(line)["prompt"] for line in open(os.path.join(os.path.dirname(__file__),
                                                                        "code_completion.jsonl"))]
    print(json.dumps(compare({"name": "shipped", "target": "default", "draft": "default-draft+ngram"}, prompts,
                             (1, 4), 8, 32, 1, 2), indent=1)[:2000])
