"""Hardening of the engine and its settings (issue 33), each as a class of failure:

1. every request that enters the engine ends, with its tokens or with an error naming the
   cause, whatever phase of a step raises, and later requests are still exact;
2. sampling settings too extreme to compute (tiny temperatures, tiny top-p) are exact;
3. non-finite logits, from the target or the draft, fail the requests they belong to;
4. every size a user sets has an upper bound, checked before anything is allocated;
5. every draft kind works with every tree option (drafts that cannot branch draft chains).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import speculative.runtime.engine as engine_module
from speculative import (DraftModelProposer, Engine, NGramProposer, SamplingParams, SpeculativeConfig,
                         SpeculativeDecoder, SuffixProposer, autoregressive_generate)
from speculative.core.config import (MAX_BATCH_SIZE, MAX_DRAFT_TOKENS, MAX_NEW_TOKENS, MAX_NGRAM, MAX_PROMPT_TOKENS,
                                MAX_TREE_TOKENS, MAX_TREE_TOP_K)
from speculative.runtime.decoder import GenerationError
from speculative.core.inputs import normalize_max_new, normalize_prompts
from speculative.models.head import build_head
from speculative.core.sampling import MIN_TEMPERATURE, NonFiniteLogits, probabilities
from tests.helpers import perturbed, tiny

CHAIN = SpeculativeConfig(adaptive=False, num_draft_tokens=3)
TREE = SpeculativeConfig(adaptive=False, num_draft_tokens=3, tree_top_k=2, tree_max_tokens=6)
PROMPTS = {"a": [1, 2, 3, 4], "b": [5, 6, 7], "c": [8, 9, 10, 11, 12], "d": [13, 14], "e": [15, 16, 17],
           "f": [18, 19, 20, 21]}
BUDGETS = {"a": 6, "b": 20, "c": 10, "d": 8, "e": 9, "f": 12}
STEP_LIMIT = 200  # a guard against an engine that spins: every run here ends far sooner


@pytest.fixture(scope="module")
def models():
    target = tiny("decoder_only", seed=1)
    return target, perturbed(target, 0.05, seed=2)


@pytest.fixture(scope="module")
def reference(models):
    return {r: autoregressive_generate(models[0], p, BUDGETS[r]) for r, p in PROMPTS.items()}


def run(engine: Engine, script: dict[int, list[str]], prompts=PROMPTS, budgets=BUDGETS) -> tuple[dict, dict, dict]:
    """Add script[step]'s requests before each step, until every request has ended; per
    request its tokens, finish reason and error."""
    tokens, reasons, errors = {}, {}, {}
    for step in range(STEP_LIMIT):
        for request_id in script.get(step, []):
            engine.add_request(prompts[request_id], SamplingParams(budgets[request_id]), request_id)
            tokens[request_id] = []
        if step > max(script) and not engine.has_unfinished():
            return tokens, reasons, errors
        for output in engine.step():
            assert output.request_id not in reasons, "an output after the request ended"
            tokens[output.request_id] += output.new_token_ids
            if output.finished:
                reasons[output.request_id], errors[output.request_id] = output.finish_reason, output.error
    raise AssertionError(f"the engine did not finish its requests in {STEP_LIMIT} steps")


def inject(monkeypatch, owner, name: str, at: int) -> dict:
    """Fault injection: the `at`-th call of owner.name raises (once). Returns the call count."""
    original, calls = getattr(owner, name), {"n": 0}

    def faulty(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at:
            raise RuntimeError(f"injected fault in {name}")
        return original(*args, **kwargs)
    monkeypatch.setattr(owner, name, faulty)
    return calls


def check_every_request_ended(reference, tokens, reasons, errors, fault: str) -> set:
    """Every request ended; errors name the fault and follow only a prefix of the exact
    tokens; all others are exact. Returns the requests that failed."""
    assert set(reasons) == set(tokens)
    failed = {r for r, reason in reasons.items() if reason == "error"}
    for r in tokens:
        if r in failed:
            assert f"RuntimeError: injected fault in {fault}" in errors[r] and repr(r) in errors[r]
            assert tokens[r] == reference[r][:len(tokens[r])]
        else:
            assert reasons[r] == "length" and tokens[r] == reference[r], r
    return failed


def later_requests_are_exact(engine: Engine, reference, reuse: str) -> None:
    """The engine goes on: new requests (one reusing a failed request's id) are exact."""
    tokens, reasons, _ = run(engine, {0: ["e", "f"], 1: [reuse]})
    assert tokens == {r: reference[r] for r in ("e", "f", reuse)}
    assert set(reasons.values()) == {"length"} and not engine.has_unfinished()


# (where the fault is, which call raises, config, requests expected to fail: None = those running)
JOIN_FAULTS = [
    ("prefill", lambda target: (engine_module, "prefill"), 2, CHAIN, {"c"}),
    ("target add_rows", lambda target: (target, "add_rows"), 1, CHAIN, {"c"}),
    ("proposer add_rows", lambda target: (DraftModelProposer, "add_rows"), 2, CHAIN, {"c"}),
    ("first admission", lambda target: (DraftModelProposer, "add_rows"), 1, CHAIN, {"a", "b"}),
    ("tree join", lambda target: (target, "add_rows"), 1, TREE, {"c"}),
]
STEP_FAULTS = [
    ("catch_up", lambda target: (DraftModelProposer, "catch_up"), 3, CHAIN),
    ("propose", lambda target: (DraftModelProposer, "propose"), 3, CHAIN),
    ("verify forward", lambda target: (Engine, "_target_forward"), 3, CHAIN),
    ("commit", lambda target: (DraftModelProposer, "commit"), 3, CHAIN),
    ("rollback", lambda target: (target, "rollback"), 2, CHAIN),
    ("retire", lambda target: (target, "select_rows"), 1, CHAIN),
    ("propose_tree", lambda target: (DraftModelProposer, "propose_tree"), 2, TREE),
    ("tree verify forward", lambda target: (Engine, "_target_forward"), 2, TREE),
    ("compact", lambda target: (target, "compact"), 2, TREE),
]


@pytest.mark.parametrize("case, where, at, config, expected", JOIN_FAULTS, ids=[f[0] for f in JOIN_FAULTS])
def test_a_request_that_cannot_join_ends_with_its_error_and_the_others_stay_exact(models, reference, monkeypatch,
                                                                                  case, where, at, config, expected):
    target, draft = models
    engine = Engine(target, draft, config, max_batch_size=3)
    owner, name = where(target)
    calls = inject(monkeypatch, owner, name, at)
    tokens, reasons, errors = run(engine, {0: ["a", "b"], 2: ["c"], 3: ["d"]})
    assert calls["n"] >= at
    assert check_every_request_ended(reference, tokens, reasons, errors, name) == expected
    later_requests_are_exact(engine, reference, sorted(expected)[0])


@pytest.mark.parametrize("case, where, at, config", STEP_FAULTS, ids=[f[0] for f in STEP_FAULTS])
def test_a_phase_that_raises_ends_the_running_requests_and_the_engine_goes_on(models, reference, monkeypatch,
                                                                             case, where, at, config):
    target, draft = models
    engine = Engine(target, draft, config, max_batch_size=2)
    owner, name = where(target)
    calls = inject(monkeypatch, owner, name, at)
    tokens, reasons, errors = run(engine, {0: ["a", "b"], 1: ["c"], 2: ["d"]})
    assert calls["n"] >= at
    failed = check_every_request_ended(reference, tokens, reasons, errors, name)
    assert failed and failed < {"a", "b", "c", "d"}  # the queued ones ran after it, exactly
    later_requests_are_exact(engine, reference, sorted(failed)[0])


def test_a_lookup_proposer_that_fails_half_way_through_add_rows_leaves_no_row_out_of_step(models, reference,
                                                                                         monkeypatch):
    """A hybrid proposer adds the rows to its draft model, then its n-gram index raises: the
    draft model's rows and the index's would no longer line up. Only the joining request
    fails, and the others (and later ones) are exact."""
    target, draft = models
    config = SpeculativeConfig(adaptive=False, num_draft_tokens=3, prompt_lookup=True)
    engine = Engine(target, draft, config, max_batch_size=3)
    inject(monkeypatch, NGramProposer, "add_rows", 2)
    tokens, reasons, errors = run(engine, {0: ["a", "b"], 2: ["c"]})
    assert check_every_request_ended(reference, tokens, reasons, errors, "add_rows") == {"c"}
    later_requests_are_exact(engine, reference, "c")


def test_an_abort_whose_retire_raises_still_ends_every_request(models, reference, monkeypatch):
    target, draft = models
    engine = Engine(target, draft, CHAIN, max_batch_size=2)
    inject(monkeypatch, target, "select_rows", 1)
    engine.add_request(PROMPTS["a"], SamplingParams(BUDGETS["a"]), "a")
    engine.add_request(PROMPTS["b"], SamplingParams(BUDGETS["b"]), "b")
    engine.step()
    assert engine.abort("a")
    reasons = {}
    for _ in range(STEP_LIMIT):
        for output in engine.step():
            if output.finished:
                reasons[output.request_id] = (output.finish_reason, output.error)
        if not engine.has_unfinished():
            break
    assert reasons["a"] == ("abort", None)
    assert reasons["b"][0] == "error" and "injected fault in select_rows" in reasons["b"][1]
    later_requests_are_exact(engine, reference, "b")


def test_the_decoder_raises_the_engine_error(models, monkeypatch):
    target, draft = models
    inject(monkeypatch, DraftModelProposer, "propose", 2)
    with pytest.raises(GenerationError, match="request 0 failed: the engine failed during a step: RuntimeError: "
                                              "injected fault in propose"):
        SpeculativeDecoder(target, draft, CHAIN).generate([[1, 2], [3, 4]], 10)


# --- 3. non-finite logits ------------------------------------------------------------------

def poisoned(model, token: int):
    """A copy of `model` whose input embedding of `token` is NaN (the output layer, tied to
    it, keeps its own copy): a real model that gives NaN logits in exactly the rows that
    read that token."""
    copy = perturbed(model, 0.0, seed=0)
    with torch.no_grad():
        copy.lm_head.weight = torch.nn.Parameter(copy.embed_tokens.weight.clone(), requires_grad=False)
        copy.embed_tokens.weight[token] = float("nan")
    return copy


def unused_token(reference) -> int:
    used = {t for r in reference for t in PROMPTS[r] + reference[r]}
    return next(t for t in range(63, 0, -1) if t not in used)


def test_non_finite_rows_are_those_with_nan_or_inf_or_no_finite_value():
    """-inf alone marks a token impossible (allowed); NaN, +inf or a row of nothing but -inf
    cannot give a token; positions past a row's count do not matter."""
    from speculative.core.sampling import non_finite_rows

    logits = torch.randn(6, 2, 50)
    logits[1, 0, :10] = float("-inf")  # fine
    logits[2, 1, 7] = float("nan")
    logits[3, 0, 3] = float("inf")
    logits[4, 1] = float("-inf")
    logits[5, 1, 0] = float("nan")  # past row 5's count below
    assert non_finite_rows(logits) == [2, 3, 4, 5]
    assert non_finite_rows(logits, [2, 2, 2, 2, 2, 1]) == [2, 3, 4]
    assert non_finite_rows(logits[:, 0]) == [3] and non_finite_rows(logits[:2]) == []


@pytest.mark.parametrize("config", [CHAIN, TREE], ids=["chains", "trees"])
@pytest.mark.parametrize("side", ["target", "draft"])
def test_non_finite_logits_fail_their_request_only(models, reference, config, side):
    target, draft = models
    bad = unused_token(reference)
    if side == "target":
        target = poisoned(target, bad)
    else:
        draft = poisoned(draft, bad)
    engine = Engine(target, draft, config, max_batch_size=3)
    prompts, budgets = {**PROMPTS, "poisoned": [3, bad, 5]}, {**BUDGETS, "poisoned": 10}
    tokens, reasons, errors = run(engine, {0: ["a", "poisoned"], 1: ["b"], 2: ["c"]}, prompts, budgets)
    assert reasons.pop("poisoned") == "error" and tokens.pop("poisoned") == []
    assert f"the {side} model gave non-finite logits (NaN or infinity)" in errors["poisoned"]
    assert tokens == {r: reference[r] for r in tokens} and set(reasons.values()) == {"length"}
    later_requests_are_exact(engine, reference, "a")


@pytest.mark.parametrize("draft_kind", ["model", "ngram"])
def test_a_model_that_gives_nan_everywhere_is_an_error_never_token_0(models, draft_kind):
    target = perturbed(models[0], 0.0, seed=0)
    with torch.no_grad():
        target.norm.weight.fill_(float("nan"))
    draft = {"model": models[1], "ngram": NGramProposer()}[draft_kind]
    with pytest.raises(GenerationError, match="request 0 failed: the target model gave non-finite logits"):
        SpeculativeDecoder(target, draft, CHAIN).generate([1, 2, 3], 5)
    with pytest.raises(NonFiniteLogits, match=r"the target model gave non-finite logits .* row\(s\) \[1\]"):
        autoregressive_generate(poisoned(models[0], 9), [[1, 2], [9, 3]], 5)


def test_the_server_loop_answers_non_finite_logits_with_500_and_keeps_serving(models):
    import queue

    from speculative.entrypoints.serve.engine_loop import EngineLoop, Job
    from speculative.entrypoints.serve.metrics import Metrics

    target = poisoned(models[0], 9)
    loop = EngineLoop(Engine(target, None, max_batch_size=2), lambda ids: str(ids), Metrics(), 2)
    loop.start()
    try:
        events: queue.Queue = queue.Queue()
        loop.submit(Job(["bad-0", "good-0"], [[9, 1], [1, 2]], SamplingParams(6), (), events.put))
        assert events.get(timeout=300).kind == "admitted"
        got = [events.get(timeout=300) for _ in range(2)]
        error = next(e for e in got if e.kind == "error").error
        assert error.status == 500 and "non-finite logits" in error.message and error.code == "engine_error"
        good: queue.Queue = queue.Queue()
        loop.submit(Job(["next-0"], [[1, 2]], SamplingParams(6), (), good.put))
        assert good.get(timeout=300).kind == "admitted"
        out = []
        while True:
            event = good.get(timeout=300)
            out += event.token_ids
            if event.finish_reason:
                break
        assert out == autoregressive_generate(target, [1, 2], 6) and loop.alive
    finally:
        loop.stop()


# --- 2. extreme sampling settings ------------------------------------------------------------

logits_rows = st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=2, max_size=12)
temperatures = st.one_of(st.sampled_from([5e-324, 1e-300, 1e-45, 1e-38, MIN_TEMPERATURE, 1e-30, 1e-6]),
                         st.floats(1e-38, 1e30))
top_ps = st.one_of(st.none(), st.sampled_from([5e-324, 1e-300, 1e-45, 1e-8, 1.0]), st.floats(1e-12, 1.0))


@settings(max_examples=300, deadline=None)
@given(logits_rows, temperatures, st.one_of(st.none(), st.integers(1, 20)), top_ps)
def test_every_allowed_sampling_setting_gives_a_distribution_holding_the_top_token(row, temperature, top_k, top_p):
    logits = torch.tensor([row])
    probs = probabilities(logits, temperature, top_k, top_p)[0]
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-4)
    assert float(probs[logits[0] == logits.max()].sum()) > 0  # the top keeps mass, however small top_p and T


@settings(max_examples=100, deadline=None)
@given(logits_rows, st.sampled_from([5e-324, 1e-300, 1e-45, 1e-38, 1e-30]))
def test_a_tiny_temperature_samples_the_argmax(row, temperature):
    logits = torch.tensor([row])
    top_two = torch.topk(logits[0].double(), 2).values if len(row) > 1 else None
    # Exact sampling: only where the gap to the runner-up dwarfs the temperature is the
    # runner-up's probability zero (logits 1e-45 apart at T = 1e-30 are rightly a coin toss).
    if top_two is None or float(top_two[0] - top_two[1]) > 200 * temperature:
        assert probabilities(logits, temperature)[0].tolist() == torch.nn.functional.one_hot(
            logits.argmax(-1), len(row)).float()[0].tolist()


EXTREME = [dict(temperature=5e-324), dict(temperature=1e-300), dict(temperature=1e-38), dict(temperature=1e-30),
           dict(temperature=1.0, top_p=1e-300), dict(temperature=1.0, top_p=5e-324),
           dict(temperature=1e-30, top_p=1e-300, top_k=3)]


@pytest.mark.parametrize("kwargs", EXTREME, ids=[str(k) for k in EXTREME])
def test_extreme_settings_through_the_engine_give_the_greedy_tokens(models, reference, kwargs):
    """A temperature or top-p that leaves only the top token samples exactly the greedy
    tokens (seeded or not), beside ordinary greedy rows."""
    target, draft = models
    engine = Engine(target, draft, CHAIN, max_batch_size=4)
    engine.add_request(PROMPTS["b"], SamplingParams(BUDGETS["b"], seed=3, **kwargs), "seeded")
    engine.add_request(PROMPTS["b"], SamplingParams(BUDGETS["b"], **kwargs), "fresh")
    engine.add_request(PROMPTS["c"], SamplingParams(BUDGETS["c"]), "c")
    out = {}
    while engine.has_unfinished():
        for output in engine.step():
            out.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert out == {"seeded": reference["b"], "fresh": reference["b"], "c": reference["c"]}


@pytest.mark.parametrize("draft_temperature", [5e-324, 1e-300, 1e-30])
def test_a_tiny_draft_temperature_drafts_as_a_greedy_draft(models, draft_temperature):
    """The draft temperature never changes the output; a tiny one drafts the argmax, so the
    same seeds give the same tokens as greedy drafts."""
    target, draft = models

    def sampled(temperature):
        config = SpeculativeConfig(adaptive=False, num_draft_tokens=3, greedy_verification=False,
                                   target_temperature=1.0, draft_temperature=temperature)
        return SpeculativeDecoder(target, draft, config).generate([PROMPTS["a"]] * 4, 12, seeds=[1, 2, 3, 4])
    assert sampled(draft_temperature) == sampled(0.0)


def test_config_temperatures_below_the_threshold_are_greedy(models, reference):
    target, draft = models
    for temperature in (5e-324, 1e-40):
        config = SpeculativeConfig(greedy_verification=False, target_temperature=temperature)
        assert not config.sampling
        assert SpeculativeDecoder(target, draft, config).generate(PROMPTS["b"], BUDGETS["b"]) == reference["b"]
        assert autoregressive_generate(target, PROMPTS["b"], BUDGETS["b"], config) == reference["b"]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "speculative.entrypoints.cli", *args], capture_output=True,
                          text=True, env=env, timeout=600, cwd=Path(__file__).parent.parent)


def generated_text(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout.rsplit("\n[", 1)[0]  # the stats line (timings) differs from run to run


@pytest.mark.slow  # three runs of the command (the library tests above cover the class)
def test_the_cli_samples_extreme_settings_as_greedy():
    common = ["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "12", "--draft", "ngram"]
    greedy = generated_text(cli(*common))
    for extreme in (["--temperature", "1e-38"], ["--temperature", "1", "--top-p", "1e-300", "--seed", "2"]):
        assert generated_text(cli(*common, *extreme)) == greedy, extreme


# --- 4. upper bounds on sizes ----------------------------------------------------------------

def make_config(name):
    return lambda value: SpeculativeConfig(**{name: value, **({"max_ngram": value} if name == "min_ngram" else {})})


BOUNDS = [
    ("num_draft_tokens", MAX_DRAFT_TOKENS, make_config("num_draft_tokens")),
    ("tree_max_tokens", MAX_TREE_TOKENS, make_config("tree_max_tokens")),
    ("tree_top_k", MAX_TREE_TOP_K, make_config("tree_top_k")),
    ("max_ngram", MAX_NGRAM, make_config("max_ngram")),
    ("min_ngram", MAX_NGRAM, make_config("min_ngram")),
    ("max_new_tokens", MAX_NEW_TOKENS, lambda value: SamplingParams(max_new_tokens=value)),
    ("max_new_tokens", MAX_NEW_TOKENS, lambda value: normalize_max_new([1, value], 2)),
    ("max_batch_size", MAX_BATCH_SIZE, lambda value: Engine(tiny("s4d"), None, max_batch_size=value)),
    ("max_ngram", MAX_NGRAM, lambda value: NGramProposer(max_ngram=value)),
    ("num_draft_tokens", MAX_DRAFT_TOKENS, lambda value: NGramProposer(num_draft_tokens=value)),
    ("min_draft", MAX_DRAFT_TOKENS, lambda value: NGramProposer(num_draft_tokens=1, min_draft=value)),
    ("num_draft_tokens", MAX_DRAFT_TOKENS, lambda value: SuffixProposer(num_draft_tokens=value)),
]


@pytest.mark.parametrize("name, bound, make", BOUNDS, ids=[f"{b[0]}-{i}" for i, b in enumerate(BOUNDS)])
def test_every_size_has_an_upper_bound_named_in_its_error(name, bound, make):
    make(bound)  # the bound itself is allowed
    for value in (bound + 1, 10 ** 12):
        with pytest.raises(ValueError, match=f"{name} is {value}, above its upper bound of {bound}: allowed at "
                                             f"most {bound}"):
            make(value)


def test_prompt_length_and_prompt_count_are_bounded_before_any_model_work():
    normalize_prompts([0] * MAX_PROMPT_TOKENS)
    with pytest.raises(ValueError, match=f"prompt has {MAX_PROMPT_TOKENS + 1} tokens: allowed at most "
                                         f"{MAX_PROMPT_TOKENS} per prompt"):
        normalize_prompts(np.zeros(MAX_PROMPT_TOKENS + 1, dtype=np.int64))
    normalize_prompts([[1]] * MAX_BATCH_SIZE)
    with pytest.raises(ValueError, match=f"a batch of {MAX_BATCH_SIZE + 1} prompts is more than one call takes: "
                                         f"allowed at most {MAX_BATCH_SIZE}"):
        normalize_prompts(torch.ones(MAX_BATCH_SIZE + 1, 1, dtype=torch.long))
    engine = Engine(tiny("s4d"), None)
    with pytest.raises(ValueError, match="allowed at most"):
        engine.add_request([1] * (MAX_PROMPT_TOKENS + 1))
    with pytest.raises(ValueError, match="max_new_tokens is 1048577, above its upper bound"):
        engine.add_request([1], SamplingParams(MAX_NEW_TOKENS + 1))
    assert engine.state is None and not engine.has_unfinished()  # nothing was allocated or queued


def test_the_largest_allowed_tree_and_k_still_generate_exactly(models):
    target, draft = models
    config = SpeculativeConfig(num_draft_tokens=MAX_DRAFT_TOKENS, tree_top_k=MAX_TREE_TOP_K,
                               tree_max_tokens=MAX_TREE_TOKENS, adaptive=False)
    prompt = [1, 2, 3] * 3
    assert SpeculativeDecoder(target, draft, config).generate(prompt, 6) == autoregressive_generate(target, prompt, 6)


# --- 5. every draft kind with every tree option ---------------------------------------------

def draft_of(kind: str, target):
    """(draft, prompt_lookup, can branch) for a kind of draft."""
    model = perturbed(target, 0.05, seed=2)
    return {"model": (model, False), "s4d": (tiny("s4d", seed=3), False),
            "model+ngram": (model, True), "s4d+ngram": (tiny("s4d", seed=3), True),
            "ngram": (NGramProposer(max_ngram=3), False), "suffix": (SuffixProposer(num_draft_tokens=4), False),
            "head": (build_head(target, seed=0), False), "none": (None, False)}[kind]


DRAFT_KINDS = ["model", "s4d", "model+ngram", "s4d+ngram", "ngram", "suffix", "head", "none"]
TREE_OPTIONS = [(1, 16), (2, 1), (2, 8), (4, 16)]


@pytest.mark.parametrize("target_kind", ["decoder_only", "s4d"])
@pytest.mark.parametrize("top_k, max_tokens", TREE_OPTIONS)
@pytest.mark.parametrize("kind", DRAFT_KINDS)
def test_every_draft_kind_works_with_every_tree_option(kind, top_k, max_tokens, target_kind):
    """Each combination the options allow generates the target's own greedy tokens; drafts
    and targets that cannot branch say so once and draft chains."""
    target = tiny(target_kind, seed=1)
    if kind == "head" and target_kind == "s4d":
        pytest.skip("a draft head reads a decoder's features")
    draft, lookup = draft_of(kind, target)
    prompts = [[1, 2, 3, 1, 2, 3, 1], [4, 5, 6, 7]]
    expected = autoregressive_generate(target, prompts, [14, 9])
    for adaptive in (False, True) if top_k == 4 else (False,):  # the adaptive policy plans trees too
        config = SpeculativeConfig(num_draft_tokens=3, tree_top_k=top_k, tree_max_tokens=max_tokens,
                                   prompt_lookup=lookup, adaptive=adaptive)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine = Engine(target, draft, config, max_batch_size=2)
        chains = [str(w.message) for w in caught if "this engine drafts chains" in str(w.message)]
        cannot = top_k > 1 and draft is not None and (target_kind == "s4d" or kind.startswith("s4d"))
        assert len(chains) == int(cannot), chains
        if cannot and target_kind == "decoder_only":
            assert "the draft model S4DLM cannot read token trees" in chains[0]
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, SamplingParams([14, 9][i]), i)
        out = {0: [], 1: []}
        while engine.has_unfinished():
            for output in engine.step():
                assert output.finish_reason != "error", output.error
                out[output.request_id] += output.new_token_ids
        assert [out[0], out[1]] == expected


@pytest.mark.slow  # two runs of the command (the library test above covers every draft kind with trees)
def test_the_cli_generates_with_an_s4d_draft_and_trees():
    common = ["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "12", "--draft", "s4d"]
    chains = cli(*common)
    trees = cli(*common, "--tree-top-k", "2")
    assert generated_text(trees) == generated_text(chains)


# --- numpy prompts ---------------------------------------------------------------------------

def test_numpy_arrays_are_prompts(models):
    target, draft = models
    decoder = SpeculativeDecoder(target, draft, CHAIN)
    expected = autoregressive_generate(target, [[1, 2, 3], [4, 5, 6]], 5)
    for dtype in (np.int64, np.int32, np.uint8):
        assert decoder.generate(np.array([1, 2, 3], dtype=dtype), 5) == expected[0]
        assert decoder.generate(np.array([[1, 2, 3], [4, 5, 6]], dtype=dtype), 5) == expected
        assert decoder.generate([np.array([1, 2, 3], dtype=dtype), [4, 5, 6]], 5) == expected
    assert autoregressive_generate(target, np.array([[1, 2, 3], [4, 5, 6]]), 5) == expected
    engine = Engine(target, draft, CHAIN)
    assert engine.add_request(np.array([1, 2, 3]), SamplingParams(5), "np") == "np"
    for bad, message in ((np.array([1.0, 2.0]), "must be integers, got a numpy array of float64"),
                         (np.array([[[1]]]), r"must be 1-D \(one prompt\) or 2-D \(a batch\), got shape \(1, 1, 1\)"),
                         (np.zeros((0, 3), dtype=np.int64), "the batch is empty"),
                         ([np.array([[1, 2]])], r"prompt 0 must be a 1-D numpy array of token ids, got shape \(1, 2\)"),
                         (np.array([1, 2], dtype=object), "must be integers, got a numpy array of object")):
        with pytest.raises(ValueError, match=message):
            decoder.generate(bad, 5)
