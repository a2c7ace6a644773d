"""Penalties, logit bias and min_tokens: a request's changes to the target's logits.

They act on the logits of every position the target scores, before temperature, top-k
and top-p, in vLLM's order: `logit_bias` is added, stop tokens are masked while fewer than
`min_tokens` tokens are generated, then the repetition penalty divides positive logits
(multiplies negative ones) of tokens seen in the prompt or the output, and the frequency
and presence penalties subtract `frequency * count + presence * (count > 0)` for tokens
of the output (OpenAI's formula; the prompt does not count).

Exactness: position t of a verify forward follows the output plus the drafted tokens
before it, so its counts include those drafts (`extra[t]`), exactly what plain decoding
counts when it reaches that point of the text. Greedy output therefore equals plain
greedy decoding with the same settings, and sampled output follows its distribution.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Penalties:
    """One request's logit changes (all off by default)."""

    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs, added to those tokens' logits.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Stop tokens are impossible until this many tokens are generated.
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()

    @property
    def active(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1
                    or self.logit_bias or (self.min_tokens and self.stop_token_ids))

    def apply(self, logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int],
              extra: Sequence[Sequence[int]]) -> None:
        """Change logits (T, V) in place: position t follows prompt + output + extra[t]."""
        if self.logit_bias:
            ids, values = zip(*self.logit_bias)
            logits[:, list(ids)] += torch.tensor(values, dtype=logits.dtype, device=logits.device)
        if self.min_tokens and self.stop_token_ids:
            early = [t for t, more in enumerate(extra) if len(output) + len(more) < self.min_tokens]
            if early:
                rows, stops = torch.tensor(early), torch.tensor(self.stop_token_ids)
                logits[rows[:, None], stops[None, :]] = float("-inf")
        if self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1:
            self._penalize(logits, prompt, output, extra)

    def _penalize(self, logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int],
                  extra: Sequence[Sequence[int]]) -> None:
        """The penalties, on the columns of the tokens seen only (a few, of a large vocabulary)."""
        base = Counter(output)
        seen = set(base).union(*map(set, extra))
        in_prompt = set(prompt) if self.repetition_penalty != 1 else set()
        columns = sorted(seen | in_prompt)
        if not columns:
            return
        where = {token: j for j, token in enumerate(columns)}
        counts = torch.zeros(len(extra), len(columns), dtype=logits.dtype)  # (T, S)
        for token, count in base.items():
            counts[:, where[token]] = count
        for t, more in enumerate(extra):
            for token in more:
                counts[t, where[token]] += 1
        counts = counts.to(logits.device)
        index = torch.tensor(columns, device=logits.device)
        chosen = logits[:, index]  # (T, S)
        if self.repetition_penalty != 1:
            prompt_mask = torch.tensor([token in in_prompt for token in columns], device=logits.device)
            repeated = (counts > 0) | prompt_mask[None]
            penalized = torch.where(chosen > 0, chosen / self.repetition_penalty, chosen * self.repetition_penalty)
            chosen = torch.where(repeated, penalized, chosen)
        chosen = chosen - self.frequency_penalty * counts - self.presence_penalty * (counts > 0).to(logits.dtype)
        logits[:, index] = chosen


def chain_contexts(drafts: Sequence[int], positions: int) -> list[list[int]]:
    """What follows the output at each of a chain's verified positions: the drafts before it."""
    return [list(drafts[:t]) for t in range(positions)]


def tree_contexts(tokens: Sequence[int], parents: Sequence[int]) -> list[list[int]]:
    """What follows the output at each position of a tree's verify forward: nothing at row 0
    (the last committed token), the path from the root to node i inclusive at row i + 1."""
    paths: list[list[int]] = []
    for token, parent in zip(tokens, parents):
        paths.append((paths[parent] if parent >= 0 else []) + [token])
    return [[], *paths]
