"""Prompt lookup first, the draft model where lookup finds nothing convincing.

A small model's greedy output often repeats itself, and edits copy their input: there an
n-gram match predicts many tokens at no drafting cost. Elsewhere the draft model drafts.
Per row and per step: a row whose longest n-gram match has at least `min_match` tokens
takes the lookup's tokens; the other rows take the draft model's (which then runs for the
batch, rows that do not need it asking for no tokens).

The decoder may decide the rows itself (its adaptive plan weighs lookup and the model for
the batch as a whole): it then passes each row's lookup draft, or None for a model row.
"""

from __future__ import annotations

import torch

from .base import Proposal
from .draft_model import DraftModelProposer
from .ngram import NGramProposer, pad_rows


class HybridProposer:
    def __init__(self, model_proposer: DraftModelProposer, ngram: NGramProposer | None = None, min_match: int = 2):
        self.drafter = model_proposer
        self.ngram = ngram or NGramProposer()
        self.min_match = min_match
        self.model = model_proposer.model
        self.vocab_size = model_proposer.vocab_size
        self.reports_confidence = True
        self._used_model = False

    @property
    def forward_seconds(self) -> float:
        return self.drafter.forward_seconds

    @property
    def forwards(self) -> int:
        return self.drafter.forwards

    def start(self, prompts, capacity, generators) -> None:
        self.drafter.start(prompts, capacity, generators)
        self.ngram.start(prompts, capacity, generators)

    def lookup_drafts(self, sequences: list[list[int]], limits: list[int]) -> tuple[list[list[int]], list[bool]]:
        """Per row: the lookup's draft, and whether its match is long enough to be preferred."""
        drafts, matched = self.ngram.lookup(sequences, limits)
        return drafts, [n >= self.min_match for n in matched]

    def propose(self, sequences: list[list[int]], limits: list[int], min_confidence: float | None = None,
                lookup: list[list[int] | None] | None = None) -> Proposal:
        """Row b takes lookup[b] when it is not None, else up to limits[b] tokens from the
        draft model. Without `lookup`, rows with a convincing match take the lookup's."""
        if lookup is None:
            drafts, strong = self.lookup_drafts(sequences, limits)
            lookup = [d if s else None for d, s in zip(drafts, strong)]
        use_lookup = [d is not None for d in lookup]
        looked_up = [d or [] for d in lookup]
        model_limits = [0 if use else k for use, k in zip(use_lookup, limits)]
        self._used_model = max(model_limits) > 0
        if not self._used_model:
            return Proposal(pad_rows(looked_up), [len(d) for d in looked_up], free=use_lookup)
        drafted = self.drafter.propose(sequences, model_limits, min_confidence=min_confidence)
        width = max([drafted.tokens.shape[1]] + [len(d) for d in looked_up])
        device = drafted.tokens.device
        tokens = torch.zeros(len(sequences), width, dtype=torch.long, device=device)
        tokens[:, :drafted.tokens.shape[1]] = drafted.tokens
        lengths = list(drafted.lengths)
        for row, (use, draft) in enumerate(zip(use_lookup, looked_up)):
            if use:
                tokens[row, :len(draft)] = torch.tensor(draft, dtype=torch.long, device=device)
                lengths[row] = len(draft)
        probs = None
        if drafted.probs is not None:  # lookup rows are deterministic: q is one-hot on their tokens
            onehot = torch.nn.functional.one_hot(tokens, drafted.probs.shape[-1]).to(drafted.probs.dtype)
            probs = onehot.clone()
            probs[:, :drafted.probs.shape[1]] = drafted.probs
            mask = torch.tensor(use_lookup, device=device)
            probs[mask] = onehot[mask]
        confidences = None
        if drafted.confidences is not None:
            confidences = [[1.0] * len(d) if use else c for use, d, c in
                           zip(use_lookup, looked_up, drafted.confidences)]
        return Proposal(tokens, lengths, probs, confidences, free=use_lookup)

    def commit(self, sequences: list[list[int]]) -> None:
        if self._used_model:
            self.drafter.commit(sequences)

    def probe_seconds(self, rows) -> float:
        return self.drafter.probe_seconds(rows)

    def select_rows(self, rows: list[int]) -> None:
        self.drafter.select_rows(rows)
        self.ngram.select_rows(rows)
