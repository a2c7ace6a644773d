"""Reduced draft vocabularies (FR-Spec): the N most frequent target tokens of a corpus.

A draft that shares a 152k-262k token vocabulary with its target spends much of its time
in its output layer. Scoring only the tokens that text actually uses most (counted once
on a corpus, cached) cuts that share by the ratio N / V, while verification stays exact:
the draft's q is zero outside the subset, so those tokens are never drafted and the
target's residual keeps all their probability.

Corpora: `stdlib` (this interpreter's standard library, the training files of
`speculative train`: code), or a text file / JSON-lines file of {"text": ...} or
{"prompt": ...} objects. `auto_vocab` is what every front-end and the Python API give a draft
model when nothing is said (`draft_vocab="auto"`). The counts are cached as `core/disk_cache.py`
keeps every cache: checked at each read, counted again where damaged, by one process at a time.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch

from ..core import disk_cache
from ..core.stdlib import read_text, split_files
from ..models.head import DraftHead
from ..models.presets import cache_root
from .base import Proposer

log = logging.getLogger("speculative")

# Characters of corpus text counted: enough for stable ranks of the top tens of thousands.
CORPUS_CHARS = 4_000_000
# --draft-vocab auto: a draft model over a vocabulary of more than LARGE_VOCAB tokens scores
# only the AUTO_DRAFT_VOCAB most frequent. Qwen2.5-Coder 0.5B (151,936 tokens) drafting for
# 1.5B on a Zen 4, against llama.cpp: chat 1.04-1.08x with it, 0.96-0.99x without.
LARGE_VOCAB, AUTO_DRAFT_VOCAB = 65_536, 32_768


def auto_size(draft) -> int:
    """The reduced vocabulary `auto` gives `draft` (0: all tokens): AUTO_DRAFT_VOCAB for a draft
    model over more than LARGE_VOCAB tokens; never for a draft head, which keeps the vocabulary
    it was trained with, nor for lookup."""
    if draft is None or isinstance(draft, (DraftHead, Proposer)) or getattr(draft, "vocab_size", 0) <= LARGE_VOCAB:
        return 0
    return AUTO_DRAFT_VOCAB


def auto_vocab(draft, tokenizer) -> torch.Tensor | None:
    """`draft_vocab="auto"`: the auto_size most frequent tokens of the standard library under
    `tokenizer` (the target's), or None (all tokens) where auto_size is 0 or no tokenizer is known."""
    size = auto_size(draft)
    if not size or tokenizer is None:
        return None
    log.info("draft vocabulary auto: the draft model scores the %d most frequent of its %d tokens", size,
             draft.vocab_size)
    return corpus_vocab(tokenizer, size)


def frequent_tokens(tokenizer, texts: Iterable[str], n: int) -> torch.Tensor:
    """The n most frequent token ids of `texts` (ties broken by the smaller id), as a sorted
    1-D long tensor; fewer if the texts use fewer distinct tokens."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"a draft vocabulary size must be an integer >= 1, got {n!r}")
    counts: Counter[int] = Counter()
    for text in texts:
        counts.update(tokenizer.encode(text))
    ranked = sorted(counts, key=lambda token: (-counts[token], token))[:n]
    return torch.tensor(sorted(ranked), dtype=torch.long)


def corpus_texts(corpus: str, limit: int = CORPUS_CHARS) -> list[str]:
    """Texts of a named corpus or a file, about `limit` characters in all."""
    if corpus == "stdlib":
        train, _ = split_files()
        step = max(1, len(train) // 400)  # an even spread over the library
        texts = [read_text(path) for path in train[::step]]
    else:
        path = Path(corpus)
        if not path.is_file():
            raise FileNotFoundError(f"draft vocabulary corpus {corpus} is neither 'stdlib' nor a file")
        raw = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix.lower() == ".jsonl":
            texts = []
            for number, line in enumerate(raw.splitlines(), 1):
                if line.strip():
                    row = json.loads(line)
                    text = row.get("text", row.get("prompt")) if isinstance(row, dict) else None
                    if not isinstance(text, str):
                        raise ValueError(f"{path} line {number}: expected an object with a \"text\" or "
                                         "\"prompt\" string")
                    texts.append(text)
        else:
            texts = [raw]
    kept, total = [], 0
    for text in texts:
        kept.append(text[:limit - total])
        total += len(kept[-1])
        if total >= limit:
            break
    return kept


def corpus_vocab(tokenizer, n: int, corpus: str = "stdlib", cache: Path | None = None) -> torch.Tensor:
    """frequent_tokens over a corpus, cached per tokenizer, corpus and n."""
    source = corpus if corpus == "stdlib" else [corpus, Path(corpus).stat().st_size, Path(corpus).stat().st_mtime_ns]
    key = hashlib.sha1(json.dumps([sorted(tokenizer.vocab().items()), source, n]).encode()).hexdigest()[:16]
    path = (cache or cache_root() / "vocab") / f"{key}.json"
    ids, damage = _stored(path)
    if ids is not None:
        return ids
    with disk_cache.lock(path) as unwritable:
        if not unwritable:  # another process may have counted it while this one waited
            ids, damage = _stored(path)
            if ids is not None:
                return ids
        if damage:
            disk_cache.say(f"the draft vocabulary {path} is damaged ({damage}): counting it again")
        ids = frequent_tokens(tokenizer, corpus_texts(corpus), n)
        unwritable = unwritable or _store(ids, path)
    if unwritable:
        disk_cache.say_once(f"the cache folder {path.parent} cannot be written ({unwritable.strerror}): draft "
                            "vocabularies are counted in memory, again at every start; set SPECULATIVE_CACHE to a "
                            "writable folder to keep them")
    return ids


def _stored(path: Path) -> tuple[torch.Tensor | None, str | None]:
    """(the cached ids, None), or (None, what is wrong with the file; None where absent)."""
    if not path.exists():
        return None, None
    damage = disk_cache.file_damage(path)
    return (None, damage) if damage else (torch.tensor(json.loads(path.read_text()), dtype=torch.long), None)


def _store(ids: torch.Tensor, path: Path) -> OSError | None:
    """Write the ids and their checksum; the OSError where that fails (nothing is left)."""
    written = disk_cache.partial(path)
    try:
        written.write_text(json.dumps(ids.tolist()))
        disk_cache.publish(written, path)
        disk_cache.record_file(path)
    except OSError as error:
        written.unlink(missing_ok=True)
        return error
    return None
