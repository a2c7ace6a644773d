"""What a request and a pair of models must satisfy before the engine takes them, and how
rows are reordered when some leave. Everything here raises before anything changes, so a
bad request or pair never disturbs the running ones."""

from __future__ import annotations

from typing import Hashable

from ..core.config import MAX_BATCH_SIZE, at_most
from ..core.rows import SamplingParams
from ..models.text import same_vocabulary


def check_compatible(target, proposer) -> None:
    """Draft and target must share one vocabulary: compared by tokenizer when both have
    one (padded embedding matrices, as in Qwen, then pass), else by vocabulary size."""
    if proposer.vocab_size is None:
        return  # lookup proposes ids from the sequence itself
    target_tok = getattr(target, "tokenizer", None)  # optional in the model protocol
    draft_tok = getattr(proposer.model, "tokenizer", None)
    if target_tok is not None and draft_tok is not None:
        if not same_vocabulary(target_tok, draft_tok):
            raise ValueError(f"draft and target tokenizers differ: draft {draft_tok.name} ({len(draft_tok)} tokens), "
                             f"target {target_tok.name} ({len(target_tok)} tokens); both sides need one tokenizer")
        return
    if proposer.vocab_size != target.vocab_size:
        raise ValueError(f"draft and target vocabularies differ: draft has {proposer.vocab_size} tokens, target "
                         f"has {target.vocab_size}; both sides must share one vocabulary")


def check_batch_size(max_batch_size) -> int:
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
    return at_most(max_batch_size, "max_batch_size", MAX_BATCH_SIZE)


def check_params(params) -> SamplingParams:
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams or None, got {type(params).__name__}")
    return params


def check_request_id(request_id, live) -> None:
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
        raise TypeError(f"request_id must be a string or an integer, got {request_id!r}")
    if request_id in live:
        raise ValueError(f"request id {request_id!r} is already in use by a request that has not finished")


def check_fits(request_id: Hashable, prompt: list[int], params: SamplingParams, target, draft) -> None:
    """Prompt and stop tokens within the vocabulary; prompt and new tokens within each model's length."""
    vocab = target.vocab_size
    for name, ids in (("prompt", prompt), ("stop_token_ids", params.stop_token_ids or ()),
                      ("logit_bias", params.logit_bias or ())):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: {name} holds token id {bad[0]}, outside the vocabulary: "
                             f"allowed 0..{vocab - 1}")
    for role, model in (("target", target), ("draft", draft)):
        limit = None if model is None else model.max_seq_len
        if limit is not None and len(prompt) + params.max_new_tokens > limit:
            raise ValueError(f"request {request_id!r}: the prompt has {len(prompt)} tokens and max_new_tokens is "
                             f"{params.max_new_tokens}: {len(prompt) + params.max_new_tokens} tokens exceed the "
                             f"{role} model's maximum length of {limit}")


def check_grammar(grammar, target, trees: bool) -> None:
    """A grammar runs with chain drafts, over the target's vocabulary."""
    if trees:
        raise ValueError("a grammar (structured output) runs with chain drafts: this engine drafts token trees "
                         "(tree_top_k > 1); use tree_top_k 1")
    if grammar.tokenizer.vocab_size != target.vocab_size:
        raise ValueError(f"the grammar was built for a vocabulary of {grammar.tokenizer.vocab_size} tokens, the "
                         f"target has {target.vocab_size}")


def check_can_join_running(target, draft) -> None:
    """A request that joins a running batch needs `add_rows` on both models (optional in the
    model protocol: a model without it serves only the batch it started with)."""
    for role, model in (("target", target), ("draft", draft)):
        if model is not None and not callable(getattr(model, "add_rows", None)):
            raise TypeError(f"the {role} model {type(model).__name__} lacks add_rows, so requests cannot "
                            "join a running batch; add all requests before the first step (at most "
                            "max_batch_size), or implement add_rows (speculative.models.base)")


def refill_order(size: int, leaving: set[int]) -> list[int]:
    """The rows that stay, ordered so that the fewest move: a row that leaves from the
    front is replaced by one that stays from the back."""
    kept = size - len(leaving)
    movers = [i for i in range(kept, size) if i not in leaving]
    return [movers.pop() if i in leaving else i for i in range(kept)]
