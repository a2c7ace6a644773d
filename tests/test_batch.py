"""Batches with per-row acceptance: every row as if it ran alone."""

import pytest
import torch

from speculative import NGramProposer, SpeculativeConfig, SpeculativeDecoder, autoregressive_generate
from tests.helpers import TableModel, perturbed, tiny

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3], [7],
           [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5]]
BUDGETS = [20, 12, 25, 16]


@pytest.mark.parametrize("kind", ["decoder_only", "s4d", "transformers"])
@pytest.mark.parametrize("draft_kind", ["model", "ngram"])
def test_every_row_equals_the_row_alone(kind, draft_kind):
    if kind == "transformers":
        pytest.importorskip("transformers")
        from tests.test_transformers import llama
        from speculative.models.hf import HFModel
        target, draft = HFModel(llama(1, vocab=64)), HFModel(llama(2, vocab=64, hidden=32, layers=1))
    else:
        target = tiny(kind, seed=1)
        draft = perturbed(target, 0.05, seed=2)
    if draft_kind == "ngram":
        draft = NGramProposer(max_ngram=3)
    decoder = SpeculativeDecoder(target, draft, SpeculativeConfig(adaptive=False, num_draft_tokens=3))
    outs = decoder.generate(PROMPTS, BUDGETS)
    alone = [autoregressive_generate(target, p, n) for p, n in zip(PROMPTS, BUDGETS)]
    assert outs == alone
    assert [len(o) for o in outs] == BUDGETS  # rows finish at different steps and leave the batch


def test_rows_that_finish_early_on_eos():
    target = tiny("decoder_only", seed=3)
    draft = perturbed(target, 0.05, seed=4)
    reference = [autoregressive_generate(target, p, 30) for p in PROMPTS]
    eos = reference[1][4]  # ends row 1 early; other rows end where it first appears, if at all
    decoder = SpeculativeDecoder(target, draft, SpeculativeConfig(adaptive=False, num_draft_tokens=4,
                                                                prompt_lookup=False))
    outs = decoder.generate(PROMPTS, 30, eos_token_id=eos)
    for out, ref in zip(outs, reference):
        assert out == (ref[:ref.index(eos) + 1] if eos in ref else ref)
    assert len(outs[1]) <= 5


def cycle_tables():
    """Target: 0->1->...->7->0 and 8->11->14->9->... Draft: right on the first cycle, always
    wrong on the second."""
    target = torch.full((16, 16), -20.0)
    draft = torch.full((16, 16), -20.0)
    for t in range(8):
        target[t, (t + 1) % 8] = draft[t, (t + 1) % 8] = 20.0
        target[8 + t, 8 + (t + 3) % 8] = 20.0
        draft[8 + t, 8 + (t + 5) % 8] = 20.0
    return TableModel(target), TableModel(draft)


def test_one_row_always_accepts_while_another_never_does():
    target, draft = cycle_tables()
    decoder = SpeculativeDecoder(target, draft, SpeculativeConfig(adaptive=False, num_draft_tokens=4,
                                                                prompt_lookup=False))
    outs = decoder.generate([[0], [8]], 30)
    assert outs == [autoregressive_generate(target, [0], 30), autoregressive_generate(target, [8], 30)]
    # Row 0 keeps every draft (5 tokens per step), row 1 none: its rejections cost row 0 nothing.
    assert decoder.stats.accepted == 24  # row 0: 6 steps x 4 accepted; row 1: 0
    assert decoder.stats.target_forwards == 30  # row 1 needs one step per token; row 0 rode along


def test_per_row_seeds_give_the_same_output_in_any_batch():
    target = tiny("decoder_only", seed=5)
    draft = tiny("s4d", seed=6)
    config = SpeculativeConfig(greedy_verification=False, num_draft_tokens=3, draft_temperature=0.7)
    decoder = SpeculativeDecoder(target, draft, config)
    together = decoder.generate(PROMPTS, BUDGETS, seeds=[11, 12, 13, 14])
    reordered = decoder.generate([PROMPTS[2], PROMPTS[0]], [BUDGETS[2], BUDGETS[0]], seeds=[13, 11])
    alone = decoder.generate(PROMPTS[3], BUDGETS[3], seeds=[14])
    assert reordered == [together[2], together[0]]
    assert alone == together[3]
    assert together[0] != decoder.generate(PROMPTS[0], BUDGETS[0], seeds=[99])


def test_stream_per_row():
    target = tiny("decoder_only", seed=7)
    decoder = SpeculativeDecoder(target, NGramProposer(), SpeculativeConfig(num_draft_tokens=4))
    rows = [[] for _ in PROMPTS]
    for row, token in decoder.stream(PROMPTS, BUDGETS):
        rows[row].append(token)
    assert rows == decoder.generate(PROMPTS, BUDGETS)


@pytest.mark.parametrize("prompts, budget, message", [
    ([], 5, "the prompt is empty"),
    ([[1, 2], []], 5, "prompt 1 is empty"),
    ([[1, 2], [3]], [4], "1 entries for 2 prompts"),
    ([[1, 2], [3]], [4, -1], "max_new_tokens must be an integer >= 0"),
])
def test_bad_batches(prompts, budget, message):
    decoder = SpeculativeDecoder(tiny("decoder_only"), NGramProposer())
    with pytest.raises(ValueError, match=message):
        decoder.generate(prompts, budget)


class RowCounter:
    """Wraps a model and records how many rows every forward carries."""

    def __init__(self, model):
        self.model, self.rows = model, []
        self.vocab_size, self.max_seq_len, self.device = model.vocab_size, model.max_seq_len, model.device

    def new_state(self, *args):
        return self.model.new_state(*args)

    def forward(self, tokens, state, num_valid=None, keep_logits=True):
        self.rows.append(tokens.shape[0])
        return self.model.forward(tokens, state, num_valid, keep_logits)

    def rollback(self, state, lengths):
        self.model.rollback(state, lengths)

    def select_rows(self, state, rows):
        self.model.select_rows(state, rows)


@pytest.mark.parametrize("kind", ["decoder_only", "s4d", "transformers"])
def test_the_reference_takes_per_row_budgets_and_finished_rows_leave_its_batch(kind):
    """A long prompt with a budget of 1 beside a short one with 10: the reference must give
    each row what it gives alone, and stop feeding a row once it is done (a finished row
    fed on overruns its cache, or a model's context)."""
    prompts, budgets = [list(range(40, 60)), [5, 6]], [1, 10]
    if kind == "transformers":
        pytest.importorskip("transformers")
        from tests.test_transformers import llama, reference
        from speculative.models.hf import HFModel
        target = HFModel(llama(1, vocab=64))
        alone = [reference(target.model, p, n) for p, n in zip(prompts, budgets)]  # transformers' own generate
    else:
        target = tiny(kind, seed=1)
        alone = [autoregressive_generate(target, p, n) for p, n in zip(prompts, budgets)]
    counter = RowCounter(target)
    assert autoregressive_generate(counter, prompts, budgets) == alone
    assert counter.rows == [2, 2] + [1] * 9  # the prompts, both rows' first token, then row 1 alone
    decoder = SpeculativeDecoder(target, NGramProposer(), SpeculativeConfig(adaptive=False, num_draft_tokens=3))
    assert decoder.generate(prompts, budgets) == alone
    eos = alone[1][2]  # ends row 1 early: both leave the batch at their own step
    ended = [row[:row.index(eos) + 1] if eos in row else row for row in alone]
    assert autoregressive_generate(target, prompts, budgets, eos_token_id=eos) == ended
    assert decoder.generate(prompts, budgets, eos_token_id=eos) == ended
