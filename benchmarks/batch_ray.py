"""Benchmark section `batch-ray`: `speculative batch` on Ray against one process, same 2 cores.

Workload: 64 records of code completion on the shipped pair (the 10 held-out prompts of
code_completion.jsonl, record i cut 8 * (i // 10) tokens shorter, so no two are alike), 128
new tokens each (as the `default` section; with 64 the job lasted about 17 s, a third of
it Ray's start-up), greedy. Four ways, interleaved round by round, medians of the rounds:

- one process x 2 threads (`run_local`), speculative (the default draft) and plain (no
  draft, the same engine);
- Ray, 2 actors x 1 thread (`run_ray` on a local cluster of 2 CPUs started once), the same
  two drafts.

Reported per way: tokens/s over the whole job; seconds until every worker has its models
loaded and until the first record is written (start-up: actors, model loading; the
cluster's own start is reported once apart); time outside the engines' step calls
(1 - step seconds / (workers x job seconds)); and whether every record equals the first
way's. For Ray, a projection to more actors from the measured per-actor rate after
start-up (from the moment every actor had its models loaded; each actor on a core of its
own, the writer never the limit).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from speculative import load_tokenizer
from speculative.entrypoints.batch import ModelSpec, run_local
from speculative.entrypoints.bench import machine

WAYS = [("process", "speculative"), ("ray", "speculative"), ("process", "plain"), ("ray", "plain")]
DRAFTS = {"speculative": "default-draft+ngram", "plain": "none"}


def workload(path: Path, prompts, count: int, max_new: int) -> None:
    tokenizer = load_tokenizer("default")
    ids = prompts("code_completion.jsonl", tokenizer, max_tokens=512 - max_new - 9)
    with open(path, "w") as f:
        for i in range(count):
            row = ids[i % len(ids)]
            f.write(json.dumps({"id": i, "prompt": row[:max(8, len(row) - 8 * (i // len(ids)))],
                                "max_tokens": max_new}) + "\n")


def run_way(where: str, draft: str, records: Path, folder: Path, round_: int, batch: int) -> dict:
    from speculative.entrypoints.batch_ray import run_ray

    out = folder / f"{where}-{draft}-{round_}.jsonl"
    spec = ModelSpec(draft=DRAFTS[draft], max_batch_size=batch)
    if where == "process":
        torch.set_num_threads(2)
        summary = run_local(records, out, spec, show_progress=False)
        workers = 1
    else:
        torch.set_num_threads(1)  # the driver only reads and writes
        summary = run_ray(records, out, spec, actors=2, threads=1, show_progress=False)
        workers = 2
    tokens = {row["id"]: row["token_ids"] for row in map(json.loads, out.read_text().splitlines())}
    return {"tokens_per_second": summary.tokens / summary.seconds, "seconds": summary.seconds,
            "first_record_seconds": summary.first_record_seconds, "ready_seconds": summary.ready_seconds,
            "outside_steps": 1 - summary.step_seconds / (workers * summary.seconds),
            # After start-up: from the moment every worker had its models loaded.
            "steady_tokens_per_second": summary.tokens / (summary.seconds - summary.ready_seconds),
            "tokens": tokens, "errors": summary.errors}


def section(save, prompts, smoke: bool = False) -> None:
    import ray

    count, max_new, runs, batch = (16, 32, 1, 8) if smoke else (64, 128, 3, 8)
    folder = Path(tempfile.mkdtemp(prefix="batch-ray-"))
    records = folder / "records.jsonl"
    workload(records, prompts, count, max_new)
    started = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    cluster_seconds = time.perf_counter() - started
    results: dict = {f"{w} {d}": [] for w, d in WAYS}
    threads = torch.get_num_threads()  # run_way sets its own; later sections get theirs back
    try:
        for round_ in range(runs):
            for where, draft in WAYS:
                result = run_way(where, draft, records, folder, round_, batch)
                results[f"{where} {draft}"].append(result)
                print(f"  round {round_ + 1}, {where} {draft}: {result['tokens_per_second']:.1f} tok/s, first "
                      f"record {result['first_record_seconds']:.1f} s, outside steps {result['outside_steps']:.1%}")
    finally:
        ray.shutdown()
        torch.set_num_threads(threads)
    reference = results["process speculative"][0]["tokens"]
    report = {"title": (f"speculative batch: Ray (2 actors x 1 thread) against one process (2 threads), {count} "
                        f"code-completion records, {max_new} new tokens, shipped pair"),
              "machine": machine(), "date": time.strftime("%Y-%m-%d"), "records": count, "max_new_tokens": max_new,
              "runs": runs, "max_batch_size": batch, "smoke": smoke, "ray_cluster_start_seconds": cluster_seconds,
              "ways": {}}
    for name, rounds in results.items():
        report["ways"][name] = {key: statistics.median(r[key] for r in rounds) for key in
                                ("tokens_per_second", "seconds", "ready_seconds", "first_record_seconds",
                                 "outside_steps")}
        report["ways"][name]["steady_tokens_per_second"] = statistics.median(r["steady_tokens_per_second"]
                                                                             for r in rounds)
        report["ways"][name]["identical"] = all(r["tokens"] == reference and not r["errors"] for r in rounds)
    ways = report["ways"]
    report["ray_vs_process"] = {d: ways[f"ray {d}"]["tokens_per_second"] / ways[f"process {d}"]["tokens_per_second"]
                                for d in DRAFTS}
    report["speculative_vs_plain_on_ray"] = (ways["ray speculative"]["tokens_per_second"]
                                             / ways["ray plain"]["tokens_per_second"])
    steady, start = ways["ray speculative"]["steady_tokens_per_second"], ways["ray speculative"]["ready_seconds"]
    report["projection"] = [
        {"actors": n, "tokens_per_second": n * steady / 2,
         "seconds_for_10000_records": start + 10_000 * max_new / (n * steady / 2)} for n in (2, 4, 8, 16, 32)]
    save("batch-ray-smoke" if smoke else "batch-ray", report)
    for line in render(report):
        print(line)


def render(report: dict) -> list[str]:
    parts = [f"### {report['title']}\n",
             f"Medians of {report['runs']} rounds, the four ways interleaved. Starting the local Ray cluster took "
             f"{report['ray_cluster_start_seconds']:.1f} s (once). `outside steps`: the share of the workers' time "
             "not spent in the engine's step calls (loading, Ray, reading and writing).\n",
             "| way | tokens/s | job seconds | models loaded after (s) | first record after (s) | outside steps | "
             "identical |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, way in report["ways"].items():
        parts.append(f"| {name} | {way['tokens_per_second']:.1f} | {way['seconds']:.1f} | "
                     f"{way['ready_seconds']:.1f} | {way['first_record_seconds']:.1f} | {way['outside_steps']:.1%} | "
                     f"{'yes' if way['identical'] else 'NO'} |")
    ratio = report["ray_vs_process"]
    parts.append(f"\nRay against one process: {ratio['speculative']:.2f}x speculative, {ratio['plain']:.2f}x plain "
                 f"(goal >= 0.9x); speculative against plain through Ray: "
                 f"{report['speculative_vs_plain_on_ray']:.2f}x (goal >= 1.5x).\n")
    parts.append("Projection from the measured per-actor rate after the models loaded (an actor per core, the writer "
                 "never the limit): " + ", ".join(f"{p['actors']} actors {p['tokens_per_second']:.0f} tokens/s "
                                            f"({p['seconds_for_10000_records'] / 60:.0f} min for 10,000 records)"
                                            for p in report["projection"]) + ".\n")
    return parts
