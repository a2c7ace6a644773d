"""What a verify step does with the target's logits for requests that change or read them:
penalties, logit bias and grammars before the acceptance rule, log-probabilities after it."""

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


def constrain_rows(rows: list[Row], logits: torch.Tensor, drafted: list[list[int]]) -> None:
    """Each row with a grammar: tokens it forbids get -inf at the row's verified positions of
    logits (B, T, V), position j following drafted[b][:j] (chains)."""
    for b, row in enumerate(rows):
        if row.constraint is not None:
            row.constraint.mask(logits[b, :len(drafted[b]) + 1], drafted[b])


def forced_drafts(rows: list[Row], max_drafts: list[int]) -> list[list[int] | None]:
    """Per row with a grammar, the tokens it forces from here (None: none): a draft that costs
    no model forward."""
    return [(row.constraint.forced()[:most] or None) if row.constraint is not None and most else None
            for row, most in zip(rows, max_drafts)]


def cut_to_grammar(rows: list[Row], tokens: list[list[int]], lengths: list[int], certain: list[bool]) -> None:
    """Cut each grammar row's draft before its first token the grammar refuses, in place: that
    token could never be accepted. Only where the draft was certain (greedy, lookup or forced),
    since cutting a sampled draft would change what the acceptance rule gives."""
    for i, row in enumerate(rows):
        if row.constraint is not None and certain[i] and lengths[i]:
            lengths[i] = row.constraint.valid_prefix(tokens[i][:lengths[i]])


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
