"""Prompt-lookup drafting: propose what followed the last n tokens the previous time.

No draft model: the history itself (prompt + output) is the draft. Works best on
input-grounded generation (editing code, quoting a document), where the output copies
long spans of the input.
"""

from __future__ import annotations

import copy

from ..core.config import LOOKUP_K, MAX_DRAFT_TOKENS, MAX_NGRAM, at_most
from ..models.base import pad
from ..core.tree import Tree, from_branches
from .base import Proposal

# Earlier occurrences of a suffix that contribute branches to a tree (the most recent ones).
MAX_BRANCHES = 64
# Matches of at least this many tokens are `preferred`: a draft model (hybrid) drafts for
# shorter ones, and the adaptive policy learns their acceptance apart (a one-token match
# is right far less often).
STRONG_MATCH = 2
# Tokens of context compared to choose among the matches of a max_ngram suffix: 16 drafted
# as well as 64 on a grounded-editing replay (Gemma 3 270M), 8 slightly worse.
CONTEXT = 16


class _RowIndex:
    """For one row: where each n-gram (min..max tokens) ended, every time, oldest first
    (positions before `indexed`)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0

    def occurrences(self, seq: list[int]) -> tuple[list[int], int]:
        """(ends of every earlier match of the longest suffix that has one, most recent
        first, at most MAX_BRANCHES; its length n) or ([], 0)."""
        for end in range(max(self.indexed, 1), len(seq)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends.setdefault(tuple(seq[end - n:end]), []).append(end)
        self.indexed = max(self.indexed, len(seq))
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            ends = self.ends.get(tuple(seq[len(seq) - n:]))
            if ends:
                return ends[:-MAX_BRANCHES - 1:-1], n
        return [], 0

    def lookup(self, seq: list[int]) -> tuple[int, int]:
        """(end of the earlier match of the longest suffix whose preceding tokens agree
        longest with the row's, up to CONTEXT; the most recent among equals; its length n)
        or (-1, 0). Past max_n tokens, this tells apart the places a line was copied from."""
        ends, n = self.occurrences(seq)
        if not ends or n < self.max_n:
            return (ends[0] if ends else -1), n  # a shorter suffix: no match agrees further back
        return max(ends, key=lambda end: agreement(seq, end)), n


def agreement(seq: list[int], end: int, source: list[int] | None = None) -> int:
    """How many tokens before `end` in `source` (default: `seq` itself) equal the last ones
    of `seq`, up to CONTEXT."""
    source = seq if source is None else source
    length = 0
    while length < min(CONTEXT, end, len(seq)) and source[end - 1 - length] == seq[-1 - length]:
        length += 1
    return length


class NGramProposer:
    """Drafts by looking up the last n tokens (n from max_ngram down to min_ngram) in the
    row's own prompt and output, and proposing the tokens that followed an earlier
    occurrence: the one whose preceding tokens agree longest with the row's (up to
    CONTEXT), the most recent among equals.

    Unlike a fixed n, trying the longest n first finds the most specific match (and the
    context picks among a max_ngram suffix's matches: 3.5% less replayed time on
    grounded editing than the most recent one). A match
    proposes its whole continuation, up to num_draft_tokens: how much of it to verify is
    the adaptive policy's choice, from the acceptance it measured for matches this long
    (`preferred`: at least STRONG_MATCH tokens, or shorter) and the cost of verify width.
    (Cutting drafts by match length, K*n/max_ngram tokens, needed 49 forwards where drafting
    up to 10 needed 44 on a grounded-editing replay with Gemma 3 270M.) `min_draft` is
    checked but no longer used: no rule cuts a draft below what the policy chooses.
    """

    vocab_size = None  # proposes ids taken from the row itself
    model = None
    branches = True  # drafts trees (free_trees)
    reads_features = False

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, num_draft_tokens: int = LOOKUP_K, min_draft: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if num_draft_tokens < 1 or min_draft < 1:
            raise ValueError(f"num_draft_tokens and min_draft must be >= 1, got {num_draft_tokens}, {min_draft}")
        for name, value, bound in (("max_ngram", max_ngram, MAX_NGRAM), ("num_draft_tokens", num_draft_tokens,
                                    MAX_DRAFT_TOKENS), ("min_draft", min_draft, MAX_DRAFT_TOKENS)):
            at_most(value, name, bound)
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
        """Every row's lookup draft (always taken: there is no model), preferred where its
        match is long (the policy then judges it by the long matches' acceptance)."""
        drafts, matched = self.lookup(sequences, limits)
        return drafts, [n >= STRONG_MATCH for n in matched]

    def lookup(self, sequences: list[list[int]], limits: list[int]) -> tuple[list[list[int]], list[int]]:
        """Per row: the tokens that followed the match, up to its limit and K (none without
        a match), and the length n of the n-gram matched (0: none)."""
        drafts, matched = [], []
        for index, seq, limit in zip(self.rows, sequences, limits):
            k = min(limit, self.num_draft_tokens)
            # Indexed n-grams end before len(seq): the suffix never matches itself.
            end, n = index.lookup(seq)
            if end < 0 or k <= 0:
                drafts.append([])
                matched.append(0)
                continue
            drafts.append(seq[end:end + k])
            matched.append(n)
        return drafts, matched

    def free_trees(self, sequences: list[list[int]], limits: list[int], top_k: int,
                   max_nodes: int) -> tuple[list[Tree], list[bool]]:
        """Every row's lookup tree, always taken (there is no model to prefer)."""
        return self.branch_lookup(sequences, limits, top_k, max_nodes)[0], [True] * len(sequences)

    def branch_lookup(self, sequences: list[list[int]], limits: list[int], top_k: int,
                      max_nodes: int) -> tuple[list[Tree], list[int]]:
        """Per row: a tree of what followed every earlier occurrence of its longest matched
        suffix (shared prefixes merged, branches ranked by how often they occur, the most
        recent first among equals), and the length n of that suffix (0: none). As deep as
        a chain draft: up to K and limits[b] (the node budget cuts it)."""
        trees, matched = [], []
        for index, seq, limit in zip(self.rows, sequences, limits):
            k = min(limit, self.num_draft_tokens)
            ends, n = index.occurrences(seq) if k > 0 else ([], 0)
            trees.append(from_branches(self.continuations(seq, ends, k), top_k, max_nodes, k))
            matched.append(n)
        return trees, matched

    @staticmethod
    def continuations(seq: list[int], ends: list[int], depth: int) -> list[list[int]]:
        return [seq[end:end + depth] for end in ends]

    def unread(self, sequences) -> int:
        return 0  # no model

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
