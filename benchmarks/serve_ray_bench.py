"""`speculative serve --ray` against the single-process server, N concurrent `openai` clients.

Three servers, one at a time (each `--ray` one starts its own local Ray cluster): the
single-process server on `--threads 1`, Ray with 1 replica x 1 CPU, Ray with 2 replicas x
1 CPU. Each is warmed up (one round of requests, not timed), then driven `--runs` times by
`--clients` streaming greedy clients (serve_bench.drive); requests/s is the median over
runs. Greedy outputs are compared token for token with the single-process server's. Ratios
that the issue sets goals for: 2 replicas over 1 replica, and 1 replica over one process.

`--speculation`: speculative over plain decoding (the shipped draft against `--draft none`)
in one process and through Ray (1 replica x 1 CPU): four servers up together, each round
drives all four in turn (order rotated by round), and each ratio is the median over rounds
of same-round ratios; the goal is Ray's ratio >= 0.9x the process's.

    python benchmarks/serve_ray_bench.py --requests 32 --clients 8 --max-tokens 64 --runs 3
    python benchmarks/serve_ray_bench.py --speculation --requests 32 --clients 8 --max-tokens 64 --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import ServerProcess, drive, free_port  # noqa: E402
from serve_ray_routing import cpu_name  # noqa: E402

PROMPTS = ["def add(a, b):", "import os\nimport sys\n\n\ndef main(argv):", "for i in range(10):\n    if i % 2 == 0:",
           "class Stack:\n    def __init__(self):\n        self.items = []", "def fib(n):\n    if n < 2:",
           "# Parse the command line\nparser = argparse.ArgumentParser(description=",
           "    def __repr__(self):\n        return", 'def read_lines(path):\n    """Return the lines of a file."""']


def server(kind: str, draft: list[str] = ()) -> ServerProcess:
    if kind == "process":
        return ServerProcess.ours(["--max-batch-size", "8", *draft], threads=1)
    port = free_port()
    replicas = "2" if kind == "ray-2x1" else "1"
    return ServerProcess([sys.executable, "-m", "speculative.entrypoints.cli", "serve", "--ray", "--port", str(port),
                          "--replicas", replicas, "--replica-cpus", "1", "--max-batch-size", "8", "--no-access-log",
                          *draft], port, {"OMP_NUM_THREADS": "1"})


def speculation(prompts: list[str], clients: int, max_tokens: int, runs: int) -> dict:
    """Speculative over plain, in one process and through Ray; see the module docstring."""
    names = [(kind, draft) for kind in ("process", "ray-1x1") for draft in ("speculative", "plain")]
    servers = {n: server(n[0], ["--draft", "none"] if n[1] == "plain" else []) for n in names}
    rounds = []
    try:
        for s in servers.values():
            s.wait(900)
        for s in servers.values():  # warm-up
            asyncio.run(drive(s.url, "default", prompts[:clients], clients, max_tokens))
        for run in range(runs):
            got = {}
            for n in names[run % 4:] + names[:run % 4]:
                got[n] = asyncio.run(drive(servers[n].url, "default", prompts, clients, max_tokens))
            rounds.append(got)
            print(f"round {run + 1}: " + ", ".join(f"{k}/{d} {r['tokens_per_second']:.1f} tok/s"
                                                   for (k, d), r in got.items()), flush=True)
    finally:
        for s in servers.values():
            s.close()
    ratio = {kind: [r[(kind, "speculative")]["tokens_per_second"] / r[(kind, "plain")]["tokens_per_second"]
                    for r in rounds] for kind in ("process", "ray-1x1")}
    same = all(r[n]["outputs"] == r[names[0]]["outputs"] for r in rounds for n in names)
    return {"speedup": {k: statistics.median(v) for k, v in ratio.items()}, "speedup_runs": ratio,
            "ray_speedup_over_process_speedup": statistics.median(
                ray / process for ray, process in zip(ratio["ray-1x1"], ratio["process"])),
            "identical_greedy_outputs": same,
            "servers": {f"{k}/{d}": {key: statistics.median(r[(k, d)][key] for r in rounds)
                                     for key in ("tokens_per_second", "ttft_p50", "itl_p50")} for k, d in names}}


def measure(kind: str, prompts: list[str], clients: int, max_tokens: int, runs: int) -> dict:
    process = server(kind).wait(900)
    try:
        asyncio.run(drive(process.url, "default", prompts[:clients], clients, max_tokens))  # warm-up
        results = [asyncio.run(drive(process.url, "default", prompts, clients, max_tokens)) for _ in range(runs)]
    finally:
        process.close()
    rates = [len(prompts) / r["seconds"] for r in results]
    return {"requests_per_second": statistics.median(rates), "runs": rates,
            "tokens_per_second": statistics.median(r["tokens_per_second"] for r in results),
            "ttft_p50": statistics.median(r["ttft_p50"] for r in results), "outputs": results[0]["outputs"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--speculation", action="store_true", help="speculative over plain, process and Ray")
    args = parser.parse_args()
    prompts = [f"{PROMPTS[i % len(PROMPTS)]}  # {i}" for i in range(args.requests)]
    if args.speculation:
        report = {"cpu": cpu_name(), "clients": args.clients,
                  "requests": args.requests, "max_tokens": args.max_tokens, "runs": args.runs,
                  **speculation(prompts, args.clients, args.max_tokens, args.runs)}
        print(f"speculative / plain: one process {report['speedup']['process']:.2f}x, Ray 1 replica "
              f"{report['speedup']['ray-1x1']:.2f}x; Ray's over the process's "
              f"{report['ray_speedup_over_process_speedup']:.2f}x")
        return print(json.dumps(report))
    report = {kind: measure(kind, prompts, args.clients, args.max_tokens, args.runs)
              for kind in ("process", "ray-1x1", "ray-2x1")}
    reference = report["process"]["outputs"]
    same = {kind: report[kind].pop("outputs") == reference for kind in report}
    summary = {"cpu": cpu_name(), "clients": args.clients,
               "requests": args.requests, "max_tokens": args.max_tokens, "identical_greedy_outputs": same,
               "two_replicas_over_one": report["ray-2x1"]["requests_per_second"]
               / report["ray-1x1"]["requests_per_second"],
               "ray_one_replica_over_process": report["ray-1x1"]["requests_per_second"]
               / report["process"]["requests_per_second"], "servers": report}
    for kind, row in report.items():
        print(f"{kind:8s} {row['requests_per_second']:6.2f} requests/s  {row['tokens_per_second']:7.1f} tokens/s  "
              f"TTFT p50 {row['ttft_p50'] * 1000:7.1f} ms  identical: {same[kind]}")
    print(f"2 replicas / 1 replica: {summary['two_replicas_over_one']:.2f}x; Ray 1 replica / one process: "
          f"{summary['ray_one_replica_over_process']:.2f}x")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
