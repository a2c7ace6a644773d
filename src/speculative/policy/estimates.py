"""What the adaptive policy learns, apart from how it plans with it: the costs of target
and draft forwards at one batch size (`Costs`), and the acceptance of one source of drafts
per drafted position (`Acceptance`). Both forget exponentially, so that they follow a
workload that changes; adaptive.py says how they are learned and used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Observed steps after which an estimated cost (from other batch sizes) counts as measured.
ESTIMATED_STEPS = 4


@dataclass
class Costs:
    """Seconds of target forwards by width, and of one draft-model forward, at one batch size."""

    # Width 1 (a plain step).
    v1: float
    # Seconds per draft-model forward over the batch (one drafted position for every row).
    draft: float
    # Decayed sums (weight, x, y, xx, xy) of a least-squares line through (width, seconds), width >= 2.
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)
    # Observed steps left before an estimate made from other batch sizes counts as measured:
    # until then timings are taken as they come, and it is not used to estimate others.
    estimated: int = 0
    # Steps observed at this batch size.
    steps: int = 0
    # Decayed weight of the one-token timings in v1: 20 moves it 5% per timing; 0 = none
    # yet, v1 a guess (what the cheapest wider forward cost) that the first one replaces.
    v1_weight: float = 20.0
    # Widths whose first step timing has come (and was left out, `observe`).
    seen: set[int] = field(default_factory=set)

    @classmethod
    def unmeasured(cls) -> "Costs":
        """Costs before any timing (drafts without a model, which are never probed): every
        width costs one unit, so drafting is tried, until the steps' own timings come in
        (taken as they come for the first ESTIMATED_STEPS, as an estimate's are)."""
        return cls(v1=1.0, draft=0.0, v1_weight=0.0, estimated=ESTIMATED_STEPS)

    def renew(self, other: "Costs") -> None:
        """Take another's figures in place (every policy holding this object sees them)."""
        self.v1, self.draft, self.sums, self.estimated = other.v1, other.draft, list(other.sums), other.estimated
        self.v1_weight = other.v1_weight

    def observe(self, width: int, seconds: float) -> None:
        """One step's timing. A width's first is left out: the first forward of a width in
        a process builds what later ones reuse (kernels for a new shape, a lazily built
        output-layer screen; Gemma 3 270M's first verify forward took 365 ms, the next 95).
        Counted, it made the line's slope 10x too steep, and drafting stayed at one token
        for 60 steps: the widths that would have corrected it were never tried."""
        if width in self.seen:
            self.add(width, seconds)
        self.seen.add(width)

    def add(self, width: int, seconds: float, weight: float = 1.0, decay: float = 0.95, robust: bool = True) -> None:
        """One timing; `robust` caps it at twice the current estimate, so that one stall
        (another process, a page fault) cannot switch speculation off for long."""
        if robust and not self.estimated and (self.sums[0] > 0 or width == 1):
            seconds = min(seconds, 2 * self.verify(width))
        if width == 1:
            self.v1_weight = decay * self.v1_weight + weight
            self.v1 += (seconds - self.v1) * weight / self.v1_weight
            return
        if not self.v1_weight:  # no one-token forward timed yet: one costs at most this one
            self.v1 = min(self.v1, seconds) if self.sums[0] > 0 else seconds
        point = (1.0, width, seconds, width * width, width * seconds)
        self.sums = [decay * s + weight * p for s, p in zip(self.sums, point)]

    def widths_vary(self) -> bool:
        """Whether the widths (>= 2) timed lately differ enough to give the line a slope
        (weighted variance of at least 0.1: old widths fade with the timings' decay)."""
        n, x, _, xx, _ = self.sums
        return n > 0 and (n * xx - x * x) / (n * n) >= 0.1

    def line(self) -> tuple[float, float]:
        """(intercept, slope) of the fit for widths >= 2; slope never negative; flat at v1
        before any such width is timed."""
        n, x, y, xx, xy = self.sums
        if n <= 0:
            return self.v1, 0.0
        spread = n * xx - x * x
        slope = max(0.0, (n * xy - x * y) / spread) if spread > 1e-12 else 0.0
        return (y - slope * x) / n, slope

    @property
    def slope(self) -> float:
        """Seconds per extra token of width."""
        return self.line()[1]

    def verify(self, width: int) -> float:
        if width == 1:
            return self.v1
        intercept, slope = self.line()
        return max(self.v1, intercept + slope * width)


@dataclass
class Acceptance:
    """Decayed counts of drafted positions reached and kept, one source of drafts."""

    longest_draft: int
    # Prior acceptance per position before anything is observed (optimistic, so drafting is tried).
    prior: float = 0.7
    # Pseudo-observations the prior is worth.
    prior_weight: float = 2.0
    # Forgetting factor per observation (0.97: roughly the last 30 observations count).
    decay: float = 0.97
    accepted: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)
    # Rows allowed position j that had drafted every position before it, and of those the
    # ones that drafted j too (a draft model stops early at a token of low confidence).
    asked: list[float] = field(default_factory=list)
    continued: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("accepted", "reached", "asked", "continued"):
            setattr(self, name, getattr(self, name) or [0.0] * self.longest_draft)

    def alphas(self) -> list[float]:
        """Acceptance per position. The prior of a position is `prior` or the estimate of
        the one before it, whichever is higher (a draft right so far tends to stay right):
        positions seldom reached, because the plan kept drafts short, are not held down."""
        values, previous = [], self.prior
        for accepted, reached in zip(self.accepted, self.reached):
            prior = max(self.prior, previous)
            previous = (accepted + self.prior_weight * prior) / (reached + self.prior_weight)
            values.append(previous)
        return values

    def drafting(self) -> list[float]:
        """Per position j, the chance that a row allowed j drafts it, given it drafted
        every position before (1 until a stop is seen)."""
        m = self.prior_weight
        return [(c + m) / (a + m) for c, a in zip(self.continued, self.asked)]

    def expected(self) -> list[float]:
        """E(n) for n = 0..longest_draft: tokens a row allowed n drafts gets (the target adds one)."""
        totals, alive = [1.0], 1.0
        for alpha, drafts in zip(self.alphas(), self.drafting()):
            alive *= alpha * drafts
            totals.append(totals[-1] + alive)
        return totals

    def forwards(self, width: int, rows: int) -> float:
        """Expected draft-model forwards for `rows` rows allowed `width` drafts: the model
        runs position i while any row still drafts."""
        total, still = 0.0, 1.0
        for i, drafts in enumerate(self.drafting()[:width]):
            if i:
                total += 1 - (1 - still) ** rows
            still *= drafts
        return 1.0 + total if width else 0.0

    def observe_stops(self, limits: list[int], lengths: list[int]) -> None:
        for limit, length in zip(limits, lengths):
            for j in range(min(limit, length + 1)):
                self.asked[j] = self.decay * self.asked[j] + 1
                self.continued[j] = self.decay * self.continued[j] + (j < length)

    def observe(self, lengths: list[int], accepted: list[int]) -> None:
        for length, kept in zip(lengths, accepted):
            for j in range(min(length, kept + 1)):  # positions that were reached
                self.reached[j] = self.decay * self.reached[j] + 1
                self.accepted[j] = self.decay * self.accepted[j] + (j < kept)
