"""Verification: which drafted tokens to keep. Pure tensor functions, no model calls.

Every step emits, per row, output = accepted + one more token: the *recovered* token at
the first rejection, or the *bonus* token when all drafted tokens were accepted. Row i of
the target's (K+1)-row logits is the distribution that follows the committed prefix and
the first i drafted tokens, so row `accepted` is where the extra token comes from.

Token trees (tree.py) have one logits row per node (row 0: the last committed token, row
i + 1: node i) and keep a path instead of a prefix:

- Greedy: the longest root-to-leaf path whose every token is the target's argmax at its
  parent, then the argmax at the path's end. Siblings carry distinct tokens, so at most
  one child of a node matches: the path is what plain greedy decoding would emit.
- Sampling (multi-draft speculative sampling, SpecInfer, arXiv 2305.09781): start at the
  root with p = the target's distribution there. Try the node's children in order: child
  c, drawn from q_c, is accepted with probability min(1, p(x_c) / q_c(x_c)); on rejection
  p <- norm(max(0, p - q_c)) and the next child is tried. An accepted child becomes the
  node (p reset to the target's distribution at it); when every child is rejected, the
  extra token is drawn from the final p. Exact: one try emits x_c with probability
  min(p, q_c)(x) and otherwise passes on the residual, so by induction over the children
  the token emitted at a node (accepted child or final draw) follows p, provided each
  child's token is independent of the earlier tries' coins given the tokens before it:
  siblings drawn i.i.d. from one q (SpecInfer), or deterministic candidates such as n-gram
  branches and top-k children, whose q_c is one-hot on x_c. For those the rule becomes
  sampling without replacement: accept x_c with probability p(x_c), else remove x_c from
  p and renormalise, so candidate j is emitted with probability exactly p(x_j). (Siblings
  sampled *without* replacement from a model would need the other rule of that name;
  no source here drafts them.) The path continues below the accepted child with the
  target's own distribution there, as in the chain rule.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .deprecation import renamed_keywords
from .sampling import Sampler, argmax, row_probabilities, sample, uniform
from .tree import Tree


@renamed_keywords(verifier_tokens="target_tokens")
def accept_reject(draft_tokens, target_tokens) -> torch.Tensor:
    """Length of the longest common prefix of draft and target tokens.

    Shapes [K] give a 0-dim integer tensor, [B, K] give [B] (the Edifice design, whose
    `verifier_tokens` is the target's: that keyword still works, with a DeprecationWarning).
    """
    draft_tokens = torch.as_tensor(draft_tokens)
    target_tokens = torch.as_tensor(target_tokens)
    if draft_tokens.shape != target_tokens.shape or draft_tokens.dim() not in (1, 2):
        raise ValueError("accept_reject takes two tensors of the same shape [K] or [B, K], got "
                         f"{tuple(draft_tokens.shape)} and {tuple(target_tokens.shape)}")
    match = (draft_tokens == target_tokens).long()
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
    target_tokens = argmax(target_logits)  # (B, K+1)
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


def greedy_tree_verify(trees: list[Tree], target_logits: torch.Tensor) -> tuple[list[list[int]], list[int]]:
    """Per row the accepted path (node indices) and the target's argmax after it.
    target_logits (B, 1+N, V): row 0 the last committed token, row i + 1 node i."""
    paths, extra = [], []
    for tree, best in zip(trees, argmax(target_logits).tolist()):  # (B, 1+N)
        depth = {-1: 0}  # accepted nodes and their depth
        deepest = -1
        for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
            if parent in depth and token == best[parent + 1]:
                depth[i] = depth[parent] + 1
                if depth[i] > depth[deepest]:
                    deepest = i
        paths.append(tree.path(deepest))
        extra.append(best[deepest + 1])
    return paths, extra


def tree_rejection_walk(tree: Tree, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                        generator: torch.Generator | None) -> tuple[list[int], int]:
    """One row's multi-draft speculative sampling (the rule in the module docstring).

    draft_probs (N, V): q_c of each node (the distribution it was drawn from), or None when
    every node is deterministic (q one-hot). target_probs (1+N, V). Returns the accepted
    path and the extra token."""
    path, p = walk_tree(tree, draft_probs, target_probs, generator)
    return path, int(sample(p[None], [generator])[0])


def walk_tree(tree: Tree, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
              generator: torch.Generator | None) -> tuple[list[int], torch.Tensor]:
    """The accepted path and the distribution (V,) the extra token is drawn from."""
    children = tree.children()
    node, path = 0, []
    device = target_probs.device
    while True:
        p = target_probs[node]
        for child in children[node]:
            x = tree.tokens[child]
            q = None if draft_probs is None else draft_probs[child]
            u = float(torch.rand(1, generator=generator, device=device))
            if u * (1.0 if q is None else float(q[x])) < float(p[x]):
                break
            if q is None:  # max(0, p - one_hot(x)): p without x
                residual = p.clone()
                residual[x] = 0
            else:
                residual = (p - q).clamp(min=0)
            mass = residual.sum()
            p = residual / mass if mass > 0 else p  # p == q up to rounding: p is then exact
        else:
            return path, p
        path.append(child)
        node = child + 1


def tree_verify_rows(trees: list[Tree], draft_probs: list[torch.Tensor | None] | None, target_logits: torch.Tensor,
                     samplers: list[Sampler], generators: list[torch.Generator]) -> tuple[list[list[int]], list[int]]:
    """Each row's tree by its own rule: greedy rows the longest argmax path, sampled rows the
    multi-draft rule with p shaped by their own settings. draft_probs: per row q per node
    (N_b, V) or None (deterministic drafts). target_logits (B, 1+N, V), float32."""
    paths, extra = greedy_tree_verify(trees, target_logits)
    sampled = [i for i, s in enumerate(samplers) if not s.greedy]
    if sampled:
        index = torch.tensor(sampled, device=target_logits.device)
        p = row_probabilities(target_logits[index], [samplers[i] for i in sampled])  # (S, 1+N, V)
        finals = []
        for row, probs in zip(sampled, p):
            q = None if draft_probs is None else draft_probs[row]
            paths[row], final = walk_tree(trees[row], q, probs, generators[row])
            finals.append(final)
        # One draw per row from its own generator, after its walk's: the same stream as one by one.
        for row, token in zip(sampled, sample(torch.stack(finals), [generators[i] for i in sampled]).tolist()):
            extra[row] = token
    return paths, extra
