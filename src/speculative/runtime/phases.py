"""Phases 2-4 of an engine step over the running rows: propose, verify, accept.

Each phase is one method. Propose plans the step (with the policy) and drafts, handing on
a `Drafts`; verify runs the one target forward and the acceptance rule, handing on a
`Verdict`; accept commits what each row keeps, rolls both sides back to it and lets the
policy learn. `ChainPhases` drafts chains (at most K tokens per row), `TreePhases` trees
(at most K deep and `node_budget` nodes per row). The words are the engine's glossary's
(engine.py, docs/glossary.md).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

from ..core.penalties import chain_contexts, tree_contexts
from ..core.rows import Row
from ..core.sampling import check_finite
from ..core.stats import DecodeStats
from ..core.tree import Tree, tree_inputs
from ..core.verify import tree_verify_rows, verify_rows
from ..policy.costs import measure
from ..policy.tree_budget import LOOKUP, MODEL
from ..proposers import Proposal, merge_drafts
from .request_logits import constrain_rows, cut_to_grammar, forced_drafts, kept_logprobs, penalize_rows

# Guards what engines learn together: shared policies, cost books, a decoder's totals.
LEARNING = threading.Lock()


@dataclass
class Drafts:
    """What phase 2 made: every row's draft, and how the step was planned."""

    # The policy that planned this step; it learns from the step in phase 4.
    policy: object
    # Per row, the longest draft it may take this step: K, and one less than its tokens left.
    max_drafts: list[int]
    # Per row, the most tokens the draft model was asked for (0: none; all 0: it did not run).
    limits: list[int]
    # Seconds of the draft model's forwards (what the policy learns drafting costs).
    draft_seconds: float = 0.0
    # Chains: the drafted tokens, and per row whether its lookup draft was preferred.
    proposal: Proposal | None = None
    preferred: list[bool] | None = None
    # Trees: each row's tree, where it came from (LOOKUP, MODEL or None), the step's node budget.
    trees: list[Tree] | None = None
    sources: list[str | None] | None = None
    node_budget: int = 0

    @property
    def model_ran(self) -> bool:
        return max(self.limits) > 0


@dataclass
class Verdict:
    """What phase 3 decided: per row the drafts kept and the token the target adds."""

    accepted: list[int]
    extra: list[int]
    # The target's final hidden states of the verified positions, when a draft head reads them.
    hidden: torch.Tensor | None
    # Seconds of the verify forward (what the policy learns verifying costs).
    seconds: float
    # Trees: each row's accepted path (node indices), the verified positions kept, the verify width.
    paths: list[list[int]] | None = None
    kept: list[list[int]] | None = None
    verify_width: int = 0
    # Per row, the kept tokens' log-probabilities (None: the row did not ask).
    logprobs: list | None = None


class Phases:
    """What chain and tree steps share: the step's policy, and committing rows."""

    def __init__(self, engine):
        # Its proposer and target state are replaced on restart: read them each step. A weak
        # reference: the engine holds its phases, and a cycle would keep a finished engine's
        # KV caches alive until Python's cyclic collector runs (which counts objects, not bytes).
        self.engine = weakref.proxy(engine)

    def policy_for(self, rows: list[Row], sequences: list[list[int]], widest: int):
        """The policy of this step (fixed while a seeded sampled row runs), with costs for
        this batch size (probed up to `widest` drafted tokens when none are known and a
        draft model needs them; a probe waits for a step where no row has a token yet)."""
        engine = self.engine
        policy = engine.fixed if any(row.pins_k for row in rows) else engine.policy
        fresh = not any(row.generated for row in rows)
        with LEARNING:
            policy.prepare(len(rows), lambda: measure(engine.target, engine.state, sequences, engine.proposer, widest,
                                                      engine.clock, engine.argmax_rows(rows)), fresh)
        return policy

    def max_drafts(self, rows: list[Row]) -> list[int]:
        """Drafts a row could never use are not made: at most the longest draft (a lookup match's
        may reach further than the draft model's K), and one less than it has left."""
        k = self.engine.config.longest_draft
        return [max(0, min(k, row.left - 1)) for row in rows]

    def commit_rows(self, rows: list[Row], tokens: list[list[int]], drafted: list[int], accepted: list[int],
                    stats: DecodeStats, outputs: list, logprobs: list | None = None) -> None:
        """Each row keeps its accepted drafts and the target's token; finished rows are let go."""
        logprobs = logprobs or [None] * len(rows)
        for row, row_tokens, length, kept, row_logprobs in zip(rows, tokens, drafted, accepted, logprobs):
            output = row.commit(row_tokens, length, kept, row_logprobs)
            stats.generated += len(output.new_token_ids)
            outputs.append((row.number, output))
            if row.finished:
                self.engine._forget(row)
        stats.target_forwards += 1

    def roll_back(self, rows: list[Row], features: list[torch.Tensor] | None, model_ran: bool) -> None:
        """Both sides return to the committed sequences; a draft head reads the kept positions' features."""
        engine = self.engine
        engine.target.rollback(engine.state, [len(row.sequence) - 1 for row in rows])
        if features is not None:  # the last committed token and the accepted drafts are in the target's state
            engine.proposer.read_features(features)
        if model_ran:  # the draft model ran: it rolls back to what was kept
            engine.proposer.commit([row.sequence for row in rows])


class ChainPhases(Phases):
    """Steps whose drafts are chains: each row drafts up to K tokens, by lookup or the draft model."""

    def propose(self, rows: list[Row], stats: DecodeStats) -> Drafts:
        """Plan, then draft: rows take their free draft as the plan says (a preferred match,
        unless the model is expected to do better; any match when the model sits out); the
        model drafts for the others. Cut to the longest row's draft (none: a plain step)."""
        engine, proposer = self.engine, self.engine.proposer
        sequences, max_drafts = [row.sequence for row in rows], self.max_drafts(rows)
        started = engine.clock()
        lookups, preferred = proposer.free_drafts(sequences, max_drafts)
        stats.draft_seconds += engine.clock() - started
        policy = self.policy_for(rows, sequences, engine.config.num_draft_tokens)
        with LEARNING:
            has_model = proposer.model is not None
            plan = policy.plan(len(rows), [len(d) for d in lookups], preferred, max_drafts, has_model,
                               proposer.unread(sequences) if has_model else 0)
        lookup = [d[:plan.k] if plan.takes_lookup(i, bool(d), p) else None
                  for i, (d, p) in enumerate(zip(lookups, preferred))]
        lookup = [forced or d for forced, d in zip(forced_drafts(rows, max_drafts), lookup)]
        num_draft_tokens = engine.config.num_draft_tokens
        limits = [0 if d is not None or not plan.use_model else min(plan.k, most, num_draft_tokens)
                  for d, most in zip(lookup, max_drafts)]
        started = engine.clock()
        drafted, draft_seconds = None, 0.0
        if max(limits) > 0:
            proposer.catch_up(sequences)  # apart: reading a prompt is not what drafting costs
            caught_up = engine.clock()
            drafted = proposer.propose(sequences, limits, plan.min_confidence)
            draft_seconds = engine.clock() - caught_up
            stats.draft_forward_seconds += engine.clock() - started
        proposal = merge_drafts(lookup, drafted, engine.target.device)
        if any(row.constraint is not None for row in rows):
            cut_to_grammar(rows, proposal.tokens.tolist(), proposal.lengths,
                           [d is not None or row.draft_sampler.greedy for d, row in zip(lookup, rows)])
        proposal = cut(proposal)
        stats.draft_seconds += engine.clock() - started
        return Drafts(policy, max_drafts, limits, draft_seconds, proposal=proposal, preferred=preferred)

    def verify(self, rows: list[Row], drafts: Drafts, stats: DecodeStats) -> Verdict:
        """One target forward over every row's last committed token and drafts, then each
        row's acceptance rule."""
        engine, proposal = self.engine, drafts.proposal
        started = engine.clock()
        last = torch.tensor([[row.sequence[-1]] for row in rows], device=engine.target.device)
        logits, hidden = engine._target_forward(torch.cat([last, proposal.tokens], 1),  # (B, K+1, V)
                                                argmax_rows=engine.argmax_rows(rows))
        stats.target_forward_seconds += engine.clock() - started
        check_finite(logits, "target", [1 + n for n in proposal.lengths])
        logits, drafted = logits.float(), proposal.tokens.tolist()
        penalize_rows(rows, logits, lambda b: chain_contexts(drafted[b], proposal.lengths[b] + 1))
        constrain_rows(rows, logits, [d[:n] for d, n in zip(drafted, proposal.lengths)])
        accepted, extra = verify_rows(proposal.tokens, proposal.lengths, proposal.probs, logits,
                                      [row.sampler for row in rows], [row.target_generator for row in rows])
        logprobs = kept_logprobs(rows, logits, [list(range(n + 1)) for n in accepted],
                                 [d[:n] + [x] for d, n, x in zip(drafted, accepted, extra)])
        seconds = engine.clock() - started
        stats.verify_seconds += seconds
        return Verdict(accepted, extra, hidden, seconds, logprobs=logprobs)

    def accept(self, rows: list[Row], drafts: Drafts, verdict: Verdict, stats: DecodeStats, outputs: list) -> None:
        """Commit, roll back, then the policy learns from the step."""
        proposal, accepted = drafts.proposal, verdict.accepted
        kept = [tokens[:n] + [token] for tokens, n, token in zip(proposal.tokens.tolist(), accepted, verdict.extra)]
        self.commit_rows(rows, kept, proposal.lengths, accepted, stats, outputs, verdict.logprobs)
        stats.record_step(proposal.lengths, accepted)
        hidden = verdict.hidden
        features = None if hidden is None else [hidden[b, :n + 1] for b, n in enumerate(accepted)]
        self.roll_back(rows, features, drafts.model_ran)
        with LEARNING:
            drafts.policy.observe_step(len(rows), proposal, drafts.limits, accepted, verdict.seconds,
                                       proposal.forwards, drafts.draft_seconds, drafts.preferred)


def cut(proposal: Proposal) -> Proposal:
    """The proposal cut to its longest row's draft."""
    width = max(proposal.lengths)
    if proposal.tokens.shape[1] > width:
        proposal.tokens = proposal.tokens[:, :width]
        if proposal.probs is not None:
            proposal.probs = proposal.probs[:, :width]
    if proposal.confidences is not None:
        proposal.confidences = [c[:width] for c in proposal.confidences]
    return proposal


class TreePhases(Phases):
    """Steps whose drafts branch: rows with a lookup tree take it (when preferred to the
    draft model's), the draft model expands a tree for the others, all cut to the step's
    node budget; one forward verifies every row's nodes, each seeing its ancestors only."""

    def propose(self, rows: list[Row], stats: DecodeStats) -> Drafts:
        engine, proposer, config = self.engine, self.engine.proposer, self.engine.config
        sequences, max_drafts = [row.sequence for row in rows], self.max_drafts(rows)  # depths a row can use
        started = engine.clock()
        trees, preferred = proposer.free_trees(sequences, max_drafts, config.tree_top_k, config.tree_max_tokens)
        model = proposer.model is not None
        take = [len(t) > 0 and (p or not model) for t, p in zip(trees, preferred)]
        sources = [LOOKUP if taken else MODEL if model and most else None for taken, most in zip(take, max_drafts)]
        policy = self.policy_for(rows, sequences, config.tree_max_tokens)
        with LEARNING:
            node_budget = policy.plan_tree(len(rows), sources, list(map(len, trees)), max_drafts)
        trees = [t.prefix(node_budget) if taken else Tree([], []) for t, taken in zip(trees, take)]
        limits = [min(most, node_budget, config.num_draft_tokens) if source == MODEL else 0
                  for source, most in zip(sources, max_drafts)]
        draft_seconds = 0.0
        if max(limits) > 0:
            proposer.catch_up(sequences)
            caught_up = engine.clock()
            drafted = proposer.propose_tree(sequences, limits, config.tree_top_k, node_budget)
            draft_seconds = engine.clock() - caught_up
            stats.draft_forward_seconds += draft_seconds
            trees = [d if limit else t for t, d, limit in zip(trees, drafted, limits)]
        stats.draft_seconds += engine.clock() - started
        return Drafts(policy, max_drafts, limits, draft_seconds, trees=trees, sources=sources,
                      node_budget=node_budget)

    def verify(self, rows: list[Row], drafts: Drafts, stats: DecodeStats) -> Verdict:
        """One forward over every row's last token and nodes; each row's accepted path, whose
        cache entries are compacted into place."""
        engine, trees = self.engine, drafts.trees
        started = engine.clock()
        starts = [len(row.sequence) - 1 for row in rows]
        tokens, positions, mask, counts = tree_inputs(trees, [row.sequence[-1] for row in rows], starts,
                                                      engine.target.device)
        logits, hidden = engine._target_forward(tokens, counts, positions=positions, tree=mask,  # (B, 1+N, V)
                                                argmax_rows=engine.argmax_rows(rows))
        check_finite(logits, "target", counts)
        seconds = engine.clock() - started
        stats.target_forward_seconds += seconds
        logits = logits.float()
        penalize_rows(rows, logits, lambda b: tree_contexts(trees[b].tokens, trees[b].parents))
        # Every node is a deterministic candidate (lookup branches, a draft's top-k children).
        paths, extra = tree_verify_rows(trees, None, logits, [row.sampler for row in rows],
                                        [row.target_generator for row in rows])
        kept = [[0] + [node + 1 for node in path] for path in paths]
        logprobs = kept_logprobs(rows, logits, kept, [[tree.tokens[node] for node in path] + [x]
                                                      for tree, path, x in zip(trees, paths, extra)])
        engine.target.compact(engine.state, starts, kept)
        stats.verify_seconds += engine.clock() - started
        return Verdict([len(p) for p in paths], extra, hidden, seconds, paths, kept, tokens.shape[1],
                       logprobs=logprobs)

    def accept(self, rows: list[Row], drafts: Drafts, verdict: Verdict, stats: DecodeStats, outputs: list) -> None:
        """Commit each row's accepted path, let the policy learn, then roll back."""
        trees, paths = drafts.trees, verdict.paths
        tokens = [[tree.tokens[node] for node in path] + [token] for tree, path, token in zip(trees, paths, verdict.extra)]
        self.commit_rows(rows, tokens, list(map(len, trees)), verdict.accepted, stats, outputs, verdict.logprobs)
        depths = [max(t.depths(), default=0) for t in trees]
        stats.record_step(depths, verdict.accepted, list(map(len, trees)))
        with LEARNING:
            drafts.policy.observe_tree(len(rows), drafts.sources, paths, depths, drafts.max_drafts, drafts.node_budget,
                                       verdict.verify_width, verdict.seconds, max(drafts.limits), drafts.draft_seconds)
        hidden = verdict.hidden
        features = None if hidden is None else [hidden[b, index] for b, index in enumerate(verdict.kept)]
        self.roll_back(rows, features, drafts.model_ran)
