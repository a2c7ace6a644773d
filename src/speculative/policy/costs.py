"""What forwards cost, measured once per pair of models in the process and shared.

The adaptive policy plans from the seconds of a target forward by width and of a draft
forward, at the batch size it plans for. Drafts without a model (n-gram, suffix and
lookup trees) are never probed: every step is a target forward of a known width, and its
timing is all the policy needs (`Costs.unmeasured`, `AdaptivePolicy`); a probe costs a
short request a tenth of its time or more (6 forwards, 0.35-0.5 s on Gemma 3 270M). A draft
model's cost must be known before its first step: probe forwards measure it, but on a
large model they cost seconds, so they run only when a `CostBook` knows no batch size at
all: once per (target, draft) pair, dtype, thread count and device in the process, at the
batch size of the first step that needs them. Every later decoder or engine on those
models reuses the book, and a batch size never seen is estimated from the sizes the book
knows, never probed:

- between two known sizes, by linear interpolation;
- beyond them, by treating a forward of B rows of width T as one of B*T rows at the
  nearest known size B0, i.e. of width T * B / B0 there (matrix products scale with the
  rows they multiply; below one known row, a forward costs what one row does).

Estimates are refined by the steps that follow (`AdaptivePolicy.observe_costs`) and serve
to estimate other sizes once a few steps have been observed.

The first forwards of a process can run many times slower than later ones (allocations,
page faults, a busy machine): the book probes a second time once it has seen REPROBE_AFTER
steps, at the first step of a request after that (never in the middle of one), and that
warm probe replaces everything the first one led to.
"""

from __future__ import annotations

import threading
import time
import weakref

import torch

from .estimates import ESTIMATED_STEPS, Costs

# Books by target model, then by (draft model id, dtype, threads, device).
_BOOKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# Observed steps after which the book's first probe is made again.
REPROBE_AFTER = 32
# Decoders made in several threads at once get one book per pair, not one each.
_BOOKS_LOCK = threading.Lock()


class CostBook:
    """Costs by batch size for one pair of models (all policies on them share it)."""

    def __init__(self, draft=None, probe: bool = True):
        self.costs: dict[int, Costs] = {}
        self.probes = 0
        # False: never measure, learn from the steps (drafts without a model).
        self.probe = probe
        self._draft = None if draft is None else weakref.ref(draft)

    def draft_alive(self, draft) -> bool:
        return (self._draft is None) == (draft is None) and (draft is None or self._draft() is draft)

    def get(self, batch: int, max_width: int, measure, fresh: bool = True) -> Costs:
        """Costs at this batch size: known, estimated from known sizes, or (the book being
        empty) measured by `measure()`, or left to the steps when the book does not probe.
        The warm probe waits for a `fresh` step (no running request has a token yet)."""
        costs = self.costs.get(batch)
        if costs is None:
            known = {b: c for b, c in self.costs.items() if not c.estimated}
            if known:
                costs = estimate(known, batch, max_width)
            else:
                costs = self._probe(measure) if self.probe else Costs.unmeasured()
            self.costs[batch] = costs
        elif fresh and self.probes == 1 and sum(c.steps for c in self.costs.values()) >= REPROBE_AFTER:
            costs.renew(self._probe(measure))  # warm now: start again from this probe alone
            for size, other in self.costs.items():
                if other is not costs:
                    other.renew(estimate({batch: costs}, size, max_width))
        return costs

    def _probe(self, measure) -> Costs:
        self.probes += 1
        return measure()


def cost_book(target, draft) -> CostBook:
    """The process-wide book of this target and draft model (None: lookup or no drafting,
    whose costs are learned from the steps, never probed)."""
    key = (None if draft is None else id(draft), _dtype(target), torch.get_num_threads(), str(target.device))
    with _BOOKS_LOCK:
        books = _BOOKS.setdefault(target, {})
        book = books.get(key)
        if book is None or not book.draft_alive(draft):  # an id reused by a new draft model
            book = books[key] = CostBook(draft, probe=draft is not None)
    return book


def _dtype(model):
    parameters = getattr(model, "parameters", None)
    if callable(parameters):
        first = next(iter(parameters()), None)
        if first is not None:
            return first.dtype
    return getattr(model, "dtype", None)


def estimate(known: dict[int, Costs], batch: int, max_width: int) -> Costs:
    """Costs at `batch` from those at other batch sizes (see the module docstring)."""
    widths = sorted({2, max(3, max_width)})
    below = max((b for b in known if b < batch), default=None)
    above = min((b for b in known if b > batch), default=None)
    if below is not None and above is not None:
        t = (batch - below) / (above - below)
        low, high = known[below], known[above]
        v1 = (1 - t) * low.v1 + t * high.v1
        points = [(1 - t) * at_width(low, w) + t * at_width(high, w) for w in widths]
        draft = (1 - t) * low.draft + t * high.draft
    else:
        near = below if below is not None else above
        costs, scale = known[near], batch / near
        v1 = at_width(costs, scale)
        points = [at_width(costs, w * scale) for w in widths]
        draft = costs.draft * v1 / costs.v1 if costs.v1 > 0 else costs.draft
    estimated = Costs(v1=v1, draft=draft, estimated=ESTIMATED_STEPS)
    for width, seconds in zip(widths, points):
        estimated.add(width, seconds, robust=False)
    return estimated


def at_width(costs: Costs, width: float) -> float:
    """Seconds of a forward of (possibly fractional) `width` at the batch size of `costs`."""
    if width <= 1:
        return costs.v1
    intercept, slope = costs.line()
    wide = max(costs.v1, intercept + slope * max(width, 2.0))
    if width >= 2:
        return wide
    return costs.v1 + (width - 1) * (wide - costs.v1)  # between the one-row kernel and the line


def measure(target, state, sequences: list[list[int]], proposer, longest_draft: int, clock=time.perf_counter,
            argmax_rows: list[bool] | None = None) -> Costs:
    """Time target forwards of width 1, 2 and K+1 on the running state (each then rolled
    back) and one draft forward: the probe behind a book's first entry. `argmax_rows`: as the
    steps pass them to a target that takes them (a screened output layer costs less)."""
    lengths = list(state.lengths)
    last = torch.tensor([[row[-1]] for row in sequences], device=target.device)
    widths = sorted({1, 2, longest_draft + 1})
    screen = {} if argmax_rows is None else {"argmax_rows": argmax_rows}
    seconds = {}
    for width in widths * 2:  # twice each: the first call may allocate
        started = clock()
        target.forward(last.repeat(1, width), state, **screen)
        synchronize(target.device)
        elapsed = clock() - started
        seconds[width] = min(seconds.get(width, elapsed), elapsed)
        target.rollback(state, lengths)
    # A stall can only slow a timing down: a wider forward costs at least a one-token one, and
    # at most that many one-token forwards.
    seconds[1] = min(seconds.values())
    seconds = {width: min(value, width * seconds[1]) for width, value in seconds.items()}
    draft = 0.0
    if proposer.model is not None:
        for _ in range(2):  # the faster of two, as for the target
            started = clock()
            proposer.probe(sequences)
            synchronize(target.device)
            draft = min(draft or float("inf"), clock() - started)
    costs = Costs(v1=seconds[1], draft=draft)
    for width in widths[1:]:
        costs.add(width, seconds[width], weight=3.0, robust=False)  # worth a few observed steps
    return costs


def synchronize(device) -> None:
    """Wait for queued GPU work, so that wall-clock timings mean something there too."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
