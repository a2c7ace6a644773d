"""Drafting with a head that reads the target's features (EAGLE-style, `models/head.py`).

The engine hands the proposer the target's final hidden states for every token that
enters the target's state (`read_features`: the prompts' at admission, the kept tokens'
from each verify forward), so the head never needs a target forward of its own. The head
reads each committed token x_t with the feature f_{t-1}; it is one token ahead of the
target (the target has not yet read the last committed token, the head has: its output
there drafts the first token). Drafted tokens are read with the head's own output
feature, so after verification the head rolls back to the committed tokens it read with
real features, whatever was accepted, and reads the kept tokens again with theirs.

Sampling, per-row settings, reduced vocabularies and confidences are those of the draft
model proposer (`DraftModelProposer.propose`); only what a forward reads differs. So are
trees (`propose_tree`, EAGLE-2): each node is read with its parent's output feature.
"""

from __future__ import annotations

import torch

from ..models.base import pad
from .draft_model import DraftModelProposer


class HeadProposer(DraftModelProposer):
    reads_features = True
    branches = True  # a head reads a tree layer in one forward (its `tree` mask)

    def __init__(self, head, target):
        head.check_target(target)
        self.model = head
        self.vocab_size = target.vocab_size
        self.vocab = head.vocab_ids
        self.head = head.output_layer(target)  # the target's output layer, frozen
        self.embed = target.embed
        # The output layer's dtype: the target's, which the head's own may differ from.
        self.out_dtype = target.embed(torch.zeros(1, 1, dtype=torch.long, device=target.device)).dtype
        self._reset()

    def _reset(self) -> None:
        super()._reset()
        # Per row: the target's features of the row's tokens so far (n, H), a zero row first
        # (the feature "before" the first token).
        self.features: list[torch.Tensor] = []
        self._own: torch.Tensor | None = None  # (B, H): the head's last output while drafting
        self._tree_own: torch.Tensor | None = None  # (B, F, H): its outputs at the tree nodes read

    def add_rows(self, prompts, capacity, samplers, generators) -> None:
        super().add_rows(prompts, capacity, samplers, generators)
        size = self.model.cfg.hidden_size
        self.features += [torch.zeros(1, size, device=self.model.device) for _ in prompts]

    def select_rows(self, rows: list[int]) -> None:
        super().select_rows(rows)
        self.features = [self.features[r] for r in rows]

    def read_features(self, features: list[torch.Tensor]) -> None:
        """features[b] (n_b, H): the target's hidden states of row b's tokens that just
        entered the target's state, in order (n_b may be 0)."""
        self.features = [torch.cat([old, new.to(old.dtype)]) if len(new) else old
                         for old, new in zip(self.features, features)]

    def unread(self, sequences: list[list[int]]) -> int:
        """The most tokens of a row the draft has yet to read."""
        return max((len(seq) - n for seq, n in zip(sequences, self.state.lengths)), default=0)

    def catch_up(self, sequences: list[list[int]]) -> None:
        """Read what the head has not, but the last `catch_up_limit` tokens, without drafting."""
        self._read_apart(sequences)
        pending = [seq[n:] for seq, n in zip(sequences, self.state.lengths)]
        if max(map(len, pending)) > self.catch_up_limit:
            self._read([p[:-1] for p in pending])

    def _read_joined(self, prompts: list[list[int]], rows: list[int]):
        """Joined rows' prompts (their last token apart, as `catch_up` leaves it) read with
        their features into a state of their own."""
        joined = self.model.new_state(len(prompts), self.capacity)
        self._read([p[:-1] for p in prompts], rows, joined)
        return joined

    def _read(self, pending: list[list[int]], rows: list[int] | None = None, state=None) -> torch.Tensor:
        """Read committed tokens with the target's features; h (B, T, H). `rows` and `state`:
        these rows only, into a state of their own (default: every row, the head's state)."""
        rows = range(len(pending)) if rows is None else rows
        state = self.state if state is None else state
        width = max(1, max(map(len, pending)))
        features = torch.zeros(len(pending), width, self.model.cfg.hidden_size, device=self.model.device)
        for i, (row, start, tokens) in enumerate(zip(rows, state.lengths, pending)):
            features[i, :len(tokens)] = self.features[row][start:start + len(tokens)]
        tokens = pad(pending, self.model.device)
        return self.model(self.embed(tokens), features, state, [len(p) for p in pending])

    def _run(self, tokens: torch.Tensor, num_valid: list[int] | None = None, keep_logits: bool = True):
        """Logits (B, T, N) as DraftModelProposer.propose asks for them: first over the pending
        committed tokens (real features), then over each drafted token (the head's own)."""
        if self._own is None:
            counts = [tokens.shape[1]] * tokens.shape[0] if num_valid is None else num_valid
            hidden = self._read([row[:n] for row, n in zip(tokens.tolist(), counts)])  # (B, T, H)
            rows = torch.arange(len(counts), device=hidden.device)
            self._own = hidden[rows, torch.tensor(counts, device=hidden.device) - 1]
        else:
            hidden = self.model(self.embed(tokens), self._own[:, None], self.state)  # (B, 1, H)
            self._own = hidden[:, -1]
        return self.head(hidden.to(self.out_dtype))

    def _root_logits(self, sequences):
        self._own = None  # the next _run reads committed tokens
        return super()._root_logits(sequences)

    def _tree_forward(self, tokens, parents, positions, mask):
        """A layer of tree nodes, each read with its parent's output feature (the root's: the
        last committed token's)."""
        own = self._own[:, None] if self._tree_own is None else torch.cat([self._own[:, None], self._tree_own], 1)
        features = own.gather(1, (parents + 1)[:, :, None].expand(-1, -1, own.shape[-1]))  # (B, k, H)
        hidden = self.model(self.embed(tokens), features, self.state, positions=positions, tree=mask)
        self._tree_own = hidden if self._tree_own is None else torch.cat([self._tree_own, hidden], 1)
        return self.head(hidden.to(self.out_dtype))

    def propose_tree(self, sequences, limits, top_k, max_nodes):
        try:
            return super().propose_tree(sequences, limits, top_k, max_nodes)
        finally:
            self._tree_own = None

    def commit(self, sequences: list[list[int]]) -> None:
        # Tokens drafted after the first were read with the head's own features: forget them.
        self.model.rollback(self.state, self._committed)

    def probe(self, sequences: list[list[int]]) -> None:
        """One drafting step (a token read with a feature) over these rows, then forgotten."""
        lengths = list(self.state.lengths)
        tokens = torch.tensor([[row[-1]] for row in sequences], device=self.model.device)
        features = torch.zeros(len(sequences), 1, self.model.cfg.hidden_size, device=self.model.device)
        self.head(self.model(self.embed(tokens), features, self.state).to(self.out_dtype))
        self.model.rollback(self.state, lengths)
