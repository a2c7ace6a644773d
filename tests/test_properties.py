"""Property: whatever is passed to generate (prompts, budgets, seeds, EOS ids, batch shapes),
the answer is the reference's output or a ValueError/TypeError with a message; never
anything else."""

import numpy as np
import pytest
import torch

from speculative import NGramProposer, SpeculativeConfig, SpeculativeDecoder, autoregressive_generate
from speculative.core.inputs import normalize_prompts
from speculative.core.sampling import ARGMAX_BLOCK, argmax
from tests.helpers import perturbed, tiny

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given, settings, strategies as st  # noqa: E402

VOCAB = 64
TARGET = tiny("decoder_only", vocab=VOCAB, seed=1)  # 256 positions
DRAFTS = {"decoder_only": perturbed(TARGET, 0.05, seed=2), "s4d": tiny("s4d", vocab=VOCAB, seed=3),
          "ngram": NGramProposer(max_ngram=3)}



def sometimes_bad(good, bad):
    """Draws from `bad` one time in five, so that most inputs are valid throughout."""
    return st.integers(0, 4).flatmap(lambda i: bad if i == 4 else good)


token = st.integers(0, 7)  # few distinct tokens: the n-gram draft finds matches
bad_token = st.sampled_from([-1, VOCAB, 2 ** 70, True, 2.0, "a"])
good_prompt = st.one_of(st.lists(st.one_of(token, st.just(np.int64(5))), min_size=1, max_size=8),
                        st.integers(246, 252).map(lambda n: [3] * n))  # at the 256-token context
bad_prompt = st.one_of(st.just([]), st.lists(token, max_size=4).flatmap(
    lambda row: bad_token.map(lambda t: row + [t])))
prompt = sometimes_bad(good_prompt, bad_prompt)


@st.composite
def batches(draw):
    """(prompts, number of rows): one prompt, a list of prompts, or a 2-D tensor; sometimes none."""
    shape = draw(st.sampled_from(["one", "one", "list", "list", "list", "tensor", "tensor", "empty"]))
    if shape == "one":
        return draw(prompt), 1
    if shape == "empty":
        return draw(st.sampled_from([[], torch.zeros(0, 3, dtype=torch.long), "text", None])), 1
    rows = draw(st.integers(1, 3))
    if shape == "tensor":
        return torch.tensor(draw(st.lists(st.lists(token, min_size=3, max_size=3), min_size=rows, max_size=rows))), rows
    return draw(st.lists(prompt, min_size=rows, max_size=rows)), rows


def per_row(value, rows, bad):
    """A list with one value per row or one value for all rows; sometimes `bad` instead."""
    return sometimes_bad(st.booleans().flatmap(lambda one: value if one else st.lists(value, min_size=rows,
                                                                                       max_size=rows)), bad)


@st.composite
def generate_inputs(draw):
    prompts, rows = draw(batches())
    budgets = draw(per_row(st.integers(0, 9), rows, st.one_of(
        st.sampled_from([-1, True, 2.5, None, "3"]), st.lists(st.integers(0, 9), max_size=4))))
    seed = st.one_of(st.integers(0, 2 ** 64 - 1), st.just(np.int64(7)))
    seeds = draw(sometimes_bad(st.one_of(st.none(), st.lists(seed, min_size=rows, max_size=rows)),
                               st.one_of(seed, st.lists(st.sampled_from([-1, 2 ** 64, 3.0]), min_size=rows,
                                                        max_size=rows), st.lists(seed, max_size=4))))
    eos = draw(sometimes_bad(st.one_of(st.none(), token, st.lists(token, max_size=3)),
                             st.sampled_from([-1, VOCAB, 1.5, [2, VOCAB], "x"])))
    return prompts, budgets, seeds, eos


def outcome(run):
    """('ok', output) or ('error', class, message); anything but ValueError/TypeError propagates."""
    try:
        return ("ok", run())
    except (ValueError, TypeError) as error:
        assert str(error).strip(), f"{type(error).__name__} without a message"
        return ("error", type(error), str(error))


@settings(max_examples=80, deadline=None, derandomize=True)
@given(draft=st.sampled_from(sorted(DRAFTS)), adaptive=st.booleans(), inputs=generate_inputs())
@example(draft="ngram", adaptive=False, inputs=([list(range(40, 60)), [5, 6]], [1, 10], None, None))  # issue 17
def test_greedy_generate_gives_the_reference_output_or_a_clear_error(draft, adaptive, inputs):
    prompts, budgets, seeds, eos = inputs
    config = SpeculativeConfig(num_draft_tokens=3, adaptive=adaptive)
    decoder = SpeculativeDecoder(TARGET, DRAFTS[draft], config)
    expected = outcome(lambda: autoregressive_generate(TARGET, prompts, budgets, eos_token_id=eos, seeds=seeds))
    assert outcome(lambda: decoder.generate(prompts, budgets, eos, seeds=seeds)) == expected


@settings(max_examples=40, deadline=None, derandomize=True)
@given(draft=st.sampled_from(sorted(DRAFTS)), inputs=generate_inputs())
@example(draft="s4d", inputs=([list(range(40, 60)), [5, 6]], [1, 10], [3, 4], None))  # issue 17
def test_sampling_generate_gives_rows_within_their_budget_or_a_clear_error(draft, inputs):
    """Sampled tokens differ from the reference's draws, so: the same errors as the
    reference; on success, each row stops at its first EOS or at its budget, and the
    same seeds give the same rows."""
    prompts, budgets, seeds, eos = inputs
    config = SpeculativeConfig(num_draft_tokens=3, greedy_verification=False, seed=11)
    decoder = SpeculativeDecoder(TARGET, DRAFTS[draft], config)
    expected = outcome(lambda: autoregressive_generate(TARGET, prompts, budgets, config, eos, seeds))
    got = outcome(lambda: decoder.generate(prompts, budgets, eos, seeds=seeds))
    assert got[0] == expected[0] and (got[0] == "ok" or got == expected)
    if got[0] == "error":
        return
    rows, batched = normalize_prompts(prompts)
    outputs = got[1] if batched else [got[1]]
    limits = list(budgets) if isinstance(budgets, list) else [budgets] * len(rows)
    stops = set() if eos is None else set(eos) if isinstance(eos, list) else {eos}
    for row, limit in zip(outputs, limits):
        assert all(0 <= t < VOCAB for t in row) and len(row) <= limit
        assert not stops & set(row[:-1]) and (len(row) == limit or row[-1] in stops)
    assert decoder.generate(prompts, budgets, eos, seeds=seeds) == got[1]


special = st.sampled_from([0.0, 1.0, -2.5, 7.0, float("inf"), float("-inf"), float("nan")])


@settings(max_examples=150, deadline=None)
@given(st.integers(2 * ARGMAX_BLOCK, 3 * ARGMAX_BLOCK + 77), st.integers(1, 3),
       st.sampled_from(["randn", "-inf", "zeros"]), st.lists(st.tuples(st.integers(0, 10 ** 6), special), max_size=8), st.integers(0, 2 ** 31))
def test_blocked_argmax_is_torchs(width, rows, fill, spots, seed):
    """core.sampling.argmax gives torch's argmax: the first largest, NaN the largest, at ties
    across and within blocks, in a short last block, on rows of -inf (as screened logits are)."""
    if fill == "randn":
        logits = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    else:
        logits = torch.full((rows, width), float("-inf") if fill == "-inf" else 0.0)
    for spot, value in spots:
        logits[spot % rows, spot % width] = value
        logits[spot % rows, (spot * 7919) % width] = value  # the same value again, elsewhere: a tie
    assert torch.equal(argmax(logits), logits.argmax(-1))
    assert torch.equal(argmax(logits[None]), logits[None].argmax(-1))  # (B, T, V)
    assert torch.equal(argmax(logits[0]), logits[0].argmax(-1))  # (V,)
