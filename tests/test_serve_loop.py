"""The engine loop on its own, in this process with a tiny model: what it sends each job
(tokens equal to the plain reference, stop strings, refusals) and what it does when the
engine fails. The HTTP server around it is tested in test_serve.py."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from speculative import Engine, SamplingParams, autoregressive_generate
from speculative.entrypoints.serve.engine_loop import EngineLoop, Job
from speculative.entrypoints.serve.metrics import Metrics
from speculative.entrypoints.serve.errors import APIError
from tests.helpers import tiny

WAIT = 300  # seconds for any one event: a guard against a hang, not a timing


def decode(ids: list[int]) -> str:
    return "".join(f"<{t}>" for t in ids)


def start(max_batch_size: int = 4, max_queued: int = 4):
    model = tiny("decoder_only", vocab=64, seed=3)
    loop = EngineLoop(Engine(model, None, max_batch_size=max_batch_size), decode, Metrics(), max_queued)
    loop.start()
    return model, loop


def submit(loop: EngineLoop, name: str, prompts, params: SamplingParams, stops=()) -> queue.Queue:
    events: queue.Queue = queue.Queue()
    loop.submit(Job([f"{name}-{i}" for i in range(len(prompts))], prompts, params, stops, events.put))
    return events


def collect(events: queue.Queue, count: int = 1) -> dict:
    """Until `count` prompts finished: per prompt its tokens, text and finish reason."""
    first = events.get(timeout=WAIT)
    if first.kind == "error":
        return {"error": first.error}
    assert first.kind == "admitted"
    out = {i: {"tokens": [], "text": "", "finish": None} for i in range(count)}
    while any(o["finish"] is None for o in out.values()):
        event = events.get(timeout=WAIT)
        assert event.kind == "output"
        out[event.index]["tokens"] += event.token_ids
        out[event.index]["text"] += event.text
        out[event.index]["finish"] = event.finish_reason
    return out


def test_jobs_get_the_reference_tokens_and_text():
    model, loop = start()
    try:
        prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
        got = collect(submit(loop, "a", prompts, SamplingParams(12)), 3)
        expected = autoregressive_generate(model, prompts, 12)
        for i, tokens in enumerate(expected):
            assert got[i] == {"tokens": tokens, "text": decode(tokens), "finish": "length"}
    finally:
        loop.stop()


def test_stop_string_cuts_the_text_and_ends_the_request():
    model, loop = start()
    try:
        expected = autoregressive_generate(model, [1, 2, 3], 20)
        stop = f"{expected[4]}><{expected[5]}"  # spans tokens 4 and 5
        got = collect(submit(loop, "s", [[1, 2, 3]], SamplingParams(20), (stop,)))[0]
        text = decode(expected)
        upto = next(n for n in range(len(expected) + 1) if stop in decode(expected[:n]))
        assert got == {"tokens": expected[:upto], "text": text[:text.index(stop)], "finish": "stop"}
        assert loop.metrics.requests.labels("stop")._value.get() == 1
    finally:
        loop.stop()


def test_capacity_and_bad_requests_are_refused_without_disturbing_others():
    model, loop = start(max_batch_size=1, max_queued=0)
    try:
        bad = submit(loop, "b", [[1, 999]], SamplingParams(5)).get(timeout=WAIT).error
        assert bad.status == 400 and "outside the vocabulary" in bad.message and bad.param == "prompt"
        running = submit(loop, "r", [[1, 2]], SamplingParams(30))
        refused = submit(loop, "q", [[3, 4]], SamplingParams(5))
        assert running.get(timeout=WAIT).kind == "admitted"
        error = refused.get(timeout=WAIT).error
        assert (error.status, error.code) == (429, "queue_full")
        assert collect_after_admitted(running)["tokens"] == autoregressive_generate(model, [1, 2], 30)
    finally:
        loop.stop()


def test_a_full_queue_refuses_at_once_while_a_step_runs_and_counts_every_end():
    """1 row and 2 queued places, the engine thread held inside a step: the fourth job (and a
    job of 2 prompts when 1 place is left) is refused inside `submit`, before the step ends,
    with 429 and a message that says how many are queued; every way a request ends (length,
    a stop string, an abort, a 400, a refusal) gives its place back."""
    model, loop = start(max_batch_size=1, max_queued=2)
    stepping, release = threading.Event(), threading.Event()
    step = loop.engine.step

    def held_step():
        stepping.set()
        assert release.wait(WAIT)
        return step()
    try:
        loop.engine.step = held_step
        jobs = [submit(loop, f"j{i}", [[1 + i, 2]], SamplingParams(6)) for i in range(3)]
        assert stepping.wait(WAIT) and loop.held == 3
        full = submit(loop, "full", [[5]], SamplingParams(2))
        error = full.get_nowait().error  # already there: no step had to end
        assert (error.status, error.code) == (429, "queue_full") and not release.is_set()
        assert "2 queued for a row" in error.message and "--max-queued" in error.message
        assert "retry later" in error.message and error.body()["error"]["type"] == "rate_limit_error"
        with pytest.raises(APIError) as early:
            loop.check_room(1)
        assert early.value.status == 429
        assert loop.metrics.refused._value.get() == 2 and loop.held == 3
        release.set()
        loop.engine.step = step
        for i, events in enumerate(jobs):
            got = collect(events)
            assert got[0]["tokens"] == autoregressive_generate(model, [1 + i, 2], 6)
        assert wait_until(lambda: loop.held == 0)
        # a 400, a stop string, an abort: each gives its place back
        assert submit(loop, "bad", [[1, 999]], SamplingParams(5)).get(timeout=WAIT).error.status == 400
        text = decode(autoregressive_generate(model, [1, 2], 6))
        assert collect(submit(loop, "s", [[1, 2]], SamplingParams(20), (text[4:9],)))[0]["finish"] == "stop"
        stepping.clear(), release.clear()
        loop.engine.step = held_step  # the abort lands while the request's first step runs
        aborted = submit(loop, "a", [[3, 4]], SamplingParams(20))
        assert aborted.get(timeout=WAIT).kind == "admitted" and stepping.wait(WAIT)
        loop.abort(["a-0"])
        loop.engine.step = step
        release.set()
        assert collect_after_admitted(aborted)["finish"] == "abort"
        assert wait_until(lambda: loop.held == 0)
        two = submit(loop, "two", [[1], [2]], SamplingParams(3))
        assert collect(two, 2)[1]["finish"] == "length" and wait_until(lambda: loop.held == 0)
    finally:
        release.set()
        loop.stop()


def test_max_queued_must_be_a_count():
    model = tiny("decoder_only", vocab=64, seed=3)
    for bad in (-1, 1.5, "8", None, True):
        with pytest.raises(ValueError, match="max_queued must be an integer >= 0"):
            EngineLoop(Engine(model, None, max_batch_size=1), decode, Metrics(), bad)


def wait_until(condition, deadline: float = WAIT) -> bool:
    end = time.monotonic() + deadline
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def collect_after_admitted(events: queue.Queue) -> dict:
    out = {"tokens": [], "finish": None}
    while out["finish"] is None:
        event = events.get(timeout=WAIT)
        out["tokens"] += event.token_ids
        out["finish"] = event.finish_reason
    return out


def test_a_failing_engine_answers_500_then_503():
    model, loop = start()
    try:
        def broken():
            raise RuntimeError("out of memory (injected)")
        loop.engine.step = broken
        events = submit(loop, "f", [[1, 2]], SamplingParams(5))
        assert events.get(timeout=WAIT).kind == "admitted"
        error = events.get(timeout=WAIT).error
        assert error.status == 500 and "out of memory (injected)" in error.message
        assert not loop.alive
        error = submit(loop, "g", [[1, 2]], SamplingParams(5)).get(timeout=WAIT).error
        assert error.status == 503 and "engine failed" in error.message
    finally:
        loop.stop()


def test_drain_aborts_what_runs_with_a_final_event():
    """After a drain with no grace, the running request ends with "abort" (each step is slowed
    down so that 200 tokens cannot finish first), and new jobs are refused."""
    model, loop = start()
    try:
        step = loop.engine.step

        def slow_step():
            time.sleep(0.01)
            return step()
        loop.engine.step = slow_step
        events = submit(loop, "d", [[1, 2]], SamplingParams(200))
        assert events.get(timeout=WAIT).kind == "admitted"
        loop.drain(0.0)
        got = collect_after_admitted(events)
        assert got["finish"] == "abort" and len(got["tokens"]) < 200
        assert submit(loop, "late", [[1]], SamplingParams(2)).get(timeout=WAIT).error.status == 503
    finally:
        loop.stop()
