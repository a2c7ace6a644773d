"""Draft sources: a draft model, n-gram lookup in the prompt and output, both, or none."""

from .base import NoDraft, Proposal, Proposer, merge_drafts
from .draft_model import DraftModelProposer
from .hybrid import HybridProposer
from .ngram import NGramProposer

MODEL_METHODS = ("new_state", "forward", "rollback", "select_rows")


def as_proposer(draft, num_draft_tokens: int, prompt_lookup: bool) -> Proposer:
    """What drafts for the engine: `draft` itself when it is a proposer, no drafting for
    None, else a draft model, behind prompt lookup when `prompt_lookup`."""
    if draft is None:
        return NoDraft()
    if isinstance(draft, Proposer):
        return draft
    missing = [m for m in MODEL_METHODS if not callable(getattr(draft, m, None))]
    if missing:
        raise TypeError(f"draft must be a model (with {', '.join(MODEL_METHODS)}), a proposer such as "
                        f"NGramProposer, or None; got {type(draft).__name__}, which lacks {', '.join(missing)}")
    proposer = DraftModelProposer(draft)
    if prompt_lookup:
        proposer = HybridProposer(proposer, NGramProposer(num_draft_tokens=num_draft_tokens))
    return proposer


__all__ = ["Proposal", "Proposer", "NoDraft", "DraftModelProposer", "HybridProposer", "NGramProposer",
           "as_proposer", "merge_drafts"]
