"""`speculative batch --ray`: the job on a Ray cluster, one engine per actor.

This process reads INPUT (ids checked, the ones already in OUTPUT left out) and hands the
pending records to Ray Data as blocks of whole batches (`from_items`, each record pickled
as it was read, so JSON and Parquet records reach the actors unchanged). `map_batches`
runs `GenerateBatch` on an actor pool: `concurrency` actors of `num_cpus` CPUs each, each
with that many torch threads and its own models, loaded once when the actor starts. Every
call takes up to max_batch_size records and returns their output lines; this process
writes them (`batch_files.OutputFile`: append-only, ids checked, so exactly once per id;
it holds OUTPUT's lock for the whole job).
Reading in this process costs Ray no read tasks (each wanted a worker process of its own:
seconds of start-up on a small machine), and the nodes need no access to INPUT.

An actor that dies is restarted and its batch retried: Ray Data gives its actors
max_restarts=-1 and max_task_retries=-1 (without a bound), so a killed actor (out of
memory, a lost node) costs its batch, not the job (tests/test_batch_ray.py kills one).
"""

from __future__ import annotations

import json
import logging
import math
import pickle
import time
from dataclasses import replace
from typing import Callable

from .batch import ModelSpec, Summary, Worker, open_job, progress


class GenerateBatch:
    """The callable class of `map_batches`: one Worker per actor."""

    def __init__(self, spec: ModelSpec, threads: int):
        import ray

        self.worker = Worker(replace(spec, threads=threads))  # the engine, on the actor's CPUs
        self.node = ray.get_runtime_context().get_node_id()
        self.loaded_at = time.time()  # wall clock: the driver compares it with its own

    def __call__(self, batch) -> dict:
        """Output lines of the batch's records, and what the call cost."""
        records = [pickle.loads(item) for item in batch.column("record").to_pylist()]
        inside = self.worker.step_seconds
        lines = [json.dumps(out, ensure_ascii=False) for out in self.worker.generate(records)]
        # The call's seconds inside engine steps, and when this actor had loaded its models,
        # ride on its first line (zero on the others).
        first = [1.0] + [0.0] * (len(lines) - 1) if lines else []
        return {"line": lines, "node": [self.node] * len(lines),
                "step_seconds": [(self.worker.step_seconds - inside) * f for f in first],
                "loaded_at": [self.loaded_at * f for f in first]}


def connect(address: str | None) -> bool:
    """Join the cluster at `address`, or start a local one sized to this machine (no
    dashboard); an already connected driver is used as it is. True when we connected."""
    import ray

    if ray.is_initialized():
        return False
    if address is None:
        ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    else:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    return True


def run_ray(input_path, output_path, spec: ModelSpec, address: str | None = None, actors: int | None = None,
            threads: int = 1, show_progress: bool = True, clock: Callable[[], float] = time.perf_counter,
            redo_changed: bool = False) -> Summary:
    """The job on Ray. `actors` defaults to the cluster's CPUs / `threads`. This process holds
    OUTPUT's lock for the whole job, as a local job does."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'speculative[ray]'") from None
    spec, output, summary, todo = open_job(input_path, output_path, spec, redo_changed)
    started, started_at = clock(), time.time()
    joined = False
    try:
        if todo:
            joined = connect(address)
            cpus = int(ray.cluster_resources().get("CPU", 0))
            actors = actors or max(1, cpus // threads)
            if actors * threads > cpus:
                raise ValueError(f"--actors {actors} x --threads-per-actor {threads} needs {actors * threads} CPUs; "
                                 f"the cluster has {cpus}")
            summary.workers = actors
            lines = dataset(todo, spec, actors, threads)
            with progress(len(todo), show_progress) as bar:
                for row in lines.iter_rows():
                    record = json.loads(row["line"])
                    summary.step_seconds += row["step_seconds"]
                    if row["loaded_at"]:
                        loaded = row["loaded_at"] - started_at
                        summary.ready_seconds = max(summary.ready_seconds or 0.0, loaded)
                    if output.write(record):
                        summary.count(record, started, clock())
                        summary.nodes[row["node"]] = summary.nodes.get(row["node"], 0) + 1
                        bar.update()
                        bar.set_postfix_str(f"{summary.tokens / max(clock() - started, 1e-9):.1f} tokens/s")
    finally:
        output.close()
        if joined:
            ray.shutdown()
    summary.seconds = clock() - started
    return summary


def dataset(records: list[dict], spec: ModelSpec, actors: int, threads: int):
    """The Ray Data pipeline: the records, then generate on the actor pool.

    Work is spread over every actor: the pool starts all of them (models loaded) before the
    first batch is handed out, and the records are cut into enough blocks (one batch each,
    up to 8 per actor) that no actor gets a block other actors could have shared. Without
    both, the first actor ready takes every block of a short job."""
    import ray

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # ours counts records and tokens
    context.wait_for_min_actors_s = 600
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    blocks = max(1, min(math.ceil(len(records) / spec.max_batch_size), 8 * actors))
    data = ray.data.from_items([{"record": pickle.dumps(record)} for record in records], override_num_blocks=blocks)
    return data.map_batches(GenerateBatch, fn_constructor_kwargs={"spec": spec, "threads": threads},
                            batch_size=spec.max_batch_size, batch_format="pyarrow",
                            compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=threads)
