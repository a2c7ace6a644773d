"""Reduced draft vocabularies (FR-Spec): the draft scores a subset of tokens, output unchanged."""

import pytest
import torch

from speculative import SpeculativeConfig, SpeculativeDecoder, autoregressive_generate
from speculative.proposers.draft_model import DraftModelProposer
from speculative.core.sampling import Sampler
from speculative.proposers.vocab import corpus_vocab, frequent_tokens
from tests.helpers import TableModel, perturbed, sharpen, tiny


class CharTokenizer:
    """Characters as token ids: enough for counting."""

    def encode(self, text):
        return [ord(c) % 64 for c in text]

    def vocab(self):
        return {chr(i): i for i in range(64)}


def test_frequent_tokens_ranks_by_count_then_id():
    ids = frequent_tokens(CharTokenizer(), ["aaab", "bbc", "c"], 2)  # a: 3, b: 3, c: 2
    assert ids.tolist() == sorted([ord("a") % 64, ord("b") % 64])
    assert len(frequent_tokens(CharTokenizer(), ["ab"], 10)) == 2  # fewer distinct tokens than asked
    with pytest.raises(ValueError, match="integer >= 1, got 0"):
        frequent_tokens(CharTokenizer(), ["ab"], 0)


def test_corpus_vocab_is_counted_once_and_cached(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "hello"}\n{"prompt": "help"}\n')
    first = corpus_vocab(CharTokenizer(), 3, str(corpus), cache=tmp_path / "cache")
    assert first.tolist() == sorted(ord(c) % 64 for c in "hel")  # h: 2, e: 2, l: 3
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1
    assert corpus_vocab(CharTokenizer(), 3, str(corpus), cache=tmp_path / "cache").tolist() == first.tolist()
    (tmp_path / "bad.jsonl").write_text('{"words": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl line 1: expected an object with a \"text\" or \"prompt\""):
        corpus_vocab(CharTokenizer(), 3, str(tmp_path / "bad.jsonl"), cache=tmp_path / "cache")


@pytest.mark.parametrize("vocab, words", [
    ([], "non-empty 1-D"),
    ([[1, 2]], "non-empty 1-D"),
    ([0.5, 1.0], "non-empty 1-D"),
    ([1, 64], "must lie in 0..63"),
    ([3, 3], "distinct"),
])
def test_bad_vocabularies_are_refused(vocab, words):
    with pytest.raises(ValueError, match=words):
        DraftModelProposer(tiny("decoder_only"), vocab=torch.tensor(vocab))


def half_vocab(seed=0, vocab=64):
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:vocab // 2]


@pytest.mark.parametrize("draft_type", ["decoder_only", "s4d"])
def test_greedy_with_a_reduced_vocabulary_equals_autoregressive(draft_type):
    target = tiny("decoder_only", seed=1)
    draft = perturbed(target, 0.05, seed=2) if draft_type == "decoder_only" else tiny("s4d", seed=2)
    subset = half_vocab()  # the target's argmax is often outside: those steps must reject
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (2, 9, 30)]
    for k in (1, 4):
        decoder = SpeculativeDecoder(target, draft, SpeculativeConfig(adaptive=False, num_draft_tokens=k,
                                                                      prompt_lookup=False),
                                     draft_vocab=subset)
        outs = decoder.generate(prompts, 25)
        assert outs == [autoregressive_generate(target, p, 25) for p in prompts]
        assert set(decoder.proposer.vocab.tolist()) == set(subset.tolist())


def test_drafts_come_from_the_subset_only():
    target = tiny("decoder_only", seed=1)
    subset = half_vocab(seed=3)
    proposer = DraftModelProposer(perturbed(target, 0.05, seed=2), vocab=subset)
    proposer.add_rows([[1, 2, 3], [4, 5]], 64, [Sampler(), Sampler(1.0)], [None, torch.Generator().manual_seed(0)])
    proposal = proposer.propose([[1, 2, 3], [4, 5]], [6, 6])
    assert set(proposal.tokens.flatten().tolist()) <= set(subset.tolist())  # greedy and sampled rows
    outside = torch.ones(64, dtype=torch.bool)
    outside[subset] = False
    assert proposal.probs[1][:, outside].sum() == 0 and torch.allclose(proposal.probs[1].sum(-1), torch.ones(6))


@pytest.mark.slow
def test_sampling_with_a_reduced_vocabulary_is_lossless():
    """G-test (20,000 draws, see test_lossless.py): q is zero outside the subset, and the
    target's residual gives those tokens all their probability. Negative control: a target
    that itself loses the tokens outside the subset is rejected by the same test."""
    from tests.test_lossless import DRAWS, LENGTH, P_MIN, PROMPT, VOCAB, draw, exact_joint, g_test_pvalue

    target = sharpen(tiny("decoder_only", vocab=VOCAB, seed=11), 6.0)
    draft = sharpen(tiny("decoder_only", vocab=VOCAB, seed=12), 6.0)
    subset = torch.tensor([0, 2, 3, 5, 6])
    config = SpeculativeConfig(adaptive=False, greedy_verification=False, num_draft_tokens=2)
    decoder = SpeculativeDecoder(target, draft, config, draft_vocab=subset)
    exact = exact_joint(target, config)
    assert exact[[1, 4, 7]].sum() > 0.05  # tokens outside the subset matter
    assert g_test_pvalue(draw(decoder), exact) > P_MIN
    assert 0 < decoder.acceptance_rate() < 1

    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0))
    lossy = table.clone()
    lossy[:, [1, 4, 7]] = float("-inf")
    outs = autoregressive_generate(TableModel(lossy), [PROMPT] * DRAWS, LENGTH, config, seeds=list(range(DRAWS)))
    index = torch.tensor([o[0] * VOCAB ** 2 + o[1] * VOCAB + o[2] for o in outs])
    counts = torch.bincount(index, minlength=VOCAB ** LENGTH).double()
    truth = exact_joint(TableModel(table), config).flatten().double()
    assert g_test_pvalue(counts, truth) < P_MIN
