"""The ingress side of `serve --ray`: the engine loop's face for the routes, over replicas.

`handlers.Routes` talks to an EngineLoop (submit a Job, read its Events, abort). On Ray
the ingress holds `RemoteLoop` instead: each Job becomes one streaming call to the engine
deployment (`Call`: the token ids, sampling, stop strings and the prompt's prefix keys
that PrefixRouter routes on), whose Events it feeds to the Job's sink. So every route,
check, error and response is the plain server's code, run in the ingress.

A replica that dies (killed, out of memory, drained) ends the call with an actor error. A
call that had given no tokens yet is sent again (another replica, or the restarted one:
greedy and seeded requests give the same tokens there); otherwise each of its unfinished
prompts gets a 503 error event, which the routes answer as an HTTP 503 JSON body or as the
stream's error chunk and `[DONE]`. Nothing waits without end on a dead replica.

`/metrics` is every replica's registry (each pushes its exposition to the metrics board
deployment every PUSH_SECONDS), one sample per replica with a `replica` label.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from ...core.rows import SamplingParams
from .engine_loop import Event, Job
from .errors import APIError
from .ray_router import prefix_keys

log = logging.getLogger("speculative.serve")

RETRIES = 2  # sends of a call that had given no token, after the first, when its replica died
RETRY_PAUSE = 0.25  # seconds before the first of them, twice that before the second
PUSH_SECONDS = 0.5  # how often each replica pushes its metrics to the board


@dataclass
class Call:
    """One Job on the wire: everything but its sink, grammars as (kind, text)."""

    request_ids: list[str]
    prompts: list[list[int]]
    params: list[SamplingParams]
    grammars: list[tuple[str, str] | None]
    stops: tuple[str, ...]
    prefix_keys: list[int]

    @classmethod
    def of(cls, job: Job) -> "Call":
        grammars = [(p.grammar.kind, p.grammar.text) if p.grammar is not None else None for p in job.params]
        params = [replace(p, grammar=None) for p in job.params]  # compiled grammars do not pickle
        return cls(job.request_ids, job.prompts, params, grammars, tuple(job.stops), prefix_keys(job.prompts[0]))


class RemoteLoop:
    """What Routes needs of an EngineLoop, over the engine deployment's handle."""

    def __init__(self, engine, board, capacity: int):
        self.engine, self.capacity = engine, capacity
        self.metrics = GatheredMetrics(board)
        self.draining, self.failed, self.alive = False, None, True
        self.calls: dict[str, asyncio.Task] = {}

    def start(self) -> None:
        pass

    def stop(self, timeout: float = 0.0) -> None:
        self.draining = True

    def clock(self) -> float:
        return time.monotonic()

    def check_room(self, count: int) -> None:
        """Room is each replica's to give (its own 429) and Serve's queue's (BackPressureError)."""

    def submit(self, job: Job) -> None:
        task = asyncio.get_running_loop().create_task(self._run(job))
        for request_id in job.request_ids:
            self.calls[request_id] = task
        task.add_done_callback(lambda _: [self.calls.pop(rid, None) for rid in job.request_ids])

    def abort(self, request_ids: list[str]) -> None:
        """The client went away: cancel the call (Serve cancels it on the replica, whose loop
        aborts its requests)."""
        for request_id in request_ids:
            task = self.calls.pop(request_id, None)
            if task is not None:
                task.cancel()

    async def _run(self, job: Job) -> None:
        from ray.exceptions import ActorUnavailableError, RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

        call, admitted, delivered, finished = Call.of(job), False, False, set()
        for attempt in range(RETRIES + 1):
            stream = self.engine.options(stream=True).generate.remote(call)
            try:
                async for event in stream:
                    if event.kind == "admitted":
                        if admitted:
                            continue  # a second send: the routes saw the first
                        admitted = True
                    elif event.kind == "output":
                        delivered = True
                    if event.finish_reason is not None or (event.kind == "error" and admitted):
                        finished.add(event.index)
                    job.sink(event)
                return
            except asyncio.CancelledError:
                stream.cancel()
                raise
            except BackPressureError:
                error = APIError(429, "every replica is busy and the queue in front of them is full: retry later",
                                 code="queue_full")
            except (RayActorError, ActorUnavailableError, DeploymentUnavailableError) as lost:
                if not delivered and attempt < RETRIES:
                    log.warning("a replica was lost before answering %s (%s): sending it again", job.request_ids[0],
                                type(lost).__name__)
                    await asyncio.sleep(RETRY_PAUSE * (attempt + 1))  # time for the router to drop the dead one
                    continue
                error = APIError(503, f"the replica serving this request was lost ({type(lost).__name__}): retry",
                                 code="replica_lost")
            except Exception as failed:  # the replica raised: say so rather than hang
                log.exception("engine call failed")
                error = APIError(500, f"{type(failed).__name__}: {failed}", code="engine_failed")
            break
        if not admitted:
            return job.sink(Event("error", error=error))
        for index in range(len(job.prompts)):
            if index not in finished:
                job.sink(Event("error", index, error=error))


class GatheredMetrics:
    """The `metrics` of a RemoteLoop: every replica's exposition, labelled with its replica."""

    def __init__(self, board):
        self.board = board
        self.latest = b""

    async def gather(self) -> bytes:
        expositions = await self.board.collect.remote()
        self.latest = merge(expositions)
        return self.latest

    def exposition(self) -> bytes:
        return self.latest


def merge(expositions: dict[str, str]) -> bytes:
    """Prometheus texts of several replicas as one, each sample labelled replica=<id>."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(expositions.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value, sample.timestamp)

    class Gathered:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Gathered())
    return generate_latest(registry)
