"""Public API: accept_reject, config validation, clear errors, seeds, streaming, stats."""

import pytest
import torch

from speculative import SpeculativeConfig, SpeculativeDecoder, accept_reject, autoregressive_generate
from tests.helpers import perturbed, sharpen, tiny


def test_accept_reject_one_dimensional():
    assert accept_reject(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 9, 4])).item() == 2
    assert accept_reject(torch.tensor([5, 2, 3]), torch.tensor([1, 2, 3])).item() == 0
    full = accept_reject(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3]))
    assert full.dim() == 0 and full.item() == 3 and not full.is_floating_point()


def test_accept_reject_batched():
    draft = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    verifier = torch.tensor([[1, 2, 3], [0, 5, 6], [7, 8, 0]])
    assert accept_reject(draft, verifier).tolist() == [3, 0, 2]


def test_accept_reject_shape_mismatch():
    with pytest.raises(ValueError, match="same shape"):
        accept_reject(torch.tensor([1, 2]), torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_draft_tokens=0), "num_draft_tokens must be >= 1, got 0"),
    (dict(num_draft_tokens=2.5), "num_draft_tokens must be an integer"),
    (dict(draft_temperature=-0.1), "draft_temperature must be a number >= 0"),
    (dict(target_temperature=-1), "target_temperature must be a number >= 0"),
    (dict(top_p=0), r"0 < top_p <= 1, got 0"),
    (dict(top_p=1.5), r"0 < top_p <= 1"),
    (dict(top_k=0), "top_k must be None or an integer >= 1"),
    (dict(seed="x"), "seed must be None or an integer"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kwargs)


def test_config_defaults_follow_the_rust_design():
    cfg = SpeculativeConfig()
    assert (cfg.num_draft_tokens, cfg.draft_temperature, cfg.target_temperature, cfg.greedy_verification) == \
        (4, 1.0, 1.0, True)


@pytest.fixture(scope="module")
def pair():
    target = tiny("decoder_only", seed=1)
    return perturbed(target, 0.05, seed=2), target


@pytest.mark.parametrize("prompt, message", [
    ([], "the prompt is empty"),
    ([1, 64], "token id 64, outside the vocabulary: allowed 0..63"),
    ([-1, 3], "token id -1, outside the vocabulary"),
    ([1.5, 2], "token ids must be integers"),
    ("hello", "prompt_ids must be a list of token ids"),
    (torch.tensor([1.0, 2.0]), "must be integers"),
    ([[1, 2], []], "prompt 1 is empty"),
])
def test_bad_prompts(pair, prompt, message):
    decoder = SpeculativeDecoder(pair[1], pair[0])
    with pytest.raises(ValueError, match=message):
        decoder.generate(prompt, 5)
    with pytest.raises(ValueError, match=message):
        autoregressive_generate(pair[1], prompt, 5)


def test_too_long_for_the_model(pair):
    decoder = SpeculativeDecoder(pair[1], pair[0])
    with pytest.raises(ValueError, match="exceed the target model's maximum length of 256"):
        decoder.generate([1] * 200, 57)
    assert len(decoder.generate([1] * 200, 56)) == 56


def test_bad_budgets_and_eos(pair):
    decoder = SpeculativeDecoder(pair[1], pair[0])
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0"):
        decoder.generate([1, 2], -1)
    with pytest.raises(ValueError, match="eos_token_id must be a token id in 0..63"):
        decoder.generate([1, 2], 3, eos_token_id=99)
    with pytest.raises(ValueError, match="3 entries for 2 prompts"):
        decoder.generate([[1, 2], [3]], [1, 2, 3])


def test_vocabulary_mismatch():
    with pytest.raises(ValueError, match="draft has 32 tokens, target has 64"):
        SpeculativeDecoder(tiny("decoder_only", vocab=64), tiny("s4d", vocab=32))


def test_same_seed_same_output_and_other_seed_other_output():
    target = sharpen(tiny("decoder_only", seed=1), 8.0)
    draft = sharpen(tiny("s4d", seed=2), 8.0)

    def sampled(seed):
        config = SpeculativeConfig(adaptive=False, greedy_verification=False, seed=seed)
        return SpeculativeDecoder(target, draft, config).generate([3, 1, 4], 40)

    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)
    config = SpeculativeConfig(adaptive=False, greedy_verification=False, seed=7)
    assert autoregressive_generate(target, [3, 1, 4], 40, config) == \
        autoregressive_generate(target, [3, 1, 4], 40, config)


def test_stream_yields_the_generated_tokens_in_order(pair):
    draft, target = pair
    decoder = SpeculativeDecoder(target, draft, SpeculativeConfig(adaptive=False, num_draft_tokens=3))
    streamed = list(decoder.stream([5, 6, 7], 20))
    assert streamed == autoregressive_generate(target, [5, 6, 7], 20)


def test_stats_and_reset(pair):
    draft, target = pair
    decoder = SpeculativeDecoder(target, draft, SpeculativeConfig(adaptive=False, num_draft_tokens=4))
    decoder.generate([5, 6, 7], 30)
    s = decoder.stats
    assert s.generated == 30 and s.target_forwards > 0 and s.drafted > 0
    assert decoder.acceptance_rate() == s.accepted / s.drafted
    assert s.tokens_per_forward == 30 / s.target_forwards
    assert sum(s.accepted_at) == s.accepted and sum(s.drafted_at) == s.drafted
    assert len(s.drafted_at) == 4
    assert s.draft_seconds > 0 and s.verify_seconds > 0 and s.other_seconds >= 0
    assert s.total_seconds >= s.draft_seconds + s.verify_seconds
    assert decoder.config.num_draft_tokens == 4
    decoder.reset_stats()
    assert decoder.stats.generated == 0 and decoder.acceptance_rate() == 0.0


def test_conditional_acceptance_counts_only_the_drafts_the_target_judged():
    from speculative import DecodeStats

    stats = DecodeStats()
    stats.record_step([4, 4, 2], [1, 4, 0])  # reached: 2 (kept, rejected), 4, 1
    assert stats.drafted_at == [3, 3, 2, 2] and stats.accepted_at == [2, 1, 1, 1]
    assert stats.acceptance_rate == 5 / 10
    assert stats.conditional_acceptance == 5 / 7


def test_adaptive_k_is_used_when_sampling_without_a_seed_and_pinned_with_one(pair):
    draft, target = pair
    decoder = SpeculativeDecoder(target, draft, SpeculativeConfig(greedy_verification=False, num_draft_tokens=4))
    decoder.generate([5, 6, 7], 10)
    assert 1 in decoder.policy.costs  # the policy measured costs: it chose K
    seeded = SpeculativeDecoder(target, draft, SpeculativeConfig(greedy_verification=False, num_draft_tokens=4))
    seeded.generate([5, 6, 7], 10, seeds=[3])
    assert not seeded.policy.costs and len(seeded.stats.drafted_at) == 4  # fixed K = 4
