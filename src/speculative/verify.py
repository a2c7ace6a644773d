"""Verification: which drafted tokens to keep. Pure tensor functions, no model calls.

Every step emits, per row, output = accepted + one more token: the *recovered* token at
the first rejection, or the *bonus* token when all drafted tokens were accepted. Row i of
the target's (K+1)-row logits is the distribution that follows the committed prefix and
the first i drafted tokens, so row `accepted` is where the extra token comes from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .sampling import Sampler, row_probabilities, sample, uniform


def accept_reject(draft_tokens, verifier_tokens) -> torch.Tensor:
    """Length of the longest common prefix of draft and verifier tokens.

    Shapes [K] give a 0-dim integer tensor, [B, K] give [B] (the Edifice design).
    """
    draft_tokens = torch.as_tensor(draft_tokens)
    verifier_tokens = torch.as_tensor(verifier_tokens)
    if draft_tokens.shape != verifier_tokens.shape or draft_tokens.dim() not in (1, 2):
        raise ValueError("accept_reject takes two tensors of the same shape [K] or [B, K], got "
                         f"{tuple(draft_tokens.shape)} and {tuple(verifier_tokens.shape)}")
    match = (draft_tokens == verifier_tokens).long()
    return match.cumprod(-1).sum(-1)


def _valid(draft_tokens: torch.Tensor, draft_lengths: list[int]) -> torch.Tensor:
    """(B, K) mask of drafted positions that exist (rows may draft fewer than K tokens)."""
    positions = torch.arange(draft_tokens.shape[1], device=draft_tokens.device)
    return positions[None, :] < torch.tensor(draft_lengths, device=draft_tokens.device)[:, None]


def greedy_verify(draft_tokens: torch.Tensor, draft_lengths: list[int],
                  target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep drafted tokens while they equal the target's argmax.

    draft_tokens (B, K), draft_lengths (tokens drafted per row), target_logits (B, K+1, V).
    Returns accepted (B,) and the next token (B,): the target's argmax after the kept prefix.
    """
    target_tokens = target_logits.argmax(-1)  # (B, K+1)
    match = (draft_tokens == target_tokens[:, :-1]) & _valid(draft_tokens, draft_lengths)
    accepted = match.long().cumprod(-1).sum(-1)
    return accepted, target_tokens.gather(1, accepted[:, None]).squeeze(1)


def rejection_verify(draft_tokens: torch.Tensor, draft_lengths: list[int],
                     draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

    Accept drafted token x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first
    rejection sample from norm(max(0, p_i - q_i)); if all are accepted sample the bonus
    from p_{K+1}. draft_probs (B, K, V) is q; None means the drafts were deterministic
    (greedy draft, n-gram lookup), i.e. q is one-hot on the drafted token.
    target_probs (B, K+1, V) is p after temperature / top-k / top-p.
    Returns accepted (B,) and the recovered-or-bonus token (B,).
    """
    batch, k = draft_tokens.shape
    if draft_probs is not None and draft_probs.shape[-1] != target_probs.shape[-1]:
        # Padded vocabularies (same tokenizer, different logit widths): ids past a side's
        # width have probability 0 on that side.
        width = max(draft_probs.shape[-1], target_probs.shape[-1])
        draft_probs = F.pad(draft_probs, (0, width - draft_probs.shape[-1]))
        target_probs = F.pad(target_probs, (0, width - target_probs.shape[-1]))
    p_drafted = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # (B, K)
    if draft_probs is None:
        q_drafted = torch.ones_like(p_drafted)
    else:
        q_drafted = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)  # (B, K)
    u = uniform(draft_lengths, k, generators, draft_tokens.device)  # one draw per drafted token
    keep = (u * q_drafted < p_drafted) & _valid(draft_tokens, draft_lengths)
    accepted = keep.long().cumprod(-1).sum(-1)

    rows = torch.arange(batch, device=draft_tokens.device)
    p_next = target_probs[rows, accepted]  # (B, V)
    rejected = accepted < torch.tensor(draft_lengths, device=accepted.device)
    if bool(rejected.any()):
        at = accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_next = torch.nn.functional.one_hot(draft_tokens[rows, at], p_next.shape[-1]).float()
        else:
            q_next = draft_probs[rows, at]
        residual = (p_next - q_next).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        # p == q up to rounding leaves no residual mass; p itself is then the exact answer.
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
        p_next = torch.where(rejected[:, None], residual, p_next)
    return accepted, sample(p_next, generators)


def verify_rows(draft_tokens: torch.Tensor, draft_lengths: list[int], draft_probs: torch.Tensor | None,
                target_logits: torch.Tensor, samplers: list[Sampler],
                generators: list[torch.Generator]) -> tuple[list[int], list[int]]:
    """Each row by its own rule in one batch: greedy rows (temperature 0) keep drafts equal
    to the target's argmax; sampled rows follow the rejection rule with p shaped by their
    own temperature / top-k / top-p, drawing from their own generator. target_logits
    (B, K+1, V), in float32. Returns accepted and the extra token per row, as lists."""
    sampled = [i for i, s in enumerate(samplers) if not s.greedy]
    if not sampled:
        accepted, extra = greedy_verify(draft_tokens, draft_lengths, target_logits)
        return accepted.tolist(), extra.tolist()
    if len(sampled) == len(samplers):
        p = row_probabilities(target_logits, samplers)
        accepted, extra = rejection_verify(draft_tokens, draft_lengths, draft_probs, p, generators)
        return accepted.tolist(), extra.tolist()
    accepted, extra = [0] * len(samplers), [0] * len(samplers)
    greedy = [i for i, s in enumerate(samplers) if s.greedy]
    for rows, is_sampled in ((greedy, False), (sampled, True)):
        index = torch.tensor(rows, device=draft_tokens.device)
        tokens, lengths, logits = draft_tokens[index], [draft_lengths[i] for i in rows], target_logits[index]
        if is_sampled:
            p = row_probabilities(logits, [samplers[i] for i in rows])
            q = None if draft_probs is None else draft_probs[index]
            kept, nxt = rejection_verify(tokens, lengths, q, p, [generators[i] for i in rows])
        else:
            kept, nxt = greedy_verify(tokens, lengths, logits)
        for i, a, x in zip(rows, kept.tolist(), nxt.tolist()):
            accepted[i], extra[i] = a, x
    return accepted, extra
