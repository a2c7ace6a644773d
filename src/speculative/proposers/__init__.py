"""Draft sources: a draft model, n-gram lookup in the prompt and output, both, or none."""

from ..core.config import SpeculativeConfig, as_config
from ..models.head import DraftHead
from .base import NoDraft, Proposal, Proposer, merge_drafts
from .draft_model import DraftModelProposer
from .head import HeadProposer
from .hybrid import HybridProposer
from .ngram import NGramProposer
from .suffix import SuffixProposer
from .vocab import auto_vocab


def default_config(draft, config=None) -> SpeculativeConfig:
    """`config`, or where it is None the defaults for `draft`: SpeculativeConfig() (K = MODEL_K,
    prompt lookup in front of a draft model or head), or a lookup proposer's own K (LOOKUP_K by
    default), as `generate` runs them."""
    if config is None and isinstance(draft, (NGramProposer, SuffixProposer)):
        return SpeculativeConfig(num_draft_tokens=draft.num_draft_tokens, prompt_lookup=False)
    return as_config(config)


def as_proposer(draft, config, vocab="auto", target=None) -> Proposer:
    """What drafts for the engine: `draft` itself when it is a proposer, no drafting for
    None, else a draft model (scoring only `vocab`: "auto" is `vocab.auto_vocab`, None all its
    tokens) or a draft head (drafting from `target`'s features, over its own vocabulary), behind
    prompt lookup when `config.prompt_lookup`. Check `draft` first (inputs.check_draft)."""
    if draft is None:
        return NoDraft()
    if isinstance(vocab, str):
        if vocab != "auto":
            raise ValueError(f"draft_vocab must be 'auto', None (all tokens) or a tensor of token ids, got {vocab!r}")
        if isinstance(draft, (Proposer, DraftHead)):
            vocab = None
        else:
            tokenizer = getattr(target, "tokenizer", None) or getattr(draft, "tokenizer", None)
            vocab = auto_vocab(draft, tokenizer)
    if isinstance(draft, Proposer):
        if vocab is not None:
            raise ValueError("draft_vocab applies to a draft model; pass it to the proposer itself")
        return draft
    if isinstance(draft, DraftHead):
        if vocab is not None:
            raise ValueError("draft_vocab applies to a draft model; a draft head keeps the vocabulary it was "
                             "trained with (train-head --vocab)")
        if target is None:
            raise ValueError("a draft head drafts from a target's features: pass the target as well")
        proposer = HeadProposer(draft, target)
    else:
        proposer = DraftModelProposer(draft, vocab=vocab)
    if config.prompt_lookup:
        proposer = HybridProposer(proposer, NGramProposer(config.max_ngram, config.min_ngram, config.longest_draft))
    return proposer


__all__ = ["Proposal", "Proposer", "NoDraft", "DraftModelProposer", "HeadProposer", "HybridProposer", "NGramProposer",
           "SuffixProposer", "as_proposer", "default_config", "merge_drafts"]
