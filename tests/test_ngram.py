"""Prompt-lookup drafting: what it proposes, and that decoding with it stays exact."""

import pytest
import torch

from speculative import NGramProposer, SpeculativeConfig, SpeculativeDecoder, autoregressive_generate
from speculative.proposers.draft_model import DraftModelProposer
from tests.helpers import TableModel, tiny
from tests.test_greedy import CountingModel


def propose(proposer, seq, k=10):
    proposer.add_rows([seq])
    out = proposer.propose([seq], [k])
    return out.tokens[0, :out.lengths[0]].tolist()


def test_longest_match_wins_and_the_occurrence_with_the_longest_agreeing_context_is_used():
    seq = [1, 2, 3, 9, 9, 5, 2, 3, 7, 7, 1, 2, 3]
    # "1 2 3" occurs at the start; "2 3" occurs later (followed by 7 7) but is shorter.
    assert propose(NGramProposer(max_ngram=3, num_draft_tokens=3), seq, 3) == [9, 9, 5]
    # With bigrams only, both "2 3" match; the first is preceded by 1, as the row's is.
    assert propose(NGramProposer(max_ngram=2, min_ngram=2, num_draft_tokens=2), seq, 2) == [9, 9]
    # Equal context: the most recent occurrence.
    tie = [8, 1, 2, 3, 4, 8, 1, 2, 5, 6, 0, 1, 2]
    assert propose(NGramProposer(max_ngram=2, num_draft_tokens=2), tie, 2) == [5, 6]
    # Context decides beyond max_ngram: "0 1 2" three and four tokens back.
    far = [7, 0, 1, 2, 3, 4, 6, 0, 1, 2, 5, 5, 7, 0, 1, 2]
    assert propose(NGramProposer(max_ngram=2, num_draft_tokens=2), far, 2) == [3, 4]
    assert propose(NGramProposer(max_ngram=4, num_draft_tokens=2), far, 2) == [3, 4]


def test_a_match_proposes_its_whole_continuation_up_to_k():
    """No rule cuts a short match's draft (the adaptive policy chooses how much to verify):
    a one-token match proposes as much as a four-token one, cut only by K, the row's limit
    and the end of the history. Whether the match was long comes back as `preferred`."""
    four_gram, one_gram = list(range(20)) + [0, 1, 2, 3], list(range(20)) + [3]
    assert propose(NGramProposer(max_ngram=4, num_draft_tokens=8), four_gram, 8) == list(range(4, 12))
    assert propose(NGramProposer(max_ngram=4, num_draft_tokens=8), one_gram, 8) == list(range(4, 12))
    assert propose(NGramProposer(max_ngram=4, num_draft_tokens=8), one_gram, 5) == list(range(4, 9))
    assert propose(NGramProposer(max_ngram=4, num_draft_tokens=32), one_gram, 32) == list(range(4, 20)) + [3]
    proposer = NGramProposer(max_ngram=4, num_draft_tokens=8)
    proposer.add_rows([one_gram, four_gram, [1, 2, 3]])
    drafts, preferred = proposer.free_drafts([one_gram, four_gram, [1, 2, 3]], [8, 8, 8])
    assert drafts == [list(range(4, 12)), list(range(4, 12)), []]
    assert preferred == [False, True, False]  # the policy learns one-token matches apart


def test_no_match_proposes_nothing_and_costs_one_plain_target_step():
    assert propose(NGramProposer(), [1, 2, 3, 4]) == []
    target = tiny("decoder_only", seed=1)
    counting = CountingModel(target)
    ids = torch.randperm(60, generator=torch.Generator().manual_seed(0)).tolist()[:10]
    decoder = SpeculativeDecoder(counting, NGramProposer(), SpeculativeConfig(adaptive=False, num_draft_tokens=4))
    out = decoder.generate(ids, 20)
    assert out == autoregressive_generate(target, ids, 20)
    steps = counting.widths[1:]
    # Every forward fed the last token plus exactly the drafts found: no padding.
    assert sum(steps) == decoder.stats.drafted + decoder.stats.target_forwards
    assert 1 in steps  # some steps found no match and were plain one-token steps


def test_ngram_greedy_is_exact_on_repetitive_text():
    target = tiny("decoder_only", seed=2)
    ids = [5, 6, 7, 8, 9] * 6
    decoder = SpeculativeDecoder(target, NGramProposer(), SpeculativeConfig(adaptive=False, num_draft_tokens=8))
    assert decoder.generate(ids, 40) == autoregressive_generate(target, ids, 40)
    assert decoder.stats.tokens_per_forward > 1.2


def test_prompt_lookup_with_a_draft_model_is_exact_and_uses_both():
    from speculative.proposers.hybrid import HybridProposer

    target = tiny("decoder_only", seed=2)
    draft = tiny("s4d", seed=3)
    ids = [5, 6, 7, 8, 9] * 4 + [11, 30, 2]
    config = SpeculativeConfig(adaptive=False, num_draft_tokens=4, prompt_lookup=True)
    decoder = SpeculativeDecoder(target, draft, config)
    assert isinstance(decoder.proposer, HybridProposer)
    assert decoder.generate(ids, 40) == autoregressive_generate(target, ids, 40)
    assert decoder.generate([ids, ids[5:]], 30) == [autoregressive_generate(target, p, 30) for p in (ids, ids[5:])]
    sampled = SpeculativeConfig(adaptive=False, num_draft_tokens=4, prompt_lookup=True, greedy_verification=False,
                                seed=3)
    assert len(SpeculativeDecoder(target, draft, sampled).generate(ids, 20)) == 20


def test_a_draft_model_that_lookup_makes_unneeded_never_runs_not_even_on_the_prompt():
    table = torch.zeros(16, 16)
    for token in range(16):
        table[token, (token + 1) % 7 if token < 7 else 0] = 10.0  # greedy output cycles through 0..6
    target, draft = TableModel(table), TableModel(table)
    calls = []
    forward = draft.forward
    draft.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    config = SpeculativeConfig(adaptive=False, num_draft_tokens=4, prompt_lookup=True)
    prompts = [[(i + j) % 7 for j in range(9)] for i in range(3)]  # a whole cycle: lookup always matches
    decoder = SpeculativeDecoder(target, draft, config)
    assert decoder.generate(prompts, 30) == autoregressive_generate(target, prompts, 30)
    assert decoder.stats.tokens_per_forward > 3
    assert not calls


def test_with_a_draft_model_lookup_drafts_reach_their_own_k_and_the_model_keeps_its_own(monkeypatch):
    """lookup_draft_tokens: a match drafts up to its own K (free to draft), the draft model
    never more than num_draft_tokens; the output is still the target's greedy decoding."""
    table = torch.zeros(16, 16)
    for token in range(16):
        table[token, (token + 1) % 7 if token < 7 else 0] = 10.0  # greedy output cycles through 0..6
    target, draft = TableModel(table), TableModel(torch.roll(table, 1, dims=1))  # the draft is always wrong
    prompts = [[(i + j) % 7 for j in range(9)] for i in range(2)] + [[9, 12]]  # the last has no match at first
    asked = []
    propose = DraftModelProposer.propose
    monkeypatch.setattr(DraftModelProposer, "propose", lambda self, seqs, limits, *rest: asked.append(max(limits))
                        or propose(self, seqs, limits, *rest))
    for adaptive in (False, True):
        config = SpeculativeConfig(adaptive=adaptive, num_draft_tokens=2, prompt_lookup=True, lookup_draft_tokens=12)
        decoder = SpeculativeDecoder(target, draft, config)
        asked.clear()
        assert decoder.generate(prompts, 40) == autoregressive_generate(target, prompts, 40)
        assert decoder.stats.tokens_per_forward > 3  # more than K = 2 drafts (3 tokens) can give
        assert max(asked, default=0) <= 2  # never past its K (and, at a fixed K, it drafted)
        assert asked or adaptive  # (the adaptive policy may leave an always wrong draft out)


def test_lookup_trees_reach_their_own_depth_behind_a_model_and_stay_exact():
    target, draft = tiny("decoder_only", seed=2), tiny("decoder_only", seed=3)
    prompts = [[5, 6, 7, 8, 9] * 6 + [11, 30, 2], [8, 9] + [5, 6, 7, 8, 9] * 5]
    for adaptive in (False, True):
        config = SpeculativeConfig(adaptive=adaptive, num_draft_tokens=2, prompt_lookup=True, lookup_draft_tokens=12,
                                   tree_top_k=2, tree_max_tokens=16)
        decoder = SpeculativeDecoder(target, draft, config)
        assert decoder.generate(prompts, 60) == autoregressive_generate(target, prompts, 60)
        assert decoder.stats.tokens_per_forward > 3  # lookup trees deeper than the model's K = 2


def test_lookup_draft_tokens_needs_prompt_lookup_and_a_bound():
    with pytest.raises(ValueError, match="applies with prompt_lookup=True"):
        SpeculativeConfig(prompt_lookup=False, lookup_draft_tokens=8)
    with pytest.raises(ValueError, match="lookup_draft_tokens is 65, above its upper bound"):
        SpeculativeConfig(prompt_lookup=True, lookup_draft_tokens=65)
    with pytest.raises(ValueError, match="lookup_draft_tokens"):
        SpeculativeConfig(prompt_lookup=True, lookup_draft_tokens=0)
    assert SpeculativeConfig(num_draft_tokens=4, prompt_lookup=True, lookup_draft_tokens=24).longest_draft == 24
    assert SpeculativeConfig(num_draft_tokens=6, prompt_lookup=True, lookup_draft_tokens=3).longest_draft == 6
    assert SpeculativeConfig(num_draft_tokens=6).longest_draft == 6
    assert SpeculativeConfig(lookup_draft_tokens=8).prompt_lookup  # on by default
