"""Costs shared by every decoder and engine on the same models: measured once (and once more
when warm), estimated for other batch sizes, never probed because the batch size changed."""

import pytest

from speculative import NGramProposer, SpeculativeConfig, SpeculativeDecoder, SuffixProposer, autoregressive_generate
from speculative.policy.adaptive import ESTIMATED_STEPS, Costs
from speculative.policy.costs import REPROBE_AFTER, CostBook, cost_book, estimate
from tests.helpers import perturbed, tiny


def line_costs(v1, intercept, slope, draft=0.001, widths=(2, 5)):
    costs = Costs(v1=v1, draft=draft)
    for width in widths:
        costs.add(width, intercept + slope * width, weight=3.0, robust=False)
    return costs


def test_other_batch_sizes_are_estimated_as_more_rows_of_the_known_one():
    # Batch 1: 1.4 ms for one token, 1 ms + 0.4 ms per token from two tokens on (a CPU-like line).
    known = {1: line_costs(0.0014, 0.001, 0.0004)}
    sixteen = estimate(known, 16, max_width=5)
    assert sixteen.v1 == pytest.approx(0.001 + 0.0004 * 16)  # 16 rows of width 1: 16 tokens at batch 1
    assert sixteen.verify(5) == pytest.approx(0.001 + 0.0004 * 80)
    assert sixteen.draft == pytest.approx(0.001 * sixteen.v1 / 0.0014)  # the draft scales like the target
    assert sixteen.estimated > 0
    # Between two known sizes: linear interpolation.
    known[8] = line_costs(0.004, 0.002, 0.001)
    four = estimate(known, 4, max_width=5)
    t = 3 / 7
    assert four.v1 == pytest.approx((1 - t) * 0.0014 + t * 0.004)
    assert four.verify(5) == pytest.approx((1 - t) * known[1].verify(5) + t * known[8].verify(5))


def test_a_book_measures_once_then_estimates_then_measures_once_more_when_warm():
    book = CostBook()
    calls = []

    def measure():
        calls.append(1)
        return line_costs(0.010 / len(calls), 0.008 / len(calls), 0.002 / len(calls))  # the second probe: warm

    first = book.get(4, 5, measure)
    assert len(calls) == 1 and not first.estimated
    two = book.get(2, 5, measure)
    assert len(calls) == 1 and two.estimated  # another batch size: estimated, not probed
    assert book.get(4, 5, measure) is first
    for _ in range(REPROBE_AFTER):
        first.steps += 1
    assert book.get(2, 5, measure, fresh=False) is two and len(calls) == 1  # never in the middle of a request
    assert book.get(2, 5, measure) is two and len(calls) == 2  # the warm probe, at the current size
    assert two.v1 == pytest.approx(0.005) and not two.estimated
    assert first.estimated and first.v1 < 0.010  # what the cold probe led to is estimated again
    for _ in range(3 * REPROBE_AFTER):
        two.steps += 1
    book.get(2, 5, measure)
    assert len(calls) == 2  # never a third time


def test_books_are_shared_per_pair_of_models():
    target, draft, other = tiny("decoder_only", seed=1), tiny("decoder_only", seed=2), tiny("s4d", seed=3)
    assert cost_book(target, draft) is cost_book(target, draft)
    assert cost_book(target, draft) is not cost_book(target, other)
    assert cost_book(target, None) is not cost_book(target, draft)
    assert cost_book(other, None) is not cost_book(target, None)


def test_a_book_without_a_draft_model_never_probes_and_learns_from_the_steps():
    book = CostBook(probe=False)
    costs = book.get(1, 25, lambda: pytest.fail("a probe ran"))
    assert costs.verify(1) == costs.verify(2) == costs.verify(25)  # before any timing every width is alike
    costs.add(25, 0.030)  # the first step: 24 drafts
    assert costs.v1 == pytest.approx(0.030)  # a one-token forward costs at most that, until one is timed
    costs.add(13, 0.020)  # the steps' widths give the line
    assert costs.verify(25) == pytest.approx(0.030) and costs.verify(19) == pytest.approx(0.025)
    costs.add(1, 0.012)  # the first one-token step replaces the guess
    assert costs.v1 == pytest.approx(0.012)
    costs.add(1, 0.010)  # later ones are averaged in (decayed, as into a probed v1)
    assert costs.v1 == pytest.approx(0.012 + (0.010 - 0.012) / (0.95 + 1))
    assert book.get(2, 25, lambda: pytest.fail("a probe ran")).v1_weight == 0  # nothing known yet: unmeasured
    costs.estimated = 0  # after ESTIMATED_STEPS observed steps, other sizes are estimated from it
    assert book.get(4, 25, None).estimated == ESTIMATED_STEPS and book.probes == 0
    assert cost_book(tiny("decoder_only", seed=4), None).probe is False


DRAFTS = {"ngram": (lambda target: NGramProposer(num_draft_tokens=6), {}),
          "suffix": (lambda target: SuffixProposer(num_draft_tokens=6), {}),
          "ngram tree": (lambda target: NGramProposer(num_draft_tokens=6), {"tree_top_k": 3, "tree_max_tokens": 12}),
          "negative control: a draft model": (lambda target: perturbed(target, 0.05, seed=8), {})}


@pytest.mark.parametrize("kind", DRAFTS)
def test_drafts_without_a_model_run_no_probe_forward(kind, monkeypatch):
    """Counted target forwards: one prefill and one per step, nothing else, however many
    generations run; a draft model's first generation adds its probe's forwards."""
    target = tiny("decoder_only", seed=6)  # a model of its own: a fresh cost book
    make, options = DRAFTS[kind]
    decoder = SpeculativeDecoder(target, make(target), SpeculativeConfig(num_draft_tokens=6, **options))
    prompts = [[5, 6, 7, 8, 9] * 4, [1, 2, 3] * 5 + [4]]
    expected = autoregressive_generate(target, prompts, 30)
    forwards = []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *args, **kwargs: forwards.append(1) or forward(*args, **kwargs))
    for _ in range(3):
        assert decoder.generate(prompts, 30) == expected
    extra = len(forwards) - 3 - decoder.stats.target_forwards  # beyond a prefill per generation and the steps
    assert decoder.stats.drafted > 0
    assert extra > 0 if kind.startswith("negative") else extra == 0
