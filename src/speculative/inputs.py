"""Checking what users pass in: prompts, lengths, token ids. Errors say what is allowed."""

from __future__ import annotations

import numbers

import torch


def normalize_prompts(prompt_ids) -> tuple[list[list[int]], bool]:
    """Return (prompts, batched): a list of token-id lists, and whether a batch was given.

    Accepts a list/tuple of ints or a 1-D integer tensor (one prompt), or a list of those
    or a 2-D integer tensor (a batch).
    """
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.is_floating_point() or prompt_ids.is_complex() or prompt_ids.dtype == torch.bool:
            raise ValueError(f"prompt token ids must be integers, got a tensor of {prompt_ids.dtype}")
        if prompt_ids.dim() == 1:
            return [_token_list(prompt_ids.tolist(), "prompt")], False
        if prompt_ids.dim() == 2:
            return [_token_list(row, f"prompt {i}") for i, row in enumerate(prompt_ids.tolist())], True
        raise ValueError(f"a prompt tensor must be 1-D (one prompt) or 2-D (a batch), got shape "
                         f"{tuple(prompt_ids.shape)}")
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, (list, tuple)):
        raise ValueError("prompt_ids must be a list of token ids (ints), a list of such lists, or an "
                         f"integer tensor; got {type(prompt_ids).__name__}")
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty: give at least one token id (or at least one prompt)")
    if all(isinstance(row, (list, tuple, torch.Tensor)) for row in prompt_ids):
        rows = [row.tolist() if isinstance(row, torch.Tensor) else row for row in prompt_ids]
        return [_token_list(row, f"prompt {i}") for i, row in enumerate(rows)], True
    return [_token_list(prompt_ids, "prompt")], False


def _token_list(row, name: str) -> list[int]:
    if not isinstance(row, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {type(row).__name__}")
    if len(row) == 0:
        raise ValueError(f"{name} is empty: a prompt needs at least one token id")
    for token in row:
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise ValueError(f"{name} holds {token!r} ({type(token).__name__}); token ids must be integers")
    return [int(t) for t in row]


def check_token_range(prompts: list[list[int]], vocab_size: int) -> None:
    for i, row in enumerate(prompts):
        bad = [t for t in row if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} holds token id {bad[0]}, outside the vocabulary: allowed 0..{vocab_size - 1}")


def normalize_max_new(max_new_tokens, batch: int) -> list[int]:
    """One budget per row: an int for all rows, or a list with one entry per row."""
    values = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * batch
    if len(values) != batch:
        raise ValueError(f"max_new_tokens has {len(values)} entries for {batch} prompts; give one per "
                         "prompt or a single integer")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {value!r}")
    return [int(v) for v in values]


def check_eos(eos_token_id, vocab_size: int) -> set[int]:
    """EOS as a set of ids (None = no EOS)."""
    if eos_token_id is None:
        return set()
    ids = list(eos_token_id) if isinstance(eos_token_id, (list, tuple, set)) else [eos_token_id]
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or not 0 <= token < vocab_size:
            raise ValueError(f"eos_token_id must be a token id in 0..{vocab_size - 1}, got {token!r}")
    return {int(t) for t in ids}


def check_length(prompts: list[list[int]], max_new: list[int], model, role: str) -> None:
    """Refuse work the model cannot hold, before any compute is spent."""
    limit = getattr(model, "max_seq_len", None)
    if limit is None:
        return
    for i, (row, new) in enumerate(zip(prompts, max_new)):
        if len(row) + new > limit:
            raise ValueError(f"prompt {i} has {len(row)} tokens and max_new_tokens is {new}: {len(row) + new} "
                             f"tokens exceed the {role} model's maximum length of {limit}")
