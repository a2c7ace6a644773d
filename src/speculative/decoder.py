"""The engine: propose -> verify -> commit -> roll back, and the plain reference it must match.

One step, per row of the batch: the draft proposes up to K tokens; the target scores the
last committed token plus all drafts in one forward (K+1 rows of logits); verification
keeps the longest acceptable prefix and adds one target token (recovered or bonus); both
sides roll back to the committed prefix. Rows keep their own lengths throughout, so one
row's rejection never costs another row its accepted tokens, and rows that finish leave
the batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from .adaptive import AdaptivePolicy, Costs, Plan
from .config import SpeculativeConfig, as_config
from .inputs import (check_draft, check_draft_width, check_eos, check_length, check_model, check_token_range,
                     normalize_max_new, normalize_prompts)
from .inputs import row_seeds as checked_row_seeds
from .proposers.base import Proposal
from .proposers.draft_model import DraftModelProposer, pad
from .proposers.hybrid import HybridProposer
from .proposers.ngram import NGramProposer, pad_rows
from .sampling import make_generators, probabilities, sample
from .stats import DecodeStats
from .text import same_vocabulary
from .verify import greedy_verify, rejection_verify


def row_seeds(config: SpeculativeConfig, batch: int, seeds: list[int] | None) -> list[int | None]:
    """Seed of each row: given per row, else config.seed + row index, else fresh randomness."""
    return checked_row_seeds(seeds, batch, config.seed)


def draft_seed(seed: int | None) -> int | None:
    """A second stream per row for the draft, so drafting never shifts the target's draws."""
    return None if seed is None else (seed * 0x9E3779B1 + 0x5EED) % (2 ** 63)


def prefill(model, prompts: list[list[int]], capacity: int):
    """A fresh state that has seen every prompt but its last token (fed with the first step)."""
    state = model.new_state(len(prompts), capacity)
    heads = [p[:-1] for p in prompts]
    if max(map(len, heads)) > 0:
        model.forward(pad(heads, model.device), state, [len(h) for h in heads], keep_logits=False)
    return state


def cut(tokens: list[int], budget: int, eos: set[int]) -> tuple[list[int], bool]:
    """Tokens that fit the row's budget, up to and including EOS; and whether the row is done."""
    tokens = tokens[:budget]
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[:i + 1], True
    return tokens, len(tokens) == budget


def check_compatible(target, proposer) -> None:
    """Draft and target must share one vocabulary: compared by tokenizer when both have
    one (padded embedding matrices, as in Qwen, then pass), else by vocabulary size."""
    draft = getattr(proposer, "model", None)
    draft_vocab = getattr(proposer, "vocab_size", None)
    if draft_vocab is None:
        return  # n-gram lookup proposes ids from the sequence itself
    target_tok, draft_tok = getattr(target, "tokenizer", None), getattr(draft, "tokenizer", None)
    if target_tok is not None and draft_tok is not None:
        if not same_vocabulary(target_tok, draft_tok):
            raise ValueError(f"draft and target tokenizers differ: draft {draft_tok.name} ({len(draft_tok)} tokens), "
                             f"target {target_tok.name} ({len(target_tok)} tokens); both sides need one tokenizer")
        return
    if draft_vocab != target.vocab_size:
        raise ValueError(f"draft and target vocabularies differ: draft has {draft_vocab} tokens, target "
                         f"has {target.vocab_size}; both sides must share one vocabulary")


class SpeculativeDecoder:
    """Speculative decoding of `main_model` (the target) with `draft_model` proposing.

    `draft_model` is a model following `speculative.models.base` or a proposer such as
    `NGramProposer`. Greedy verification reproduces the target's greedy output exactly;
    sampling verification reproduces its distribution exactly.
    """

    def __init__(self, main_model, draft_model, config: SpeculativeConfig | None = None, draft_vocab=None):
        """`draft_vocab`: token ids the draft model scores alone (a reduced vocabulary,
        `speculative.vocab.corpus_vocab`); None scores all."""
        self.config = as_config(config)
        check_model(main_model)
        check_draft(draft_model)
        self.main_model = main_model
        self.draft_model = draft_model
        if hasattr(draft_model, "propose"):
            if draft_vocab is not None:
                raise ValueError("draft_vocab applies to a draft model; pass it to the proposer itself")
            self.proposer = draft_model
        else:
            sampling = self.config.sampling
            self.proposer = DraftModelProposer(
                draft_model, self.config.draft_temperature if sampling else 0.0,
                self.config.top_k, self.config.top_p, sampling, vocab=draft_vocab)
            if self.config.prompt_lookup:
                lookup = NGramProposer(self.config.max_ngram, self.config.min_ngram, self.config.num_draft_tokens)
                self.proposer = HybridProposer(self.proposer, lookup)
        check_compatible(main_model, self.proposer)
        self.stats = DecodeStats()
        # Learned across generations: acceptance and costs carry over from call to call.
        self.policy = AdaptivePolicy(max_k=self.config.num_draft_tokens)

    def acceptance_rate(self) -> float:
        """Accepted / drafted over everything generated since the last reset_stats()."""
        return self.stats.acceptance_rate

    def reset_stats(self) -> None:
        self.stats = DecodeStats()

    def generate(self, prompt_ids, max_new_tokens, eos_token_id=None, seeds: list[int] | None = None):
        """New tokens only: a list of ids for one prompt, a list of lists for a batch."""
        prompts, batched = normalize_prompts(prompt_ids)
        outputs: list[list[int]] = [[] for _ in prompts]
        for row, tokens in self._run(prompts, max_new_tokens, eos_token_id, seeds):
            outputs[row].extend(tokens)
        return outputs if batched else outputs[0]

    def stream(self, prompt_ids, max_new_tokens, eos_token_id=None, seeds: list[int] | None = None) -> Iterator:
        """Yield tokens as they are committed: ids for one prompt, (row, id) pairs for a batch."""
        prompts, batched = normalize_prompts(prompt_ids)
        for row, tokens in self._run(prompts, max_new_tokens, eos_token_id, seeds):
            for token in tokens:
                yield (row, token) if batched else token

    def _run(self, prompts: list[list[int]], max_new_tokens, eos_token_id, seeds) -> Iterator[tuple[int, list[int]]]:
        cfg, target, proposer, stats = self.config, self.main_model, self.proposer, self.stats
        batch = len(prompts)
        budgets = normalize_max_new(max_new_tokens, batch)
        check_token_range(prompts, target.vocab_size)
        eos = check_eos(eos_token_id, target.vocab_size)
        check_length(prompts, budgets, target, "target")
        check_draft_width(cfg.num_draft_tokens, target, "target")
        if getattr(proposer, "model", None) is not None:
            check_length(prompts, budgets, proposer.model, "draft")
            check_draft_width(cfg.num_draft_tokens, proposer.model, "draft")
        # A seed pins K: adaptive K follows timings, which would make sampled output vary.
        seeded = cfg.seed is not None or seeds is not None
        policy = self.policy if cfg.adaptive and not (cfg.sampling and seeded) else None
        seeds = row_seeds(cfg, batch, seeds)
        target_gens = make_generators(seeds, target.device)
        draft_gens = make_generators([draft_seed(s) for s in seeds], target.device)
        capacity = max(len(p) + m for p, m in zip(prompts, budgets)) + cfg.num_draft_tokens + 1
        has_model = not isinstance(proposer, NGramProposer)  # n-gram lookup alone: no model to plan for

        started = time.perf_counter()
        with torch.inference_mode():
            state = prefill(target, prompts, capacity)
            proposer.start(prompts, capacity, draft_gens)
        sequences = [list(p) for p in prompts]
        produced = [0] * batch
        active = list(range(batch))
        stats.prefill_seconds += time.perf_counter() - started
        stats.total_seconds += time.perf_counter() - started
        while True:
            started = time.perf_counter()
            done = [i for i, r in enumerate(active) if produced[r] >= budgets[r]]
            if done:
                keep = [i for i in range(len(active)) if i not in done]
                active = [active[i] for i in keep]
                if active:  # finished rows leave the batch and stop costing compute
                    target.select_rows(state, keep)
                    proposer.select_rows(keep)
                    target_gens = [target_gens[i] for i in keep]
            if not active:
                stats.total_seconds += time.perf_counter() - started
                return
            rows = [sequences[r] for r in active]
            remaining = [budgets[r] - produced[r] for r in active]
            with torch.inference_mode():
                if policy is not None and len(rows) not in policy.costs:
                    policy.costs[len(rows)] = self._measure_costs(state, rows)
                # Each row drafts at most what it can still use, whatever the rest of the batch.
                caps = [max(0, min(cfg.num_draft_tokens, left - 1)) for left in remaining]
                lookups, preferred = self._lookup(rows, caps)
                if policy is None:
                    plan = Plan(cfg.num_draft_tokens, has_model)
                else:
                    plan = policy.plan(len(rows), [len(d) for d in lookups], preferred, caps, has_model)
                # A row takes its lookup draft when preferred, or when the draft model sits out.
                lookup = [d[:plan.width] if d and (p or not plan.use_model) else None
                          for d, p in zip(lookups, preferred)]
                limits = [0 if d is not None or not plan.use_model else min(plan.width, cap)
                          for d, cap in zip(lookup, caps)]
                min_confidence = None if policy is None else plan.min_confidence
                proposal, draft_seconds, forwards = self._propose(rows, lookup, limits, min_confidence)
                accepted, extra, verify_seconds = self._verify(state, rows, proposal, target_gens)
            stats.target_forwards += 1
            stats.record_step(proposal.lengths, accepted)
            if policy is not None:
                learn(policy, len(rows), proposal, limits, accepted, verify_seconds, forwards, draft_seconds)
            drafts = proposal.tokens.tolist()
            events = []
            for i, r in enumerate(active):
                new, finished = cut(drafts[i][:accepted[i]] + [extra[i]], remaining[i], eos)
                sequences[r] += new
                produced[r] = budgets[r] if finished else produced[r] + len(new)
                stats.generated += len(new)
                events.append((r, new))
            with torch.inference_mode():
                target.rollback(state, [len(sequences[r]) - 1 for r in active])
                if forwards is not None:  # the proposer ran: it rolls back to what was kept
                    proposer.commit([sequences[r] for r in active])
            stats.total_seconds += time.perf_counter() - started
            yield from events

    def _lookup(self, rows: list[list[int]], caps: list[int]) -> tuple[list[list[int]], list[bool]]:
        """Per row, what prompt lookup drafts for free (empty: no match), and whether it
        is preferred to the draft model (a long enough match)."""
        started = time.perf_counter()
        if isinstance(self.proposer, HybridProposer):
            drafts, preferred = self.proposer.lookup_drafts(rows, caps)
        elif isinstance(self.proposer, NGramProposer):
            drafts, preferred = self.proposer.lookup(rows, caps)[0], [True] * len(rows)
        else:
            drafts, preferred = [[] for _ in rows], [False] * len(rows)
        self.stats.draft_seconds += time.perf_counter() - started
        return drafts, preferred

    def _propose(self, rows: list[list[int]], lookup: list[list[int] | None], limits: list[int],
                 min_confidence: float | None):
        """Drafts for this step: row b takes lookup[b] if not None, else up to limits[b]
        tokens from the draft model; cut to the longest row's draft (no row drafting
        means a plain one-token target step, with nothing wasted). Returns the proposal,
        the seconds spent and the draft-model forwards run (None: the proposer did not run)."""
        device = self.main_model.device
        started = time.perf_counter()
        forwards_before = getattr(self.proposer, "forwards", 0)
        forward_before = getattr(self.proposer, "forward_seconds", 0.0)
        forwards = None
        if max(limits) > 0:
            kwargs = {"lookup": lookup} if isinstance(self.proposer, HybridProposer) else {}
            if min_confidence is not None and getattr(self.proposer, "reports_confidence", False):
                kwargs["min_confidence"] = min_confidence
            proposal = self.proposer.propose(rows, limits, **kwargs)
            forwards = getattr(self.proposer, "forwards", forwards_before + max(limits)) - forwards_before
        else:
            drafts = [d or [] for d in lookup]
            proposal = Proposal(pad_rows(drafts), [len(d) for d in drafts], free=[d is not None for d in lookup])
        seconds = time.perf_counter() - started
        self.stats.draft_seconds += seconds
        self.stats.draft_forward_seconds += getattr(self.proposer, "forward_seconds", 0.0) - forward_before
        width = max(proposal.lengths)
        probs = None if proposal.probs is None else proposal.probs[:, :width]
        confidences = None if proposal.confidences is None else [c[:width] for c in proposal.confidences]
        return Proposal(proposal.tokens[:, :width].to(device), proposal.lengths, probs,
                        confidences, proposal.free), seconds, forwards

    def _verify(self, state, rows: list[list[int]], proposal: Proposal, generators):
        """One target forward over the last committed token and the drafts, then the
        acceptance rule: (accepted per row, the extra token per row, seconds)."""
        cfg, target = self.config, self.main_model
        started = time.perf_counter()
        last = torch.tensor([[row[-1]] for row in rows], device=target.device)
        logits = target.forward(torch.cat([last, proposal.tokens], 1), state)  # (B, K+1, V)
        self.stats.target_forward_seconds += time.perf_counter() - started
        if cfg.sampling:
            p = probabilities(logits, cfg.main_temperature, cfg.top_k, cfg.top_p)
            accepted, extra = rejection_verify(proposal.tokens, proposal.lengths, proposal.probs, p, generators)
        else:
            accepted, extra = greedy_verify(proposal.tokens, proposal.lengths, logits)
        accepted, extra = accepted.tolist(), extra.tolist()
        seconds = time.perf_counter() - started
        self.stats.verify_seconds += seconds
        return accepted, extra, seconds

    def _measure_costs(self, state, rows: list[list[int]]) -> Costs:
        """Time target forwards of width 1 and K+1 and one drafted token at this batch size
        (forward, then roll back), once per batch size: the adaptive policy's cost model."""
        target, k = self.main_model, self.config.num_draft_tokens
        lengths = list(state.lengths)
        last = torch.tensor([[row[-1]] for row in rows], device=target.device)
        widths = sorted({1, 2, k + 1})
        seconds = {}
        for width in widths * 2:  # twice each: the first call may allocate
            started = time.perf_counter()
            target.forward(last.repeat(1, width), state)
            synchronize(target.device)
            elapsed = time.perf_counter() - started
            seconds[width] = min(seconds.get(width, elapsed), elapsed)
            target.rollback(state, lengths)
        probe = getattr(self.proposer, "probe_seconds", None)
        costs = Costs(v1=seconds[1], draft=probe(rows) if probe is not None else 1e-5)
        for width in widths[1:]:
            costs.add(width, seconds[width], weight=3.0, robust=False)  # worth a few observed steps
        return costs


def learn(policy: AdaptivePolicy, batch: int, proposal: Proposal, limits: list[int], accepted: list[int],
          verify_seconds: float, forwards: int | None, draft_seconds: float) -> None:
    """Feed one step to the adaptive policy: lookup rows teach it the lookup's acceptance,
    the others the draft model's, and where the model stopped short of its limit."""
    free = proposal.free or [False] * len(accepted)
    lookup = [i for i, f in enumerate(free) if f]
    policy.lookup.observe([proposal.lengths[i] for i in lookup], [accepted[i] for i in lookup])
    model = [i for i, f in enumerate(free) if not f and limits[i] > 0]
    policy.model.observe([proposal.lengths[i] for i in model], [accepted[i] for i in model])
    policy.model.observe_stops([limits[i] for i in model], [proposal.lengths[i] for i in model])
    if proposal.confidences is not None:
        policy.observe_confidence([proposal.lengths[i] for i in model], [accepted[i] for i in model],
                                  [proposal.confidences[i] for i in model])
    policy.observe_costs(batch, proposal.tokens.shape[1] + 1, verify_seconds, forwards or 0, draft_seconds)


def synchronize(device) -> None:
    """Wait for queued GPU work, so that wall-clock timings mean something there too."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def autoregressive_generate(model, prompt_ids, max_new_tokens, config: SpeculativeConfig | None = None,
                            eos_token_id=None, seeds: list[int] | None = None):
    """The plain reference: one target forward per token, same model code, no drafting.

    Greedy unless `config.greedy_verification` is False and `config.main_temperature` > 0,
    in which case it samples with main_temperature / top_k / top_p, row b from its own
    generator (seeded like the speculative decoder's target stream).
    """
    config = as_config(config)
    check_model(model, "model")
    prompts, batched = normalize_prompts(prompt_ids)
    batch = len(prompts)
    budgets = normalize_max_new(max_new_tokens, batch)
    check_token_range(prompts, model.vocab_size)
    eos = check_eos(eos_token_id, model.vocab_size)
    check_length(prompts, budgets, model, "target")
    generators = make_generators(row_seeds(config, batch, seeds), model.device)
    outputs: list[list[int]] = [[] for _ in prompts]
    active = list(range(batch))  # rows still generating; finished rows leave the batch
    with torch.inference_mode():
        state = prefill(model, prompts, max(len(p) + m for p, m in zip(prompts, budgets)) + 1)
        last = [p[-1] for p in prompts]
        while True:
            keep = [i for i, row in enumerate(active) if len(outputs[row]) < budgets[row]
                    and not (outputs[row] and outputs[row][-1] in eos)]
            if not keep:
                break
            if len(keep) < len(active):
                model.select_rows(state, keep)
                active, last = [active[i] for i in keep], [last[i] for i in keep]
                generators = [generators[i] for i in keep]
            logits = model.forward(torch.tensor(last, device=model.device)[:, None], state)[:, -1]  # (B, V)
            if config.sampling:
                tokens = sample(probabilities(logits, config.main_temperature, config.top_k, config.top_p),
                                generators).tolist()
            else:
                tokens = logits.argmax(-1).tolist()
            for row, token in zip(active, tokens):
                outputs[row].append(token)
            last = tokens
    return outputs if batched else outputs[0]
