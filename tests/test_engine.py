"""The step engine: requests join and leave a running batch, and every output is what the
target alone gives that prompt (greedy), whatever ran beside it and whenever it joined."""

import pytest
import torch

from speculative import (Engine, NGramProposer, SamplingParams, SpeculativeConfig, SpeculativeDecoder,
                         autoregressive_generate)
from tests.helpers import perturbed, tiny

KINDS = ["decoder_only", "s4d", "transformers"]
DRAFTS = ["model", "ngram", "hybrid", "s4d"]


def pair(kind, draft_kind):
    """(target, draft, prompt_lookup) for a kind of target and of draft."""
    if kind == "transformers":
        pytest.importorskip("transformers")
        from tests.test_transformers import llama
        from speculative.models.hf import HFModel
        target, model = HFModel(llama(1, vocab=64)), HFModel(llama(2, vocab=64, hidden=32, layers=1))
    else:
        target = tiny(kind, seed=1)
        model = perturbed(target, 0.05, seed=2)
    draft = {"model": model, "ngram": NGramProposer(max_ngram=3), "hybrid": model,
             "s4d": tiny("s4d", seed=3)}[draft_kind]
    return target, draft, draft_kind == "hybrid"


def prompt(n, seed):
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def drive(engine, script, steps=200):
    """Run the engine, doing script[step] (("add", id, prompt, params) or ("abort", id))
    before each step. Returns tokens and finish reasons per request, and the batch sizes seen."""
    tokens, reasons, sizes = {}, {}, []
    for step in range(steps):
        for action in script.get(step, []):
            if action[0] == "add":
                _, request_id, ids, params = action
                assert engine.add_request(ids, params, request_id) == request_id
                tokens[request_id] = []
            else:
                assert engine.abort(action[1])
        if not engine.has_unfinished() and step > max(script):
            break
        for output in engine.step():
            assert reasons.get(output.request_id) is None, "an output after the request finished"
            tokens[output.request_id] += output.new_token_ids
            if output.finished:
                reasons[output.request_id] = output.finish_reason
        sizes.append(engine.num_running())
    return tokens, reasons, sizes


def first_new(reference, at_least=2):
    """A token of the reference that first appears at index >= at_least (a stop token
    that ends the request early), and that index."""
    i = next(i for i, t in enumerate(reference) if i >= at_least and t not in reference[:i])
    return reference[i], i


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("draft_kind", DRAFTS)
def test_requests_join_and_leave_on_every_model_and_draft_kind(kind, draft_kind):
    target, draft, lookup = pair(kind, draft_kind)
    config = SpeculativeConfig(adaptive=False, num_draft_tokens=3, prompt_lookup=lookup)
    engine = Engine(target, draft, config, max_batch_size=2)
    prompts = {"a": prompt(5, 1), "b": prompt(9, 2), "c": [7], "d": prompt(12, 4), "e": prompt(3, 5),
               "f": prompt(6, 6) * 3}
    budgets = {"a": 20, "b": 12, "c": 15, "d": 12, "e": 0, "f": 14}
    reference = {r: autoregressive_generate(target, prompts[r], budgets[r]) for r in prompts}
    stop, at = first_new(reference["b"])
    script = {0: [("add", "a", prompts["a"], SamplingParams(20)), ("add", "b", prompts["b"], SamplingParams(12,
                                                                              stop_token_ids=[stop]))],
              1: [("add", "c", prompts["c"], SamplingParams(15))],
              2: [("add", "d", prompts["d"], SamplingParams(12))],
              3: [("add", "e", prompts["e"], SamplingParams(0)), ("add", "f", prompts["f"], SamplingParams(14))],
              5: [("abort", "d")]}
    tokens, reasons, sizes = drive(engine, script)
    assert tokens["b"] == reference["b"][:at + 1] and reasons["b"] == "stop"
    for r in "acf":
        assert tokens[r] == reference[r], r
        assert reasons[r] == "length"
    assert tokens["e"] == [] and reasons["e"] == "length"
    assert reasons["d"] == "abort" and tokens["d"] == reference["d"][:len(tokens["d"])]
    assert max(sizes) == 2 and not engine.has_unfinished()
    assert engine.num_running() == engine.num_waiting() == 0
    stats = [engine.request_stats(r) for r in prompts]
    assert sum(s.generated for s in stats) == engine.stats.generated == sum(map(len, tokens.values()))
    assert sum(s.drafted for s in stats) == engine.stats.drafted
    assert sum(s.accepted for s in stats) == engine.stats.accepted
    assert engine.request_stats("a").target_forwards >= 1
    if draft_kind in ("ngram", "hybrid"):
        assert engine.request_stats("f").accepted > 0  # the repeated prompt gives lookup something to find


def test_the_adaptive_engine_probes_costs_once_per_pair_of_models(monkeypatch):
    """Batch sizes change every few steps; costs are measured once, at the first step, and a
    second engine on the same models measures nothing (the book's second, warm probe put off)."""
    import speculative.policy.costs
    import speculative.runtime.phases as phases_module

    monkeypatch.setattr(speculative.policy.costs, "REPROBE_AFTER", 10 ** 9)

    target = tiny("decoder_only", seed=7)
    draft = perturbed(target, 0.05, seed=8)
    probes = []
    real = phases_module.measure
    monkeypatch.setattr(phases_module, "measure", lambda *args: probes.append(len(args[2])) or real(*args))
    config = SpeculativeConfig(num_draft_tokens=4, prompt_lookup=True)
    prompts = [prompt(4 + i, 20 + i) * 2 for i in range(8)]
    for _ in range(2):
        engine = Engine(target, draft, config, max_batch_size=4)
        script = {}
        for i, step in enumerate([0, 0, 1, 3, 3, 4, 9, 12]):
            script.setdefault(step, []).append(("add", f"r{i}", prompts[i], SamplingParams(6 + 5 * i)))
        tokens, _, sizes = drive(engine, script)
        for i, ids in enumerate(prompts):
            assert tokens[f"r{i}"] == autoregressive_generate(target, ids, 6 + 5 * i)
        assert len(set(sizes)) >= 3  # the batch size changed
        assert set(sizes) - {0} <= set(engine.policy.costs)  # every size was planned from costs
    assert probes == [2]  # one probe: the first step's batch of two rows


@pytest.mark.slow
def test_greedy_and_sampled_requests_share_one_batch_losslessly():
    """Two sampled requests at different temperatures (one with top-k) beside a greedy one,
    in every batch, with rows joining at every step: each sampled kind follows its own
    target distribution (G-test, 20,000 draws each), the greedy rows equal plain decoding,
    and the negative control (the two kinds swapped) fails."""
    from tests.test_lossless import LENGTH, P_MIN, PROMPT, VOCAB, exact_joint, g_test_pvalue
    from types import SimpleNamespace

    target = sharpened(tiny("decoder_only", vocab=VOCAB, seed=11))
    draft = sharpened(tiny("decoder_only", vocab=VOCAB, seed=12))
    kinds = {"hot": SimpleNamespace(target_temperature=1.0, top_k=None, top_p=None),
             "cool": SimpleNamespace(target_temperature=0.6, top_k=5, top_p=None)}
    engine = Engine(target, draft, SpeculativeConfig(adaptive=False, num_draft_tokens=2), max_batch_size=1500)
    draws = 20_000
    for i in range(draws):
        engine.add_request(PROMPT, SamplingParams(LENGTH), f"greedy {i}")
        for name, k in kinds.items():
            engine.add_request(PROMPT, SamplingParams(LENGTH, k.target_temperature, k.top_k, seed=i), f"{name} {i}")
    counts = {name: torch.zeros(VOCAB ** LENGTH) for name in kinds}
    greedy, outs = set(), {}
    while engine.has_unfinished():
        for output in engine.step():
            outs.setdefault(output.request_id, []).extend(output.new_token_ids)
    for request_id, out in outs.items():
        name = request_id.split()[0]
        if name == "greedy":
            greedy.add(tuple(out))
        else:
            counts[name][out[0] * VOCAB ** 2 + out[1] * VOCAB + out[2]] += 1
    assert greedy == {tuple(autoregressive_generate(target, PROMPT, LENGTH))}
    assert 0 < engine.stats.acceptance_rate < 1
    for name, settings in kinds.items():
        assert counts[name].sum() == draws
        assert g_test_pvalue(counts[name], exact_joint(target, settings)) > P_MIN, name
    # The test has teeth: each kind's draws are refused against another kind's distribution.
    assert g_test_pvalue(counts["cool"], exact_joint(target, kinds["hot"])) < P_MIN
    warmer = SimpleNamespace(target_temperature=0.8, top_k=None, top_p=None)
    assert g_test_pvalue(counts["hot"], exact_joint(target, warmer)) < P_MIN


def sharpened(model):
    from tests.helpers import sharpen
    return sharpen(model, 12.0)


@pytest.mark.parametrize("draft_kind", ["model", "hybrid", "s4d"])
def test_a_seeded_request_gives_the_same_tokens_alone_or_in_a_busy_batch(draft_kind):
    target, draft, lookup = pair("decoder_only", draft_kind)
    config = SpeculativeConfig(num_draft_tokens=3, prompt_lookup=lookup, draft_temperature=0.9)  # adaptive
    ids = prompt(6, 30) * 2
    params = SamplingParams(30, temperature=0.8, top_p=0.95, seed=123)
    alone = Engine(target, draft, config, max_batch_size=1)
    tokens, _, _ = drive(alone, {0: [("add", "r", ids, params)]})
    script = {0: [("add", "g1", prompt(5, 31), SamplingParams(25)),
                  ("add", "s1", prompt(7, 32), SamplingParams(60, temperature=1.0))],
              1: [("add", "r", ids, params)],
              3: [("abort", "g1"), ("add", "s2", prompt(4, 33), SamplingParams(9, temperature=0.5, seed=5))],
              4: [("add", "g2", prompt(9, 34), SamplingParams(30))],
              5: [("abort", "s1"), ("add", "g3", prompt(3, 35), SamplingParams(3))]}
    busy = Engine(target, draft, config, max_batch_size=3)
    crowded, reasons, sizes = drive(busy, script)
    assert crowded["r"] == tokens["r"] and len(tokens["r"]) == 30
    assert reasons["g1"] == reasons["s1"] == "abort" and max(sizes) == 3
    other = Engine(target, draft, config, max_batch_size=1)
    changed, _, _ = drive(other, {0: [("add", "r", ids, SamplingParams(30, 0.8, top_p=0.95, seed=124))]})
    assert changed["r"] != tokens["r"]


@pytest.mark.parametrize("params, message", [
    (dict(temperature=-1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(temperature="hot"), "temperature must be a finite number"),
    (dict(top_k=0), "top_k must be None or an integer >= 1, got 0"),
    (dict(top_k=2.5), "top_k must be None or an integer >= 1"),
    (dict(top_p=0), r"0 < top_p <= 1, got 0"),
    (dict(top_p=1.5), r"0 < top_p <= 1, got 1.5"),
    (dict(seed=2 ** 64), "seed must be None or an integer in"),
    (dict(seed="x"), "seed must be None or an integer"),
    (dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 0, got -1"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 0"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer >= 0"),
    (dict(stop_token_ids="ab"), "stop_token_ids must be None or a list of token ids"),
    (dict(stop_token_ids=[3, -1]), r"stop_token_ids must hold token ids \(integers >= 0\), got -1"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids must hold token ids"),
])
def test_bad_sampling_params(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


def test_sampling_params_accept_numpy_integers_and_normalize():
    numpy = pytest.importorskip("numpy")
    params = SamplingParams(numpy.int64(5), top_k=numpy.int32(3), seed=numpy.int64(7), stop_token_ids=[numpy.int64(2)])
    assert (params.max_new_tokens, params.top_k, params.seed, params.stop_token_ids) == (5, 3, 7, (2,))
    assert type(params.max_new_tokens) is int and type(params.stop_token_ids[0]) is int


def test_bad_requests_are_refused_while_the_engine_keeps_serving():
    target = tiny("decoder_only", seed=1)  # context 256
    draft = tiny("decoder_only", seed=2, max_seq_len=64)
    engine = Engine(target, draft, SpeculativeConfig(adaptive=False, num_draft_tokens=3), max_batch_size=2)
    good = {"a": (prompt(5, 40), 12), "b": (prompt(8, 41), 10), "c": (prompt(3, 42), 6)}
    for request_id, (ids, budget) in good.items():
        engine.add_request(ids, SamplingParams(budget), request_id)
    tokens = {r: [] for r in good}
    for output in engine.step():
        tokens[output.request_id] += output.new_token_ids
    bad = [
        (([1, 64], None, None), ValueError, "prompt holds token id 64, outside the vocabulary: allowed 0..63"),
        (([-1, 3], None, None), ValueError, "token id -1, outside the vocabulary"),
        (([1] * 200, SamplingParams(57), None), ValueError, "exceed the target model's maximum length of 256"),
        (([1] * 50, SamplingParams(20), None), ValueError, "70 tokens exceed the draft model's maximum length of 64"),
        (([1, 2], SamplingParams(5), "a"), ValueError, "request id 'a' is already in use"),
        (([1, 2], SamplingParams(5), "c"), ValueError, "request id 'c' is already in use"),  # waiting, not running
        (([1, 2], SamplingParams(5, stop_token_ids=[99]), None), ValueError, "stop_token_ids holds token id 99"),
        (([1, 2], {"max_new_tokens": 5}, None), TypeError, "params must be a SamplingParams or None, got dict"),
        (([[1, 2], [3]], None, None), ValueError, "add_request takes one prompt"),
        (([], None, None), ValueError, "the prompt is empty"),
        (([1.5], None, None), ValueError, "token ids must be integers"),
        (([1, 2], None, 2.5), TypeError, "request_id must be a string or an integer"),
    ]
    for (ids, params, request_id), error, message in bad:
        with pytest.raises(error, match=message):
            engine.add_request(ids, params, request_id)
        assert (engine.num_running(), engine.num_waiting()) == (2, 1)
    assert engine.abort("never added") is False
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    for request_id, (ids, budget) in good.items():
        assert tokens[request_id] == autoregressive_generate(target, ids, budget)
    with pytest.raises(ValueError, match="unknown request id 'zzz'"):
        engine.request_stats("zzz")


def test_bad_engine_arguments():
    target = tiny("decoder_only")
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1, got 0"):
        Engine(target, None, max_batch_size=0)
    with pytest.raises(TypeError, match="config must be a SpeculativeConfig or None, got dict"):
        Engine(target, None, {"num_draft_tokens": 3})
    with pytest.raises(TypeError, match="draft_model must be a loaded model, got the name 'default-draft'"):
        Engine(target, "default-draft")
    with pytest.raises(TypeError, match="draft_model must follow the model protocol .* object lacks vocab_size"):
        Engine(target, object())
    with pytest.raises(TypeError, match="target must follow the model protocol"):
        Engine(object(), None)
    with pytest.raises(ValueError, match="draft has 32 tokens, target has 64"):
        Engine(target, tiny("s4d", vocab=32))


def test_a_model_without_add_rows_serves_one_batch_and_refuses_joins_at_once():
    from tests.helpers import TableModel

    target = TableModel(torch.randn(16, 16, generator=torch.Generator().manual_seed(0)))
    engine = Engine(target, None, max_batch_size=2)
    engine.add_request([1, 2], SamplingParams(5), "a")
    engine.add_request([3], SamplingParams(4), "b")
    with pytest.raises(TypeError, match="the target model TableModel lacks add_rows, so requests cannot join"):
        engine.add_request([4], SamplingParams(3), "c")  # the batch is full: it would have to join later
    engine.step()
    assert engine.state is not None
    while engine.has_unfinished():
        engine.step()
    assert engine.request_stats("a").generated == 5 and engine.request_stats("b").generated == 4
    with pytest.raises(TypeError, match="lacks add_rows"):
        engine.add_request([4], SamplingParams(3), "c")  # the state exists: it would join it


def test_plain_decoding_through_the_engine_never_drafts():
    target = tiny("decoder_only", seed=9)
    engine = Engine(target, None, max_batch_size=3)
    prompts = [prompt(4 + i, 50 + i) for i in range(5)]
    tokens, _, _ = drive(engine, {0: [("add", i, p, SamplingParams(8 + i)) for i, p in enumerate(prompts)]})
    assert [tokens[i] for i in range(5)] == [autoregressive_generate(target, p, 8 + i) for i, p in enumerate(prompts)]
    assert engine.stats.drafted == 0
    assert all(engine.request_stats(i).tokens_per_forward == 1.0 for i in range(5))


@pytest.mark.slow  # long run: 200 requests
def test_a_long_run_keeps_the_transformers_cache_bounded():
    """200 requests through four rows: requests join every step, and the cache's slots stay
    within a bound set by the longest request, not by how long the engine has run."""
    pytest.importorskip("transformers")
    from tests.test_transformers import llama
    from speculative.models.hf import HFModel

    target = HFModel(llama(3, vocab=64, hidden=32, layers=1))
    engine = Engine(target, NGramProposer(max_ngram=3), SpeculativeConfig(adaptive=False, num_draft_tokens=3),
                    max_batch_size=4)
    gen = torch.Generator().manual_seed(0)
    requests = []
    for i in range(200):
        ids = prompt(int(torch.randint(2, 12, (1,), generator=gen)), 100 + i)
        requests.append((ids * int(torch.randint(1, 3, (1,), generator=gen)), int(torch.randint(1, 14, (1,),
                                                                                                 generator=gen))))
    longest = max(len(ids) + budget for ids, budget in requests)
    tokens, peak = {}, 0
    queue = list(enumerate(requests))
    while queue or engine.has_unfinished():
        for i, (ids, budget) in queue[:2]:  # two arrive per step: the batch stays full and rows keep joining
            engine.add_request(ids, SamplingParams(budget), i)
            tokens[i] = []
        queue = queue[2:]
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
        keys = engine.state.cache.layers[0].keys if engine.state.cache.layers else None
        if keys is not None:
            assert keys.shape[0] == engine.num_running() <= 4
            assert keys.shape[2] == engine.state.valid.shape[1]
            peak = max(peak, keys.shape[2])
    assert peak <= 2 * longest + 8
    assert engine.stats.drafted > 0 and engine.stats.accepted < engine.stats.drafted  # holes were made
    for i, (ids, budget) in enumerate(requests):
        assert tokens[i] == autoregressive_generate(target, ids, budget), i


def test_the_decoder_is_a_thin_wrapper_over_the_engine():
    """generate() over a batch and the engine fed the same requests give the same tokens, and
    the decoder's stats are the engine's."""
    target = tiny("decoder_only", seed=12)
    draft = perturbed(target, 0.05, seed=13)
    config = SpeculativeConfig(adaptive=False, num_draft_tokens=3, greedy_verification=False, seed=4)
    prompts = [prompt(5, 60), prompt(8, 61)]
    decoder = SpeculativeDecoder(target, draft, config)
    outs = decoder.generate(prompts, [10, 14])
    engine = Engine(target, draft, config, max_batch_size=2)
    tokens, _, _ = drive(engine, {0: [("add", b, p, SamplingParams(n, 1.0, seed=4 + b)) for b, (p, n) in
                                       enumerate(zip(prompts, [10, 14]))]})
    assert [tokens[0], tokens[1]] == outs
    assert decoder.stats.generated == engine.stats.generated == 24
    assert decoder.stats.drafted == engine.stats.drafted and decoder.stats.accepted == engine.stats.accepted


def test_autoregressive_reference_with_per_row_budgets():
    target = tiny("decoder_only", vocab=128, seed=14)
    prompts = [list(range(100, 120)), [5, 6]]
    outs = autoregressive_generate(target, prompts, [1, 10])
    assert outs == [autoregressive_generate(target, prompts[0], 1), autoregressive_generate(target, prompts[1], 10)]
    assert [len(o) for o in outs] == [1, 10]


def test_a_finished_generation_frees_its_caches_without_the_cyclic_collector():
    """An engine and its phases must not form a cycle: Python's cyclic collector runs by
    object counts, not bytes, so caches held by a cycle piled up (a G-test drawing 5000
    rows a call reached 24 GB)."""
    import gc

    from speculative.models.attention import KVState

    target, draft = tiny("decoder_only", seed=1), tiny("decoder_only", seed=2)
    decoder = SpeculativeDecoder(target, draft, SpeculativeConfig(num_draft_tokens=3))
    gc.collect()
    gc.disable()
    try:
        decoder.generate([[1, 2, 3], [4, 5]], 6)
        alive = [o for o in gc.get_objects() if type(o) is KVState]
    finally:
        gc.enable()
    assert not alive
