"""The engine benchmark: a queue of requests through continuous batching.

A workload is a list of requests (prompt, budget, arrival time). Three ways serve it:

- `engine`: the step engine with a draft (continuous batching with speculative decoding);
- `plain`: the same engine with draft=None (continuous batching, no drafting: the fair
  baseline);
- `static`: today's static batches, `SpeculativeDecoder.stream` on fixed batches of
  `max_batch_size` requests in arrival order, a batch starting once its last request has
  arrived and the previous batch is done.

Each run records, per request, its arrival, first token and finish times (one clock for
all), and its tokens, compared with the target's own greedy output. Reported: total
tokens/s (all tokens over the span from the first arrival to the last finish), time to
first token and per-request latency (finish - arrival), p50 and p99.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

from ..core.config import SpeculativeConfig
from ..core.rows import SamplingParams
from ..policy.adaptive import AdaptivePolicy
from ..policy.costs import cost_book
from ..proposers import as_proposer
from ..runtime.decoder import SpeculativeDecoder, autoregressive_generate
from ..runtime.engine import Engine
from .bench_report import machine


@dataclass
class Request:
    prompt: list[int]
    budget: int
    # Seconds after the start of the run.
    arrival: float = 0.0


@dataclass
class Served:
    """What happened to one request in one run."""

    arrival: float
    first: float | None = None
    finish: float | None = None
    tokens: list[int] = field(default_factory=list)


def workload(prompts: list[list[int]], count: int, max_new: int) -> list[Request]:
    """`count` requests cycling through the prompts, all queued at time 0."""
    return [Request(prompts[i % len(prompts)], max_new) for i in range(count)]


def spread(requests: list[Request], span: float, seed: int = 0) -> list[Request]:
    """The same requests arriving at uniformly random times over `span` seconds (sorted)."""
    times = sorted(random.Random(seed).uniform(0, span) for _ in requests)
    return [Request(r.prompt, r.budget, t) for r, t in zip(requests, times)]


def serve_engine(engine: Engine, requests: list[Request], clock=time.perf_counter) -> list[Served]:
    """Run the requests through the engine, adding each when its arrival time has come."""
    served = [Served(r.arrival) for r in requests]
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    start = clock()
    while order or engine.has_unfinished():
        now = clock() - start
        while order and requests[order[0]].arrival <= now:
            i = order.pop(0)
            engine.add_request(requests[i].prompt, SamplingParams(requests[i].budget), i)
        if not engine.has_unfinished():
            time.sleep(max(0.0, requests[order[0]].arrival - now))
            continue
        outputs = engine.step()
        now = clock() - start
        for output in outputs:
            record = served[output.request_id]
            if output.new_token_ids and record.first is None:
                record.first = now
            record.tokens += output.new_token_ids
            if output.finished:
                record.finish = now
    return served


def serve_static(decoder: SpeculativeDecoder, requests: list[Request], batch_size: int,
                 clock=time.perf_counter) -> list[Served]:
    """Fixed batches in arrival order through `decoder.stream`."""
    served = [Served(r.arrival) for r in requests]
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    start = clock()
    for chunk in (order[i:i + batch_size] for i in range(0, len(order), batch_size)):
        time.sleep(max(0.0, max(requests[i].arrival for i in chunk) - (clock() - start)))
        stream = decoder.stream([requests[i].prompt for i in chunk], [requests[i].budget for i in chunk])
        for row, token in stream:
            record = served[chunk[row]]
            record.first = record.first if record.first is not None else clock() - start
            record.tokens.append(token)
            record.finish = clock() - start
    return served


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(served: list[Served], reference: list[list[int]]) -> dict:
    tokens = sum(len(s.tokens) for s in served)
    span = max(s.finish for s in served) - min(s.arrival for s in served)
    first = [s.first - s.arrival for s in served]
    latency = [s.finish - s.arrival for s in served]
    return {"tokens_per_second": tokens / span, "seconds": span, "tokens": tokens,
            "ttft_p50": percentile(first, 0.5), "ttft_p99": percentile(first, 0.99),
            "latency_p50": percentile(latency, 0.5), "latency_p99": percentile(latency, 0.99),
            "identical": [s.tokens for s in served] == reference}


def references(target, requests: list[Request]) -> list[list[int]]:
    """The target's own greedy output of every request (computed once per distinct prompt)."""
    done: dict[tuple, list[int]] = {}
    for r in requests:
        key = (tuple(r.prompt), r.budget)
        if key not in done:
            done[key] = autoregressive_generate(target, r.prompt, r.budget)
    return [done[(tuple(r.prompt), r.budget)] for r in requests]


def methods(target, draft, config: SpeculativeConfig, batch_size: int) -> dict:
    """name -> function(requests) -> served: a fresh engine per run, learning into one policy
    across runs as the decoder's calls do."""
    decoder = SpeculativeDecoder(target, draft, config)
    model = as_proposer(draft, config, target=target).model
    policy = AdaptivePolicy.for_config(config, cost_book(target, model)) if config.adaptive else None
    return {"engine": lambda requests: serve_engine(Engine(target, draft, config, batch_size, policy=policy), requests),
            "plain": lambda requests: serve_engine(Engine(target, None, config, batch_size), requests),
            "static": lambda requests: serve_static(decoder, requests, batch_size)}


def compare(target, draft, config: SpeculativeConfig, requests: list[Request], batch_sizes=(1, 4, 8, 16),
            runs: int = 3, spread_fraction: float = 0.75, log=print) -> dict:
    """Every method at every batch size, on the queued workload and on the same requests
    spread over `spread_fraction` of the time plain continuous batching took for the queue.
    Methods alternate within each round; figures are medians over rounds."""
    reference = references(target, requests)
    warm = [Request(r.prompt, min(8, r.budget)) for r in requests[:4]]
    report = {"queued": {}, "spread": {}}
    for size in batch_sizes:
        ways = methods(target, draft, config, size)
        for run in ways.values():  # warm-up (and the adaptive policy's one cost probe)
            run(warm)
        for name, workload_requests in (("queued", requests), ("spread", None)):
            if workload_requests is None:
                span = report["queued"][str(size)]["plain"]["seconds"] * spread_fraction
                workload_requests = spread(requests, span, seed=size)
            rounds = {method: [] for method in ways}
            for _ in range(runs):
                for method, run in ways.items():
                    rounds[method].append(summarize(run(workload_requests), reference))
            entry = {method: median_summary(results) for method, results in rounds.items()}
            for method in ("engine", "static"):
                entry[method]["vs_plain"] = statistics.median(
                    r["tokens_per_second"] / p["tokens_per_second"] for r, p in zip(rounds[method], rounds["plain"]))
            report[name][str(size)] = entry
            log(f"  {name} batch {size}: " + ", ".join(
                f"{m} {e['tokens_per_second']:.1f} tok/s (TTFT p50 {e['ttft_p50']:.2f}s, latency p50 "
                f"{e['latency_p50']:.2f}s p99 {e['latency_p99']:.2f}s{'' if e['identical'] else ', NOT IDENTICAL'})"
                for m, e in entry.items()))
    return report


def median_summary(results: list[dict]) -> dict:
    keys = [k for k in results[0] if k != "identical"]
    out = {k: statistics.median(r[k] for r in results) for k in keys}
    out["identical"] = all(r["identical"] for r in results)
    return out


def batch_one(decoders: dict, prompts: list[list[int]], max_new: int, runs: int = 3) -> dict:
    """Batch-1 `generate` of several decoders (say, this code and the main branch's), prompt
    by prompt in turn; tokens/s per decoder (median over rounds) and whether outputs agree."""
    for decoder in decoders.values():
        decoder.generate(prompts[0], min(8, max_new))
    speeds = {name: [] for name in decoders}
    outputs = {}
    for _ in range(runs):
        seconds = {name: 0.0 for name in decoders}
        outputs = {name: [] for name in decoders}
        for ids in prompts:
            for name, decoder in decoders.items():
                started = time.perf_counter()
                outputs[name].append(decoder.generate(ids, max_new))
                seconds[name] += time.perf_counter() - started
        for name in decoders:
            speeds[name].append(sum(map(len, outputs[name])) / seconds[name])
    first = next(iter(decoders))
    return {name: {"tokens_per_second": statistics.median(speeds[name]),
                   "vs_" + first: statistics.median(a / b for a, b in zip(speeds[name], speeds[first])),
                   "identical": outputs[name] == outputs[first]} for name in decoders}


def batch_throughput(target, draft, prompts: list[list[int]], batch_sizes=(1, 2, 4, 8, 16), max_new: int = 64,
                     runs: int = 3, k: int = 4, eos=None, prompt_lookup: bool = False, log=print) -> dict:
    """Total tokens/s across a batch: batched autoregressive against speculative decoding
    (fixed K and adaptive), per batch size. Rows cycle through the prompts."""
    rows = []
    for size in batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(size)]
        entry = {"batch_size": size}
        methods = {
            "autoregressive": None,
            f"speculative K={k}": SpeculativeDecoder(target, draft, SpeculativeConfig(
                num_draft_tokens=k, adaptive=False, prompt_lookup=prompt_lookup)),
            "speculative adaptive": SpeculativeDecoder(target, draft, SpeculativeConfig(
                num_draft_tokens=k, prompt_lookup=prompt_lookup)),
        }
        def run(method, batch=batch):
            if method is None:
                return autoregressive_generate(target, batch, max_new, eos_token_id=eos)
            return method.generate(batch, max_new, eos)

        for method in methods.values():
            run(method)  # warm-up (adaptive K measures its costs at this batch size here)
            if method is not None:
                method.reset_stats()
        speeds = {name: [] for name in methods}
        ratios = {name: [] for name in methods}
        outputs = {}
        for _ in range(runs):  # rounds: each method's ratio is to the baseline of its round
            for name, method in methods.items():
                started = time.perf_counter()
                outputs[name] = run(method)
                speeds[name].append(sum(map(len, outputs[name])) / (time.perf_counter() - started))
                ratios[name].append(speeds[name][-1] / speeds["autoregressive"][-1])
        for name, method in methods.items():
            entry[name] = {"tokens_per_second": statistics.median(speeds[name]),
                           "speedup": statistics.median(ratios[name]),
                           "identical": outputs[name] == outputs["autoregressive"]}
            if method is not None:
                entry[name]["acceptance_rate"] = method.stats.acceptance_rate
                entry[name]["tokens_per_forward"] = method.stats.tokens_per_forward
                entry[name]["drafted_per_step"] = method.stats.drafted / max(1, method.stats.target_forwards)
        log(f"  batch {size}: " + ", ".join(f"{n} {entry[n]['tokens_per_second']:.1f} tok/s "
                                              f"({entry[n]['speedup']:.2f}x)" for n in methods))
        rows.append(entry)
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "max_new_tokens": max_new, "runs": runs,
            "k": k, "prompt_lookup": prompt_lookup, "rows": rows}
