"""Adaptive tree budgets: how many nodes a tree step drafts, from the measured cost of verify width.

A tree's nodes come best first, so the tree of budget n is the first n nodes of a larger
one (tree.py: lookup trees and a draft model's both rank their nodes). One verified tree
therefore tells what every smaller budget would have kept: the accepted path's nodes of
index < n (indices grow along a path). Per draft source (the draft model, lookup) the
policy keeps the decayed mean of tokens kept at every budget n, and plans each step's
budget for the whole batch, which shares one verify forward as wide as its largest tree:

    rate(n) = sum over rows of (1 + kept(source, n)) / (verify(1 + widest) + forwards(n) * draft)

verify(width) is the adaptive policy's cost line at this batch size (adaptive.Costs,
probed up to the widest tree); a draft model's tree costs one draft forward per depth,
min(n, deepest tree) of them, each `draft` seconds (learned from tree steps); n = 0 is a plain
step. Budgets above the largest one observed keep their prior (a chain's: each position
kept with probability PRIOR); every `probe_every` steps one drafts the full budget, so
that they are learned. A lookup tree kept whole (its accepted path reaches its deepest
node) that was shallower than its max draft (the deepest it could go) may have been cut
by its node budget: it says nothing about larger budgets, so the next step drafts at
least twice as many nodes. Text
copied from the prompt then climbs to the full budget at once (waiting for the probe, a
replay of Gemma 3 270M's grounded prompts sat at 7-8 of 24 nodes, each tree kept whole).
A draft model's trees do not grow so: each depth costs it a forward, which the plan
weighs (forced growth cost the shipped target's head trees 1.30x -> 1.18x). Nor does a
budget whose expected rate is below a plain step's: where verify width is dear, trees of
one node kept whole doubled to 12 and back every few steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODEL, LOOKUP = "model", "lookup"
# Prior acceptance per position (optimistic, so that drafting is tried), and what it weighs.
PRIOR = 0.7
PRIOR_WEIGHT = 2.0
DECAY = 0.97


@dataclass
class KeptByBudget:
    """Decayed mean of tokens kept, per node budget n = 0..max_nodes, for one draft source."""

    max_nodes: int
    max_depth: int
    sums: list[float] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sums = self.sums or [0.0] * (self.max_nodes + 1)
        self.weights = self.weights or [0.0] * (self.max_nodes + 1)

    def observe(self, path: list[int], node_budget: int) -> None:
        """A verified tree of at most `node_budget` nodes whose accepted path is `path` (node indices)."""
        for n in range(node_budget + 1):
            self.sums[n] = DECAY * self.sums[n] + sum(node < n for node in path)
            self.weights[n] = DECAY * self.weights[n] + 1

    def expected(self) -> list[float]:
        """Tokens kept at every budget (never fewer for a larger one)."""
        out, best = [], 0.0
        for n, (total, weight) in enumerate(zip(self.sums, self.weights)):
            prior = sum(PRIOR ** i for i in range(1, min(n, self.max_depth) + 1))
            best = max(best, (total + PRIOR_WEIGHT * prior) / (weight + PRIOR_WEIGHT))
            out.append(best)
        return out


@dataclass
class TreeBudget:
    """Plans the node budget of each tree step (the module docstring says how)."""

    # The largest budget (tree_max_tokens).
    max_nodes: int
    # The deepest a tree may go (the configured K).
    max_depth: int
    probe_every: int = 16
    # Seconds of one draft-model forward while expanding a tree (None: not measured yet).
    draft: float | None = None
    kept: dict = field(default_factory=dict)
    idle_steps: int = 0
    # The least budget of the next step: twice that of a step with a lookup tree kept whole.
    grow: int = 0

    def __post_init__(self) -> None:
        if self.max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {self.max_nodes}")
        self.kept = self.kept or {source: KeptByBudget(self.max_nodes, self.max_depth) for source in (MODEL, LOOKUP)}

    def plan(self, costs, sources: list[str | None], lookup_sizes: list[int], max_drafts: list[int]) -> int:
        """The node budget of the next step. Row b drafts from sources[b] (MODEL, LOOKUP,
        or None: nothing), its lookup tree holding lookup_sizes[b] nodes, at most max_drafts[b] deep."""
        expected = {source: table.expected() for source, table in self.kept.items()}
        draft = costs.draft if self.draft is None else self.draft
        model_depth = max([most for source, most in zip(sources, max_drafts) if source == MODEL], default=0)
        best, best_rate = 0, len(sources) / costs.verify(1)
        plain_rate, rates = best_rate, [best_rate]
        for n in range(1, self.max_nodes + 1):
            tokens, widest = 0.0, 0
            for source, size in zip(sources, lookup_sizes):
                if source is None:
                    tokens += 1.0
                    continue
                nodes = min(n, size) if source == LOOKUP else n
                tokens += 1.0 + expected[source][nodes]
                widest = max(widest, nodes)
            drafting = min(n, model_depth) * draft
            rate = tokens / (costs.verify(1 + widest) + drafting)
            rates.append(rate)
            if rate > best_rate:
                best, best_rate = n, rate
        if rates[self.grow] > plain_rate:  # growth that would be slower than a plain step is not tried
            best = max(best, self.grow)
        self.grow = 0
        self.idle_steps = self.idle_steps + 1 if best < self.max_nodes else 0
        if self.idle_steps >= self.probe_every:  # learn what the larger budgets keep
            self.idle_steps = 0
            return self.max_nodes
        return best

    def observe(self, sources: list[str | None], paths: list[list[int]], node_budget: int, draft_forwards: int,
                draft_seconds: float, depths: list[int] | None = None, max_drafts: list[int] | None = None,
                weight: float = 0.1) -> None:
        """Learn from one tree step: what each row's tree kept, and a draft forward's cost.
        depths[b]: how deep row b's tree went (a path that deep kept it whole), max_drafts[b]:
        how deep it could have gone (a lookup tree kept whole short of it: the next budget grows)."""
        for source, path in zip(sources, paths):
            if source is not None:
                self.kept[source].observe(path, node_budget)
        if depths and any(source == LOOKUP and path and len(path) == depth < most
                          for source, path, depth, most in zip(sources, paths, depths, max_drafts)):
            self.grow = min(self.max_nodes, 2 * node_budget)
        if draft_forwards:
            seconds = draft_seconds / draft_forwards
            if self.draft is not None:  # one stall cannot make drafting look dear for long
                seconds = (1 - weight) * self.draft + weight * min(seconds, 2 * self.draft)
            self.draft = seconds
