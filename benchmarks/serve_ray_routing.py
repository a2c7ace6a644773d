"""Prefix routing against Serve's default router: `speculative serve --ray --replicas 2`,
`--router prefix` (ours) and `--router serve` (the less busy of two at random).

Two servers (each its own local Ray cluster, 2 engine replicas x 1 CPU) are up together
and take turns: each round runs every workload on one, then on the other, in alternating
order. Workloads (8 clients, one per conversation or document, its requests one after
another, greedy, streaming):
- conversation: 8 conversations x 5 turns; a turn's prompt is the previous turn's prompt,
  its answer and a new comment line asking for the next function.
- edit: 8 documents x 5 versions; each version changes the same line near the module's
  end again, and asks for the same continuation after it (a document edited and re-sent).
Text differs from round to round (other names); a suffix cache still holds what earlier
rounds generated, on both servers alike. `--sequential`: the 8 run one after another (one
request in flight), where Serve's router sees equal queues and chooses at random.

Per request the reply's `speculative` object gives the replica that served it and what was
drafted and kept. Reported, medians over rounds: the share of requests (after each
conversation's first) served by the replica of its previous one, acceptance (kept /
drafted), prompt tokens read, TTFT p50 and tokens/s. The engine keeps no KV cache between
requests (no prefix cache: every prompt token is read again); what can persist on a
replica is the suffix cache of `--draft suffix`, so both the shipped draft and `suffix` run.

    python benchmarks/serve_ray_routing.py --rounds 3 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import ServerProcess, free_port, percentile  # noqa: E402

ROUTERS = ("prefix", "serve")
TASKS = ["parse a date string", "merge two sorted lists", "count the words of a file", "flatten a nested list",
         "read a CSV file into dictionaries", "check that a string is a palindrome", "compute a running mean",
         "remove duplicate items, keeping their order", "split a path into its parts", "find the largest value"]
NAMES = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda", "zeta", "iota", "rho"]
MODULE = '''"""Helpers for the {name} service."""

import os
import sys


def load_{name}(path):
    """Read the {name} records of a file."""
    with open(path) as handle:
        return [line.strip() for line in handle if line.strip()]


def save_{name}(path, records):
    """Write the {name} records, one a line."""
    with open(path, "w") as handle:
        for record in records:
            handle.write(record + "\\n")


def count_{name}(records):
    """How many {name} records there are."""
    return len(records)
'''


def conversation(c: int, round_: int, turns: int) -> tuple[str, list[str]]:
    """A conversation's opening and the user lines of its later turns."""
    name = f"{NAMES[(c + round_) % len(NAMES)]}_{round_}"
    opening = f"# Utilities for the {name} project.\nimport os\nimport sys\n\n\ndef {name}_main(argv):\n"
    lines = [f"\n\n# Next: a function to {TASKS[(c + t + round_) % len(TASKS)]}.\ndef {name}_step{t}("
             for t in range(1, turns)]
    return opening, lines


def document(d: int, round_: int, version: int) -> str:
    """Version `version` of document d: its later functions renamed one more time each version."""
    name = f"{NAMES[(d + 3 * round_) % len(NAMES)]}{round_}"
    text = MODULE.format(name=name)
    for v in range(1, version + 1):
        before = "    return len(records)" + ("" if v == 1 else f" + {v - 1}")
        text = text.replace(before, f"    return len(records) + {v}")
    return text + "\n\ndef main(argv):\n"


async def request(api, prompt: str, max_tokens: int) -> dict:
    sent = time.perf_counter()
    first, text, usage, figures = None, "", None, {}
    stream = await api.completions.create(model="default", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter()
            text += chunk.choices[0].text
        if chunk.usage is not None:
            usage, figures = chunk.usage, (chunk.model_extra or {}).get("speculative", {})
    return {"text": text, "ttft": (first or time.perf_counter()) - sent, "prompt_tokens": usage.prompt_tokens,
            "tokens": usage.completion_tokens, "replica": figures.get("replica"),
            "drafted": figures.get("drafted", 0), "accepted": figures.get("accepted", 0),
            "forwards": figures.get("target_forwards", 0)}


async def run_workload(url: str, kind: str, round_: int, clients: int, steps: int, max_tokens: int,
                       sequential: bool = False) -> dict:
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=1800)

    async def one(c: int) -> list[dict]:
        records = []
        if kind == "conversation":
            prompt, lines = conversation(c, round_, steps)
            for t in range(steps):
                records.append(await request(api, prompt, max_tokens))
                prompt += records[-1]["text"] + (lines[t] if t < len(lines) else "")
        else:
            for v in range(steps):
                records.append(await request(api, document(c, round_, v), max_tokens))
        return records

    start = time.perf_counter()
    if sequential:
        chains = [await one(c) for c in range(clients)]
    else:
        chains = await asyncio.gather(*(one(c) for c in range(clients)))
    span = time.perf_counter() - start
    await api.close()
    return summarize(chains, span)


def summarize(chains: list[list[dict]], span: float) -> dict:
    flat = [r for chain in chains for r in chain]
    follows = [b["replica"] == a["replica"] for chain in chains for a, b in zip(chain, chain[1:])]
    drafted, accepted = sum(r["drafted"] for r in flat), sum(r["accepted"] for r in flat)
    forwards = sum(r["forwards"] for r in flat)
    later = [r["ttft"] for chain in chains for r in chain[1:]]
    return {"same_replica_as_previous": sum(follows) / len(follows), "acceptance_rate": accepted / max(drafted, 1),
            "mean_acceptance_length": 1 + accepted / max(forwards, 1), "drafted": drafted, "accepted": accepted,
            "prompt_tokens_read": sum(r["prompt_tokens"] for r in flat), "prompt_tokens_reused": 0,
            "ttft_p50": percentile([r["ttft"] for r in flat], 50), "ttft_p50_later_turns": percentile(later, 50),
            "tokens_per_second": sum(r["tokens"] for r in flat) / span,
            "replicas_used": len({r["replica"] for r in flat}), "busiest_replica_share": max(
                sum(r["replica"] == x for r in flat) for x in {r["replica"] for r in flat}) / len(flat),
            "texts": [r["text"] for r in flat]}


def cpu_name() -> str:
    """The CPU as /proc/cpuinfo names it (family and model: a Zen 3 is 25/1), and its widest vectors."""
    try:
        info = dict(line.split(":", 1) for line in open("/proc/cpuinfo").read().split("\n\n")[0].splitlines()
                    if ":" in line)
        info = {k.strip(): v.strip() for k, v in info.items()}
        flags = info.get("flags", "").split()
        widest = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
        return f"{info['model name']} (family {info['cpu family']} model {info['model']}, {widest})"
    except (OSError, KeyError, ValueError):
        return platform.processor() or platform.machine()


def server(router: str, draft: str) -> ServerProcess:
    port = free_port()
    return ServerProcess([sys.executable, "-m", "speculative.entrypoints.cli", "serve", "--ray", "--port", str(port),
                          "--replicas", "2", "--replica-cpus", "1", "--max-batch-size", "8", "--router", router,
                          "--draft", draft, "--no-access-log"], port, {"OMP_NUM_THREADS": "1"})


KEYS = ("same_replica_as_previous", "acceptance_rate", "mean_acceptance_length", "prompt_tokens_read",
        "ttft_p50", "ttft_p50_later_turns", "tokens_per_second", "replicas_used", "busiest_replica_share")


def compare(draft: str, args, log=print) -> dict:
    servers = {router: server(router, draft) for router in ROUTERS}
    rounds: dict[str, list[dict]] = {f"{kind}/{router}": [] for kind in args.workloads for router in ROUTERS}
    identical = True
    try:
        for s in servers.values():
            s.wait(900)
        for router, s in servers.items():  # warm-up, not timed, text no round uses
            asyncio.run(run_workload(s.url, "conversation", 99, 2, 2, 8))
        for round_ in range(args.rounds):
            order = ROUTERS if round_ % 2 == 0 else ROUTERS[::-1]
            for kind in args.workloads:
                got = {}
                for router in order:
                    got[router] = asyncio.run(run_workload(servers[router].url, kind, round_, args.clients,
                                                           args.steps, args.max_tokens, args.sequential))
                    rounds[f"{kind}/{router}"].append(got[router])
                    log(f"  {draft} round {round_ + 1} {kind} {router}: " + ", ".join(
                        f"{k} {got[router][k]:.3g}" for k in KEYS))
                identical &= got["prefix"].pop("texts") == got["serve"].pop("texts")
    finally:
        for s in servers.values():
            s.close()
    report = {name: {k: statistics.median(r[k] for r in results) for k in KEYS} | {"runs": results}
              for name, results in rounds.items()}
    return {"draft": draft, "identical_greedy_outputs": identical, "results": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="turns per conversation, versions per document")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--drafts", nargs="+", default=["default-draft+ngram", "suffix"])
    parser.add_argument("--workloads", nargs="+", default=["conversation", "edit"])
    parser.add_argument("--sequential", action="store_true", help="one conversation or document at a time")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    report = {"cpu": cpu_name(), "cores": os.cpu_count(), "rounds": args.rounds, "clients": args.clients,
              "steps": args.steps, "max_tokens": args.max_tokens, "replicas": 2,
              "sequential": args.sequential,
              "drafts": [compare(draft, args) for draft in args.drafts]}
    for entry in report["drafts"]:
        for name, row in entry["results"].items():
            print(f"{entry['draft']:20s} {name:22s} same replica {row['same_replica_as_previous']:.2f}  acceptance "
                  f"{row['acceptance_rate']:.3f}  TTFT p50 {row['ttft_p50'] * 1000:6.0f} ms  "
                  f"{row['tokens_per_second']:6.1f} tok/s")
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text[:1500])


if __name__ == "__main__":
    main()
