"""Settings of one speculative decoder, validated once so the engine never has to."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpeculativeConfig:
    """How many tokens to draft and how both sides sample.

    The names follow the two source designs (Edifice, kizzasi-inference). `top_k` and
    `top_p` shape both the target distribution p and the draft distribution q before the
    acceptance ratio is taken, so they change what is generated, while
    `draft_temperature` only changes how often drafts are accepted.
    """

    # K: tokens the draft proposes per step; the target scores all of them in one forward.
    # With `adaptive`, the largest K the policy may choose.
    num_draft_tokens: int = 4
    # Temperature of the draft's proposals (0 = greedy drafts). Never changes the output.
    draft_temperature: float = 1.0
    # Temperature of the target, i.e. of the output distribution (0 = greedy).
    main_temperature: float = 1.0
    # True: keep drafted tokens while they equal the target's argmax (output = target greedy).
    # False: lossless rejection sampling (Leviathan et al. 2023, Chen et al. 2023).
    greedy_verification: bool = True
    # Keep only the k most likely tokens before sampling (None = all).
    top_k: int | None = None
    # Keep the smallest set of tokens whose probability reaches top_p (None = all).
    top_p: float | None = None
    # Seed of the sampling generators; None draws a fresh seed from the OS.
    seed: int | None = None
    # Plan every step for the whole batch from measured acceptance and costs: how far rows
    # draft, whether the draft model runs; nothing is drafted when that cannot pay.
    # Sampling with a seed keeps K fixed, so that output is reproducible.
    adaptive: bool = True
    # With a draft model: take the tokens that followed the last n-gram (n >= 2) earlier in
    # the prompt and output when there is one, and ask the draft model only otherwise.
    prompt_lookup: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.num_draft_tokens, bool) or not isinstance(self.num_draft_tokens, int):
            raise ValueError(f"num_draft_tokens must be an integer >= 1, got {self.num_draft_tokens!r}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        for name in ("draft_temperature", "main_temperature"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0 (0 means greedy), got {value!r}")
        if self.top_k is not None:
            if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
                raise ValueError(f"top_k must be None or an integer >= 1, got {self.top_k!r}")
        if self.top_p is not None:
            if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
                raise ValueError(f"top_p must be None or a number with 0 < top_p <= 1, got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be None or an integer, got {self.seed!r}")
        for name in ("adaptive", "prompt_lookup", "greedy_verification"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def sampling(self) -> bool:
        """Whether output tokens are sampled (False means greedy, target argmax)."""
        return not self.greedy_verification and self.main_temperature > 0
