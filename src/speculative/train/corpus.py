"""Training data: the running interpreter's own standard library (core/stdlib.py: its files,
split into train and held out), and a byte-level BPE."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..core.stdlib import is_held_out, read_text, split_files, stdlib_files, stdlib_root  # noqa: F401 (re-exported)

EOS = "<|endoftext|>"


def texts(files: list[Path], deadline: float | None = None):
    """The files' texts, stopping at `deadline` (time.perf_counter), after the first file."""
    for i, path in enumerate(files):
        if i and deadline is not None and time.perf_counter() > deadline:
            return
        yield read_text(path)


def train_tokenizer(files: list[Path], vocab_size: int, deadline: float | None = None):
    """A byte-level BPE (the `tokenizers` library) with one special token, EOS, learnt
    from the files read before `deadline`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts(files, deadline), trainer)
    return tokenizer


# Files encoded per call: between two calls the deadline is checked.
ENCODE_CHUNK = 16


def encode_files(tokenizer, files: list[Path], deadline: float | None = None, min_tokens: int = 0) -> torch.Tensor:
    """The files as one stream of token ids, each file followed by EOS: (N,) int32. Past
    `deadline` (time.perf_counter) the rest is left out once `min_tokens` are there."""
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for start in range(0, len(files), ENCODE_CHUNK):
        if start and deadline is not None and time.perf_counter() > deadline and len(ids) >= min_tokens:
            break
        for encoding in tokenizer.encode_batch([read_text(f) for f in files[start:start + ENCODE_CHUNK]]):
            ids += encoding.ids
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def function_prompts(files: list[Path], count: int, context_chars: int = 600) -> list[str]:
    """Prompts that end with the first line of a Python function, after some of the code before it.

    One prompt per file (its first top-level or method `def` past the first 20 lines), in
    file order, so the set is fixed for a given corpus. The prompt stops before the line's
    newline: the BPE merges a newline with the next line's indentation, so a prompt ending
    in a bare newline would tell the model that the next line is not indented.
    """
    prompts = []
    for path in files:
        lines = read_text(path).splitlines(keepends=True)
        for i, line in enumerate(lines):
            if i >= 20 and line.lstrip().startswith("def ") and line.rstrip().endswith(":"):
                before = "".join(lines[:i])[-context_chars:]
                cut = before.find("\n") + 1 if len(before) == context_chars else 0
                prompts.append(before[cut:] + line.rstrip("\n"))
                break
        if len(prompts) == count:
            break
    return prompts
