"""Training data: the running interpreter's own standard library, and a byte-level BPE.

Nothing is downloaded. Files are split by a hash of their path relative to the stdlib
root: a file is held out when sha1(path)[0] % 20 == 0, about 5% of the modules, the
same set on every machine with the same Python version.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import time
from pathlib import Path

import torch

EOS = "<|endoftext|>"
HELD_OUT_MODULUS = 20


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Every .py file of the standard library (site-packages excluded), sorted."""
    root = root or stdlib_root()
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__"))
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(found)


def is_held_out(path: Path, root: Path) -> bool:
    digest = hashlib.sha1(path.relative_to(root).as_posix().encode()).digest()
    return digest[0] % HELD_OUT_MODULUS == 0


def split_files(max_files: int | None = None, root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(train, held_out) files; `max_files` keeps an evenly spaced subset (for quick runs)."""
    root = root or stdlib_root()
    files = stdlib_files(root)
    if max_files is not None and max_files < len(files):
        step = len(files) / max_files
        files = [files[int(i * step)] for i in range(max_files)]
    files = [f for f in files if f.stat().st_size > 0]
    held = [f for f in files if is_held_out(f, root)]
    train = [f for f in files if not is_held_out(f, root)]
    if not held and len(train) > 1:  # tiny subsets still need something to evaluate on
        held = [train.pop(max(range(len(train)), key=lambda i: train[i].stat().st_size))]
    return train, held


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


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
