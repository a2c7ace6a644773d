"""Greedy speculative decoding must equal the target's own greedy decoding, token for token."""

import itertools

import pytest
import torch

from speculative import SpeculativeConfig, SpeculativeDecoder, autoregressive_generate
from tests.helpers import perturbed, tiny

TYPES = ["decoder_only", "s4d"]


def make_pair(draft_type, target_type):
    target = tiny(target_type, seed=1)
    # Same type: a noisy copy of the target, which agrees often but not always.
    draft = perturbed(target, 0.05, seed=2) if draft_type == target_type else tiny(draft_type, seed=2)
    return draft, target


def prompt(length, seed, vocab=64):
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("draft_type,target_type", list(itertools.product(TYPES, TYPES)))
def test_greedy_equals_autoregressive(draft_type, target_type):
    draft, target = make_pair(draft_type, target_type)
    exercised = {"rejected": 0, "all_accepted": 0}
    for k in (1, 2, 4, 8):
        decoder = SpeculativeDecoder(target, draft, SpeculativeConfig(adaptive=False, num_draft_tokens=k))
        for length in (1, 2, 9, 33, 64):
            ids = prompt(length, seed=length * 10 + k)
            expected = autoregressive_generate(target, ids, 30)
            assert decoder.generate(ids, 30) == expected, (k, length)
        stats = decoder.stats
        exercised["rejected"] += stats.accepted < stats.drafted
        exercised["all_accepted"] += stats.accepted_at[-1] > 0
        assert stats.generated == 5 * 30
    # The cases above must reach both the rollback and the bonus-token paths (a random
    # draft of another type rarely agrees with the target, so only rejections there).
    assert exercised["rejected"] > 0
    if draft_type == target_type:
        assert exercised["all_accepted"] > 0


def test_draft_equal_to_target_takes_the_bonus_path():
    target = tiny("decoder_only", seed=3)
    ids = prompt(7, seed=1)
    decoder = SpeculativeDecoder(target, target, SpeculativeConfig(adaptive=False, num_draft_tokens=4,
                                                                   prompt_lookup=False))
    assert decoder.generate(ids, 25) == autoregressive_generate(target, ids, 25)
    assert decoder.acceptance_rate() == 1.0
    assert decoder.stats.target_forwards == 5  # 5 tokens per forward: 4 accepted + 1 bonus
    assert decoder.stats.tokens_per_forward == 5.0


@pytest.mark.parametrize("target_type", TYPES)
def test_eos_inside_a_draft(target_type):
    target = tiny(target_type, seed=4)
    ids = prompt(5, seed=2)
    reference = autoregressive_generate(target, ids, 40)
    # An EOS that first appears in the middle of the output (not at the start of a step).
    eos = next(t for i, t in enumerate(reference) if i % 8 not in (0, 7) and t not in reference[:i])
    cut = reference.index(eos) + 1
    decoder = SpeculativeDecoder(target, target, SpeculativeConfig(adaptive=False, num_draft_tokens=8))
    assert decoder.generate(ids, 40, eos_token_id=eos) == reference[:cut]
    assert autoregressive_generate(target, ids, 40, eos_token_id=eos) == reference[:cut]
    assert decoder.stats.generated == cut


@pytest.mark.parametrize("max_new", [0, 1, 3, 5, 9])
def test_max_new_tokens_inside_a_draft(max_new):
    target = tiny("decoder_only", seed=5)
    ids = prompt(4, seed=3)
    decoder = SpeculativeDecoder(target, target, SpeculativeConfig(adaptive=False, num_draft_tokens=8))
    out = decoder.generate(ids, max_new)
    assert out == autoregressive_generate(target, ids, max_new)
    assert len(out) == max_new


class CountingModel:
    """Wraps a model and records the width of every forward call."""

    def __init__(self, model):
        self.model, self.widths = model, []
        self.vocab_size, self.max_seq_len, self.device = model.vocab_size, model.max_seq_len, model.device

    def new_state(self, *args):
        return self.model.new_state(*args)

    def forward(self, tokens, state, num_valid=None, keep_logits=True):
        self.widths.append(tokens.shape[1])
        return self.model.forward(tokens, state, num_valid, keep_logits)

    def rollback(self, state, lengths):
        self.model.rollback(state, lengths)

    def select_rows(self, state, rows):
        self.model.select_rows(state, rows)


@pytest.mark.parametrize("target_type", TYPES)
def test_target_scores_all_drafts_in_one_forward_and_never_reruns_the_prefix(target_type):
    draft, target = make_pair(target_type, target_type)
    counting = CountingModel(target)
    ids = prompt(20, seed=4)
    decoder = SpeculativeDecoder(counting, draft, SpeculativeConfig(adaptive=False, num_draft_tokens=4))
    out = decoder.generate(ids, 30)
    assert out == autoregressive_generate(target, ids, 30)
    prefill, steps = counting.widths[0], counting.widths[1:]
    assert prefill == 19
    assert len(steps) == decoder.stats.target_forwards
    # Every step feeds the last committed token plus its drafts (K, fewer only near the
    # end), and nothing else: the prefix is never fed twice.
    assert steps[0] == 5 and all(1 <= w <= 5 for w in steps)
    assert sum(steps) == decoder.stats.drafted + decoder.stats.target_forwards
    assert 0 < decoder.stats.accepted < decoder.stats.drafted
