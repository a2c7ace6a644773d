"""The engine loop: one thread owns the Engine; HTTP handlers only send it commands.

Handlers `submit` a job (one HTTP request's prompts) and read `Event`s from the job's
sink (in the app, a per-request asyncio queue fed through `call_soon_threadsafe`). The
thread takes commands between engine steps (submit, abort, drain, stop), so an abort
takes effect at the next step, and a slow forward never blocks the event loop.

The loop holds at most `capacity` requests (the engine's rows plus `max_queued` waiting
for one), counted from `submit` until each request's last event: a job that would pass it
is refused in the caller's thread, at once, with 429 (`queue_full`), whatever the engine
thread is doing. So a burst of any size costs memory for `capacity` requests, not for the
burst, and every request in it either runs or gets its refusal without waiting for a step.
Per request it turns tokens into text (`TextStream`: stop strings across token boundaries;
a request that meets one is aborted at once, so it leaves the batch before the next
step), times it, and counts it in the metrics.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ...core.rows import SamplingParams
from ...core.stats import RequestStats
from ...runtime.engine import Engine
from .metrics import Metrics
from .errors import APIError
from .text_stream import TextStream

log = logging.getLogger("speculative.serve")


@dataclass
class Job:
    """One HTTP request: its prompts (token ids), decoded with the same settings."""

    request_ids: list[str]
    prompts: list[list[int]]
    # One per request (choices differ in their seeds), or one for all.
    params: list[SamplingParams] | SamplingParams
    stops: tuple[str, ...]
    # Called from the engine thread with each Event for this job; must not block.
    sink: Callable[["Event"], None]
    arrival: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.params, SamplingParams):
            self.params = [self.params] * len(self.prompts)


@dataclass
class Event:
    """What the engine thread tells a job: `admitted`, `error`, or tokens of prompt `index`."""

    kind: str  # "admitted", "error" or "output"
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # With the last output of a prompt: its prompt length and what it drafted and kept.
    prompt_tokens: int = 0
    stats: RequestStats | None = None
    error: APIError | None = None
    # With logprobs: one per token of `token_ids` but a final stop token (which the text leaves out).
    logprobs: list | None = None
    # With prompt logprobs, on a request's first output: one per prompt token (None first).
    prompt_logprobs: list | None = None
    # On Ray, with the last output: the engine replica that served it (shown in `speculative`).
    replica: str = ""


@dataclass(eq=False)
class Tracked:
    """A request the thread still answers for."""

    job: Job
    index: int
    text: TextStream
    prompt_tokens: int
    delivered: int = 0
    first: float | None = None
    last: float | None = None
    done: bool = False  # its final event is sent (a stop string may end it before the engine does)


class EngineLoop:
    def __init__(self, engine: Engine, decode: Callable[[list[int]], str], metrics: Metrics,
                 max_queued: int, clock: Callable[[], float] = time.monotonic):
        if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 0:
            raise ValueError(f"max_queued must be an integer >= 0, got {max_queued!r}")
        self.engine, self.decode, self.metrics = engine, decode, metrics
        self.max_queued = max_queued
        self.capacity = engine.max_batch_size + max_queued  # running plus queued
        # Requests submitted and not yet ended (refused, failed, finished or aborted): the one
        # count of load, kept by submit (any thread) and the engine thread under one lock.
        self.held = 0
        self._held_lock = threading.Lock()
        self.clock = clock
        self.commands: queue.Queue = queue.Queue()
        self.tracked: dict[str, Tracked] = {}
        self.deadline: float | None = None  # after a drain: when what still runs is aborted
        self.draining = False
        self.failed: str | None = None  # why the engine stopped (a step raised)
        metrics.engine_step(engine.stats, count=False)  # a warm-up is not served
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # --- called from other threads ---------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Hand a job to the engine thread, or refuse it here and now (its sink gets the 429
        error event before this returns) when its prompts would pass the capacity."""
        with self._held_lock:
            refusal = self._refusal(len(job.prompts))
            if refusal is None:
                self.held += len(job.prompts)
        if refusal is not None:
            self.metrics.refused.inc()
            return self._send(job, Event("error", error=refusal))
        self.commands.put(("submit", job))

    def check_room(self, count: int) -> None:
        """Raise the 429 that `submit` would give `count` prompts now (a cheap early answer,
        before a request is tokenized; `submit` decides)."""
        with self._held_lock:
            refusal = self._refusal(count)
        if refusal is not None:
            self.metrics.refused.inc()
            raise refusal

    def _refusal(self, count: int) -> APIError | None:
        if self.held + count <= self.capacity:
            return None
        running = min(self.held, self.engine.max_batch_size)
        adds = f"; this request adds {count}" if count > 1 else ""
        return APIError(429, f"the queue is full: {running} requests running and {self.held - running} queued for "
                        f"a row, at most {self.max_queued} may queue (--max-queued){adds}: retry later",
                        code="queue_full")

    def _release(self, count: int = 1) -> None:
        with self._held_lock:
            self.held -= count

    def _forget(self, request_id: str) -> Tracked | None:
        """A request's last event is sent (or nobody waits for it): it stops counting."""
        tracked = self.tracked.pop(request_id, None)
        if tracked is not None:
            self._release()
        return tracked

    def abort(self, request_ids: list[str]) -> None:
        self.commands.put(("abort", list(request_ids)))

    def drain(self, grace: float) -> None:
        """Refuse new jobs; abort what still runs after `grace` seconds (each gets a final event)."""
        self.draining = True
        self.commands.put(("drain", grace))

    def stop(self, timeout: float = 10.0) -> None:
        self.commands.put(("stop", None))
        self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.failed is None

    # --- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            stalled = self.failed is not None or not self.engine.has_unfinished()
            idle = stalled and self.deadline is None
            commands = [self.commands.get()] if idle else []  # nothing to do: wait for a command
            while True:
                try:
                    commands.append(self.commands.get_nowait())
                except queue.Empty:
                    break
            for kind, value in commands:
                if kind == "stop":
                    return
                getattr(self, f"_on_{kind}")(value)
            if self.deadline is not None and self.clock() >= self.deadline:
                self.deadline = None
                self._on_abort([rid for rid, t in self.tracked.items() if not t.done])
            self._gauges()
            if self.engine.has_unfinished() and self.failed is None:
                self._step()
            elif self.deadline is not None:
                time.sleep(0.01)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # the engine's state cannot be trusted after this
            log.exception("engine step failed")
            self.failed = f"{type(error).__name__}: {error}"
            for request_id, tracked in list(self.tracked.items()):
                self._send(tracked.job, Event("error", tracked.index, error=APIError(
                    500, f"the engine failed: {self.failed}", code="engine_failed")))
            self._release(len(self.tracked))
            self.tracked.clear()
            return
        now = self.clock()
        for output in outputs:
            tracked = self.tracked.get(output.request_id)
            if tracked is not None:
                self._deliver(output.request_id, tracked, output, now)
        self.metrics.engine_step(self.engine.stats)
        self._gauges()

    def _deliver(self, request_id: str, t: Tracked, output, now: float) -> None:
        if t.done:  # ended by a stop string: the engine's abort output closes it
            if output.finished:
                self._forget(request_id)
            return
        if output.finish_reason == "error":  # the engine could not go on with it: say why
            self._forget(request_id)
            self.metrics.requests.labels("error").inc()
            return self._send(t.job, Event("error", t.index, error=APIError(500, output.error, code="engine_error")))
        tokens, stopped = [], False
        stop_token = output.finish_reason == "stop"  # the engine ends at a stop token, kept out of the text
        for i, token in enumerate(output.new_token_ids):
            tokens.append(token)
            if stop_token and i == len(output.new_token_ids) - 1:
                break
            if t.text.add(token):
                stopped = True
                break
        finish = "stop" if stopped else output.finish_reason
        if stopped and not output.finished:
            self.engine.abort(request_id)  # leaves the batch at the next step's admit
        text = t.text.take(final=finish is not None)
        if tokens:
            t.delivered += len(tokens)
            self.metrics.generation_tokens.inc(len(tokens))
            if t.first is None:
                t.first = now
                self.metrics.ttft.observe(now - t.job.arrival)
            else:
                self.metrics.itl.observe(now - t.last)
            t.last = now
        event = Event("output", t.index, text, tokens, finish, prompt_logprobs=output.prompt_logprobs)
        if output.logprobs is not None:
            ended_by_token = stop_token and not stopped and len(tokens) == len(output.new_token_ids)
            event.logprobs = output.logprobs[:len(tokens) - ended_by_token]
        if finish is not None:
            t.done = True
            event.prompt_tokens = t.prompt_tokens
            event.stats = self._stats(request_id, t)
            self.metrics.requests.labels(finish).inc()
            self.metrics.e2e.observe(now - t.job.arrival)
            if output.finished:
                self._forget(request_id)
        if tokens or finish is not None:
            self._send(t.job, event)

    def _stats(self, request_id: str, t: Tracked) -> RequestStats:
        stats = self.engine.request_stats(request_id)
        return RequestStats(stats.drafted, stats.accepted, stats.target_forwards, t.delivered, t.prompt_tokens)

    def _on_submit(self, job: Job) -> None:
        """Add every prompt of the job, or none: a refusal takes back the ones already added
        (and the job's place in the count that `submit` took)."""
        if self.draining or self.failed is not None:
            self._release(len(job.prompts))
            why = "the server is shutting down" if self.draining else f"the engine failed: {self.failed}"
            return self._send(job, Event("error", error=APIError(503, why, code="unavailable")))
        added = []
        try:
            for request_id, prompt, params in zip(job.request_ids, job.prompts, job.params):
                self.engine.add_request(prompt, params, request_id)
                added.append(request_id)
        except (ValueError, TypeError) as error:
            message = str(error).removeprefix(f"request {request_id!r}: ")  # an id the client never saw
            for request_id in added:
                self.engine.abort(request_id)
            self._release(len(job.prompts))
            param = next((name for name in ("stop_token_ids", "logit_bias") if name in message),
                         "messages" if job.request_ids[0].startswith("chatcmpl") else "prompt")
            return self._send(job, Event("error", error=APIError(400, message, param)))
        for index, (request_id, prompt) in enumerate(zip(job.request_ids, job.prompts)):
            self.tracked[request_id] = Tracked(job, index, TextStream(self.decode, job.stops), len(prompt))
            self.metrics.prompt_tokens.inc(len(prompt))
        self._send(job, Event("admitted"))

    def _on_abort(self, request_ids: list[str]) -> None:
        """Requests leave at the next step; those whose client is still there get a final event."""
        for request_id in request_ids:
            if request_id in self.tracked and self.engine.abort(request_id):
                continue
            tracked = self._forget(request_id)  # already finished in the engine
            if tracked is not None and not tracked.done:
                self._send(tracked.job, Event("output", tracked.index, tracked.text.take(final=True),
                                              finish_reason="abort"))

    def _on_drain(self, grace: float) -> None:
        self.deadline = self.clock() + grace

    def _gauges(self) -> None:
        self.metrics.running.set(self.engine.num_running())
        self.metrics.waiting.set(self.engine.num_waiting())

    @staticmethod
    def _send(job: Job, event: Event) -> None:
        try:
            job.sink(event)
        except RuntimeError:  # the event loop has closed (shutdown): nobody is listening
            pass
