"""The running interpreter's own standard library as a corpus: what the shipped models were
trained on (train/corpus.py) and what reduced draft vocabularies are counted on
(proposers/vocab.py). Nothing is downloaded. Files are split by a hash of their path relative to
the stdlib root: a file is held out when sha1(path)[0] % 20 == 0, about 5% of the modules, the
same set on every machine with the same Python version.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

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
