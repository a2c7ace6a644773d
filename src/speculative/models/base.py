"""The model protocol: what any causal language model provides to serve as target or draft.

A model owns weights only. Everything that changes during generation lives in a state
object made by `new_state`, so one loaded model can serve several generations at once.
Every tensor has a batch dimension B, and every row has its own length: after a
speculative step rows keep different numbers of tokens (ragged acceptance).

The engine uses these operations:

- `new_state(batch_size, capacity)`: an empty state for B rows of at most `capacity`
  tokens each (capacity bounds the tokens ever fed, including rejected drafts).
- `forward(tokens, state, num_valid=None, keep_logits=True, return_hidden=False,
  positions=None)`: tokens (B, T) are appended to each row; returns float32 logits
  (B, T, V). With `num_valid`, row b only keeps its first num_valid[b] tokens (its other
  tokens are padding whose logits are garbage); this is how rows of different lengths
  share one call. keep_logits=False may return None (prompt processing needs no logits,
  and a 262k-token output layer is costly; the last block then need only write its keys
  and values to the cache, as llama.cpp's does); return_hidden=True also returns the final
  hidden states. `positions` (B, T) are the tokens' positions, apart from the cache slots
  they take (default: each row's next positions), so that a token tree can give siblings
  one depth; a recurrent model only accepts the default. `tree` (B, T, T) bool, where a
  model verifies token trees: which of this forward's tokens each token sees (its
  ancestors and itself, `speculative.core.tree`); every token still sees its row's earlier slots.
  `argmax_rows` (B bools), passed only to models whose `screens_argmax` is True: rows whose
  logits are read only for their argmax (greedy rows); the model may set to -inf every logit
  it proves is not its row's largest (a screened output layer, `argmax_screen.py`). That
  argmax must be the one the model gives such rows in every call, so that speculative and
  plain decoding read the same.
- `compact(state, starts, kept)` (models that verify trees): after a tree forward that
  started row b at slot starts[b], keep only the slots starts[b] + kept[b][j], moved to
  starts[b] + j (the accepted path), and end the row there. A model without it drafts
  chains (an engine asked for trees says so once, when it is made).
- `rollback(state, lengths)`: truncate row b to its first lengths[b] tokens. A model may
  only guarantee rollback over the short forwards (a speculative step's worth of tokens)
  made since its previous rollback: a recurrent model keeps the states it passed through
  until then. The engine never needs more: it only ever rolls back drafted tokens.
- `select_rows(state, rows)`: keep only the given rows, in that order (finished
  sequences leave the batch and stop costing compute).
- `add_rows(state, new, capacity)`: append the rows of `new`, a state of the same model
  (requests joining a running batch, prefilled apart); every row then has room for
  `capacity` tokens. Called between steps, after rollback. Needed only when requests join
  a running batch (the step engine); a generate() call admits all its rows at once.

Plus the attributes `vocab_size`, `max_seq_len` (None when unbounded) and `device`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from .argmax_screen import screened_logits
from .kernels import Int8Linear, PackedLinear


@runtime_checkable
class LanguageModel(Protocol):
    vocab_size: int
    max_seq_len: int | None
    device: torch.device

    def new_state(self, batch_size: int, capacity: int) -> Any: ...

    def forward(self, tokens: torch.Tensor, state: Any, num_valid: list[int] | None = None,
                keep_logits: bool = True) -> torch.Tensor | None: ...

    def rollback(self, state: Any, lengths: list[int]) -> None: ...

    def select_rows(self, state: Any, rows: list[int]) -> None: ...

    # add_rows(state, new, capacity), compact(state, starts, kept), screens_argmax and forward's
    # return_hidden, positions, tree and argmax_rows: see above
    # (not required here, so that a minimal model still serves generate()).


def screens_argmax(model) -> bool:
    """Whether `model.forward` takes `argmax_rows` (optional in the protocol)."""
    return bool(getattr(model, "screens_argmax", False))


def check_lengths(lengths: list[int], current: list[int], lowest: list[int] | None = None) -> None:
    """Reject a rollback that would grow a row or reach before what the model kept."""
    if len(lengths) != len(current):
        raise ValueError(f"rollback got {len(lengths)} lengths for a batch of {len(current)} rows")
    for row, (new, old) in enumerate(zip(lengths, current)):
        low = 0 if lowest is None else lowest[row]
        if not low <= new <= old:
            raise ValueError(f"row {row}: cannot roll back to length {new}; allowed {low}..{old}")


def valid_counts(num_valid: list[int] | None, batch: int, width: int) -> list[int]:
    """num_valid as a list, checked against the (B, T) input it describes."""
    if num_valid is None:
        return [width] * batch
    num_valid = [int(n) for n in num_valid]
    if len(num_valid) != batch or any(not 0 <= n <= width for n in num_valid):
        raise ValueError(f"num_valid must hold {batch} counts in 0..{width}, got {num_valid}")
    return num_valid


def pad(rows: list[list[int]], device=None, value: int = 0) -> torch.Tensor:
    """Token lists as a right-padded (B, max(1, longest)) long tensor."""
    width = max(1, max(map(len, rows), default=0))
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def prefill(model, prompts: list[list[int]], capacity: int, hidden: list | None = None,
            logits: list | None = None):
    """A fresh state that has seen every prompt but its last token (fed with the first step).
    Given a list `hidden`, appends to it each prompt's final hidden states (len - 1, H); given
    a list `logits`, each prompt's logits (len - 1, V) (what prompt log-probabilities need)."""
    state = model.new_state(len(prompts), capacity)
    heads = [p[:-1] for p in prompts]
    if max(map(len, heads)) > 0:
        out = model.forward(pad(heads, model.device), state, [len(h) for h in heads], keep_logits=logits is not None,
                            **({"return_hidden": True} if hidden is not None else {}))
        if hidden is not None:
            hidden += [out[1][b, :len(h)] for b, h in enumerate(heads)]
        if logits is not None:
            scores = out[0] if hidden is not None else out  # (B, T, V)
            logits += [scores[b, :len(h)].float() for b, h in enumerate(heads)]
    elif logits is not None:
        logits += [torch.zeros(0, model.vocab_size, device=model.device) for _ in heads]
    if max(map(len, heads)) == 0 and hidden is not None:
        size = model.embed(torch.zeros(1, 1, dtype=torch.long, device=model.device)).shape[-1]
        hidden += [torch.zeros(0, size, device=model.device) for _ in heads]
    return state


def output(head: nn.Module, hidden: torch.Tensor, keep_logits: bool, return_hidden: bool,
           argmax_rows: list[bool] | None = None):
    """What a forward returns: float32 logits (or None), with the hidden states if asked; the
    rows of `argmax_rows` through the layer's screen where one pays (`screened_logits`)."""
    if not keep_logits:
        logits = None
    elif argmax_rows is not None:
        logits = screened_logits(head, hidden, argmax_rows)
    else:
        logits = head(hidden).float()
    return (logits, hidden) if return_hidden else logits


class OutputHead(nn.Module):
    """A model's output layer as hidden (..., H) -> float32 logits (..., N), over all tokens or
    over `token_ids` only (N of them, in that order): a reduced draft vocabulary (FR-Spec)
    scores a fraction of a large vocabulary's output layer."""

    def __init__(self, head: nn.Module, token_ids: torch.Tensor | None = None):
        super().__init__()
        self.layer = head if token_ids is None else rows_of(head, token_ids)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer(hidden).float()


def rows_of(head: nn.Module, token_ids: torch.Tensor) -> nn.Module:
    """The output layer `head` over rows `token_ids` only, in the same kind of layer (int8,
    packed or plain)."""
    from .kquant import KQuantLinear  # (kquant.py builds on the decoder, which imports this module)

    if isinstance(head, (Int8Linear, KQuantLinear)):
        return head.select_rows(token_ids)
    weight = getattr(head, "weight", None)
    if weight is None:
        raise ValueError(f"a reduced vocabulary needs the output layer's weights; {type(head).__name__} keeps none")
    token_ids = token_ids.to(weight.device)
    rows = nn.Linear(weight.shape[1], len(token_ids), bias=getattr(head, "bias", None) is not None,
                     device=weight.device, dtype=weight.dtype).requires_grad_(False)
    rows.weight.copy_(weight.detach()[token_ids])
    if rows.bias is not None:
        rows.bias.copy_(head.bias.detach()[token_ids])
    return PackedLinear(rows) if isinstance(head, PackedLinear) else rows


def load_checked(model: nn.Module, tensors: dict, directory, config_path) -> None:
    """Load saved tensors into `model`, naming missing, extra or misshapen weights first."""
    expected = model.state_dict()
    problems = sorted(set(expected) ^ set(tensors))
    problems += [f"{k}: {tuple(tensors[k].shape)} != {tuple(v.shape)}" for k, v in expected.items()
                 if k in tensors and tensors[k].shape != v.shape]
    if problems:
        raise ValueError(f"the weights in {directory} do not match {config_path}: {'; '.join(problems[:5])}")
    model.load_state_dict(tensors)
