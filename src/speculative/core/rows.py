"""Requests and their rows: what a user asks for (SamplingParams), what each step gives back
(RequestOutput), and what the engine keeps for one running request (Row)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Hashable

import torch

from .config import MAX_NEW_TOKENS, at_most
from .sampling import GREEDY, MIN_TEMPERATURE, Sampler, make_generators
from .stats import RequestStats

# Seeds torch.Generator.manual_seed accepts.
SEED_RANGE = (-2 ** 63, 2 ** 64 - 1)
FINISH_REASONS = ("length", "stop", "abort", "error")


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
        for name, value in (("max_new_tokens", int(self.max_new_tokens)), ("stop_token_ids", stop),
                            ("temperature", float(self.temperature)),
                            ("seed", None if self.seed is None else int(self.seed)),
                            ("top_k", None if self.top_k is None else int(self.top_k)),
                            ("top_p", None if self.top_p is None else float(self.top_p))):
            object.__setattr__(self, name, value)

    @property
    def sampler(self) -> Sampler:
        """The target's p for this request."""
        return GREEDY if self.temperature < MIN_TEMPERATURE else Sampler(self.temperature, self.top_k, self.top_p)


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

    def commit(self, tokens: list[int], drafted: int, accepted: int) -> RequestOutput:
        """Append what this step gives the row (cut at its token budget and stop tokens)."""
        tokens = tokens[:self.left]
        for i, token in enumerate(tokens):
            if token in self.stop:
                tokens = tokens[:i + 1]
                self.finish_reason = "stop"
                break
        self.sequence += tokens
        if self.finish_reason is None and self.left == 0:
            self.finish_reason = "length"
        stats = self.stats
        stats.drafted += drafted
        stats.accepted += accepted
        stats.target_forwards += 1
        stats.generated += len(tokens)
        return RequestOutput(self.request_id, tokens, self.finished, self.finish_reason)
