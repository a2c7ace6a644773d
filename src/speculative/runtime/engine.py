"""The step engine: requests join and leave a running batch, each with its own sampling settings.

Glossary (one name per concept, here, in phases.py, rows.py, proposers/, adaptive.py and
docs/glossary.md):

- target: the model whose output is reproduced exactly (the source designs' "verifier" and
  "main model"). draft: whatever proposes tokens for it: a draft model, a draft head, n-gram
  lookup or a suffix cache; the engine reaches it through a proposer (proposers/base.py).
- request: a prompt, its SamplingParams and an id, from `add_request` until it finishes;
  it waits in the queue until a row is free.
- row: a running request; row i of the batch is row i of the target's state and of the
  proposer's (`rows.Row`, the per-row state).
- sequence: a row's prompt and committed tokens. Its last token is not yet in the target's
  state: every step feeds it first.
- token budget: the most new tokens a request may get (`max_new_tokens`); left: what remains.
- K (`num_draft_tokens`): the longest draft a row may take in one step (with `adaptive`,
  the largest the policy may choose; with trees, the deepest a tree may go). Behind a draft
  model, a lookup match may reach `lookup_draft_tokens` instead (the longest draft,
  `config.longest_draft`); the draft model stays within K.
- draft length: the tokens one row drafted this step. max draft (`max_drafts[b]`): the
  longest draft row b may take this step: the longest draft, and one less than its tokens left.
- limit (`limits[b]`): the most tokens the draft model is asked for row b (0: none).
- verify width: the positions one row feeds the target in a verify forward: its last
  committed token and its drafts (draft length + 1; a tree: nodes + 1).
- argmax rows: the greedy rows of a verify forward, whose logits are read only for their
  argmax; a target that screens them (`screens_argmax`) may score most tokens -inf there.
- free draft: tokens drafted at no cost (prompt lookup), `preferred` when a long match
  makes them better than the draft model's.
- plan: how far this step drafts (its K) and whether the draft model runs, for the batch as
  a whole (`FixedPolicy`, or `AdaptivePolicy` from measured acceptance and costs).
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

A step runs five phases (`Engine.step`): 1 admit, 2 propose (plan and draft), 3 verify,
4 accept (commit, roll back, learn), 5 retire. Phases 2-4 are `phases.ChainPhases` or
`phases.TreePhases`.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import OrderedDict, deque
from typing import Callable, Hashable

import torch

from ..core.config import SpeculativeConfig
from ..core.inputs import check_draft, check_model, normalize_prompts
from ..core.logprobs import prompt_logprobs
from ..core.rows import RequestOutput, Row, SamplingParams
from ..core.sampling import GREEDY, NonFiniteLogits, Sampler
from ..core.stats import DecodeStats, RequestStats
from ..core.tree import can_branch
from ..models.base import prefill, screens_argmax
from ..policy.adaptive import AdaptivePolicy, FixedPolicy
from ..policy.costs import cost_book
from ..proposers import as_proposer, default_config
from ..proposers.base import branches, reads_features
from .admission import (check_batch_size, check_can_join_running, check_compatible, check_fits, check_grammar,
                        check_params, check_request_id, refill_order)
from .phases import LEARNING, ChainPhases, TreePhases

# Finished requests whose stats `request_stats` still answers for.
KEPT_STATS = 10_000

__all__ = ["Engine", "LEARNING", "KEPT_STATS", "check_compatible", "refill_order", "describe"]


class Engine:
    """Continuous batching with speculative decoding (shaped like vLLM's LLMEngine).

    `draft` is a model, a proposer (such as NGramProposer), or None for plain decoding
    through the same engine. `config` gives K (`num_draft_tokens`), `adaptive`,
    `prompt_lookup` and `draft_temperature` (None: the defaults `generate` runs with,
    `proposers.default_config`); sampling settings come with each request. `draft_vocab`:
    the tokens a draft model scores ("auto": `proposers.vocab.auto_vocab`, as `generate`
    does; None: all).
    Greedy requests get exactly the target's own greedy tokens, sampled ones exactly its
    distribution, whatever else runs beside them. `policy` and `totals` (a function giving
    a DecodeStats) let several engines learn and count together, as a decoder's do.
    Every request added ends: with its tokens, or with finish reason "error" and an
    `error` that names the cause (`step` itself does not raise for a request's failure).
    """

    def __init__(self, target, draft=None, config: SpeculativeConfig | None = None, max_batch_size: int = 8, *,
                 draft_vocab="auto", policy: AdaptivePolicy | None = None,
                 totals: Callable[[], DecodeStats] | None = None, clock: Callable[[], float] = time.perf_counter):
        self.config = config = default_config(draft, config)
        self.max_batch_size = check_batch_size(max_batch_size)
        check_model(target, "target")
        if draft is not None:
            check_draft(draft)
        self.target = target
        self.clock = clock  # every timing: the stats, and what the adaptive policy learns
        self.proposer = as_proposer(draft, config, draft_vocab, target=target).fork()
        check_compatible(target, self.proposer)
        # A feature draft (a draft head) is handed the target's hidden states (proposers/base.py).
        self.reads_features = reads_features(self.proposer)
        self.fixed = FixedPolicy(config.longest_draft, config.tree_max_tokens)
        if policy is None and config.adaptive and draft is not None:
            policy = AdaptivePolicy.for_config(config, cost_book(target, self.proposer.model))
        self.policy = policy or self.fixed
        self.trees = (config.trees and draft is not None
                      and can_branch(target, self.proposer, config.tree_top_k, branches(self.proposer)))
        if self.trees and not self.policy.plans_trees:
            raise ValueError("this adaptive policy plans no tree budgets: make it with "
                             "AdaptivePolicy.for_config(config, book) for a configuration with tree_top_k > 1")
        self.phases = TreePhases(self) if self.trees else ChainPhases(self)
        # The most positions a row may feed beyond its sequence in one step (its verify width
        # less one): the widest draft (a draft model expanding a tree reads top_k nodes per
        # depth but the last).
        self.widest_draft = (max(config.longest_draft, config.tree_max_tokens,
                                 (config.num_draft_tokens - 1) * config.tree_top_k)
                             if self.trees else config.longest_draft)
        self.stats = DecodeStats()
        self.totals = totals
        self.waiting: deque[Row] = deque()
        self.running: list[Row] = []
        self.state = None
        self._live: dict[Hashable, Row] = {}
        self._finished: OrderedDict[Hashable, RequestStats] = OrderedDict()
        self._aborts: set[Hashable] = set()
        self._numbers = itertools.count()
        self._inside = threading.Lock()  # held by the one thread in add_request, abort or step
        self._broken: str | None = None  # why the engine refuses work: a step or request cut short

    @contextlib.contextmanager
    def _entered(self, what: str):
        """One thread at a time, and none after a step or request was cut short by an exception
        the engine does not handle (KeyboardInterrupt, or a bug): its rows, states and outputs may
        be half updated then, and going on would give wrong tokens silently (issue 62)."""
        if self._broken is not None:
            raise RuntimeError(f"this engine cannot go on: {self._broken}; its state may be half updated, so "
                               "build a new Engine (its requests are lost)")
        if not self._inside.acquire(blocking=False):
            raise RuntimeError(f"Engine.{what} was called while another thread was inside this engine: an Engine "
                               "is driven by one thread (a server runs it in one loop); SpeculativeDecoder's calls "
                               "each run their own engine and may share threads")
        try:
            yield
        except (ValueError, TypeError):  # a refused request: nothing changed
            raise
        except BaseException as error:
            self._broken = f"{type(error).__name__} in the middle of Engine.{what}"
            raise
        finally:
            self._inside.release()

    # --- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids, params: SamplingParams | None = None, request_id: Hashable | None = None):
        """Queue one prompt; returns its id. Everything is checked here: a bad request
        raises ValueError or TypeError and changes nothing for the others."""
        with self._entered("add_request"):
            return self._add(prompt_ids, params, request_id)

    def _add(self, prompt_ids, params: SamplingParams | None, request_id: Hashable | None):
        prompts, batched = normalize_prompts(prompt_ids)
        if batched:
            raise ValueError(f"add_request takes one prompt (a list of token ids), got a batch of {len(prompts)}")
        prompt = prompts[0]
        params = check_params(params)
        number = next(self._numbers)
        if request_id is None:
            request_id = str(number)
            while request_id in self._live:
                request_id += "'"
        else:
            check_request_id(request_id, self._live)
        check_fits(request_id, prompt, params, self.target, self.proposer.model)
        if params.grammar is not None:
            check_grammar(params.grammar, self.target, self.trees)
        if self.state is not None or len(self.waiting) >= self.max_batch_size:  # it will join a running batch
            check_can_join_running(self.target, self.proposer.model)
        draft_sampler = GREEDY if params.sampler.greedy else Sampler(
            self.config.draft_temperature, params.top_k, params.top_p)
        row = Row(request_id, number, list(prompt), params, draft_sampler, self.target.device)
        self._live[request_id] = row
        self.waiting.append(row)
        return request_id

    def abort(self, request_id: Hashable) -> bool:
        """Stop a request at the next step boundary (it then frees its row); False when no
        unfinished request has this id."""
        with self._entered("abort"):
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
        """One step of every running row; returns what each request got, in admission order.
        A step cut short by KeyboardInterrupt (or anything else it does not handle) leaves the
        engine refusing further work with a RuntimeError, never giving wrong tokens."""
        with self._entered("step"):
            return self._step()

    def _step(self) -> list[RequestOutput]:
        started = self.clock()
        stats = DecodeStats()
        outputs: list[tuple[int, RequestOutput]] = []
        with torch.inference_mode():
            self._admit(stats, outputs)                                           # 1 admit
            rows = self.running
            if rows:
                try:
                    drafts = self.phases.propose(rows, stats)                     # 2 propose
                    verdict = self.phases.verify(rows, drafts, stats)             # 3 verify
                    self.phases.accept(rows, drafts, verdict, stats, outputs)     # 4 accept
                    self._retire({i for i, row in enumerate(rows) if row.finished})   # 5 retire
                except Exception as error:  # noqa: BLE001 - every request must end, whatever failed
                    self._recover(error, outputs)
        stats.total_seconds = self.clock() - started
        self.stats.add(stats)
        if self.totals is not None:
            with LEARNING:
                self.totals().add(stats)
        return [output for _, output in sorted(outputs, key=lambda pair: pair[0])]

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
        capacity = max(len(p) + row.left for p, row in zip(prompts, joining)) + self.widest_draft + 1
        hidden = [] if self.reads_features else None
        echo = [row.params.prompt_logprobs is not None and row.generated == 0 for row in joining]
        logits = [] if any(echo) else None  # the prompts' logits, read only for prompt logprobs
        if self.state is None:
            self.state = prefill(self.target, prompts, capacity, hidden, logits)
        else:  # prefilled apart (only as long as the prompts), then added to the running rows
            self.target.add_rows(self.state, prefill(self.target, prompts, max(map(len, prompts)), hidden, logits),
                                 capacity)
        for row, wanted, scores in zip(joining, echo, logits or []):
            if wanted:
                row.prompt_logprobs = prompt_logprobs(scores, row.sequence, row.params.prompt_logprobs)
        self.proposer.add_rows(prompts, capacity, [row.draft_sampler for row in joining],
                               [row.draft_generator for row in joining])
        if hidden is not None:
            nothing = [hidden[0][:0]] * len(self.running)
            self.proposer.read_features(nothing + hidden)
        self.running += joining
        stats.prefill_seconds += self.clock() - started

    def argmax_rows(self, rows: list[Row]) -> list[bool] | None:
        """Which rows read only the argmax of their logits (greedy), for a target that takes it."""
        return [row.params.reads_argmax_only for row in rows] if screens_argmax(self.target) else None

    def _target_forward(self, tokens, *args, argmax_rows: list[bool] | None, **kwargs):
        """The verify forward: logits, and the final hidden states when a draft head reads
        them (else None)."""
        if argmax_rows is not None:
            kwargs["argmax_rows"] = argmax_rows
        if self.reads_features:
            return self.target.forward(tokens, self.state, *args, return_hidden=True, **kwargs)
        return self.target.forward(tokens, self.state, *args, **kwargs), None

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
