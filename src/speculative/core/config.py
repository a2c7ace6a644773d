"""Settings of one speculative decoder, validated once so the engine never has to."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from .deprecation import renamed_attribute, renamed_keywords
from .sampling import MIN_TEMPERATURE

# torch.Generator.manual_seed takes seeds up to 2**64 - 1 (and aliases negative ones onto them).
MAX_SEED = 2 ** 64 - 1

# The drafting defaults, one set for the Python API and every front-end (EngineArgs): K of a
# draft model or head, and K of lookup drafts without a model (ngram, suffix), whose matches
# draft for free and whose length the adaptive policy cuts to what pays; K + 1 = 16 rows fill
# an AMX tile, and 15 beat 24 on grounded editing (dev/LOG.md, 2026-12-05).
MODEL_K = 4
LOOKUP_K = 15

# Upper bounds of the sizes a user sets, checked before anything is allocated: each
# allocation grows with them, so an absurd value would exhaust memory instead of failing.
# K: every step scores K + 1 positions per row, (B, K+1, V) logits.
MAX_DRAFT_TOKENS = 64
# Tree nodes per row and step: the verify forward's (1+N, V) logits and (1+N, 1+N) mask per row.
MAX_TREE_TOKENS = 256
# Children per tree node: a draft model reads top_k nodes per depth and ranks top_k**2 candidates.
MAX_TREE_TOP_K = 32
# Longest n-gram looked up: each row indexes (max - min + 1) n-grams of up to max tokens per position.
MAX_NGRAM = 32
# New tokens per request, and tokens per prompt.
MAX_NEW_TOKENS = 2 ** 20
MAX_PROMPT_TOKENS = 2 ** 20
# Rows of one batch: an engine's max_batch_size, and prompts per generate() call.
MAX_BATCH_SIZE = 2 ** 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """How many tokens to draft and how both sides sample.

    The names follow the two source designs (Edifice, kizzasi-inference). `top_k` and
    `top_p` shape both the target distribution p and the draft distribution q before the
    acceptance ratio is taken, so they change what is generated, while
    `draft_temperature` only changes how often drafts are accepted. Frozen: a setting
    changed after the checks below ran would skip them (use dataclasses.replace).
    """

    # K: tokens the draft proposes per step; the target scores all of them in one forward.
    # With `adaptive`, the largest K the policy may choose. (A lookup proposer passed as the
    # draft with no config: its own K, LOOKUP_K by default: `proposers.default_config`.)
    num_draft_tokens: int = MODEL_K
    # Temperature of the draft's proposals (0, or below sampling.MIN_TEMPERATURE = greedy
    # drafts). Never changes the output.
    draft_temperature: float = 1.0
    # Temperature of the target, i.e. of the output distribution (0, or below
    # sampling.MIN_TEMPERATURE = greedy). Its old name, the source design's
    # `main_temperature`, is still accepted and read, with a DeprecationWarning.
    target_temperature: float = 1.0
    # True: keep drafted tokens while they equal the target's argmax (output = target greedy).
    # False: lossless rejection sampling (Leviathan et al. 2023, Chen et al. 2023).
    greedy_verification: bool = True
    # Keep only the k most likely tokens before sampling (None = all).
    top_k: int | None = None
    # Keep the smallest set of tokens whose probability reaches top_p (None = all).
    top_p: float | None = None
    # Seed of the sampling generators (row b uses seed + b); None draws a fresh seed from the OS.
    seed: int | None = None
    # Plan every step for the whole batch from measured acceptance and costs: how far rows
    # draft, whether the draft model runs (trees: the node budget); nothing is drafted when
    # that cannot pay.
    # Sampling with a seed keeps K fixed, so that output is reproducible.
    adaptive: bool = True
    # With a draft model or head: take the tokens that followed the last n-gram earlier in the
    # prompt and output when there is one, and ask the draft model only otherwise (what
    # `generate` does with a target's partner draft: MODEL+ngram). Lookup drafts for free, so
    # it is on unless turned off.
    prompt_lookup: bool = True
    # With prompt_lookup: the shortest and longest n-grams looked up (longest first).
    min_ngram: int = 1
    max_ngram: int = 4
    # With prompt_lookup: the longest draft a lookup match may give (None: num_draft_tokens).
    # A match drafts for free, so it may reach further than the draft model, whose drafts
    # stay within num_draft_tokens; the adaptive policy chooses how much of it to verify.
    lookup_draft_tokens: int | None = None
    # Token trees: children tried per tree node (1 = chains, today's drafts). Above 1, drafts
    # branch (n-gram lookup and the suffix cache by their matches, draft models and heads by
    # EAGLE-2 expansion) into trees of at most `tree_max_tokens` nodes and depth
    # `num_draft_tokens`, verified in one target forward (tree.py); targets that cannot
    # branch (recurrent ones) and proposers that cannot keep chains.
    tree_top_k: int = 1
    # Token trees: the most drafted nodes per row and step (the tree's verify width less one);
    # with `adaptive`, each step's budget up to it is planned (tree_budget.py).
    tree_max_tokens: int = 16

    def __post_init__(self) -> None:
        for name, high in (("num_draft_tokens", MAX_DRAFT_TOKENS), ("min_ngram", MAX_NGRAM), ("max_ngram", MAX_NGRAM),
                           ("tree_top_k", MAX_TREE_TOP_K), ("tree_max_tokens", MAX_TREE_TOKENS)):
            self._set(name, at_most(integer(getattr(self, name), name, low=1), name, high))
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"n-gram sizes need min_ngram <= max_ngram, got min_ngram={self.min_ngram}, "
                             f"max_ngram={self.max_ngram}")
        for name in ("draft_temperature", "target_temperature"):
            value = getattr(self, name)
            if not is_real(value) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a number >= 0 (0 means greedy) and finite, got {value!r}")
            self._set(name, float(value))
        if self.top_k is not None:
            self._set("top_k", integer(self.top_k, "top_k", low=1, none_allowed=True))
        if self.top_p is not None:
            if not is_real(self.top_p) or not 0 < self.top_p <= 1:
                raise ValueError(f"top_p must be None or a number with 0 < top_p <= 1, got {self.top_p!r}")
            self._set("top_p", float(self.top_p))
        if self.seed is not None:
            self._set("seed", integer(self.seed, "seed", low=0, high=MAX_SEED, none_allowed=True))
        for name in ("adaptive", "prompt_lookup", "greedy_verification"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{name} must be True or False, got {value!r}")
            self._set(name, bool(value))
        if self.lookup_draft_tokens is not None:
            if not self.prompt_lookup:
                raise ValueError("lookup_draft_tokens applies with prompt_lookup=True (a draft model with lookup in "
                                 "front); leave it None otherwise")
            self._set("lookup_draft_tokens", at_most(integer(self.lookup_draft_tokens, "lookup_draft_tokens", low=1),
                                                     "lookup_draft_tokens", MAX_DRAFT_TOKENS))

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)  # normalizes numpy scalars to Python ones

    @property
    def longest_draft(self) -> int:
        """The longest chain draft a row may take in one step: a lookup match's, or the draft model's K."""
        return max(self.num_draft_tokens, self.lookup_draft_tokens or 0)

    @property
    def trees(self) -> bool:
        """Whether drafts may branch (tree_top_k > 1)."""
        return self.tree_top_k > 1

    @property
    def sampling(self) -> bool:
        """Whether output tokens are sampled (False means greedy, target argmax)."""
        return not self.greedy_verification and self.target_temperature >= MIN_TEMPERATURE

    main_temperature = renamed_attribute("main_temperature", "target_temperature")


# The source design's name for the target's temperature stays accepted for one release.
SpeculativeConfig.__init__ = renamed_keywords(main_temperature="target_temperature")(SpeculativeConfig.__init__)


def is_real(value) -> bool:
    """A real number (numpy's included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def integer(value, name: str, low: int, high: int | None = None, none_allowed: bool = False) -> int:
    """`value` as a Python int in low..high (numpy integers accepted), else a ValueError naming it."""
    allowed = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"
    if none_allowed:
        allowed = "None or " + allowed
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be {allowed if none_allowed or high is not None else f'>= {low}'}, "
                         f"got {value}")
    return int(value)


def at_most(value: int, name: str, bound: int) -> int:
    """`value`, unless it passes the upper bound of its setting (the MAX_ constants above)."""
    if value > bound:
        raise ValueError(f"{name} is {value}, above its upper bound of {bound}: allowed at most {bound}")
    return value


def as_config(config) -> SpeculativeConfig:
    """The config to use: None gives the defaults; anything but a SpeculativeConfig is refused."""
    if config is None:
        return SpeculativeConfig()
    if not isinstance(config, SpeculativeConfig):
        hint = " (write SpeculativeConfig(**settings))" if isinstance(config, dict) else ""
        raise TypeError(f"config must be a SpeculativeConfig or None, got {type(config).__name__}{hint}")
    return config
