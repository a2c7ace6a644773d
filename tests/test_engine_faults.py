"""Faults inside an engine never give wrong tokens (issue 62). A step cut short by what it does
not handle (KeyboardInterrupt) leaves the engine refusing work with a message that says to
build a new one; a phase that fails (an Exception, MemoryError) ends or restarts the requests,
whose tokens stay exact; a second thread inside one engine is refused, not interleaved."""

from __future__ import annotations

import threading

import pytest

from speculative import Engine, SamplingParams, SpeculativeConfig, autoregressive_generate
from tests.helpers import perturbed, sharpen, tiny

PROMPTS = [[1, 2, 3], list(range(10, 30)), [7] * 5, [40, 41, 42, 43]]
NEW = 20
# Where a step can be cut: its phases (the engine's `phases`), retiring rows, and prompts joining.
PHASES = ["propose", "verify", "accept", "_retire", "_join"]


@pytest.fixture(scope="module")
def pair():
    target = sharpen(tiny("decoder_only", seed=31), 6.0)
    draft = perturbed(target, 0.1, seed=32)
    return target, draft, [autoregressive_generate(target, p, NEW) for p in PROMPTS]


def engine_of(pair) -> Engine:
    target, draft, _ = pair
    engine = Engine(target, draft, SpeculativeConfig(adaptive=False, num_draft_tokens=4), max_batch_size=3)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, SamplingParams(NEW), i)
    return engine


def inject(engine: Engine, phase: str, error: type[BaseException], at: int) -> None:
    """`phase` raises `error` on its `at`-th call."""
    owner = engine if phase.startswith("_") else engine.phases
    original, calls = getattr(owner, phase), [0]

    def faulty(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            raise error(f"injected into {phase}")
        return original(*args, **kwargs)
    setattr(owner, phase, faulty)


def run(engine: Engine) -> tuple[dict, dict]:
    tokens, endings = {i: [] for i in range(len(PROMPTS))}, {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
            if output.finished:
                endings[output.request_id] = output.finish_reason
    return tokens, endings


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("error", [KeyboardInterrupt, MemoryError, RuntimeError])
def test_a_step_cut_short_at_any_phase_never_gives_wrong_tokens(pair, phase, error):
    reference = pair[2]
    engine = engine_of(pair)
    inject(engine, phase, error, at=1 if phase == "_join" else 3)
    if error is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            run(engine)
        for call in (engine.step, lambda: engine.add_request([1, 2], SamplingParams(4)), lambda: engine.abort(0)):
            with pytest.raises(RuntimeError, match="KeyboardInterrupt in the middle of Engine.step.*build a new "
                                                   "Engine"):
                call()
        return
    tokens, endings = run(engine)  # every request ends
    assert set(endings) == set(range(len(PROMPTS))) and "error" in endings.values()
    for i, ending in endings.items():
        if ending == "error":  # what it got before the failure is the start of its own output
            assert tokens[i] == reference[i][:len(tokens[i])], i
        else:
            assert (ending, tokens[i]) == ("length", reference[i]), i
    assert run(engine_of(pair))[0] == dict(enumerate(reference))  # a fresh engine: every token right


def test_a_second_thread_inside_one_engine_is_refused_and_the_first_goes_on(pair):
    engine = engine_of(pair)
    inside, go = threading.Event(), threading.Event()
    original = engine.phases.propose

    def held(*args, **kwargs):
        inside.set()
        go.wait(30)
        return original(*args, **kwargs)
    engine.phases.propose = held
    first = []
    stepper = threading.Thread(target=lambda: first.append(engine.step()))
    stepper.start()
    assert inside.wait(30)
    for call in (engine.step, lambda: engine.add_request([5, 6], SamplingParams(3), "late"),
                 lambda: engine.abort(1)):
        with pytest.raises(RuntimeError, match="another thread was inside this engine"):
            call()
    go.set()
    stepper.join(30)
    engine.phases.propose = original
    tokens, endings = run(engine)
    for output in first[0]:
        tokens[output.request_id][:0] = output.new_token_ids
    assert tokens == dict(enumerate(pair[2])) and set(endings.values()) == {"length"}
