"""Checking what users pass in: models, prompts, lengths, token ids, seeds, devices.

Every check runs before any compute and raises ValueError (a bad value) or TypeError (a
wrong kind of object) with a message that names the bad value and says what is allowed.
"""

from __future__ import annotations

import numbers
import os

import numpy as np
import torch

from .config import MAX_BATCH_SIZE, MAX_NEW_TOKENS, MAX_PROMPT_TOKENS, MAX_SEED, at_most
from .rows import SEED_RANGE

# What a target or draft model provides (speculative.models.base), and what a proposer does.
MODEL_NEEDS = ("vocab_size", "max_seq_len", "device", "new_state", "forward", "rollback", "select_rows")
PROPOSER_NEEDS = ("model", "vocab_size", "fork", "add_rows", "select_rows", "free_drafts", "catch_up", "propose",
                  "commit", "probe")
# Device types we know how to check for availability.
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")


def check_model(model, name: str = "main_model") -> None:
    """A target (or draft) must be a loaded model that follows the model protocol."""
    if isinstance(model, (str, os.PathLike)):
        raise TypeError(f"{name} must be a loaded model, got the name {str(model)!r}: load it first, "
                        f"e.g. load_model({str(model)!r})")
    if model is None:
        raise TypeError(f"{name} is None: pass a model, e.g. load_model('default')")
    missing = [a for a in MODEL_NEEDS if not hasattr(model, a)]
    if missing:
        raise TypeError(f"{name} must follow the model protocol of speculative.models.base; "
                        f"{type(model).__name__} lacks {', '.join(missing)}")


def check_draft(draft) -> None:
    """A draft is a model (as a target is) or a proposer such as NGramProposer."""
    if draft is None:
        raise TypeError("draft_model is None: pass a draft model (e.g. load_model('default-draft')), "
                        "or NGramProposer() to draft by prompt lookup without one")
    if hasattr(draft, "propose"):
        missing = [a for a in PROPOSER_NEEDS if not hasattr(draft, a)]
        if missing:
            raise TypeError(f"draft_model {type(draft).__name__} has propose() but lacks {', '.join(missing)} "
                            "of the proposer interface (speculative.proposers.base)")
        return
    check_model(draft, "draft_model")


def normalize_prompts(prompt_ids) -> tuple[list[list[int]], bool]:
    """Return (prompts, batched): a list of token-id lists, and whether a batch was given.

    Accepts a list/tuple of ints or a 1-D integer tensor or numpy array (one prompt), or a
    list of those or a 2-D integer tensor or array (a batch): at most MAX_BATCH_SIZE
    prompts of at most MAX_PROMPT_TOKENS tokens each.
    """
    if isinstance(prompt_ids, (torch.Tensor, np.ndarray)):
        prompts, batched = _array_prompts(prompt_ids)
    elif isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, (list, tuple)):
        raise ValueError("prompt_ids must be a list of token ids (ints), a list of such lists, or an "
                         f"integer tensor or numpy array; got {type(prompt_ids).__name__}")
    elif len(prompt_ids) == 0:
        raise ValueError("the prompt is empty: give at least one token id (or at least one prompt)")
    elif all(isinstance(row, (list, tuple, torch.Tensor, np.ndarray)) for row in prompt_ids):
        rows = [_array_row(row, f"prompt {i}") for i, row in enumerate(prompt_ids)]
        prompts, batched = [_token_list(row, f"prompt {i}") for i, row in enumerate(rows)], True
    else:
        prompts, batched = [_token_list(prompt_ids, "prompt")], False
    if len(prompts) > MAX_BATCH_SIZE:
        raise ValueError(f"a batch of {len(prompts)} prompts is more than one call takes: allowed at most "
                         f"{MAX_BATCH_SIZE}; split it")
    return prompts, batched


def _array_prompts(array) -> tuple[list[list[int]], bool]:
    """A 1-D (one prompt) or 2-D (a batch) integer tensor or numpy array as token lists."""
    _check_integer_array(array, "prompt token ids")
    if array.ndim == 1:
        return [_token_list(array.tolist(), "prompt")], False
    if array.ndim == 2:
        if array.shape[0] == 0:
            raise ValueError(f"the batch is empty: a prompt {_kind(array)} of shape {tuple(array.shape)} holds "
                             "no prompts; give at least one row")
        return [_token_list(row, f"prompt {i}") for i, row in enumerate(array.tolist())], True
    raise ValueError(f"a prompt {_kind(array)} must be 1-D (one prompt) or 2-D (a batch), got shape "
                     f"{tuple(array.shape)}")


def _array_row(row, name: str):
    """One prompt of a list: a tensor or array becomes a list, after its dtype is checked."""
    if isinstance(row, (torch.Tensor, np.ndarray)):
        _check_integer_array(row, f"{name}'s token ids")
        if row.ndim != 1:
            raise ValueError(f"{name} must be a 1-D {_kind(row)} of token ids, got shape {tuple(row.shape)}")
        return row.tolist()
    return row


def _check_integer_array(array, name: str) -> None:
    if isinstance(array, np.ndarray):
        if array.dtype.kind not in "iu":
            raise ValueError(f"{name} must be integers, got a numpy array of {array.dtype}")
    elif array.is_floating_point() or array.is_complex() or array.dtype == torch.bool:
        raise ValueError(f"{name} must be integers, got a tensor of {array.dtype}")


def _kind(array) -> str:
    return "numpy array" if isinstance(array, np.ndarray) else "tensor"


def _token_list(row, name: str) -> list[int]:
    if not isinstance(row, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {type(row).__name__}")
    if len(row) == 0:
        raise ValueError(f"{name} is empty: a prompt needs at least one token id")
    if len(row) > MAX_PROMPT_TOKENS:
        raise ValueError(f"{name} has {len(row)} tokens: allowed at most {MAX_PROMPT_TOKENS} per prompt")
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
        at_most(value, "max_new_tokens", MAX_NEW_TOKENS)
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


def check_length(prompts: list[list[int]], max_new: list[int], model, role: str,
                 names: list[str] | None = None) -> None:
    """Refuse work the model cannot hold, before any compute is spent. `names` name the
    prompts in errors (e.g. a file and line), else 'prompt i'."""
    limit = getattr(model, "max_seq_len", None)
    if limit is None:
        return
    for i, (row, new) in enumerate(zip(prompts, max_new)):
        if len(row) + new > limit:
            name = names[i] if names else f"prompt {i}"
            raise ValueError(f"{name} has {len(row)} tokens and max_new_tokens is {new}: {len(row) + new} "
                             f"tokens exceed the {role} model's maximum length of {limit}")


def check_draft_width(num_draft_tokens: int, model, role: str, name: str = "num_draft_tokens") -> None:
    """A step scores the last token and K drafts in one forward: K + 1 positions must fit."""
    limit = getattr(model, "max_seq_len", None)
    if limit is not None and num_draft_tokens + 1 > limit:
        raise ValueError(f"{name} is {num_draft_tokens}, but a step scores K + 1 = {num_draft_tokens + 1} positions "
                         f"and the {role} model holds {limit}: allowed K <= {limit - 1}")


def row_seeds(seeds, batch: int, config_seed: int | None) -> list[int | None]:
    """Seed of each row: given per row, else config_seed + row index, else None (fresh
    randomness). Every seed must fit torch's generators (0..2**64 - 1)."""
    if seeds is None:
        if config_seed is None:
            return [None] * batch
        if config_seed + batch - 1 > MAX_SEED:
            raise ValueError(f"seed {config_seed} gives row {batch - 1} the seed {config_seed + batch - 1}, above "
                             f"the largest seed {MAX_SEED}: allowed seed <= {MAX_SEED - batch + 1} for {batch} rows")
        return [config_seed + row for row in range(batch)]
    if not isinstance(seeds, (list, tuple)):
        raise TypeError(f"seeds must be a list of {batch} integer{'s' * (batch != 1)} (one per prompt) or None, "
                        f"got {seeds!r}")
    if len(seeds) != batch:
        raise ValueError(f"seeds has {len(seeds)} entries for {batch} prompts; give one per prompt")
    for seed in seeds:
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seeds must be integers in 0..{MAX_SEED}, got {seed!r}")
    return [int(s) for s in seeds]


def check_request_seed(seed, name: str = "seed", show=repr) -> None:
    """The seed of one request (a server request, a batch record): an integer torch's
    generators take, or None. One check and one text for every front-end; `name` and
    `show` write the field and the value as the front-end's own messages do."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
                             or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise ValueError(f"{name} must be an integer in {SEED_RANGE[0]}..{SEED_RANGE[1]}, got {show(seed)}")


def check_device(device, name: str = "device") -> torch.device:
    """The torch device to run on, refused when this machine cannot run models there."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{name} {device!r} is not a torch device; allowed: cpu, cuda, cuda:N, mps, xpu") from None
    if parsed.type == "meta":
        raise ValueError(f"{name} {device!r} holds no weights (meta tensors have no data); allowed: cpu, cuda, "
                         "cuda:N, mps, xpu")
    if parsed.type not in DEVICE_TYPES:
        raise ValueError(f"{name} {device!r} is not supported; allowed: cpu, cuda, cuda:N, mps, xpu")
    if parsed.type == "cpu":
        return parsed
    backend = torch.backends.mps if parsed.type == "mps" else getattr(torch, parsed.type)
    if not backend.is_available():
        raise ValueError(f"{name} {device!r} is not available: this torch ({torch.__version__}) sees no "
                         f"{parsed.type} device; use cpu")
    count = getattr(getattr(torch, parsed.type), "device_count", lambda: 1)()
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(f"{name} {device!r}: this machine has {count} {parsed.type} device(s): allowed "
                         f"{parsed.type}:0..{parsed.type}:{count - 1}")
    return parsed
