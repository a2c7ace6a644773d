"""The proposer interface: whatever drafts tokens for the target to verify.

A proposer is handed everything it needs by the engine, and answers everything the
engine asks of it; the engine never inspects its type. Per step:

- `free_drafts(sequences, limits)`: per row, what it drafts at no cost (prompt lookup;
  nothing for a draft model alone), and whether that draft is `preferred` to the model's.
- `catch_up(sequences)`: before `propose`, the draft model reads what it has not seen
  beyond its last few tokens (a prompt, or text drafted while it sat out) without logits.
  Apart, so that this one-off work is not taken for the cost of drafting.
- `unread(sequences)`: the most tokens of a row its draft model has yet to read (what a
  `catch_up` would cost; 0 without a model): the adaptive policy does not probe a model
  that is a whole prompt behind.
- `propose(sequences, limits, min_confidence)`: up to limits[b] tokens from the draft
  `model` for row b (rows with limit 0 draft nothing); called only when `model` is not
  None. With `min_confidence`, a row stops before the first token the draft gives less
  than that probability, and the confidences come back for the adaptive policy.
- `commit(sequences)`: the sequences as committed after verification, so that the draft
  model rolls back to what still holds; called only in steps where `propose` ran.

Token trees (optional): a proposer that can branch says `branches = True` and answers
`free_trees(sequences, limits, top_k, max_nodes)`: per row a `tree.Tree` (depth at most
limits[b], at most top_k children per node and max_nodes nodes; empty for a draft model
alone) and whether it is preferred, as `free_drafts`; with a model, also
`propose_tree(sequences, limits, top_k, max_nodes)`: the model's tree per row (empty where
limits[b] is 0), its nodes deterministic candidates, then `commit` as after `propose`. One
without `branches` drafts chains, and an engine asked for trees says so when it is made
(a draft model proposer branches only when its model reads trees, i.e. has `compact`).

A draft model whose logits are NaN or infinite for some rows raises
`sampling.NonFiniteLogits` naming them (`sampling.check_finite`): the engine ends those
requests with an error, never drafting from garbage.

Rows join with `add_rows(prompts, capacity, samplers, generators)` (the draft's sampling
settings and random stream per row) and leave with `select_rows(rows)`. `fork()` gives a
proposer with the same models and settings and no rows: every engine drafts with its own,
so that generations running at once never share per-row state. `probe(sequences)` runs
one draft-model forward over these rows and forgets it (nothing without a model): the
engine times it, with its own clock, for the cost probe.

Feature drafts (a draft head, EAGLE-style) also say `reads_features = True` (an optional
attribute: a proposer without it reads none). The engine then hands them the target's
final hidden states with `read_features(features)`: features[b] (n_b, H) are those of
row b's tokens that just entered the target's state, in order: each prompt but its last
token when rows join (other rows get n_b = 0), and every step, whether or not `propose`
ran, the row's last committed token and its accepted drafts, from the verify forward
itself (no second target forward); after a tree step, the last committed token's and the
accepted path's, from the tree's verify forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ..models.base import pad
from ..core.sampling import Sampler


@dataclass
class Proposal:
    # Drafted tokens (B, K), padded past each row's length.
    tokens: torch.Tensor
    # Drafted tokens per row; rows may draft fewer than K (an n-gram lookup may find none).
    lengths: list[int]
    # The draft distributions q (B, K, V) the tokens were sampled from; None when every
    # row's tokens are deterministic (greedy draft, n-gram lookup): q is then one-hot.
    probs: torch.Tensor | None = None
    # Per row, the draft's probability of each drafted token (for adaptive K); None if unknown.
    confidences: list[list[float]] | None = None
    # Per row, True where the drafts cost nothing to make (prompt lookup in front of a draft
    # model): the adaptive policy, which sizes the draft model's K, does not learn from them.
    free: list[bool] | None = None
    # Draft-model forwards run to draft this proposal (one per drafted position).
    forwards: int = 0


@runtime_checkable
class Proposer(Protocol):
    # The draft model that `propose` runs; None when drafts cost nothing (lookup only).
    model: Any
    # Ids it can propose; None when they come from the sequence itself.
    vocab_size: int | None

    def fork(self) -> "Proposer": ...

    def add_rows(self, prompts: list[list[int]], capacity: int, samplers: list[Sampler],
                 generators: list[torch.Generator]) -> None: ...

    def select_rows(self, rows: list[int]) -> None: ...

    def free_drafts(self, sequences: list[list[int]], limits: list[int]) -> tuple[list[list[int]], list[bool]]: ...

    def unread(self, sequences: list[list[int]]) -> int: ...

    def catch_up(self, sequences: list[list[int]]) -> None: ...

    def propose(self, sequences: list[list[int]], limits: list[int],
                min_confidence: float | None = None) -> Proposal: ...

    def commit(self, sequences: list[list[int]]) -> None: ...

    def probe(self, sequences: list[list[int]]) -> None: ...


def reads_features(proposer) -> bool:
    """Whether the engine hands `proposer` the target's features. Optional in the interface:
    every proposer of this package declares it; one written elsewhere may leave it out."""
    return bool(getattr(proposer, "reads_features", False))


def branches(proposer) -> bool:
    """Whether `proposer` drafts trees (optional in the interface, as `reads_features`)."""
    return bool(getattr(proposer, "branches", False))


class NoDraft:
    """No drafting at all: plain decoding through the same engine (the fair baseline)."""

    model = None
    vocab_size = None
    reads_features = False
    branches = False

    def fork(self) -> "NoDraft":
        return self

    def add_rows(self, prompts, capacity, samplers, generators) -> None:
        pass

    def select_rows(self, rows) -> None:
        pass

    def free_drafts(self, sequences, limits):
        return [[] for _ in sequences], [False] * len(sequences)

    def unread(self, sequences) -> int:
        return 0

    def catch_up(self, sequences) -> None:
        pass

    def propose(self, sequences, limits, min_confidence=None) -> Proposal:
        raise RuntimeError("NoDraft has no draft model to propose with")

    def commit(self, sequences) -> None:
        pass

    def probe(self, sequences) -> None:
        pass


def merge_drafts(lookup: list[list[int] | None], drafted: Proposal | None, device) -> Proposal:
    """One proposal for the step: row b takes lookup[b] when it is not None, else the draft
    model's tokens (or nothing, when the model did not run)."""
    taken = [d or [] for d in lookup]
    free = [d is not None for d in lookup]
    if drafted is None:
        return Proposal(pad(taken, device), [len(d) for d in taken], free=free)
    width = max([drafted.tokens.shape[1]] + [len(d) for d in taken])
    tokens = torch.zeros(len(lookup), width, dtype=torch.long, device=device)
    tokens[:, :drafted.tokens.shape[1]] = drafted.tokens
    lengths = list(drafted.lengths)
    for row, draft in enumerate(lookup):
        if draft is not None:
            tokens[row, :len(draft)] = torch.tensor(draft, dtype=torch.long, device=device)
            tokens[row, len(draft):] = 0
            lengths[row] = len(draft)
    probs = None
    if drafted.probs is not None:  # lookup rows are deterministic: q is one-hot on their tokens
        onehot = torch.nn.functional.one_hot(tokens, drafted.probs.shape[-1]).to(drafted.probs.dtype)
        probs = onehot.clone()
        probs[:, :drafted.probs.shape[1]] = drafted.probs
        mask = torch.tensor(free, device=device)
        probs[mask] = onehot[mask]
    confidences = None
    if drafted.confidences is not None:
        confidences = [[1.0] * len(d) if f else c for f, d, c in zip(free, taken, drafted.confidences)]
    return Proposal(tokens, lengths, probs, confidences, free, drafted.forwards)
