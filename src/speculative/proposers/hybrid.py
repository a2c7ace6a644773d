"""Prompt lookup first, the draft model where lookup finds nothing convincing.

A small model's greedy output often repeats itself, and edits copy their input: there an
n-gram match predicts many tokens at no drafting cost. Elsewhere the draft model drafts.
Per row and per step, the lookup's draft is offered as a free draft, `preferred` when its
longest n-gram match has at least `min_match` tokens; the engine's plan decides which rows
take it and which rows the draft model drafts for (the model then runs for the batch,
rows that do not need it asking for no tokens).
"""

from __future__ import annotations

from .base import Proposal
from .draft_model import DraftModelProposer
from .head import HeadProposer
from .ngram import STRONG_MATCH, NGramProposer


class HybridProposer:
    def __init__(self, model_proposer: DraftModelProposer | HeadProposer, ngram: NGramProposer | None = None,
                 min_match: int = STRONG_MATCH):
        self.drafter = model_proposer
        self.ngram = ngram or NGramProposer()
        self.min_match = min_match
        self.model = model_proposer.model
        self.vocab_size = model_proposer.vocab_size
        self.reads_features = model_proposer.reads_features

    def fork(self) -> "HybridProposer":
        return HybridProposer(self.drafter.fork(), self.ngram.fork(), self.min_match)

    def add_rows(self, prompts, capacity, samplers, generators) -> None:
        self.drafter.add_rows(prompts, capacity, samplers, generators)
        self.ngram.add_rows(prompts, capacity, samplers, generators)

    def select_rows(self, rows: list[int]) -> None:
        self.drafter.select_rows(rows)
        self.ngram.select_rows(rows)

    def free_drafts(self, sequences: list[list[int]], limits: list[int]) -> tuple[list[list[int]], list[bool]]:
        """Per row: the lookup's draft, and whether its match is long enough to be preferred."""
        drafts, matched = self.ngram.lookup(sequences, limits)
        return drafts, [n >= self.min_match for n in matched]

    @property
    def branches(self) -> bool:
        """Lookup trees in front of the draft model's trees, when its model can branch."""
        return self.drafter.branches

    def free_trees(self, sequences: list[list[int]], limits: list[int], top_k: int, max_nodes: int):
        """Per row: the lookup's tree, and whether its match is long enough to be preferred."""
        trees, matched = self.ngram.branch_lookup(sequences, limits, top_k, max_nodes)
        return trees, [n >= self.min_match for n in matched]

    def unread(self, sequences: list[list[int]]) -> int:
        return self.drafter.unread(sequences)

    def catch_up(self, sequences: list[list[int]]) -> None:
        self.drafter.catch_up(sequences)

    def read_features(self, features) -> None:
        self.drafter.read_features(features)

    def propose(self, sequences: list[list[int]], limits: list[int], min_confidence: float | None = None) -> Proposal:
        return self.drafter.propose(sequences, limits, min_confidence)

    def propose_tree(self, sequences, limits, top_k, max_nodes):
        return self.drafter.propose_tree(sequences, limits, top_k, max_nodes)

    def commit(self, sequences: list[list[int]]) -> None:
        self.drafter.commit(sequences)

    def probe(self, sequences: list[list[int]]) -> None:
        self.drafter.probe(sequences)
