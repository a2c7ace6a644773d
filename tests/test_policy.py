"""The adaptive policy on a fake clock: models advance it by what their forwards would
cost, with noise and stalls, so that no assertion depends on this machine's timings."""

import math
import random

import pytest
import torch

from speculative import SpeculativeConfig
from speculative.policy.adaptive import AdaptivePolicy, Costs
from speculative.runtime.engine import Engine
from speculative.core.rows import SamplingParams
from tests.helpers import TableModel

VOCAB = 32


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Timed:
    """A model whose forwards move the clock: `per_forward` plus `per_token` for each token
    fed, times a lognormal factor, and now and then a stall ten times as long."""

    def __init__(self, model, clock: Clock, per_forward: float, per_token: float, seed: int, wide: float = 0.0):
        self.model, self.clock = model, clock
        # Seconds per forward and per token fed, and extra seconds for any forward of more
        # than one token (float32 on MKL: a few rows cost far more than one).
        self.per_forward, self.per_token, self.wide = per_forward, per_token, wide
        self.random = random.Random(seed)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, tokens, state, num_valid=None, keep_logits=True, **options):
        noise = math.exp(self.random.gauss(0, 0.3)) * (10 if self.random.random() < 0.05 else 1)
        tokens_fed = tokens.shape[0] * tokens.shape[1]
        seconds = self.per_forward + self.per_token * tokens_fed + (self.wide if tokens_fed > 1 else 0.0)
        self.clock.now += seconds * noise
        return self.model.forward(tokens, state, num_valid, keep_logits)


def tables(agreement_rows: int, seed: int = 0):
    """A peaked target table and a draft table whose argmax agrees on the first
    `agreement_rows` rows (a row is the token before)."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(VOCAB, VOCAB, generator=gen) * 4
    draft = target.clone()
    for row in range(agreement_rows, VOCAB):
        draft[row] = torch.roll(draft[row], 1 + row % (VOCAB - 1))  # another argmax
    return target, draft


# Seconds of (target per forward, per token, extra when wide), (draft per forward, per token).
BFLOAT16 = (0.100, 0.005, 0.0), (0.010, 0.005)  # a verify forward costs little more than one token
FLOAT32_MKL = (0.394, 0.012, 0.230), (0.160, 0.010)  # the Qwen pair as measured: 5 tokens cost 1.75x one


def run(agreement_rows: int, costs=BFLOAT16, prompts: int = 40, new_tokens: int = 40):
    """Generations one after another on one policy, prompts of 200 tokens: the draft reads
    each prompt at its first use, which costs 200 drafted tokens' worth of work."""
    clock = Clock()
    target_table, draft_table = tables(agreement_rows)
    (forward, token, wide), (draft_forward, draft_token) = costs
    target = Timed(TableModel(target_table), clock, forward, token, seed=1, wide=wide)
    draft = Timed(TableModel(draft_table), clock, draft_forward, draft_token, seed=2)
    config = SpeculativeConfig(num_draft_tokens=4, prompt_lookup=False)  # the draft model alone
    policy = AdaptivePolicy(longest_draft=4)
    gen = torch.Generator().manual_seed(3)
    late = {"drafted": 0, "forwards": 0, "accepted": 0}
    for number in range(prompts):
        engine = Engine(target, draft, config, max_batch_size=1, policy=policy, clock=clock)
        engine.add_request(torch.randint(0, VOCAB, (200,), generator=gen).tolist(), SamplingParams(new_tokens))
        while engine.has_unfinished():
            engine.step()
        if number >= prompts // 2:  # after the policy has learned
            late["drafted"] += engine.stats.drafted
            late["accepted"] += engine.stats.accepted
            late["forwards"] += engine.stats.target_forwards
    return late


@pytest.mark.parametrize("costs", [BFLOAT16, FLOAT32_MKL], ids=["cheap verify", "float32 on MKL"])
def test_a_draft_with_high_acceptance_stays_on_under_noisy_timings(costs):
    late = run(VOCAB - 1, costs)
    assert late["accepted"] / late["drafted"] > 0.9  # the draft is good
    assert late["drafted"] / late["forwards"] > 3.0  # and drafts nearly K=4 tokens every step


@pytest.mark.parametrize("costs", [BFLOAT16, FLOAT32_MKL], ids=["cheap verify", "float32 on MKL"])
def test_a_useless_draft_is_switched_off_under_the_same_timings(costs):
    """The negative control: the same clock and costs, a draft that is never right."""
    late = run(0, costs)
    assert late["drafted"] / late["forwards"] < 0.5


@pytest.mark.parametrize("right", [True, False], ids=["underconfident draft", "negative control: wrong"])
def test_the_confidence_floor_rises_on_evidence_only(right):
    """A draft whose tokens of confidence 0.15 are right (a draft head trained on soft
    targets) drafts them from the start, since a bin not yet seen is expected to pay, and
    the floor stays under them. When those tokens are wrong, the floor rises above them
    after a few and stays there, but for the floor-free steps that keep learning."""
    policy = AdaptivePolicy(longest_draft=4)
    costs = Costs(v1=1.0, draft=0.25)
    for width, seconds in ((2, 1.2), (5, 2.0)):  # each token of verify width costs 0.27 of a step
        costs.add(width, seconds, robust=False)
    policy.costs[1] = costs
    policy.model.observe([4] * 50, [4] * 50)  # the draft's confident tokens are kept
    floors = []
    for _ in range(200):
        plan = policy.plan(1, [0], [False], [4], True)
        assert plan.use_model
        floors.append(plan.min_confidence)
        if plan.min_confidence <= 0.15:  # the row drafts its confidence-0.15 token, then one more
            policy.observe_confidence([2], [2 if right else 0], [[0.15, 0.95]])
    assert floors[0] <= 0.15  # unseen bins are tried
    if right:
        assert all(f <= 0.15 for f in floors)
    else:
        assert floors[10] > 0.15  # a few wrong tokens raised it
        assert sum(f <= 0.15 for f in floors[-50:]) <= 50 // policy.probe_every + 1


@pytest.mark.parametrize("pooled", [False, True], ids=["apart", "negative control: pooled"])
def test_short_lookup_matches_are_judged_apart_from_preferred_ones(pooled):
    """Lookup drafts from matches too short to be preferred are learned in a table of their
    own. Long matches were right 40 times, short ones wrong 8 times: a row with a short
    match then lets the (good) draft model draft. Pooled in one table (as before), the long
    matches' record made the short match look nearly as good, and free: the model sat out."""
    from speculative.proposers.base import Proposal

    policy = AdaptivePolicy(longest_draft=4)
    if pooled:
        policy.weak_lookup = policy.lookup
    costs = Costs(v1=1.0, draft=0.1)
    for width, seconds in ((2, 1.02), (5, 1.1)):
        costs.add(width, seconds, robust=False)
    policy.costs[1] = costs
    policy.model.observe([4] * 40, [3] * 40)  # the draft model keeps about 3 of 4
    proposal = Proposal(torch.zeros(1, 4, dtype=torch.long), [4], free=[True])
    for step in range(48):
        long_match = step % 6 != 5
        policy.observe_step(1, proposal, [4], [4 if long_match else 0], 1.1, 0, 0.0, preferred=[long_match])
    assert policy.lookup.alphas()[0] > (0.8 if pooled else 0.95)
    plan = policy.plan(1, [4], [False], [4], has_model=True)  # a short match
    assert plan.use_model != pooled and plan.takes_lookup(0, True, False) == pooled
    assert policy.plan(1, [4], [True], [4], has_model=True).takes_lookup(0, True, True)  # a long one drafts


@pytest.mark.parametrize("kept", [0.3, 0.0], ids=["worth its verify width", "negative control: never kept"])
def test_the_floor_charges_a_token_only_its_verify_width(kept):
    """The draft forward that made a token is spent when its confidence is seen: a token
    kept 30% of the time is worth less than that forward and its verify width (0.5 + 0.27
    of a step) but more than its verify width alone, so it is drafted. A token never kept is not."""
    policy = AdaptivePolicy(longest_draft=4)
    costs = Costs(v1=1.0, draft=0.5)
    for width, seconds in ((2, 1.2), (5, 2.0)):
        costs.add(width, seconds, robust=False)
    for i in range(60):  # tokens of confidence 0.15, the first drafted position
        policy.observe_confidence([1], [int(i % 10 < 10 * kept)], [[0.15]])
    assert policy._conf_alpha(1) < policy._break_even(costs)
    floor = policy._min_confidence(costs)
    assert floor <= 0.15 if kept else floor > 0.15


@pytest.mark.parametrize("per_token, kept, widths", [(0.001, 0.9, (16, 24)), (0.05, 0.9, (2, 8)), (0.05, 0.0, (0, 0))],
                         ids=["cheap width", "dear width", "negative control: never kept"])
def test_lookup_widths_follow_costs_learned_from_the_steps_alone(per_token, kept, widths):
    """Drafts without a model are never probed: v1 and the cost of width come from the steps'
    own timings (here a forward of w tokens takes 0.1 + per_token * w seconds). Matches of 24
    tokens whose positions are each kept with probability `kept`: where width is nearly free
    the policy verifies nearly all of it, where each token costs half a forward only a few,
    and drafting stays off where nothing drafted is kept."""
    from speculative.policy.costs import CostBook
    from speculative.proposers.base import Proposal

    policy = AdaptivePolicy(longest_draft=24, book=CostBook(probe=False))
    draws, drafted = random.Random(0), []
    for step in range(300):
        policy.prepare(1, lambda: pytest.fail("a probe ran"), fresh=step == 0)
        width = policy.plan(1, [24], [True], [24], has_model=False).k
        accepted = next((j for j in range(width) if draws.random() >= kept), width)
        proposal = Proposal(torch.zeros(1, width, dtype=torch.long), [width], free=[True])
        policy.observe_step(1, proposal, [0], [accepted], 0.1 + per_token * (width + 1), 0, 0.0, [True])
        drafted.append(width)
    costs = policy.costs[1]
    assert costs.verify(1) == pytest.approx(0.1 + per_token)  # a plain step was timed
    if kept:
        assert costs.verify(9) == pytest.approx(0.1 + 9 * per_token)  # and two widths at least
    late = sorted(drafted[-100:])
    assert widths[0] <= late[50] <= widths[1]


def test_a_slow_first_forward_does_not_hold_drafting_back():
    """A process's first forward can cost several later ones (kernels built for a new shape,
    a lazily built output-layer screen): a width's first timing is left out. Counted, the
    first step's (a short match, 4x slow), then plain steps where nothing matched, set the
    line's slope 10x too steep, and the policy drafted one token at a time (for 60 steps,
    in a real run) where every drafted token is kept and width is nearly free."""
    from speculative.policy.costs import CostBook
    from speculative.proposers.base import Proposal

    policy = AdaptivePolicy(longest_draft=24, book=CostBook(probe=False))
    drafted = []
    for step in range(70):
        policy.prepare(1, lambda: pytest.fail("a probe ran"), fresh=step == 0)
        first = step == 0  # a short match, wrong: drafting on it has not paid yet
        match = 7 if first else 0 if step < 8 else 24
        width = policy.plan(1, [match], [not first], [24], has_model=False).k
        proposal = Proposal(torch.zeros(1, width, dtype=torch.long), [width], free=[True])
        seconds = (0.1 + 0.001 * (width + 1)) * (4 if first else 1)
        policy.observe_step(1, proposal, [0], [0 if first else width], seconds, 0, 0.0, [not first])
        drafted.append(width)
    assert sorted(drafted[20:])[25] >= 16, drafted


@pytest.mark.parametrize("unread", [500, 10], ids=["a prompt to read", "negative control: caught up"])
def test_a_draft_model_with_a_prompt_to_read_waits_while_lookup_drafts(unread):
    """A good draft model that has a long prompt to read first (its prefill) neither drafts
    nor probes while lookup drafts, however weakly; after CATCH_UP_AFTER steps without a
    lookup draft it reads it. Caught up, it drafts where lookup is weak, as before."""
    from speculative.policy.adaptive import CATCH_UP_AFTER

    policy = AdaptivePolicy(longest_draft=4)
    costs = Costs(v1=1.0, draft=0.05)
    for width, seconds in ((2, 1.05), (5, 1.2)):
        costs.add(width, seconds, robust=False)
    policy.costs[1] = costs
    policy.model.observe([4] * 50, [4] * 50)  # the model's drafts are kept
    policy.weak_lookup.observe([4] * 50, [0] * 50)  # short matches are not
    used = [policy.plan(1, [3], [False], [4], True, unread).use_model for _ in range(40)]
    assert not any(used) if unread > 64 else all(used)
    used = [policy.plan(1, [0], [False], [4], True, unread).use_model for _ in range(CATCH_UP_AFTER)]
    assert used == [False] * (CATCH_UP_AFTER - 1) + [True] if unread > 64 else all(used)
