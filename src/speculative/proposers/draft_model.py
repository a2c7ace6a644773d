"""Drafting with a small language model that follows the model protocol."""

from __future__ import annotations

import torch

from ..sampling import probabilities, sample
from .base import Proposal


class DraftModelProposer:
    """Runs the draft model K times per step and rolls it back to the kept prefix.

    The draft lags the committed sequence by one or more tokens (the target's extra token,
    and the last drafted token when all were accepted); those pending tokens are fed at
    the start of the next step, in the same forward call that drafts the first token.
    """

    def __init__(self, model, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, sampling: bool = False):
        self.model = model
        self.vocab_size = model.vocab_size
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        # In greedy mode q is never needed: draft the argmax and skip the softmax.
        self.sampling = sampling and temperature > 0
        self.state = None
        self.generators: list[torch.Generator] = []
        self._committed: list[int] = []
        self._k = 0

    def start(self, prompts: list[list[int]], capacity: int, generators: list[torch.Generator]) -> None:
        self.state = self.model.new_state(len(prompts), capacity)
        self.generators = list(generators)
        heads = [p[:-1] for p in prompts]
        if max(map(len, heads)) > 0:
            self.model.forward(pad(heads, self.model.device), self.state, [len(h) for h in heads], keep_logits=False)

    def propose(self, sequences: list[list[int]], k: int) -> Proposal:
        device = self.model.device
        pending = [seq[n:] for seq, n in zip(sequences, self.state.lengths)]
        outside = [t for p in pending for t in p if t >= self.vocab_size]
        if outside:
            raise ValueError(f"the target produced token id {outside[0]}, outside the draft's vocabulary of "
                             f"{self.vocab_size} (a padded id the tokenizer does not have)")
        self._committed, self._k = [len(seq) for seq in sequences], k
        logits = self.model.forward(pad(pending, device), self.state, [len(p) for p in pending])
        rows = torch.arange(len(sequences), device=device)
        logits = logits[rows, torch.tensor([len(p) - 1 for p in pending], device=device)]  # (B, V)
        tokens, probs = [], []
        for i in range(k):
            if i:
                logits = self.model.forward(tokens[-1][:, None], self.state)[:, -1]
            if self.sampling:
                q = probabilities(logits, self.temperature, self.top_k, self.top_p)
                probs.append(q)
                tokens.append(sample(q, self.generators))
            else:
                tokens.append(logits.argmax(-1))
        return Proposal(torch.stack(tokens, 1), [k] * len(sequences), torch.stack(probs, 1) if self.sampling else None)

    def commit(self, accepted: list[int]) -> None:
        # The draft has seen the committed prefix plus its first K-1 drafts; keep what the
        # target kept (at most those K-1: the K-th draft was never fed).
        keep = [n + min(a, self._k - 1) for n, a in zip(self._committed, accepted)]
        self.model.rollback(self.state, keep)

    def select_rows(self, rows: list[int]) -> None:
        self.model.select_rows(self.state, rows)
        self.generators = [self.generators[r] for r in rows]


def pad(rows: list[list[int]], device, value: int = 0) -> torch.Tensor:
    """Right-pad token lists into a (B, T) long tensor."""
    width = max(1, max(map(len, rows)))
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
