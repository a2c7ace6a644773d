"""Counters and timings of speculative decoding, the figures every report is built from."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodeStats:
    # Tokens proposed by the draft.
    drafted: int = 0
    # Drafted tokens the target kept.
    accepted: int = 0
    # Drafted tokens the target looked at: those whose predecessors were all kept.
    reached: int = 0
    # Target forward passes after the prompt (each scores K+1 positions at once).
    target_forwards: int = 0
    # Tokens emitted (accepted + recovered + bonus), after EOS / max_new_tokens truncation.
    generated: int = 0
    # Per drafted position i (0-based): how often a token was drafted there / kept there.
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    # Wall-clock seconds: prompt processing, drafting, target forward + verification, total.
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    # Of those, seconds inside model forward calls (target; draft, as its proposer reports).
    target_forward_seconds: float = 0.0
    draft_forward_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """alpha = accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def conditional_acceptance(self) -> float:
        """accepted / reached: the chance that a drafted token is kept when the ones before it
        were, the alpha of Leviathan et al.'s formula (accepted / drafted also counts tokens
        after a rejection, which the target never judged)."""
        return self.accepted / self.reached if self.reached else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """tau = tokens emitted per target forward (counts the recovered / bonus token)."""
        return self.generated / self.target_forwards if self.target_forwards else 0.0

    @property
    def other_seconds(self) -> float:
        """Engine time outside drafting and verification (bookkeeping, commits, rollbacks)."""
        return max(0.0, self.total_seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds)

    @property
    def overhead_seconds(self) -> float:
        """Engine time outside model forward passes (after the prompt)."""
        return max(0.0, self.total_seconds - self.prefill_seconds - self.target_forward_seconds
                   - self.draft_forward_seconds)

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.total_seconds if self.total_seconds else 0.0

    def record_step(self, drafted: list[int], accepted: list[int], nodes: list[int] | None = None) -> None:
        """Count one verification step: per row, how many were drafted and kept. For trees,
        `drafted` is each tree's depth (positions reached, for acceptance per depth) and
        `nodes` its drafted tokens."""
        width = max(drafted, default=0)
        if len(self.drafted_at) < width:
            grow = width - len(self.drafted_at)
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for n, a, m in zip(drafted, accepted, nodes or drafted):
            self.drafted += m
            self.accepted += a
            self.reached += min(n, a + 1)
            for i in range(n):
                self.drafted_at[i] += 1
            for i in range(a):
                self.accepted_at[i] += 1

    def add(self, other: "DecodeStats") -> None:
        """Add another's counts and seconds to these (an engine's step into a decoder's totals)."""
        for name, value in other.__dict__.items():
            if isinstance(value, list):
                mine = getattr(self, name)
                mine += [0] * (len(value) - len(mine))
                for i, v in enumerate(value):
                    mine[i] += v
            else:
                setattr(self, name, getattr(self, name) + value)

    def summary(self) -> dict:
        """A flat JSON-able view, properties included."""
        out = {k: v for k, v in self.__dict__.items()}
        out.update(acceptance_rate=self.acceptance_rate, conditional_acceptance=self.conditional_acceptance,
                   tokens_per_forward=self.tokens_per_forward,
                   other_seconds=self.other_seconds, overhead_seconds=self.overhead_seconds,
                   tokens_per_second=self.tokens_per_second)
        return out


@dataclass
class RequestStats:
    """What one request of an engine drafted and kept (a server reports these per response)."""

    # Tokens drafted for this request, and of those the ones the target kept.
    drafted: int = 0
    accepted: int = 0
    # Target forwards (steps) the request took part in, prompt processing not counted.
    target_forwards: int = 0
    # Tokens it was given (accepted + recovered + bonus, cut at its budget or stop token).
    generated: int = 0
    # Tokens in its prompt.
    prompt_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.generated / self.target_forwards if self.target_forwards else 0.0
