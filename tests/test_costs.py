"""Costs shared by every decoder and engine on the same models: measured once (and once more
when warm), estimated for other batch sizes, never probed because the batch size changed."""

import pytest

from speculative.adaptive import Costs
from speculative.costs import REPROBE_AFTER, CostBook, cost_book, estimate
from helpers import tiny


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
