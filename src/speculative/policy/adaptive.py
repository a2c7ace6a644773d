"""Adaptive drafting: plan every step of the whole batch to maximise tokens per second.

The policy keeps running estimates, all with exponential forgetting so that it follows a
workload that changes from easy to hard prompts:

- acceptance per drafted position j, P(token j kept | tokens before it kept), one table
  for the draft model, one for prompt lookup matches long enough to be preferred and one
  for the shorter ones (a one-token n-gram is right far less often: pooled, their
  estimates made lookup drafts of a single matched token look as good as a draft head's);
- costs at each batch size: a target forward of width 1 costs v1 seconds, and of width
  T >= 2 a line fitted to (T, seconds) (width 1 is apart: on CPUs a one-row product is a
  matrix-vector kernel of its own); one forward of the draft model over the batch costs d
  seconds. A draft model's costs come first from probe forwards, measured once per pair
  of models in the process, or estimated from other batch sizes (`costs.CostBook`), then
  from every step. Drafts without a model (lookup) learn them from the steps alone: every
  step is a target forward of a known width, timed anyway (a width's first, which builds
  kernels, is left out: `Costs.observe`). Until a step is timed every width costs the
  same (drafting is tried); while recent steps all had one width, the next drafting step
  takes half of it, so that the line gets a slope; and a model-free
  policy that has drafted `probe_every` steps without ever timing a one-token forward
  takes one plain step, so that v1 is known where deciding whether to draft at all;
- acceptance of the draft model as a function of its confidence (its probability for
  the token).

A step is planned for the batch as a whole, because the batch shares one verify forward
as wide as its longest draft and one draft-model forward per drafted position. Knowing
each row's lookup match (free to find), the plan picks the step's K (the longest draft
any row takes) and whether the draft model runs, maximising expected tokens over the whole
batch divided by the step's cost, v(1 + widest draft) + K d. A row expects
E(n) = 1 + sum_{i=1..n} prod_{j<i} alpha_j tokens from n drafts. K = 0 (a plain target
step) wins when speculation cannot pay, as happens on CPUs once the batch is large
enough that a wider forward costs as much as the tokens it saves; a probe step is then
still tried every `probe_every` steps so that the estimates can recover. A draft model
that has not read a row's prompt waits while lookup drafts (PROBE_UNREAD). Within a step a
model row stops drafting at a token under the confidence floor: just above the most
confident bin whose tokens were kept less often than s / v1. The draft forward that made
the token is spent by the time its confidence is seen, so leaving it out saves only its
verify width; how far drafting should go is the plan's K. Bins start optimistic, so
the floor rises on evidence only; every `probe_every` model steps one drafts without it,
to keep learning the bins under it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from .estimates import ESTIMATED_STEPS, Acceptance, Costs
from .tree_budget import TreeBudget

__all__ = ["AdaptivePolicy", "FixedPolicy", "Plan", "Costs", "Acceptance", "ESTIMATED_STEPS", "BINS"]

BINS = 10


@dataclass
class Plan:
    """What one step drafts: every row at most `k` tokens (the step's K); the draft model
    runs for the rows without a lookup match only if `use_model`."""

    k: int
    use_model: bool
    # Draft confidence below which a model row stops drafting (0 = never stop; None = the
    # draft need not report confidences, nobody learns from them).
    min_confidence: float | None = 0.0
    # Per row, whether it takes its lookup draft when the model runs (None: the rows whose
    # match is `preferred`). A strong draft model beats a short lookup match.
    lookup_rows: list[bool] | None = None

    @property
    def width(self) -> int:
        """The old name of `k`."""
        warnings.warn("Plan.width is now Plan.k (the step's K)", DeprecationWarning, stacklevel=2)
        return self.k

    def takes_lookup(self, row: int, has_lookup: bool, preferred: bool) -> bool:
        """Whether row `row` drafts by lookup this step."""
        if not has_lookup:
            return False
        if not self.use_model:
            return True
        return preferred if self.lookup_rows is None else self.lookup_rows[row]


# A draft model with more than PROBE_UNREAD tokens of a row to read first (a prompt it has
# not seen) neither probes nor drafts once lookup has drafted, until lookup has found nothing
# for CATCH_UP_AFTER steps in a row: reading the prompt costs a prefill (3-4 s for Qwen2.5-Coder 0.5B on 850 tokens),
# wasted where lookup drafts the request (grounded editing).
PROBE_UNREAD, CATCH_UP_AFTER = 64, 4


@dataclass
class AdaptivePolicy:
    # Upper bound on the draft length (SpeculativeConfig.longest_draft).
    longest_draft: int
    # Upper bound on the draft model's drafts, K (None: longest_draft); lookup matches, free to
    # draft, may reach longest_draft (SpeculativeConfig.lookup_draft_tokens).
    num_draft_tokens: int | None = None
    # With no drafting chosen, draft one token every this many steps to keep learning; and
    # every this many model steps, draft without the confidence floor.
    probe_every: int = 16
    model: Acceptance = None
    lookup: Acceptance = None  # lookup matches long enough to be preferred to the model
    weak_lookup: Acceptance = None  # the shorter ones
    costs: dict[int, Costs] = field(default_factory=dict)
    conf_accepted: list[float] = field(default_factory=lambda: [0.0] * BINS)
    conf_reached: list[float] = field(default_factory=lambda: [0.0] * BINS)
    # Steps since drafting ran at all, and since the draft model ran where it could have.
    idle_steps: int = 0
    model_idle_steps: int = 0
    # Model steps since one drafted without the confidence floor.
    floor_steps: int = 0
    # Steps in a row without a lookup draft since lookup last drafted while the draft model
    # had a prompt to read (CATCH_UP_AFTER: lookup has not drafted since the model read one).
    lookup_idle_steps: int = CATCH_UP_AFTER
    # Drafting steps in a row, while no one-token forward has been timed (unmeasured costs).
    busy_steps: int = 0
    # Where costs come from for a batch size not planned yet: a `costs.CostBook` shared by
    # every policy on the same models; None: measured by each policy itself.
    book: object = None
    # Node budgets of tree steps (tree_budget.py; None: the engine drafts chains).
    tree: TreeBudget | None = None

    @classmethod
    def for_config(cls, config, book) -> "AdaptivePolicy":
        """The policy of a configuration: K from num_draft_tokens, tree budgets up to tree_max_tokens."""
        tree = TreeBudget(config.tree_max_tokens, config.num_draft_tokens) if config.trees else None
        return cls(longest_draft=config.longest_draft, num_draft_tokens=config.num_draft_tokens, book=book, tree=tree)

    def prepare(self, batch: int, measure, fresh: bool = True) -> None:
        """Have costs for a batch of this many rows before planning it: from the book (which
        measures only when it knows no batch size at all, and once more when warm, only
        where a draft model needs it and only in a `fresh` step, before any of the rows
        has a token) or, without a book, `measure()`."""
        widest = max(self.longest_draft, self.tree.max_nodes if self.tree else 0) + 1
        if self.book is not None:
            self.costs[batch] = self.book.get(batch, widest, measure, fresh)
        elif batch not in self.costs:
            self.costs[batch] = measure()

    def __post_init__(self) -> None:
        if self.longest_draft < 1:
            raise ValueError(f"longest_draft must be >= 1, got {self.longest_draft}")
        self.num_draft_tokens = min(self.num_draft_tokens or self.longest_draft, self.longest_draft)
        self.model = self.model or Acceptance(self.longest_draft)
        self.lookup = self.lookup or Acceptance(self.longest_draft)
        self.weak_lookup = self.weak_lookup or Acceptance(self.longest_draft)

    def plan_tree(self, batch: int, sources: list[str | None], lookup_sizes: list[int],
                  max_drafts: list[int]) -> int:
        """The node budget of a tree step (`TreeBudget.plan`; 0 where v1 must be timed)."""
        node_budget = self.tree.plan(self.costs[batch], sources, lookup_sizes, max_drafts)
        return 0 if self._time_one_token(self.costs[batch], node_budget > 0) else node_budget

    def observe_tree(self, batch: int, sources: list[str | None], paths: list[list[int]], depths: list[int],
                     max_drafts: list[int], node_budget: int, verify_width: int, verify_seconds: float,
                     draft_forwards: int, draft_seconds: float) -> None:
        """A tree step: each row's accepted path, its tree's depth and deepest allowed (`TreeBudget.observe`)."""
        self.tree.observe(sources, paths, node_budget, draft_forwards, draft_seconds, depths, max_drafts)
        self.observe_costs(batch, verify_width, verify_seconds, 0, 0.0)

    @property
    def plans_trees(self) -> bool:
        """Whether it plans node budgets (made for a configuration with trees)."""
        return self.tree is not None

    def plan(self, batch: int, lookup_lengths: list[int], preferred: list[bool], max_drafts: list[int],
             has_model: bool, model_unread: int = 0) -> Plan:
        """The next step of a batch of this many rows (needs costs for it). Row b has a
        lookup draft of lookup_lengths[b] tokens (`preferred` to the draft model's when its
        match is long enough) and may draft at most max_drafts[b] tokens; the draft model
        has up to `model_unread` tokens of a row to read before it can draft."""
        costs = self.costs[batch]
        if has_model and model_unread > PROBE_UNREAD:  # the model would first read a prompt
            self.lookup_idle_steps = self.lookup_idle_steps + 1 if not any(lookup_lengths) else 0
            has_model = self.lookup_idle_steps >= CATCH_UP_AFTER
        else:
            self.lookup_idle_steps = CATCH_UP_AFTER  # until lookup drafts, nothing to wait for
        best, best_widest = self._best_plan(costs, batch, lookup_lengths, preferred, max_drafts, has_model)
        timing = self._timing_step(costs, best, best_widest)
        if timing is not None:
            return timing
        could_use_model = has_model and any(not p and m > 0 for p, m in zip(preferred, max_drafts))
        self.model_idle_steps = self.model_idle_steps + 1 if could_use_model and not best.use_model else 0
        self.idle_steps = self.idle_steps + 1 if best.k == 0 else 0
        probe_model = could_use_model and self.model_idle_steps >= self.probe_every
        if probe_model or self.idle_steps >= self.probe_every:  # keep learning what is not used
            self.idle_steps = self.model_idle_steps = 0
            return Plan(max(1, best.k), probe_model or best.use_model)
        if best.use_model:
            self.floor_steps += 1
            # Now and then a model step drafts without the confidence floor, so that the bins
            # under it are observed too: a draft less confident than it is right (a draft head
            # trained on soft targets) would otherwise never be drafted past such a token.
            if self.floor_steps >= self.probe_every:
                self.floor_steps = 0
            else:
                best.min_confidence = self._min_confidence(costs)
        return best

    def _best_plan(self, costs: Costs, batch: int, lookup_lengths: list[int], preferred: list[bool],
                   max_drafts: list[int], has_model: bool) -> tuple[Plan, int]:
        """The plan of the highest expected tokens per second (a plain step unless drafting
        beats it), and the longest draft it takes."""
        model_pays = has_model and self._break_even(costs) < 1.0  # else no model token could pay
        best, best_rate, best_widest = Plan(0, False), batch / costs.verify(1), 0
        expected = self.model.expected(), self.lookup.expected(), self.weak_lookup.expected()
        for use_model in (False, True) if model_pays else (False,):
            for k in range(1, self.longest_draft + 1):
                tokens, widest, model_length, model_rows, lookup_rows = self._expect(
                    k, use_model, expected, lookup_lengths, preferred, max_drafts, self.num_draft_tokens)
                if widest == 0:
                    continue
                drafting = self.model.forwards(model_length, model_rows) * costs.draft
                rate = tokens / (costs.verify(widest + 1) + drafting)
                if rate > best_rate:
                    best, best_rate = Plan(k, use_model and model_length > 0, lookup_rows=lookup_rows), rate
                    best_widest = widest
        return best, best_widest

    @staticmethod
    def _expect(k: int, use_model: bool, expected, lookup_lengths: list[int], preferred: list[bool],
                max_drafts: list[int], model_cap: int):
        """Expected tokens of a step of this K over the batch (the draft model drafting at most
        `model_cap`); its longest draft, the draft model's longest draft and how many rows it
        drafts for; per row, whether it takes lookup."""
        e_model, e_strong, e_weak = expected
        tokens, widest, model_length, model_rows, lookup_rows = 0.0, 0, 0, 0, []
        for length, lookup_first, most in zip(lookup_lengths, preferred, max_drafts):
            by_model, by_lookup = min(k, most, model_cap), min(k, length)
            e_lookup = e_strong if lookup_first else e_weak
            # A preferred lookup match drafts unless the model is expected to do better.
            take_lookup = not use_model or lookup_first and e_lookup[by_lookup] >= e_model[by_model]
            lookup_rows.append(take_lookup)
            if take_lookup:
                tokens += e_lookup[by_lookup]
                widest = max(widest, by_lookup)
            else:
                tokens += e_model[by_model]
                model_length, model_rows = max(model_length, by_model), model_rows + (by_model > 0)
                widest = max(widest, by_model)
        return tokens, widest, model_length, model_rows, lookup_rows

    def _timing_step(self, costs: Costs, best: Plan, widest: int) -> Plan | None:
        """A step that times what costs learned from steps alone still lack (the module
        docstring): half the widest draft while recent widths never varied, or once a plain
        step."""
        if widest >= 2 and costs.sums[0] > 0 and not costs.widths_vary():
            return Plan(widest // 2, best.use_model, lookup_rows=best.lookup_rows)
        return Plan(0, False) if self._time_one_token(costs, best.k > 0) else None

    def _time_one_token(self, costs: Costs, drafting: bool) -> bool:
        """Whether this step should be plain: drafting has gone on for `probe_every` steps
        and no one-token forward was ever timed (only costs learned from steps lack one)."""
        self.busy_steps = self.busy_steps + 1 if drafting and not costs.v1_weight else 0
        if self.busy_steps > self.probe_every:
            self.busy_steps = 0
            return True
        return False

    @staticmethod
    def _break_even(costs: Costs) -> float:
        """Acceptance probability at which one more drafted position pays for itself."""
        return (costs.draft + costs.slope) / costs.v1

    def _min_confidence(self, costs: Costs) -> float:
        """Just above the most confident bin whose tokens are kept less often than they cost
        in verify width, s / v1 (0 where none is): with the bins' optimistic prior, the floor
        rises on evidence only. (Charged (d + s) / v1 as well, the draft forward that had
        already made the token, the floor stopped a third of the S4D draft's rows before
        their first token: adaptive 0.90x plain decoding against K = 1's 1.07x.)"""
        break_even = costs.slope / costs.v1
        failing = [b for b in range(BINS) if self._conf_alpha(b) < break_even]
        return (max(failing) + 1) / BINS if failing else 0.0

    def _conf_alpha(self, b: int) -> float:
        """Acceptance of drafted tokens of confidence bin b. The prior is optimistic, as the
        acceptance tables' is: a bin not yet seen is drafted, and learned, rather than left
        under the floor. (A calibrated prior, the bin's centre, kept an underconfident head
        under a floor of 0.1 for a third of its steps, learning only from the floor-free
        ones: tau 3.46 against 3.74 without the floor, on default-head's benchmark.)"""
        prior, weight = max((b + 0.5) / BINS, self.model.prior), self.model.prior_weight
        return (self.conf_accepted[b] + weight * prior) / (self.conf_reached[b] + weight)

    def observe_confidence(self, lengths: list[int], accepted: list[int], confidences: list[list[float]]) -> None:
        """Learn acceptance by the draft model's confidence from its drafted tokens."""
        decay = self.model.decay
        for length, kept, row in zip(lengths, accepted, confidences):
            for j in range(min(length, kept + 1)):
                b = min(BINS - 1, int(row[j] * BINS))
                self.conf_reached[b] = decay * self.conf_reached[b] + 1
                self.conf_accepted[b] = decay * self.conf_accepted[b] + (j < kept)

    def observe_costs(self, batch: int, verify_width: int, verify_seconds: float, draft_forwards: int,
                      draft_seconds: float, weight: float = 0.1) -> None:
        """Refine the cost model of this batch size from one step's timings."""
        costs = self.costs[batch]
        costs.observe(verify_width, verify_seconds)
        costs.estimated = max(0, costs.estimated - 1)
        costs.steps += 1
        if draft_forwards:
            per_forward = min(draft_seconds / draft_forwards, 2 * costs.draft)
            costs.draft = (1 - weight) * costs.draft + weight * per_forward

    def observe_step(self, batch: int, proposal, limits: list[int], accepted: list[int], verify_seconds: float,
                     draft_forwards: int, draft_seconds: float, preferred: list[bool] | None = None) -> None:
        """Learn from one step: lookup rows teach the lookup's acceptance (of preferred
        matches or of shorter ones: `preferred`, as planned; None: all preferred), the
        others the draft model's and where it stopped short of its limit; then the step's costs."""
        free = proposal.free or [False] * len(accepted)
        preferred = preferred or [True] * len(accepted)
        for table, strong in ((self.lookup, True), (self.weak_lookup, False)):
            rows = [i for i, f in enumerate(free) if f and preferred[i] == strong]
            table.observe([proposal.lengths[i] for i in rows], [accepted[i] for i in rows])
        model = [i for i, f in enumerate(free) if not f and limits[i] > 0]
        self.model.observe([proposal.lengths[i] for i in model], [accepted[i] for i in model])
        self.model.observe_stops([limits[i] for i in model], [proposal.lengths[i] for i in model])
        if proposal.confidences is not None:
            self.observe_confidence([proposal.lengths[i] for i in model], [accepted[i] for i in model],
                                    [proposal.confidences[i] for i in model])
        self.observe_costs(batch, proposal.tokens.shape[1] + 1, verify_seconds, draft_forwards, draft_seconds)


@dataclass
class FixedPolicy:
    """Draft K tokens (trees: `nodes`) every step (each row at most what it can still use):
    the plan when adaptive drafting is off, and whenever a seeded sampled request runs
    (adaptive K follows timings, which would make its tokens vary from run to run)."""

    k: int
    nodes: int = 0

    plans_trees = True

    def plan_tree(self, batch: int, sources, lookup_sizes, max_drafts) -> int:
        return self.nodes

    def observe_tree(self, *step) -> None:
        pass

    def prepare(self, batch: int, measure, fresh: bool = True) -> None:
        pass  # plans without costs

    def plan(self, batch: int, lookup_lengths: list[int], preferred: list[bool], max_drafts: list[int],
             has_model: bool, model_unread: int = 0) -> Plan:
        return Plan(self.k, has_model, min_confidence=None)

    def observe_step(self, *step) -> None:
        pass  # learns nothing
