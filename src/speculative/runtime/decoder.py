"""SpeculativeDecoder: generate and stream over the step engine, and the plain reference.

Every call runs its own `Engine`, so its rows, states and random streams are its own:
one decoder serves several threads at once, and several live `stream()` generators.
What the calls share is what they learn (the adaptive policy) and count (`stats`),
updated under a lock.
"""

from __future__ import annotations

from collections.abc import Iterator


from ..core.config import SpeculativeConfig, as_config
from ..core.deprecation import renamed_attribute, renamed_keywords
from ..core.inputs import (check_draft, check_draft_width, check_eos, check_length, check_model, check_token_range,
                     normalize_max_new, normalize_prompts)
from ..core.inputs import row_seeds as checked_row_seeds
from ..core.rows import SamplingParams
from ..core.stats import DecodeStats
from ..policy.adaptive import AdaptivePolicy
from ..policy.costs import cost_book
from ..proposers import as_proposer, default_config
from .engine import LEARNING, Engine, check_compatible
from .reference import plain_generate


class GenerationError(RuntimeError):
    """A prompt could not be generated to its end: the message says which and why (the
    engine's error, e.g. a model's non-finite logits, or an exception in a step)."""


def row_seeds(config: SpeculativeConfig, batch: int, seeds: list[int] | None) -> list[int | None]:
    """Seed of each row: given per row, else config.seed + row index, else fresh randomness."""
    return checked_row_seeds(seeds, batch, config.seed)


class SpeculativeDecoder:
    """Speculative decoding of `target` with `draft` proposing.

    `draft` is a model following `speculative.models.base` or a proposer such as
    `NGramProposer`. Greedy verification reproduces the target's greedy output exactly;
    sampling verification reproduces its distribution exactly. The source design's
    keywords `main_model` and `draft_model` still work, with a DeprecationWarning.
    """

    @renamed_keywords(main_model="target", draft_model="draft")
    def __init__(self, target, draft, config: SpeculativeConfig | None = None, draft_vocab="auto"):
        """`config`: None gives the defaults `generate` runs with (`proposers.default_config`).
        `draft_vocab`: token ids the draft model scores alone (a reduced vocabulary,
        `speculative.proposers.vocab.corpus_vocab`); "auto" what `generate` gives it
        (`vocab.auto_vocab`: 32,768 tokens for a draft over more than 65,536), None all."""
        self.config = default_config(draft, config)
        check_model(target, "target")
        check_draft(draft)
        self.target = target
        self.draft = draft
        # The proposer every call forks its own from (the calls never share rows).
        self.proposer = as_proposer(draft, self.config, draft_vocab, target=target)
        check_compatible(target, self.proposer)
        self.stats = DecodeStats()
        # Learned across generations: acceptance and costs carry over from call to call.
        self.policy = AdaptivePolicy.for_config(self.config, cost_book(target, self.proposer.model))

    main_model = renamed_attribute("main_model", "target")
    draft_model = renamed_attribute("draft_model", "draft")

    def acceptance_rate(self) -> float:
        """Accepted / drafted over everything generated since the last reset_stats()."""
        return self.stats.acceptance_rate

    def reset_stats(self) -> None:
        with LEARNING:
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
        """All prompts as requests of one engine of their own (row b is request b)."""
        cfg, target = self.config, self.target
        token_budgets = normalize_max_new(max_new_tokens, len(prompts))
        check_token_range(prompts, target.vocab_size)
        eos = sorted(check_eos(eos_token_id, target.vocab_size))
        check_length(prompts, token_budgets, target, "target")
        check_draft_width(cfg.longest_draft, target, "target")
        if self.proposer.model is not None:
            check_length(prompts, token_budgets, self.proposer.model, "draft")
            check_draft_width(cfg.num_draft_tokens, self.proposer.model, "draft")
        seeds = row_seeds(cfg, len(prompts), seeds)
        temperature = cfg.target_temperature if cfg.sampling else 0.0
        engine = Engine(target, self.proposer, cfg, max_batch_size=len(prompts),
                        policy=self.policy if cfg.adaptive else None, totals=lambda: self.stats)
        for row, (prompt, budget, seed) in enumerate(zip(prompts, token_budgets, seeds)):
            engine.add_request(prompt, SamplingParams(budget, temperature, cfg.top_k, cfg.top_p, seed, eos), row)
        while engine.has_unfinished():
            for output in engine.step():
                if output.new_token_ids:
                    yield output.request_id, output.new_token_ids
                if output.finish_reason == "error":
                    raise GenerationError(output.error)


def autoregressive_generate(model, prompt_ids, max_new_tokens, config: SpeculativeConfig | None = None,
                            eos_token_id=None, seeds: list[int] | None = None):
    """The plain reference: one target forward per token, same model code, no drafting.

    Greedy unless `config.greedy_verification` is False and `config.target_temperature` > 0,
    in which case it samples with target_temperature / top_k / top_p, row b from its own
    generator (seeded like the speculative decoder's target stream). Per-request settings
    (penalties, logprobs, ...): `reference.plain_generate`, which this calls.
    """
    config = as_config(config)
    check_model(model, "model")
    prompts, batched = normalize_prompts(prompt_ids)
    budgets = normalize_max_new(max_new_tokens, len(prompts))
    check_token_range(prompts, model.vocab_size)
    eos = tuple(sorted(check_eos(eos_token_id, model.vocab_size)))
    check_length(prompts, budgets, model, "target")  # checked in the decoder's order, seeds last
    temperature = config.target_temperature if config.sampling else 0.0
    params = [SamplingParams(budget, temperature, config.top_k, config.top_p, seed, eos)
              for budget, seed in zip(budgets, row_seeds(config, len(prompts), seeds))]
    outputs = [out.token_ids for out in plain_generate(model, prompts, params)]
    return outputs if batched else outputs[0]
