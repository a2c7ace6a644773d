"""The engine loop on its own, in this process with a tiny model: what it sends each job
(tokens equal to the plain reference, stop strings, refusals) and what it does when the
engine fails. The HTTP server around it is tested in test_serve.py."""

from __future__ import annotations

import queue
import time

from speculative import Engine, SamplingParams, autoregressive_generate
from speculative.entrypoints.serve.engine_loop import EngineLoop, Job
from speculative.entrypoints.serve.metrics import Metrics
from tests.helpers import tiny

WAIT = 300  # seconds for any one event: a guard against a hang, not a timing


def decode(ids: list[int]) -> str:
    return "".join(f"<{t}>" for t in ids)


def start(max_batch_size: int = 4, max_waiting: int = 4):
    model = tiny("decoder_only", vocab=64, seed=3)
    loop = EngineLoop(Engine(model, None, max_batch_size=max_batch_size), decode, Metrics(), max_waiting)
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
    model, loop = start(max_batch_size=1, max_waiting=0)
    try:
        bad = submit(loop, "b", [[1, 999]], SamplingParams(5)).get(timeout=WAIT).error
        assert bad.status == 400 and "outside the vocabulary" in bad.message and bad.param == "prompt"
        running = submit(loop, "r", [[1, 2]], SamplingParams(30))
        refused = submit(loop, "q", [[3, 4]], SamplingParams(5))
        assert running.get(timeout=WAIT).kind == "admitted"
        error = refused.get(timeout=WAIT).error
        assert (error.status, error.code) == (503, "queue_full")
        assert collect_after_admitted(running)["tokens"] == autoregressive_generate(model, [1, 2], 30)
    finally:
        loop.stop()


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
