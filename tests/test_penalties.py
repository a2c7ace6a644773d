"""Penalties, logit bias and min_tokens: greedy speculative output is plain greedy decoding's
with the same settings, token for token, whatever drafts (a draft model with prompt lookup,
lookup alone, token trees) and whatever runs beside it; sampled output follows the
penalized distribution (G-tests, tests/test_lossless.py's, each with a negative control)."""

import pytest
import torch

from speculative import Engine, NGramProposer, SamplingParams, SpeculativeConfig
from speculative.core.penalties import Penalties, chain_contexts, tree_contexts
from speculative.core.sampling import probabilities
from speculative.runtime.reference import plain_generate
from tests.helpers import perturbed, sharpen, tiny
from tests.test_lossless import DRAWS, LENGTH, P_MIN, PROMPT, VOCAB, g_test_pvalue

BUDGET = 24


@pytest.fixture(scope="module")
def pair():
    """A tiny target and a draft that agrees with it often (tests/test_engine.py's)."""
    target = tiny("decoder_only", seed=1)
    return target, perturbed(target, 0.05, seed=2)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (5, 9)]


def settings(reference: list[int]) -> dict[str, dict]:
    """Each setting alone, and all together; min_tokens with a stop token that plain greedy
    decoding emits third (so that it would end the request there)."""
    stop = reference[2]
    return {
        "frequency": dict(frequency_penalty=1.5),
        "presence": dict(presence_penalty=2.0),
        "repetition": dict(repetition_penalty=1.8),
        "bias": dict(logit_bias={reference[1]: -100.0, reference[4]: 8.0}),
        "min_tokens": dict(min_tokens=12, stop_token_ids=[stop]),
        "all": dict(frequency_penalty=0.6, presence_penalty=0.4, repetition_penalty=1.3,
                    logit_bias={reference[3]: -5.0}, min_tokens=8, stop_token_ids=[stop]),
    }


def run_engine(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """Half the requests before the first step, the rest joining the running batch."""
    tokens = {i: [] for i in range(len(requests))}
    half = len(requests) // 2
    for i, (ids, params) in enumerate(requests[:half]):
        engine.add_request(ids, params, i)
    steps = 0
    while engine.has_unfinished() or steps == 0:
        if steps == 2:
            for i, (ids, params) in enumerate(requests[half:], half):
                engine.add_request(ids, params, i)
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            tokens[out.request_id] += out.new_token_ids
        steps += 1
    return [tokens[i] for i in range(len(requests))]


DRAFTS = {
    "draft model + lookup": lambda draft: (draft, None),
    "lookup": lambda draft: (NGramProposer(max_ngram=3), None),
    "tree": lambda draft: (NGramProposer(num_draft_tokens=6), SpeculativeConfig(
        num_draft_tokens=6, tree_top_k=3, tree_max_tokens=12, adaptive=False)),
}


@pytest.mark.parametrize("drafts", list(DRAFTS))
def test_greedy_with_penalties_is_plain_greedy(pair, drafts):
    target, draft_model = pair
    prompts_ = prompts()
    plain = [out.token_ids for out in plain_generate(target, prompts_, [SamplingParams(BUDGET)] * len(prompts_))]
    requests = []
    for ids, reference in zip(prompts_, plain):
        requests.append((ids, SamplingParams(BUDGET)))  # a row without settings, beside the others
        requests += [(ids, SamplingParams(BUDGET, **s)) for s in settings(reference).values()]
    expected = [out.token_ids for out in plain_generate(target, *zip(*requests))]
    for (ids, params), tokens in zip(requests, expected):  # every setting changes what plain decoding gives
        if params.penalties is not None:
            assert tokens != plain[prompts_.index(ids)], params
    draft, config = DRAFTS[drafts](draft_model)
    engine = Engine(target, draft, config, max_batch_size=len(requests))
    assert run_engine(engine, requests) == expected
    assert engine.stats.accepted > 0  # drafted tokens were kept, their penalties counted


def test_min_tokens_holds_back_the_stop_token(pair):
    target, _ = pair
    ids = prompts()[0]
    reference = plain_generate(target, [ids], [SamplingParams(BUDGET)])[0].token_ids
    stop = reference[2]
    ended = plain_generate(target, [ids], [SamplingParams(BUDGET, stop_token_ids=[stop])])[0].token_ids
    assert ended == reference[:reference.index(stop) + 1]
    held = plain_generate(target, [ids], [SamplingParams(BUDGET, stop_token_ids=[stop], min_tokens=12)])[0].token_ids
    assert stop not in held[:12] and len(held) > 12


def test_contexts_are_the_tokens_before_each_position():
    assert chain_contexts([5, 6, 7], 3) == [[], [5], [5, 6]]
    # Two branches under the root: 4 -> 9, and 5.
    assert tree_contexts([4, 9, 5], [-1, 0, -1]) == [[], [4], [4, 9], [5]]


def test_penalties_follow_the_openai_and_vllm_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]]).repeat(2, 1)
    penalties = Penalties(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0,
                          logit_bias=((4, 10.0),), min_tokens=2, stop_token_ids=(3,))
    penalties.apply(logits, prompt=[1], output=[0], extra=[[], [0]])
    # Position 0 follows output [0]: token 0 counted once; token 1 in the prompt; token 3 a stop, 1 token made.
    assert logits[0].tolist() == [2.0 / 2 - 0.5 - 0.25, -1.0 * 2, 0.5, float("-inf"), 11.0]
    # Position 1 follows [0, 0]: two tokens made, the stop token allowed again; token 0 counted twice.
    assert logits[1].tolist() == [2.0 / 2 - 1.0 - 0.25, -1.0 * 2, 0.5, 3.0, 11.0]


def test_bad_values_name_the_field_and_the_range():
    for kwargs, words in ((dict(frequency_penalty=2.5), "frequency_penalty must be a number in -2..2"),
                          (dict(presence_penalty="1"), "presence_penalty"),
                          (dict(repetition_penalty=0), "repetition_penalty must be a finite number > 0"),
                          (dict(logit_bias={"7": 1.0}), "logit_bias keys must be token ids"),
                          (dict(logit_bias={7: 101}), "in -100..100"),
                          (dict(min_tokens=200), "min_tokens must be an integer in 0..max_new_tokens (128)"),
                          (dict(logprobs=21), "logprobs must be None or an integer in 0..20")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
            SamplingParams(**kwargs)


def test_a_bias_outside_the_vocabulary_is_refused_alone():
    target = tiny("decoder_only", seed=1)
    engine = Engine(target, NGramProposer(), max_batch_size=2)
    engine.add_request([1, 2, 3], SamplingParams(4), "fine")
    with pytest.raises(ValueError, match="logit_bias holds token id 64, outside the vocabulary: allowed 0..63"):
        engine.add_request([1, 2, 3], SamplingParams(4, logit_bias={64: 1.0}), "bad")
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert len(tokens) == 4


# --- sampled: G-tests over the first three tokens (tests/test_lossless.py) -------------------

PENALIZED = dict(temperature=1.0, frequency_penalty=2.0, presence_penalty=1.0, repetition_penalty=2.0,
                 logit_bias={2: 3.0, 5: -2.0}, min_tokens=2, stop_token_ids=[3])


def penalized_by_hand(logits: torch.Tensor, output: list[int]) -> torch.Tensor:
    """OpenAI's and vLLM's formulas written out densely (independent of core/penalties.py)."""
    logits = logits.clone()
    for token, bias in PENALIZED["logit_bias"].items():
        logits[token] += bias
    if len(output) < PENALIZED["min_tokens"]:
        logits[PENALIZED["stop_token_ids"]] = float("-inf")
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=VOCAB).float()
    seen = (counts > 0) | torch.isin(torch.arange(VOCAB), torch.tensor(PROMPT))
    r = PENALIZED["repetition_penalty"]
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - PENALIZED["frequency_penalty"] * counts - PENALIZED["presence_penalty"] * (counts > 0).float()


def exact_penalized_joint(model) -> torch.Tensor:
    """P(t1, t2, t3) of plain sampling with PENALIZED, by enumerating every continuation."""
    rows = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # (V^2, 2)
    tokens = torch.cat([torch.tensor(PROMPT).repeat(len(rows), 1), rows], 1)
    with torch.inference_mode():
        logits = model.forward(tokens, model.new_state(len(rows), tokens.shape[1]))[:, len(PROMPT) - 1:]
    joint = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    first = probabilities(penalized_by_hand(logits[0, 0], []), 1.0).double()
    for t1 in range(VOCAB):
        second = probabilities(penalized_by_hand(logits[t1 * VOCAB, 1], [t1]), 1.0).double()
        for t2 in range(VOCAB):
            third = probabilities(penalized_by_hand(logits[t1 * VOCAB + t2, 2], [t1, t2]), 1.0).double()
            joint[t1, t2] = first[t1] * second[t2] * third
    return joint


def engine_draws(target, draft, config, params: SamplingParams, n=DRAWS, chunk=5_000) -> torch.Tensor:
    """Counts of the first three tokens of n seeded requests (seeds 0..n-1) through the engine."""
    counts = torch.zeros(VOCAB ** LENGTH)
    for start in range(0, n, chunk):
        engine = Engine(target, draft, config, max_batch_size=chunk)
        for seed in range(start, start + chunk):
            engine.add_request(PROMPT, SamplingParams(**{**vars_of(params), "seed": seed}), seed)
        outs = {seed: [] for seed in range(start, start + chunk)}
        while engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id] += out.new_token_ids
        index = torch.tensor([o[0] * VOCAB ** 2 + o[1] * VOCAB + o[2] for o in outs.values()])
        counts += torch.bincount(index, minlength=VOCAB ** LENGTH)
    return counts


def vars_of(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def plain_draws(target, params: SamplingParams, n=DRAWS, chunk=5_000) -> torch.Tensor:
    """Counts of the first three tokens of n seeded plain decodings, in chunks (memory)."""
    chunks = [[SamplingParams(**{**vars_of(params), "seed": s}) for s in range(start, min(n, start + chunk))]
              for start in range(0, n, chunk)]
    outs = [o for seeded in chunks for o in plain_generate(target, [PROMPT] * len(seeded), seeded)]
    index = torch.tensor([o.token_ids[0] * VOCAB ** 2 + o.token_ids[1] * VOCAB + o.token_ids[2] for o in outs])
    return torch.bincount(index, minlength=VOCAB ** LENGTH)


@pytest.fixture(scope="module")
def tiny_pair():
    return sharpen(tiny("decoder_only", vocab=VOCAB, seed=11), 3.0), sharpen(tiny("decoder_only", vocab=VOCAB,
                                                                                  seed=12), 3.0)


FIXED = dict(adaptive=False, prompt_lookup=False, num_draft_tokens=2, draft_temperature=1.0)
SAMPLED_PATHS = {
    "draft model": lambda draft: (draft, SpeculativeConfig(**FIXED)),
    "draft model + lookup": lambda draft: (draft, SpeculativeConfig(**{**FIXED, "prompt_lookup": True})),
    "lookup": lambda draft: (NGramProposer(max_ngram=2, num_draft_tokens=3), None),
    "tree": lambda draft: (NGramProposer(num_draft_tokens=3), SpeculativeConfig(
        num_draft_tokens=3, tree_top_k=2, tree_max_tokens=6, adaptive=False)),
}


@pytest.mark.slow
def test_plain_sampling_with_penalties_matches_the_formula(tiny_pair):
    target, _ = tiny_pair
    params = SamplingParams(LENGTH, **PENALIZED)
    assert g_test_pvalue(plain_draws(target, params), exact_penalized_joint(target)) > P_MIN


@pytest.mark.slow
def test_the_penalized_g_test_detects_missing_penalties(tiny_pair):
    """Negative control: plain sampling with the bias and min_tokens but without the three
    penalties fails the penalized test."""
    target, _ = tiny_pair
    unpenalized = {**PENALIZED, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
    counts = plain_draws(target, SamplingParams(LENGTH, **unpenalized))
    assert g_test_pvalue(counts, exact_penalized_joint(target)) < P_MIN


@pytest.mark.slow
@pytest.mark.parametrize("path", list(SAMPLED_PATHS))
def test_speculative_sampling_with_penalties_is_lossless(tiny_pair, path):
    target, draft_model = tiny_pair
    draft, config = SAMPLED_PATHS[path](draft_model)
    counts = engine_draws(target, draft, config, SamplingParams(LENGTH, **PENALIZED))
    assert g_test_pvalue(counts, exact_penalized_joint(target)) > P_MIN
