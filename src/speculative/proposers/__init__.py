"""Draft sources: a draft model, n-gram lookup in the prompt and output."""

from .base import Proposal, Proposer
from .draft_model import DraftModelProposer
from .hybrid import HybridProposer
from .ngram import NGramProposer

__all__ = ["Proposal", "Proposer", "DraftModelProposer", "HybridProposer", "NGramProposer"]
