"""Prompt-lookup drafting: propose what followed the last n tokens the previous time.

No draft model: the history itself (prompt + output) is the draft. Works best on
input-grounded generation (editing code, quoting a document), where the output copies
long spans of the input.
"""

from __future__ import annotations

import copy

from ..models.base import pad
from .base import Proposal


class _RowIndex:
    """For one row: where each n-gram (min..max tokens) last ended, positions < `indexed`."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0

    def update(self, seq: list[int], upto: int) -> None:
        """Index every n-gram that ends at a position in [indexed, upto)."""
        for end in range(max(self.indexed, 1), upto):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.last_end[tuple(seq[end - n:end])] = end
        self.indexed = max(self.indexed, upto)

    def lookup(self, seq: list[int]) -> tuple[int, int]:
        """(end of the most recent earlier match of the longest suffix, its length n) or (-1, 0)."""
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            end = self.last_end.get(tuple(seq[len(seq) - n:]))
            if end is not None:
                return end, n
        return -1, 0


class NGramProposer:
    """Drafts by looking up the last n tokens (n from max_ngram down to min_ngram) in the
    row's own prompt and output, and proposing the tokens that followed the most recent
    earlier occurrence.

    Unlike a fixed n, trying the longest n first finds the most specific match, and the
    draft length follows the match: a match of n tokens proposes up to
    num_draft_tokens * n / max_ngram tokens (at least `min_draft`), because short
    matches are more often coincidences.
    """

    vocab_size = None  # proposes ids taken from the row itself
    model = None
    reads_features = False

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, num_draft_tokens: int = 10, min_draft: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if num_draft_tokens < 1 or min_draft < 1:
            raise ValueError(f"num_draft_tokens and min_draft must be >= 1, got {num_draft_tokens}, {min_draft}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.num_draft_tokens, self.min_draft = num_draft_tokens, min_draft
        self.rows: list[_RowIndex] = []

    def fork(self) -> "NGramProposer":
        twin = copy.copy(self)
        twin.rows = []
        return twin

    def add_rows(self, prompts: list[list[int]], capacity: int = 0, samplers=None, generators=None) -> None:
        self.rows += [_RowIndex(self.min_ngram, self.max_ngram) for _ in prompts]

    def free_drafts(self, sequences: list[list[int]], limits: list[int]) -> tuple[list[list[int]], list[bool]]:
        """Every row's lookup draft, always taken (there is no model to prefer)."""
        return self.lookup(sequences, limits)[0], [True] * len(sequences)

    def lookup(self, sequences: list[list[int]], limits: list[int]) -> tuple[list[list[int]], list[int]]:
        """Per row: the drafted tokens, and the length n of the n-gram matched (0: none)."""
        drafts, matched = [], []
        for index, seq, limit in zip(self.rows, sequences, limits):
            k = min(limit, self.num_draft_tokens)
            index.update(seq, len(seq))
            # Indexed n-grams end before len(seq): the suffix never matches itself.
            end, n = index.lookup(seq)
            if end < 0 or k <= 0:
                drafts.append([])
                matched.append(0)
                continue
            budget = max(self.min_draft, (k * n) // self.max_ngram)
            drafts.append(seq[end:end + min(k, budget)])
            matched.append(n)
        return drafts, matched

    def catch_up(self, sequences: list[list[int]]) -> None:
        pass

    def propose(self, sequences: list[list[int]], limits: list[int], min_confidence: float | None = None) -> Proposal:
        drafts, _ = self.lookup(sequences, limits)
        return Proposal(pad(drafts), [len(d) for d in drafts])

    def commit(self, sequences: list[list[int]]) -> None:
        pass

    def probe(self, sequences: list[list[int]]) -> None:
        pass

    def select_rows(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]
