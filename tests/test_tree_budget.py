"""Adaptive node budgets for token trees: what a verified tree says about smaller budgets,
the budget that maximises tokens per second for given costs, and engines on a fake clock
whose budgets follow what verify width costs, with output still the target's own."""

import pytest
import torch

from speculative import Engine, NGramProposer, SamplingParams, SpeculativeConfig, autoregressive_generate
from speculative.policy.adaptive import AdaptivePolicy, Costs
from speculative.policy.tree_budget import LOOKUP, MODEL, KeptByBudget, TreeBudget
from tests.helpers import perturbed, sharpen, tiny
from tests.test_policy import Clock
from tests.test_trees import repetitive_prompts

torch.set_num_threads(1)


def costs(v1: float, per_token: float, draft: float = 0.0) -> Costs:
    """Costs whose verify line is v1 + per_token * (width - 1)."""
    line = Costs(v1=v1, draft=draft)
    for width in (2, 17):
        line.add(width, v1 + per_token * (width - 1), robust=False)
    return line


def close(values, expected, tolerance=0.1):
    """Equal but for the prior's small weight."""
    return len(values) == len(expected) and all(abs(v - e) < tolerance for v, e in zip(values, expected))


def test_a_verified_tree_tells_what_each_smaller_budget_would_have_kept():
    kept = KeptByBudget(max_nodes=8, max_depth=4)
    for _ in range(200):
        kept.observe([0, 2, 5], node_budget=8)
    assert close(kept.expected(), [0, 1, 1, 2, 2, 2, 3, 3, 3])
    fresh = KeptByBudget(max_nodes=8, max_depth=8)
    for _ in range(200):
        fresh.observe([0, 2, 5], node_budget=3)  # larger budgets never seen: they keep the prior
    assert close(fresh.expected()[:4], [0, 1, 1, 2])
    assert fresh.expected()[8] > 2.1  # the prior of 8 nodes: sum of 0.7 ** i, i = 1..8


def bushy_budget() -> TreeBudget:
    """Trees whose accepted path runs through late nodes: 3, 9, 14 (only a wide tree pays)."""
    budget = TreeBudget(max_nodes=16, max_depth=4)
    for _ in range(200):
        budget.observe([LOOKUP], [[3, 9, 14]], node_budget=16, draft_forwards=0, draft_seconds=0.0)
    return budget


def test_the_budget_follows_the_cost_of_verify_width():
    assert bushy_budget().plan(costs(1.0, 0.0), [LOOKUP], [16], [4]) == 15  # width is free: the whole path
    assert bushy_budget().plan(costs(1.0, 1.0), [LOOKUP], [16], [4]) == 0  # each node costs a forward: none
    chain = TreeBudget(max_nodes=16, max_depth=4)
    for _ in range(200):
        chain.observe([LOOKUP], [[0, 1, 2, 3]], node_budget=16, draft_forwards=0, draft_seconds=0.0)
    assert chain.plan(costs(1.0, 0.05), [LOOKUP], [16], [4]) == 4  # nodes past the path only cost
    assert chain.plan(costs(1.0, 0.05), [LOOKUP], [2], [4]) == 2  # a small lookup tree: no wider
    assert chain.plan(costs(1.0, 0.05), [None], [0], [0]) == 0  # no row can draft


def test_draft_forwards_per_depth_count_against_a_model_tree():
    budget = TreeBudget(max_nodes=16, max_depth=8)
    for _ in range(200):
        budget.observe([MODEL], [[0, 4, 9]], node_budget=16, draft_forwards=8, draft_seconds=8 * 0.01)
    assert budget.plan(costs(1.0, 0.0), [MODEL], [0], [8]) == 10
    budget.draft = 1.0  # a forward per depth as dear as the target's: the third token does not pay
    assert budget.plan(costs(1.0, 0.0), [MODEL], [0], [8]) == 0


def test_the_full_budget_is_probed_now_and_then():
    budget = bushy_budget()
    plans = [budget.plan(costs(1.0, 1.0), [LOOKUP], [16], [4]) for _ in range(32)]
    assert plans.count(16) == 2 and plans.count(0) == 30


def test_a_tree_kept_whole_doubles_the_next_budget():
    """A path through the whole of a lookup tree shallower than its cap says nothing of
    larger budgets (the budget may have cut it): the next step drafts twice the nodes, once."""
    budget = TreeBudget(max_nodes=16, max_depth=8)
    for _ in range(200):  # paths of 2 nodes: with dear width, a budget of 2 pays best
        budget.observe([LOOKUP], [[0, 1]], node_budget=2, draft_forwards=0, draft_seconds=0.0)
    dear = costs(1.0, 0.2)
    assert budget.plan(dear, [LOOKUP], [16], [8]) == 2
    budget.observe([LOOKUP], [[0, 1]], 2, 0, 0.0, depths=[2], max_drafts=[8])  # kept whole, 2 of 8 deep
    assert budget.plan(dear, [LOOKUP], [16], [8]) == 4
    assert budget.plan(dear, [LOOKUP], [16], [8]) == 2  # once
    budget.observe([LOOKUP], [[0]], 2, 0, 0.0, depths=[2], max_drafts=[8])  # rejected at depth 2
    budget.observe([LOOKUP], [[0, 1]], 2, 0, 0.0, depths=[2], max_drafts=[2])  # kept whole at its cap
    assert budget.plan(dear, [LOOKUP], [16], [8]) == 2
    budget.observe([MODEL], [[0, 1]], 2, 2, 0.0, depths=[2], max_drafts=[8])  # a draft model's: its plan decides
    assert budget.plan(dear, [LOOKUP], [16], [8]) == 2
    for _ in range(3):
        budget.observe([LOOKUP], [[0, 1]], 2, 0, 0.0, depths=[2], max_drafts=[8])
        assert budget.plan(dear, [LOOKUP], [16], [8]) == 4
    budget.observe([LOOKUP], [[0, 1, 2, 3, 4, 5, 6, 7, 8]], 12, 0, 0.0, depths=[9], max_drafts=[12])
    assert budget.plan(dear, [LOOKUP], [16], [12]) == 16  # doubling stops at the full budget


class TimedTreeModel:
    """A tree-capable model whose forwards move a fake clock by `per_forward` plus
    `per_token` for each token fed."""

    def __init__(self, model, clock: Clock, per_forward: float, per_token: float):
        self.model, self.clock, self.per_forward, self.per_token = model, clock, per_forward, per_token

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, tokens, state, *args, **options):
        self.clock.now += self.per_forward + self.per_token * tokens.numel()
        return self.model.forward(tokens, state, *args, **options)


def decode(per_token: float, draft):
    """Greedy batches of repetitive prompts with adaptive trees on a fake clock; returns the
    outputs, their references and the nodes drafted per step once the policy has learned."""
    clock = Clock()
    target = sharpen(tiny("decoder_only", seed=1), 4.0)
    timed = TimedTreeModel(target, clock, per_forward=0.1, per_token=per_token)
    config = SpeculativeConfig(num_draft_tokens=4, tree_top_k=3, tree_max_tokens=12, adaptive=True)
    engine = Engine(timed, draft(target), config, max_batch_size=4, clock=clock)
    prompts = repetitive_prompts(16, seed=5)
    outputs = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(40), i)
    nodes = forwards = 0
    while engine.has_unfinished():
        before = engine.stats.drafted
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if engine.stats.target_forwards > 40:
            nodes += engine.stats.drafted - before
            forwards += 1
    references = [autoregressive_generate(target, p, 40) for p in prompts]
    return [outputs[i] for i in range(len(prompts))], references, nodes / forwards


def test_an_engine_drafts_smaller_trees_where_verify_width_costs_more():
    for draft in (lambda target: NGramProposer(num_draft_tokens=4), lambda target: perturbed(target, 0.3, seed=2)):
        cheap, references, cheap_nodes = decode(0.0001, draft)
        dear, _, dear_nodes = decode(0.05, draft)
        assert cheap == references and dear == references
        assert cheap_nodes > 2 * dear_nodes, (cheap_nodes, dear_nodes)


def test_a_policy_without_tree_budgets_is_refused_for_trees():
    config = SpeculativeConfig(num_draft_tokens=4, tree_top_k=2)
    with pytest.raises(ValueError, match="plans no tree budgets: make it with AdaptivePolicy.for_config"):
        Engine(tiny("decoder_only"), NGramProposer(), config, policy=AdaptivePolicy(longest_draft=4))
    Engine(tiny("decoder_only"), NGramProposer(), config, policy=AdaptivePolicy.for_config(config, None))
