"""The proposer interface: whatever drafts tokens for the target to verify.

Two calls per step, as in transformers' candidate generators: `propose` drafts up to
limits[b] tokens for row b from the committed sequences; `commit` sees the sequences as
committed after verification, so the proposer can roll back to what still holds.
`start` prepares a batch and `select_rows` drops finished rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Proposal:
    # Drafted tokens (B, K), padded past each row's length.
    tokens: torch.Tensor
    # Drafted tokens per row; rows may draft fewer than K (an n-gram lookup may find none).
    lengths: list[int]
    # The draft distributions q (B, K, V) the tokens were sampled from; None when the
    # tokens are deterministic (greedy draft, n-gram lookup): q is then one-hot.
    probs: torch.Tensor | None = None
    # Per row, the draft's probability of each drafted token (for adaptive K); None if unknown.
    confidences: list[list[float]] | None = None
    # Per row, True where the drafts cost nothing to make (prompt lookup in front of a draft
    # model): the adaptive policy, which sizes the draft model's K, does not learn from them.
    free: list[bool] | None = None


class Proposer(Protocol):
    vocab_size: int | None

    def start(self, prompts: list[list[int]], capacity: int, generators: list[torch.Generator]) -> None: ...

    def propose(self, sequences: list[list[int]], limits: list[int]) -> Proposal: ...

    def commit(self, sequences: list[list[int]]) -> None: ...

    def select_rows(self, rows: list[int]) -> None: ...
