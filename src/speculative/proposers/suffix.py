"""Suffix-cache drafting: what followed a row's last tokens in its own sequence *or* in the
sequences of requests this engine finished before (SuffixDecoding's global tree).

Repeated tasks (the same question asked twice, an agent loop) then draft from what was
generated the previous time. The cache belongs to one proposer, so to one engine: requests
of an engine share it; `fork()` (each engine makes its own) starts an empty one, so
engines never see each other's data. It is bounded: past `max_tokens` cached tokens the
oldest sequences are evicted. Instead of a suffix tree, an index of every n-gram
(min..max tokens) to where it ended: the longest suffix of the row found either in the row
or in the cache (up to max_ngram tokens) contributes every occurrence's continuation to
the row's tree (own occurrences first, then the most recent cached ones).
"""

from __future__ import annotations

from collections import OrderedDict

from ..core.config import LOOKUP_K
from ..models.base import pad
from ..core.tree import Tree, from_branches
from .base import Proposal
from .ngram import MAX_BRANCHES, NGramProposer, agreement


class SuffixCache:
    """Finished sequences, n-gram indexed, at most `max_tokens` tokens (oldest evicted)."""

    def __init__(self, max_tokens: int, min_n: int, max_n: int):
        if max_tokens < 1:
            raise ValueError(f"a suffix cache holds at least 1 token, got max_tokens={max_tokens}")
        self.max_tokens, self.min_n, self.max_n = max_tokens, min_n, max_n
        self.sequences: OrderedDict[int, list[int]] = OrderedDict()
        self.index: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # n-gram -> (sequence id, end)
        self.tokens = 0
        self.entries = 0
        self._next = 0

    def add(self, seq: list[int]) -> None:
        seq = list(seq[-self.max_tokens:])
        key, self._next = self._next, self._next + 1
        self.sequences[key] = seq
        self.tokens += len(seq)
        self._index(key, seq)
        while self.tokens > self.max_tokens:
            _, old = self.sequences.popitem(last=False)
            self.tokens -= len(old)
        if self.entries > 2 * (self.max_n - self.min_n + 1) * max(self.tokens, 1):
            self._rebuild()  # evicted sequences' entries are dropped in bulk, so memory stays bounded

    def _index(self, key: int, seq: list[int]) -> None:
        for end in range(1, len(seq)):  # an n-gram ending at the last token has no continuation
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.index.setdefault(tuple(seq[end - n:end]), []).append((key, end))
                self.entries += 1

    def _rebuild(self) -> None:
        self.index, self.entries = {}, 0
        for key, seq in self.sequences.items():
            self._index(key, seq)

    def occurrences(self, suffix: tuple[int, ...]) -> list[tuple[list[int], int]]:
        """(cached sequence, end) of every match of `suffix`, most recent first (at most MAX_BRANCHES)."""
        found = []
        for key, end in reversed(self.index.get(suffix, ())):
            seq = self.sequences.get(key)
            if seq is not None:
                found.append((seq, end))
                if len(found) == MAX_BRANCHES:
                    break
        return found


class SuffixProposer:
    """Prompt lookup (NGramProposer) in the row itself plus the engine's suffix cache."""

    model = None
    vocab_size = None
    branches = True
    reads_features = False

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, num_draft_tokens: int = LOOKUP_K,
                 max_tokens: int = 100_000):
        self.ngram = NGramProposer(max_ngram, min_ngram, num_draft_tokens)
        self.max_cached = max_tokens
        self.cache = SuffixCache(max_tokens, min_ngram, max_ngram)
        self.seen: list[list[int]] = []  # each row's sequence (the engine's own list, grown in place)

    @property
    def num_draft_tokens(self) -> int:
        return self.ngram.num_draft_tokens

    def fork(self) -> "SuffixProposer":
        ngram = self.ngram
        return SuffixProposer(ngram.max_ngram, ngram.min_ngram, ngram.num_draft_tokens, self.max_cached)

    def add_rows(self, prompts, capacity=0, samplers=None, generators=None) -> None:
        self.ngram.add_rows(prompts)
        self.seen += [list(p) for p in prompts]

    def select_rows(self, rows: list[int]) -> None:
        """Rows that leave put their sequence (prompt and output) into the cache."""
        for i in sorted(set(range(len(self.seen))) - set(rows)):
            self.cache.add(self.seen[i])
        self.seen = [self.seen[r] for r in rows]
        self.ngram.select_rows(rows)

    def free_trees(self, sequences, limits, top_k: int, max_nodes: int) -> tuple[list[Tree], list[bool]]:
        self.seen = list(sequences)
        trees = []
        for index, seq, limit in zip(self.ngram.rows, sequences, limits):
            k = min(limit, self.ngram.num_draft_tokens)  # as deep as a chain draft (ngram.py)
            found = self.found(index, seq) if k > 0 else []
            trees.append(from_branches([source[end:end + k] for source, end in found], top_k, max_nodes, k))
        return trees, [True] * len(sequences)

    def free_drafts(self, sequences, limits) -> tuple[list[list[int]], list[bool]]:
        """Chains: what followed the match whose preceding tokens agree longest with the
        row's (NGramProposer's rule, over the row and the cache), where the matches differ
        in that; otherwise the most frequent branch."""
        self.seen = list(sequences)
        drafts = []
        for index, seq, limit in zip(self.ngram.rows, sequences, limits):
            k = min(limit, self.ngram.num_draft_tokens)
            found = self.found(index, seq) if k > 0 else []
            context = [agreement(seq, end, source) for source, end in found]
            if context and max(context) > min(context):
                # Ties: the longer continuation (the row's own may run into its end), then the first.
                best = max(range(len(found)), key=lambda i: (context[i], min(k, len(found[i][0]) - found[i][1]), -i))
                source, end = found[best]
                drafts.append(source[end:end + k])
            else:
                drafts.append(from_branches([source[end:end + k] for source, end in found], 1, k, k).tokens)
        return drafts, [True] * len(sequences)

    def found(self, index, seq: list[int]) -> list[tuple[list[int], int]]:
        """(sequence, end) of every earlier match of the row's longest suffix found in the row
        or the cache (up to max_ngram tokens): the row's own, most recent first, then the
        cache's, most recent first."""
        ngram = self.ngram
        ends, n = index.occurrences(seq)
        for size in range(min(ngram.max_ngram, len(seq)), max(n, ngram.min_ngram - 1), -1):
            if self.cache.index.get(tuple(seq[len(seq) - size:])):
                n, ends = size, [e for e in ends if e >= size and seq[e - size:e] == seq[-size:]]
                break
        if not n:
            return []
        return [(seq, end) for end in ends] + self.cache.occurrences(tuple(seq[len(seq) - n:]))

    def unread(self, sequences) -> int:
        return 0  # no model

    def catch_up(self, sequences) -> None:
        pass

    def propose(self, sequences, limits, min_confidence=None) -> Proposal:
        drafts, _ = self.free_drafts(sequences, limits)
        return Proposal(pad(drafts), [len(d) for d in drafts])

    def commit(self, sequences) -> None:
        pass

    def probe(self, sequences) -> None:
        pass
