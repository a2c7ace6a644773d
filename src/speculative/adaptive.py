"""Adaptive draft length: choose K at every step to maximise expected tokens per second.

The policy keeps three running estimates, all with exponential forgetting so that it
follows a workload that changes from easy to hard prompts:

- acceptance per drafted position j: P(token j accepted | tokens before it accepted);
- costs at the current batch size: a target forward of width 1 costs v1 seconds, and of
  width T >= 2 a line fitted to (T, seconds) (width 1 is apart: on CPUs a one-row
  product is a matrix-vector kernel of its own); first from probe forwards, then from
  every step; a drafted token costs d seconds;
- acceptance as a function of the draft's confidence (its probability for the token).

Expected tokens of a step with K drafts: E(K) = 1 + sum_{i=1..K} prod_{j<i} alpha_j; cost
K d + v(K + 1). K maximises E(K) / cost, and K = 0 (a plain target step) wins when
speculation cannot pay; a step with K = 1 is then still tried every `probe_every` steps
so that the estimates can recover. Within a step a row stops drafting at a token whose
confidence predicts an acceptance below break-even, (d + s) / v1: the token would cost
more than it is expected to save.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BINS = 10


@dataclass
class Costs:
    """Seconds of target forwards by width, and of one drafted token."""

    # Width 1 (a plain step).
    v1: float
    # Seconds per drafted token.
    draft: float
    # Decayed sums (weight, x, y, xx, xy) of a least-squares line through (width, seconds), width >= 2.
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)

    def add(self, width: int, seconds: float, weight: float = 1.0, decay: float = 0.95, robust: bool = True) -> None:
        """One timing; `robust` caps it at twice the current estimate, so that one stall
        (another process, a page fault) cannot switch speculation off for long."""
        if robust and (self.sums[0] > 0 or width == 1):
            seconds = min(seconds, 2 * self.verify(width))
        if width == 1:
            self.v1 = decay * self.v1 + (1 - decay) * seconds
            return
        point = (1.0, width, seconds, width * width, width * seconds)
        self.sums = [decay * s + weight * p for s, p in zip(self.sums, point)]

    def line(self) -> tuple[float, float]:
        """(intercept, slope) of the fit for widths >= 2; slope never negative."""
        n, x, y, xx, xy = self.sums
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
class AdaptivePolicy:
    # Upper bound on K.
    max_k: int
    # Prior acceptance per position before anything is observed (optimistic, so drafting is tried).
    prior: float = 0.7
    # Pseudo-observations the prior is worth.
    prior_weight: float = 2.0
    # Forgetting factor per observation (0.97: roughly the last 30 observations count).
    decay: float = 0.97
    # With K = 0 chosen, draft one token every this many steps to keep learning.
    probe_every: int = 16
    accepted: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)
    costs: dict[int, Costs] = field(default_factory=dict)
    conf_accepted: list[float] = field(default_factory=lambda: [0.0] * BINS)
    conf_reached: list[float] = field(default_factory=lambda: [0.0] * BINS)
    idle_steps: int = 0
    # True while a probe step runs: it drafts one token whatever the confidence.
    probing: bool = False

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {self.max_k}")
        self.accepted = self.accepted or [0.0] * self.max_k
        self.reached = self.reached or [0.0] * self.max_k

    def alpha(self, position: int) -> float:
        m = self.prior_weight
        return (self.accepted[position] + m * self.prior) / (self.reached[position] + m)

    def choose(self, batch: int) -> int:
        """K for the next step of a batch of this many rows (needs costs for it)."""
        costs = self.costs[batch]
        best, best_rate, expected, alive = 0, 1.0 / costs.verify(1), 1.0, 1.0
        for k in range(1, self.max_k + 1):  # E(k) grows by the chance that all k drafts are kept
            alive *= self.alpha(k - 1)
            expected += alive
            rate = expected / (k * costs.draft + costs.verify(k + 1))
            if rate > best_rate:
                best, best_rate = k, rate
        self.probing = False
        if self._break_even(costs) >= 1.0:
            best = 0  # no token could be confident enough to pay for itself
        if best == 0:
            self.idle_steps += 1
            self.probing = self.idle_steps % self.probe_every == 0
            return 1 if self.probing else 0
        self.idle_steps = 0
        return best

    @staticmethod
    def _break_even(costs: Costs) -> float:
        """Acceptance probability at which one more drafted token pays for itself."""
        return (costs.draft + costs.slope) / costs.v1

    def min_confidence(self, batch: int) -> float:
        """Draft confidence below which a row stops drafting (0 = never stop)."""
        if self.probing:
            return 0.0
        break_even = self._break_even(self.costs[batch])
        for b in range(BINS):  # the lowest bin whose acceptance reaches break-even
            if self._conf_alpha(b) >= break_even:
                return b / BINS
        return 1.0

    def _conf_alpha(self, b: int) -> float:
        centre = (b + 0.5) / BINS  # prior: a calibrated draft
        return (self.conf_accepted[b] + self.prior_weight * centre) / (self.conf_reached[b] + self.prior_weight)

    def observe(self, lengths: list[int], accepted: list[int], confidences: list[list[float]] | None) -> None:
        """Learn from one verification: per row, tokens drafted and tokens kept."""
        for length, kept in zip(lengths, accepted):
            for j in range(min(length, kept + 1)):  # positions that were reached
                self.reached[j] = self.decay * self.reached[j] + 1
                self.accepted[j] = self.decay * self.accepted[j] + (j < kept)
        if confidences is None:
            return
        for length, kept, row in zip(lengths, accepted, confidences):
            for j in range(min(length, kept + 1)):
                b = min(BINS - 1, int(row[j] * BINS))
                self.conf_reached[b] = self.decay * self.conf_reached[b] + 1
                self.conf_accepted[b] = self.decay * self.conf_accepted[b] + (j < kept)

    def observe_costs(self, batch: int, width: int, verify_seconds: float, drafted: int, draft_seconds: float,
                      weight: float = 0.1) -> None:
        """Refine the cost model of this batch size from one step's timings."""
        costs = self.costs[batch]
        costs.add(width, verify_seconds)
        if drafted:
            costs.draft = (1 - weight) * costs.draft + weight * min(draft_seconds / drafted, 2 * costs.draft)
