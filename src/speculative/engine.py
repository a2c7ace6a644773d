"""The step engine: requests join and leave a running batch, each with its own sampling settings.

Glossary (one name per concept, here and in rows.py, proposers/ and adaptive.py):

- request: a prompt, its SamplingParams and an id, from `add_request` until it finishes;
  it waits in the queue until a row is free.
- row: a running request; row i of the batch is row i of the target's state and of the
  proposer's (`rows.Row`).
- sequence: a row's prompt and committed tokens. Its last token is not yet in the target's
  state: every step feeds it first.
- budget: the most new tokens a request may get; left: what remains of it.
- cap: the most tokens a row may draft this step (K, and one less than what is left).
- free draft: tokens drafted at no cost (prompt lookup), `preferred` when a long match
  makes them better than the draft model's.
- plan: how far this step drafts and whether the draft model runs, for the batch as a
  whole (`FixedPolicy`, or `AdaptivePolicy` from measured acceptance and costs).
- proposal: the drafted tokens of every row (and their q when sampling).
- accepted / extra: drafted tokens kept, and the token the target adds (recovered or bonus).
- commit: a row's sequence grows by what it keeps; both sides roll back to it.
- retire: a finished row leaves ("length", "stop" or "abort"); its slot is refilled at the
  next step.
- failure: a phase that raises ends requests with "error", never loses them (`_fail`). A
  request that fails to join ends alone; a model's non-finite logits end the rows they
  belong to; anything else ends every running row, as its cause cannot be told. The rows
  that go on are restarted: the state is dropped and they are read again from their
  prompt and output, so the engine is consistent whatever the phase left half done.

- tree: a draft that branches (tree.py, `tree_top_k` > 1): lookup sources draft trees, a
  draft model or head expands one (EAGLE-2); one target forward verifies every row's tree,
  and the accepted path's cache entries are compacted into place.
- node budget: the most nodes a tree step drafts per row, the plan of a tree step
  (`tree_budget.py`: fixed at `tree_max_tokens`, or chosen by the adaptive policy).

A step runs six phases: 1 admit, 2 plan, 3 draft, 4 verify, 5 commit, 6 retire (a tree
step: 2-5 in `_tree_step`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict, deque
from typing import Callable, Hashable

import torch

from .adaptive import AdaptivePolicy, FixedPolicy
from .config import MAX_BATCH_SIZE, SpeculativeConfig, as_config, at_most
from .costs import cost_book, measure
from .inputs import check_draft, check_model, normalize_prompts
from .models.base import prefill
from .proposers import as_proposer, merge_drafts
from .rows import RequestOutput, Row, SamplingParams
from .sampling import GREEDY, NonFiniteLogits, Sampler, check_finite
from .stats import DecodeStats, RequestStats
from .text import same_vocabulary
from .tree import Tree, can_branch, tree_inputs
from .tree_budget import LOOKUP, MODEL
from .verify import tree_verify_rows, verify_rows

# Guards what engines learn together: shared policies, cost books, a decoder's totals.
LEARNING = threading.Lock()
# Finished requests whose stats `request_stats` still answers for.
KEPT_STATS = 10_000


def check_compatible(target, proposer) -> None:
    """Draft and target must share one vocabulary: compared by tokenizer when both have
    one (padded embedding matrices, as in Qwen, then pass), else by vocabulary size."""
    if proposer.vocab_size is None:
        return  # lookup proposes ids from the sequence itself
    target_tok = getattr(target, "tokenizer", None)
    draft_tok = getattr(proposer.model, "tokenizer", None)
    if target_tok is not None and draft_tok is not None:
        if not same_vocabulary(target_tok, draft_tok):
            raise ValueError(f"draft and target tokenizers differ: draft {draft_tok.name} ({len(draft_tok)} tokens), "
                             f"target {target_tok.name} ({len(target_tok)} tokens); both sides need one tokenizer")
        return
    if proposer.vocab_size != target.vocab_size:
        raise ValueError(f"draft and target vocabularies differ: draft has {proposer.vocab_size} tokens, target "
                         f"has {target.vocab_size}; both sides must share one vocabulary")


def refill_order(size: int, leaving: set[int]) -> list[int]:
    """The rows that stay, ordered so that the fewest move: a row that leaves from the
    front is replaced by one that stays from the back."""
    kept = size - len(leaving)
    movers = [i for i in range(kept, size) if i not in leaving]
    return [movers.pop() if i in leaving else i for i in range(kept)]


class Engine:
    """Continuous batching with speculative decoding (shaped like vLLM's LLMEngine).

    `draft` is a model, a proposer (such as NGramProposer), or None for plain decoding
    through the same engine. `config` gives K (`num_draft_tokens`), `adaptive`,
    `prompt_lookup` and `draft_temperature`; sampling settings come with each request.
    Greedy requests get exactly the target's own greedy tokens, sampled ones exactly its
    distribution, whatever else runs beside them. `policy` and `totals` (a function giving
    a DecodeStats) let several engines learn and count together, as a decoder's do.
    Every request added ends: with its tokens, or with finish reason "error" and an
    `error` that names the cause (`step` itself does not raise for a request's failure).
    """

    def __init__(self, target, draft=None, config: SpeculativeConfig | None = None, max_batch_size: int = 8, *,
                 policy: AdaptivePolicy | None = None, totals: Callable[[], DecodeStats] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.config = config = as_config(config)
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        at_most(max_batch_size, "max_batch_size", MAX_BATCH_SIZE)
        check_model(target, "target")
        if draft is not None:
            check_draft(draft)
        self.target = target
        self.max_batch_size = max_batch_size
        self.clock = clock  # every timing: the stats, and what the adaptive policy learns
        self.proposer = as_proposer(draft, config, target=target).fork()
        check_compatible(target, self.proposer)
        # A feature draft (a draft head) is handed the target's hidden states (proposers/base.py).
        self.reads_features = getattr(self.proposer, "reads_features", False)
        self.fixed = FixedPolicy(config.num_draft_tokens, config.tree_max_tokens)
        if policy is None and config.adaptive and draft is not None:
            policy = AdaptivePolicy.for_config(config, cost_book(target, self.proposer.model))
        self.policy = policy or self.fixed
        self.trees = config.trees and draft is not None and can_branch(target, self.proposer, config.tree_top_k)
        if self.trees and getattr(self.policy, "tree", False) is None:
            raise ValueError("this adaptive policy plans no tree budgets: make it with "
                             "AdaptivePolicy.for_config(config, book) for a configuration with tree_top_k > 1")
        # Slots a step may feed beyond a row's sequence: the widest draft (a draft model
        # expanding a tree reads top_k nodes per depth but the last).
        self.width = (max(config.num_draft_tokens, config.tree_max_tokens,
                          (config.num_draft_tokens - 1) * config.tree_top_k) if self.trees else config.num_draft_tokens)
        self.stats = DecodeStats()
        self.totals = totals
        self.waiting: deque[Row] = deque()
        self.running: list[Row] = []
        self.state = None
        self._live: dict[Hashable, Row] = {}
        self._finished: OrderedDict[Hashable, RequestStats] = OrderedDict()
        self._aborts: set[Hashable] = set()
        self._numbers = itertools.count()

    # --- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids, params: SamplingParams | None = None, request_id: Hashable | None = None):
        """Queue one prompt; returns its id. Everything is checked here: a bad request
        raises ValueError or TypeError and changes nothing for the others."""
        prompts, batched = normalize_prompts(prompt_ids)
        if batched:
            raise ValueError(f"add_request takes one prompt (a list of token ids), got a batch of {len(prompts)}")
        prompt = prompts[0]
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams or None, got {type(params).__name__}")
        number = next(self._numbers)
        if request_id is None:
            request_id = str(number)
            while request_id in self._live:
                request_id += "'"
        elif isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
            raise TypeError(f"request_id must be a string or an integer, got {request_id!r}")
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use by a request that has not finished")
        vocab = self.target.vocab_size
        for name, ids in (("prompt", prompt), ("stop_token_ids", params.stop_token_ids or ())):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"request {request_id!r}: {name} holds token id {bad[0]}, outside the vocabulary: "
                                 f"allowed 0..{vocab - 1}")
        for role, model in (("target", self.target), ("draft", self.proposer.model)):
            limit = None if model is None else model.max_seq_len
            if limit is not None and len(prompt) + params.max_new_tokens > limit:
                raise ValueError(f"request {request_id!r}: the prompt has {len(prompt)} tokens and max_new_tokens is "
                                 f"{params.max_new_tokens}: {len(prompt) + params.max_new_tokens} tokens exceed the "
                                 f"{role} model's maximum length of {limit}")
        if self.state is not None or len(self.waiting) >= self.max_batch_size:  # it will join a running batch
            for role, model in (("target", self.target), ("draft", self.proposer.model)):
                if model is not None and not callable(getattr(model, "add_rows", None)):
                    raise TypeError(f"the {role} model {type(model).__name__} lacks add_rows, so requests cannot "
                                    "join a running batch; add all requests before the first step (at most "
                                    "max_batch_size), or implement add_rows (speculative.models.base)")
        draft_sampler = GREEDY if params.sampler.greedy else Sampler(
            self.config.draft_temperature, params.top_k, params.top_p)
        row = Row(request_id, number, list(prompt), params, draft_sampler, self.target.device)
        self._live[request_id] = row
        self.waiting.append(row)
        return request_id

    def abort(self, request_id: Hashable) -> bool:
        """Stop a request at the next step boundary (it then frees its row); False when no
        unfinished request has this id."""
        if request_id not in self._live:
            return False
        self._aborts.add(request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def request_stats(self, request_id: Hashable) -> RequestStats:
        """Drafted, accepted, target forwards and acceptance rate of one request (running,
        waiting, or among the last finished ones)."""
        row = self._live.get(request_id)
        if row is not None:
            return row.stats
        if request_id in self._finished:
            return self._finished[request_id]
        raise ValueError(f"unknown request id {request_id!r}: not added, or finished too long ago")

    # --- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit, plan, draft, verify, commit, retire; returns what each request got."""
        started = self.clock()
        stats = DecodeStats()
        outputs: list[tuple[int, RequestOutput]] = []
        with torch.inference_mode():
            self._admit(stats, outputs)                                          # 1 admit
            if self.running:
                try:
                    self._advance(self.running, stats, outputs)                  # 2-6
                except Exception as error:  # noqa: BLE001 - every request must end, whatever failed
                    self._recover(error, outputs)
        stats.total_seconds = self.clock() - started
        self.stats.add(stats)
        if self.totals is not None:
            with LEARNING:
                self.totals().add(stats)
        return [output for _, output in sorted(outputs, key=lambda pair: pair[0])]

    def _advance(self, rows: list[Row], stats: DecodeStats, outputs: list) -> None:
        """Phases 2-6 of a step over the running rows."""
        if self.trees:
            self._tree_step(rows, stats, outputs)                                # 2-5 as a tree
        else:
            sequences = [row.sequence for row in rows]
            policy, caps, lookups, preferred, plan = self._plan(rows, sequences, stats)           # 2 plan
            proposal, limits, ran, draft_seconds = self._draft(sequences, caps, lookups, preferred, plan,
                                                               stats)                              # 3 draft
            accepted, extra, hidden, verify_seconds = self._verify(rows, proposal, stats)         # 4 verify
            self._commit(rows, proposal, accepted, extra, hidden, ran, stats, outputs)             # 5 commit
            with LEARNING:
                policy.observe_step(len(rows), proposal, limits, accepted, verify_seconds, proposal.forwards,
                                    draft_seconds, preferred)
        self._retire({i for i, row in enumerate(rows) if row.finished})                          # 6 retire

    def _admit(self, stats: DecodeStats, outputs: list) -> None:
        """Aborted requests leave; waiting ones fill the free rows, their prompts read in
        one target forward and their state rows added to the running state. Rows that
        cannot join end with "error"; the running ones are restarted (`_restart`)."""
        try:
            self._drop_aborted(outputs)
        except Exception as error:  # noqa: BLE001 - leaving rows could not be dropped from the state
            self._recover(error, outputs)
        joining = []
        while self.waiting and len(self.running) + len(joining) < self.max_batch_size:
            row = self.waiting.popleft()
            if row.left == 0:
                self._finish(row, "length", outputs)
            else:
                joining.append(row)
        if not joining:
            return
        try:
            self._join(joining, stats)
        except Exception as error:  # noqa: BLE001 - a failed join must not leave its rows half in
            for row in joining:
                self._fail(row, f"it could not join the batch: {describe(error)}", outputs)
            self._restart(self.running)

    def _drop_aborted(self, outputs: list) -> None:
        if not self._aborts:
            return
        for row in [r for r in self.waiting if r.request_id in self._aborts]:
            self.waiting.remove(row)
            self._finish(row, "abort", outputs)
        leaving = {i for i, row in enumerate(self.running) if row.request_id in self._aborts}
        self._aborts.clear()
        for i in sorted(leaving):
            self._finish(self.running[i], "abort", outputs)
        self._retire(leaving)

    def _join(self, joining: list[Row], stats: DecodeStats) -> None:
        """Prefill the joining rows and add them to the target's and the proposer's state.
        Restarted rows join the same way, their output so far read as part of the prompt."""
        started = self.clock()
        prompts = [row.sequence for row in joining]
        capacity = max(len(p) + row.left for p, row in zip(prompts, joining)) + self.width + 1
        hidden = [] if self.reads_features else None
        if self.state is None:
            self.state = prefill(self.target, prompts, capacity, hidden)
        else:  # prefilled apart (only as long as the prompts), then added to the running rows
            self.target.add_rows(self.state, prefill(self.target, prompts, max(map(len, prompts)), hidden), capacity)
        self.proposer.add_rows(prompts, capacity, [row.draft_sampler for row in joining],
                               [row.draft_generator for row in joining])
        if hidden is not None:
            nothing = [hidden[0][:0]] * len(self.running)
            self.proposer.read_features(nothing + hidden)
        self.running += joining
        stats.prefill_seconds += self.clock() - started

    def _plan(self, rows: list[Row], sequences: list[list[int]], stats: DecodeStats):
        """Per row its cap and free draft; the plan for the batch."""
        k = self.config.num_draft_tokens
        caps = [max(0, min(k, row.left - 1)) for row in rows]  # drafts a row could never use are not made
        started = self.clock()
        lookups, preferred = self.proposer.free_drafts(sequences, caps)
        stats.draft_seconds += self.clock() - started
        policy = self._policy(rows, sequences, k)
        with LEARNING:
            plan = policy.plan(len(rows), [len(d) for d in lookups], preferred, caps, self.proposer.model is not None)
        return policy, caps, lookups, preferred, plan

    def _policy(self, rows: list[Row], sequences: list[list[int]], widest: int):
        """The policy of this step (fixed while a seeded sampled row runs), with costs for
        this batch size (probed up to `widest` drafted tokens when none are known and a
        draft model needs them; a probe waits for a step where no row has a token yet)."""
        policy = self.fixed if any(row.pins_k for row in rows) else self.policy
        fresh = not any(row.generated for row in rows)
        with LEARNING:
            policy.prepare(len(rows), lambda: measure(self.target, self.state, sequences, self.proposer, widest,
                                                      self.clock), fresh)
        return policy

    def _draft(self, sequences, caps, lookups, preferred, plan, stats: DecodeStats):
        """Rows take their free draft as the plan says (a preferred match, unless the model is
        expected to do better; any match when the model sits out); the model drafts for the
        others. Cut to the longest row's draft (no draft at all: a plain step)."""
        lookup = [d[:plan.width] if plan.takes_lookup(i, bool(d), p) else None
                  for i, (d, p) in enumerate(zip(lookups, preferred))]
        limits = [0 if d is not None or not plan.use_model else min(plan.width, cap) for d, cap in zip(lookup, caps)]
        started = self.clock()
        drafted, draft_seconds = None, 0.0
        if max(limits) > 0:
            self.proposer.catch_up(sequences)  # apart: reading a prompt is not what drafting costs
            caught_up = self.clock()
            drafted = self.proposer.propose(sequences, limits, plan.min_confidence)
            draft_seconds = self.clock() - caught_up
            stats.draft_forward_seconds += self.clock() - started
        proposal = merge_drafts(lookup, drafted, self.target.device)
        width = max(proposal.lengths)
        if proposal.tokens.shape[1] > width:
            proposal.tokens = proposal.tokens[:, :width]
            if proposal.probs is not None:
                proposal.probs = proposal.probs[:, :width]
        if proposal.confidences is not None:
            proposal.confidences = [c[:width] for c in proposal.confidences]
        stats.draft_seconds += self.clock() - started
        return proposal, limits, drafted is not None, draft_seconds

    def _verify(self, rows: list[Row], proposal, stats: DecodeStats):
        """One target forward over every row's last committed token and drafts, then each
        row's acceptance rule."""
        started = self.clock()
        last = torch.tensor([[row.sequence[-1]] for row in rows], device=self.target.device)
        tokens = torch.cat([last, proposal.tokens], 1)
        logits, hidden = self._target_forward(tokens)  # (B, K+1, V), (B, K+1, H) or None
        stats.target_forward_seconds += self.clock() - started
        check_finite(logits, "target", [1 + n for n in proposal.lengths])
        accepted, extra = verify_rows(proposal.tokens, proposal.lengths, proposal.probs, logits.float(),
                                      [row.sampler for row in rows], [row.target_generator for row in rows])
        seconds = self.clock() - started
        stats.verify_seconds += seconds
        return accepted, extra, hidden, seconds

    def _target_forward(self, tokens, *args, **kwargs):
        """The verify forward: logits, and the final hidden states when a draft head reads
        them (else None)."""
        if self.reads_features:
            return self.target.forward(tokens, self.state, *args, return_hidden=True, **kwargs)
        return self.target.forward(tokens, self.state, *args, **kwargs), None

    def _commit(self, rows: list[Row], proposal, accepted, extra, hidden, ran: bool, stats: DecodeStats,
                outputs: list) -> None:
        drafts = proposal.tokens.tolist()
        for row, tokens, length, kept, token in zip(rows, drafts, proposal.lengths, accepted, extra):
            output = row.commit(tokens[:kept] + [token], length, kept)
            stats.generated += len(output.new_token_ids)
            outputs.append((row.number, output))
            if row.finished:
                self._forget(row)
        stats.target_forwards += 1
        stats.record_step(proposal.lengths, accepted)
        self.target.rollback(self.state, [len(row.sequence) - 1 for row in rows])
        if hidden is not None:  # the last committed token and the accepted drafts are in the target's state
            self.proposer.read_features([hidden[b, :kept + 1] for b, kept in enumerate(accepted)])
        if ran:  # the draft model ran: it rolls back to what was kept
            self.proposer.commit([row.sequence for row in rows])

    def _tree_step(self, rows: list[Row], stats: DecodeStats, outputs: list) -> None:
        """Plan, draft, verify and commit with trees: rows with a lookup tree take it (when
        preferred to the draft model's), the draft model expands a tree for the others, all
        cut to the step's node budget (the policy's); one forward over every row's last token
        and nodes, each node seeing its ancestors only; then each row keeps its accepted path."""
        config, sequences = self.config, [row.sequence for row in rows]
        caps = [max(0, min(config.num_draft_tokens, row.left - 1)) for row in rows]  # depths a row can use
        started = self.clock()
        trees, preferred = self.proposer.free_trees(sequences, caps, config.tree_top_k, config.tree_max_tokens)
        model = self.proposer.model is not None
        take = [len(t) > 0 and (p or not model) for t, p in zip(trees, preferred)]
        sources = [LOOKUP if taken else MODEL if model and cap else None for taken, cap in zip(take, caps)]
        policy = self._policy(rows, sequences, config.tree_max_tokens)
        with LEARNING:
            budget = policy.plan_tree(len(rows), sources, list(map(len, trees)), caps)
        trees = [t.prefix(budget) if taken else Tree([], []) for t, taken in zip(trees, take)]
        limits = [min(cap, budget) if source == MODEL else 0 for source, cap in zip(sources, caps)]
        draft_seconds = 0.0
        if max(limits) > 0:
            self.proposer.catch_up(sequences)
            caught_up = self.clock()
            drafted = self.proposer.propose_tree(sequences, limits, config.tree_top_k, budget)
            draft_seconds = self.clock() - caught_up
            stats.draft_forward_seconds += draft_seconds
            trees = [d if limit else t for t, d, limit in zip(trees, drafted, limits)]
        stats.draft_seconds += self.clock() - started
        started = self.clock()
        starts = [len(seq) - 1 for seq in sequences]
        tokens, positions, mask, counts = tree_inputs(trees, [seq[-1] for seq in sequences], starts,
                                                      self.target.device)
        logits, hidden = self._target_forward(tokens, counts, positions=positions, tree=mask)  # (B, 1+N, V)
        check_finite(logits, "target", counts)
        verify_seconds = self.clock() - started
        stats.target_forward_seconds += verify_seconds
        # Every node is a deterministic candidate (lookup branches, a draft's top-k children).
        paths, extra = tree_verify_rows(trees, None, logits.float(), [row.sampler for row in rows],
                                        [row.target_generator for row in rows])
        kept = [[0] + [node + 1 for node in path] for path in paths]
        self.target.compact(self.state, starts, kept)
        stats.verify_seconds += self.clock() - started
        for row, tree, path, token in zip(rows, trees, paths, extra):
            output = row.commit([tree.tokens[node] for node in path] + [token], len(tree), len(path))
            stats.generated += len(output.new_token_ids)
            outputs.append((row.number, output))
            if row.finished:
                self._forget(row)
        stats.target_forwards += 1
        depths = [max(t.depths(), default=0) for t in trees]
        stats.record_step(depths, [len(p) for p in paths], list(map(len, trees)))
        with LEARNING:
            policy.observe_tree(len(rows), sources, paths, depths, caps, budget, tokens.shape[1], verify_seconds,
                                max(limits), draft_seconds)
        self.target.rollback(self.state, [len(row.sequence) - 1 for row in rows])
        if hidden is not None:  # the last committed token and the accepted path are in the target's state
            self.proposer.read_features([hidden[b, index] for b, index in enumerate(kept)])
        if max(limits) > 0:
            self.proposer.commit([row.sequence for row in rows])

    def _recover(self, error: Exception, outputs: list) -> None:
        """A phase of the step raised. Non-finite logits end the rows they came from; anything
        else ends every running row (which one caused it cannot be told, and going on could
        fail the same way forever). Rows that already finished this step keep their ending;
        the others go on from a fresh state."""
        rows = self.running
        if isinstance(error, NonFiniteLogits) and error.rows:
            bad = set(error.rows)
            why = f"the {error.role} model gave non-finite logits (NaN or infinity) for it; its weights or " \
                  "configuration are broken (e.g. NaN weights, rms_norm_eps NaN or negative)"
        else:
            bad, why = set(range(len(rows))), f"the engine failed during a step: {describe(error)}"
        survivors = []
        for i, row in enumerate(rows):
            if row.finished:
                continue
            if i in bad:
                self._fail(row, why, outputs)
            else:
                survivors.append(row)
        self._restart(survivors)

    def _restart(self, rows: list[Row]) -> None:
        """Drop the target's state and the proposer's rows (whatever a failed phase left in
        them); `rows` wait at the front of the queue and join again, their prompt and output
        read as their prompt: the same tokens follow (greedy), as a joining row's do."""
        self.running, self.state = [], None
        self.proposer = self.proposer.fork()
        self.waiting.extendleft(reversed(rows))

    def _retire(self, leaving: set[int]) -> None:
        """Finished rows leave the batch and stop costing compute."""
        if not leaving:
            return
        order = refill_order(len(self.running), leaving)
        self.target.select_rows(self.state, order)
        self.proposer.select_rows(order)
        self.running = [self.running[i] for i in order]

    def _finish(self, row: Row, reason: str, outputs: list, error: str | None = None) -> None:
        row.finish_reason = reason
        outputs.append((row.number, RequestOutput(row.request_id, [], True, reason, error)))
        self._forget(row)

    def _fail(self, row: Row, why: str, outputs: list) -> None:
        """End a request that cannot go on, saying why (finish reason "error")."""
        self._finish(row, "error", outputs, f"request {row.request_id!r} failed: {why}")

    def _forget(self, row: Row) -> None:
        """A finished request: only its stats stay (the last KEPT_STATS of them)."""
        self._live.pop(row.request_id, None)
        self._finished[row.request_id] = row.stats
        if len(self._finished) > KEPT_STATS:
            self._finished.popitem(last=False)


def describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"
