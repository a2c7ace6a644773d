"""What a verify step does with the target's logits for requests that change or read them:
penalties and logit bias before the acceptance rule, log-probabilities after it."""

from __future__ import annotations

import torch

from ..core.logprobs import TokenLogprob, token_logprobs
from ..core.rows import Row


def penalize_rows(rows: list[Row], logits: torch.Tensor, contexts) -> None:
    """Apply each row's penalties to its verified positions of logits (B, T, V), in place.
    `contexts(b)` gives row b's drafted tokens before each of its positions (core/penalties.py)."""
    for b, row in enumerate(rows):
        if row.penalties is not None:
            extra = contexts(b)
            row.penalties.apply(logits[b, :len(extra)], row.sequence[:row.prompt_tokens], row.output, extra)


def kept_logprobs(rows: list[Row], logits: torch.Tensor, positions: list[list[int]],
                  tokens: list[list[int]]) -> list[list[TokenLogprob] | None]:
    """Per row that asks for them, the log-probabilities of the tokens it keeps: tokens[b][j]
    was chosen at position positions[b][j] of logits (B, T, V)."""
    out: list[list[TokenLogprob] | None] = []
    for b, row in enumerate(rows):
        top = row.params.logprobs
        if top is None:
            out.append(None)
            continue
        index = torch.tensor(positions[b], device=logits.device)
        out.append(token_logprobs(logits[b, index], tokens[b], row.sampler, top))
    return out
