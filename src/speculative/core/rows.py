"""Requests and their rows: what a user asks for (SamplingParams), what each step gives back
(RequestOutput), and what the engine keeps for one running request (Row)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Hashable

import torch

from .config import MAX_NEW_TOKENS, at_most
from .grammar import Grammar
from .logprobs import MAX_LOGPROBS, TokenLogprob
from .penalties import Penalties
from .sampling import GREEDY, MIN_TEMPERATURE, Sampler, make_generators
from .stats import RequestStats

# Seeds torch.Generator.manual_seed accepts.
SEED_RANGE = (-2 ** 63, 2 ** 64 - 1)
FINISH_REASONS = ("length", "stop", "abort", "error")
# OpenAI's ranges of the penalties and of a logit bias.
PENALTY_RANGE = (-2.0, 2.0)
BIAS_RANGE = (-100.0, 100.0)


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. Checked on creation; errors say what is allowed."""

    # Most new tokens the request may get (its token budget).
    max_new_tokens: int = 128
    # 0 is greedy (the target's argmax, token-identical to plain decoding); above 0,
    # sampling from the target's distribution at this temperature (below MIN_TEMPERATURE,
    # about 1.2e-38, greedy too: what sampling tends to as the temperature falls).
    temperature: float = 0.0
    # When sampling: only the k most likely tokens (None: all).
    top_k: int | None = None
    # When sampling: only the smallest set of tokens whose probability reaches top_p (None: all).
    top_p: float | None = None
    # Seed of the request's random streams (target and draft): the same seed gives the same
    # tokens alone or in any batch. None: fresh randomness.
    seed: int | None = None
    # Token ids that end the request; the one that ends it is part of its output.
    stop_token_ids: tuple[int, ...] | None = None
    # Subtracted from a token's logit per time it occurs in the output (-2..2, OpenAI's).
    frequency_penalty: float = 0.0
    # Subtracted from a token's logit once it occurs in the output (-2..2, OpenAI's).
    presence_penalty: float = 0.0
    # Divides positive logits (multiplies negative ones) of tokens in the prompt or output (> 0; 1: off; vLLM's).
    repetition_penalty: float = 1.0
    # {token id: bias in -100..100} added to those logits (OpenAI's logit_bias).
    logit_bias: dict | None = None
    # stop_token_ids cannot end the request before it has this many tokens.
    min_tokens: int = 0
    # Per returned token, its log-probability and this many alternatives (0..20; None: none).
    logprobs: int | None = None
    # The prompt's tokens' log-probabilities and this many alternatives (0..20; None: none).
    prompt_logprobs: int | None = None
    # What the output must match (structured output, core/grammar.py); its end token is a stop token.
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        if not _integer(self.max_new_tokens) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        at_most(self.max_new_tokens, "max_new_tokens", MAX_NEW_TOKENS)
        if not _number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature!r}")
        if self.top_k is not None and (not _integer(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be None or an integer >= 1, got {self.top_k!r}")
        if self.top_p is not None and (not _number(self.top_p) or not 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be None or a number with 0 < top_p <= 1, got {self.top_p!r}")
        if self.seed is not None and (not _integer(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed must be None or an integer in {SEED_RANGE[0]}..{SEED_RANGE[1]}, got {self.seed!r}")
        stop = self.stop_token_ids
        if stop is not None:
            if isinstance(stop, (str, bytes)) or not hasattr(stop, "__iter__"):
                raise ValueError(f"stop_token_ids must be None or a list of token ids, got {stop!r}")
            stop = tuple(stop)
            bad = [t for t in stop if not _integer(t) or t < 0]
            if bad:
                raise ValueError(f"stop_token_ids must hold token ids (integers >= 0), got {bad[0]!r}")
            stop = tuple(int(t) for t in stop)
        self._check_logit_changes()
        if self.grammar is not None:
            if not isinstance(self.grammar, Grammar):
                raise ValueError(f"grammar must be None or a speculative Grammar, got {type(self.grammar).__name__}")
            if self.min_tokens:
                raise ValueError("min_tokens cannot be combined with a grammar (the grammar decides where the "
                                 "output ends); leave min_tokens at 0")
            stop = tuple(dict.fromkeys((*(stop or ()), self.grammar.end_token)))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _integer(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in 0..{MAX_LOGPROBS}, got {value!r}")
            object.__setattr__(self, name, None if value is None else int(value))
        for name, value in (("max_new_tokens", int(self.max_new_tokens)), ("stop_token_ids", stop),
                            ("temperature", float(self.temperature)),
                            ("seed", None if self.seed is None else int(self.seed)),
                            ("top_k", None if self.top_k is None else int(self.top_k)),
                            ("top_p", None if self.top_p is None else float(self.top_p))):
            object.__setattr__(self, name, value)

    def _check_logit_changes(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _number(value) or not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                raise ValueError(f"{name} must be a number in {PENALTY_RANGE[0]:g}..{PENALTY_RANGE[1]:g}, got {value!r}")
            object.__setattr__(self, name, float(value))
        value = self.repetition_penalty
        if not _number(value) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1: off), got {value!r}")
        object.__setattr__(self, "repetition_penalty", float(value))
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise ValueError(f"logit_bias must be None or a dict {{token id: bias}}, got {bias!r}")
            for token, value in bias.items():
                if not _integer(token) or token < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
                if not _number(value) or not BIAS_RANGE[0] <= value <= BIAS_RANGE[1]:
                    raise ValueError(f"logit_bias values must be numbers in {BIAS_RANGE[0]:g}..{BIAS_RANGE[1]:g}, "
                                     f"got {value!r} for token {token}")
            object.__setattr__(self, "logit_bias", {int(t): float(v) for t, v in sorted(bias.items())} or None)
        if not _integer(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be an integer in 0..max_new_tokens ({self.max_new_tokens}), "
                             f"got {self.min_tokens!r}")
        object.__setattr__(self, "min_tokens", int(self.min_tokens))

    def __hash__(self) -> int:  # logit_bias is a dict
        return hash((self.max_new_tokens, self.temperature, self.seed, self.min_tokens))

    @property
    def sampler(self) -> Sampler:
        """The target's p for this request."""
        return GREEDY if self.temperature < MIN_TEMPERATURE else Sampler(self.temperature, self.top_k, self.top_p)

    @property
    def penalties(self) -> Penalties | None:
        """What this request changes in the target's logits (None: nothing)."""
        penalties = Penalties(self.frequency_penalty, self.presence_penalty, self.repetition_penalty,
                              tuple((self.logit_bias or {}).items()), self.min_tokens, self.stop_token_ids or ())
        return penalties if penalties.active else None

    @property
    def reads_argmax_only(self) -> bool:
        """Greedy with the model's logits as they are: only their argmax is read (a target may
        screen the rest, `models.base.screens_argmax`)."""
        return self.sampler.greedy and self.penalties is None and self.logprobs is None and self.grammar is None

    def choices(self, n: int) -> list["SamplingParams"]:
        """n independent choices of one prompt (OpenAI's `n`): choice i seeded seed + i."""
        return [replace(self, seed=None if self.seed is None else self.seed + i) for i in range(n)]


@dataclass
class RequestOutput:
    """What one step gave one request."""

    request_id: Hashable
    # Tokens committed this step (empty when the request only finished, e.g. aborted).
    new_token_ids: list[int]
    finished: bool = False
    # "length" (its token budget is spent), "stop" (a stop token), "abort", or "error" (the engine
    # could not go on with it: `error` says why); None while running.
    finish_reason: str | None = None
    error: str | None = None
    # With SamplingParams.logprobs: one per new token (core/logprobs.py says what they are).
    logprobs: list[TokenLogprob] | None = None
    # With SamplingParams.prompt_logprobs, on the request's first output: one per prompt token
    # (None for the first, which nothing precedes).
    prompt_logprobs: list[TokenLogprob | None] | None = None


def draft_seed(seed: int | None) -> int | None:
    """A second stream per request for the draft, so drafting never shifts the target's draws."""
    return None if seed is None else (seed * 0x9E3779B1 + 0x5EED) % (2 ** 63)


@dataclass(eq=False)
class Row:
    """One request from the moment it is added until it finishes."""

    request_id: Hashable
    # Admission order: outputs of a step come in this order.
    number: int
    # The prompt, then every committed token.
    sequence: list[int]
    params: SamplingParams
    # The draft's q for this request (greedy rows draft greedily).
    draft_sampler: Sampler
    device: torch.device
    stats: RequestStats = field(default_factory=RequestStats)
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self.prompt_tokens = len(self.sequence)
        self.stats.prompt_tokens = self.prompt_tokens
        self.max_new_tokens = self.params.max_new_tokens  # its token budget
        self.sampler = self.params.sampler
        self.penalties = self.params.penalties
        self.constraint = None if self.params.grammar is None else self.params.grammar.constraint()
        self.prompt_logprobs: list | None = None  # computed when it first joins, sent with its first output
        self.stop = frozenset(self.params.stop_token_ids or ())
        # A seeded sampled request drafts a fixed K: adaptive K follows timings and the rest
        # of the batch, which would shift its random streams.
        self.pins_k = not self.sampler.greedy and self.params.seed is not None
        if self.sampler.greedy:  # greedy rows never draw
            self.target_generator = self.draft_generator = None
        else:
            seed = self.params.seed
            self.target_generator, self.draft_generator = make_generators([seed, draft_seed(seed)], self.device)

    @property
    def generated(self) -> int:
        return len(self.sequence) - self.prompt_tokens

    @property
    def left(self) -> int:
        return self.max_new_tokens - self.generated

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def output(self) -> list[int]:
        return self.sequence[self.prompt_tokens:]

    def commit(self, tokens: list[int], drafted: int, accepted: int,
               logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        """Append what this step gives the row (cut at its token budget and stop tokens)."""
        tokens = tokens[:self.left]
        for i, token in enumerate(tokens):
            if token in self.stop:
                tokens = tokens[:i + 1]
                self.finish_reason = "stop"
                break
        self.sequence += tokens
        if self.constraint is not None:
            self.constraint.advance(tokens)
        if self.finish_reason is None and self.left == 0:
            self.finish_reason = "length"
        stats = self.stats
        stats.drafted += drafted
        stats.accepted += accepted
        stats.target_forwards += 1
        stats.generated += len(tokens)
        output = RequestOutput(self.request_id, tokens, self.finished, self.finish_reason,
                               logprobs=None if logprobs is None else logprobs[:len(tokens)])
        output.prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        return output
