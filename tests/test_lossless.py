"""Speculative sampling must follow the target's distribution exactly.

Each test draws the first three generated tokens 20,000 times and compares their joint
distribution with the exact one, computed by enumerating every 3-token continuation
with the target alone. G-test, cells with expected count < 5 pooled, fixed seeds;
the test fails when p < 0.001.
"""

import pytest
import torch

from speculative import SpeculativeConfig, SpeculativeDecoder, autoregressive_generate
from speculative.core.sampling import probabilities
from tests.helpers import TableModel, sharpen, tiny

# Tests marked slow take a minute or more each on 2 cores (`make test-all` runs them); the quick
# run keeps three cheap ones: an S4D pair's G-test, a draft the target rejects, top-k 1.

VOCAB, DRAWS, LENGTH, P_MIN = 8, 20_000, 3, 0.001
PROMPT = [1, 5, 2, 7]


def exact_joint(model, config, prompt=PROMPT):
    """P(t1, t2, t3) under the target with the config's temperature / top-k / top-p."""
    rows = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # (V^2, 2)
    tokens = torch.cat([torch.tensor(prompt).repeat(len(rows), 1), rows], 1)
    with torch.inference_mode():
        logits = model.forward(tokens, model.new_state(len(rows), tokens.shape[1]))  # (V^2, L+2, V)
    p = probabilities(logits[:, len(prompt) - 1:], config.target_temperature, config.top_k, config.top_p)
    first = p[0, 0]  # (V,)
    second = p[::VOCAB, 1]  # (V, V): row t1
    third = p[:, 2].reshape(VOCAB, VOCAB, VOCAB)  # [t1, t2, t3]
    return first[:, None, None] * second[:, :, None] * third


def draw(decoder, n=DRAWS, chunk=5_000, max_new=LENGTH):
    counts = torch.zeros(VOCAB ** LENGTH)
    for start in range(0, n, chunk):
        outs = decoder.generate([PROMPT] * chunk, max_new, seeds=list(range(start, start + chunk)))
        index = torch.tensor([o[0] * VOCAB ** 2 + o[1] * VOCAB + o[2] for o in outs])
        counts += torch.bincount(index, minlength=VOCAB ** LENGTH)
    return counts


def g_test_pvalue(counts, probs):
    """p-value of observed counts against exact cell probabilities (G-test)."""
    expected = probs.flatten().double() * counts.sum()
    counts = counts.double()
    assert counts[expected == 0].sum() == 0, "a token sequence the target can never produce was sampled"
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    g = 2 * torch.sum(torch.where(obs > 0, obs * torch.log(obs / exp), torch.zeros_like(obs)))
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), g / 2))


@pytest.fixture(scope="module")
def models():
    target = sharpen(tiny("decoder_only", vocab=VOCAB, seed=11), 12.0)
    draft = sharpen(tiny("decoder_only", vocab=VOCAB, seed=12), 12.0)
    return draft, target


def total_variation(a, b, config):
    with torch.inference_mode():
        pa = probabilities(a.forward(torch.tensor([PROMPT]), a.new_state(1, 8))[0, -1], 1.0)
        pb = probabilities(b.forward(torch.tensor([PROMPT]), b.new_state(1, 8))[0, -1], 1.0)
    return 0.5 * float((pa - pb).abs().sum())


# Sampled, fixed K, the draft model alone (no prompt lookup in front).
SAMPLED = dict(adaptive=False, greedy_verification=False, prompt_lookup=False)

CASES = {
    "greedy draft": dict(draft_temperature=0.0),
    "cool draft": dict(draft_temperature=0.5),
    "hot draft": dict(draft_temperature=1.5),
    "target temperature 0.7": dict(target_temperature=0.7, draft_temperature=1.0),
    "top_k 3": dict(top_k=3),
    "top_p 0.9": dict(top_p=0.9),
    "K 4, first 3 of 6": dict(num_draft_tokens=4),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_matches_target_distribution(models, case):
    draft, target = models
    settings = {**SAMPLED, "num_draft_tokens": 2, **CASES[case]}
    config = SpeculativeConfig(**settings)
    assert total_variation(draft, target, config) > 0.25  # the draft clearly differs
    decoder = SpeculativeDecoder(target, draft, config)
    counts = draw(decoder, max_new=6 if config.num_draft_tokens == 4 else LENGTH)
    assert 0 < decoder.acceptance_rate() < 1
    assert g_test_pvalue(counts, exact_joint(target, config)) > P_MIN


@pytest.mark.slow  # a G-test; s4d targets stay greedy-exact, s4d drafts seeded-exact, in the quick run
def test_s4d_pair_is_lossless():
    target = sharpen(tiny("s4d", vocab=VOCAB, seed=13), 12.0)
    draft = sharpen(tiny("s4d", vocab=VOCAB, seed=14), 12.0)
    config = SpeculativeConfig(**SAMPLED, num_draft_tokens=2, draft_temperature=1.0)
    decoder = SpeculativeDecoder(target, draft, config)
    assert g_test_pvalue(draw(decoder), exact_joint(target, config)) > P_MIN
    assert 0 < decoder.acceptance_rate() < 1


@pytest.mark.slow
def test_draft_equal_to_target_accepts_everything(models):
    _, target = models
    config = SpeculativeConfig(**SAMPLED, num_draft_tokens=2, draft_temperature=1.0)
    decoder = SpeculativeDecoder(target, target, config)
    counts = draw(decoder)
    assert decoder.acceptance_rate() == 1.0
    assert g_test_pvalue(counts, exact_joint(target, config)) > P_MIN


def test_draft_mass_on_a_token_the_target_never_emits():
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    table[:, 0] = float("-inf")  # the target never emits token 0
    target = TableModel(table)
    draft_table = torch.full((VOCAB, VOCAB), -30.0)
    draft_table[:, 0] = 30.0  # the draft always proposes token 0
    draft = TableModel(draft_table)
    config = SpeculativeConfig(**SAMPLED, num_draft_tokens=2, draft_temperature=1.0)
    decoder = SpeculativeDecoder(target, draft, config)
    counts = draw(decoder)
    assert decoder.acceptance_rate() == 0.0
    assert g_test_pvalue(counts, exact_joint(target, config)) > P_MIN


def test_top_k_1_is_greedy(models):
    draft, target = models
    config = SpeculativeConfig(**SAMPLED, top_k=1, num_draft_tokens=3)
    outs = SpeculativeDecoder(target, draft, config).generate([PROMPT] * 200, 8, seeds=list(range(200)))
    assert all(out == autoregressive_generate(target, PROMPT, 8) for out in outs)


@pytest.mark.slow
def test_exact_joint_matches_plain_sampling(models):
    """The reference itself: autoregressive sampling against the enumerated distribution."""
    _, target = models
    config = SpeculativeConfig(**SAMPLED, top_p=0.9)
    outs = autoregressive_generate(target, [PROMPT] * DRAWS, LENGTH, config, seeds=list(range(DRAWS)))
    index = torch.tensor([o[0] * VOCAB ** 2 + o[1] * VOCAB + o[2] for o in outs])
    counts = torch.bincount(index, minlength=VOCAB ** LENGTH)
    assert g_test_pvalue(counts, exact_joint(target, config)) > P_MIN


@pytest.mark.slow
def test_the_g_test_detects_a_wrong_distribution(models):
    """The check has teeth: samples at another temperature are rejected."""
    _, target = models
    hot = SpeculativeConfig(**SAMPLED, target_temperature=1.3)
    outs = autoregressive_generate(target, [PROMPT] * DRAWS, LENGTH, hot, seeds=list(range(DRAWS)))
    index = torch.tensor([o[0] * VOCAB ** 2 + o[1] * VOCAB + o[2] for o in outs])
    counts = torch.bincount(index, minlength=VOCAB ** LENGTH)
    plain = SpeculativeConfig(adaptive=False, greedy_verification=False, prompt_lookup=False)
    assert g_test_pvalue(counts, exact_joint(target, plain)) < P_MIN


@pytest.mark.slow
def test_batch_of_one_is_lossless_too(models):
    """The draws above run as batches of 5,000 rows; here one sequence at a time (fewer
    draws, so the first two tokens only: 64 cells)."""
    draft, target = models
    config = SpeculativeConfig(**SAMPLED, num_draft_tokens=2, draft_temperature=1.0)
    decoder = SpeculativeDecoder(target, draft, config)
    draws = 3_000
    counts = torch.zeros(VOCAB ** 2)
    for seed in range(draws):
        first, second = decoder.generate(PROMPT, 2, seeds=[seed])
        counts[first * VOCAB + second] += 1
    assert 0 < decoder.acceptance_rate() < 1
    assert g_test_pvalue(counts, exact_joint(target, config).sum(-1)) > P_MIN
