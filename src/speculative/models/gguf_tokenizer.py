"""The tokenizer a GGUF file describes, made from its `tokenizer.*` entries once (transformers'
converter: seconds to a minute) and kept in the cache (`tokenizers/NAME-KEY/`, the key from
the file's path, size and modification time; checked as `core/disk_cache.py` checks every
cache), so that later starts read one tokenizer.json. Its chat template and the ids that end
a turn come from the same entries."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

from ..core import disk_cache
from .gguf_source import read_metadata
from .presets import cache_root
from .text import TextTokenizer

# Tokens that end a turn, by their text, where the file does not mark them (llama.cpp's list).
END_OF_TURN = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>",
               "<|return|>", "<|call|>", "</s>", "<|END_OF_TURN_TOKEN|>", "<|end_of_text|>"}


def end_of_turn_ids(metadata: dict) -> list[int]:
    """The ids that end generation: the file's end-of-sequence and end-of-turn ids, and its
    control tokens spelled as a known end of turn (as llama.cpp reads them)."""
    ids = [metadata[f"tokenizer.ggml.{key}"] for key in ("eos_token_id", "eot_token_id", "eom_token_id")
           if f"tokenizer.ggml.{key}" in metadata]
    tokens, types = metadata.get("tokenizer.ggml.tokens"), metadata.get("tokenizer.ggml.token_type")
    if isinstance(tokens, list) and isinstance(types, list):
        ids += [i for i, (token, kind) in enumerate(zip(tokens, types)) if kind == 3 and token in END_OF_TURN]
    return sorted(set(ids))


TOKENIZER_MANIFEST = "speculative-manifest.json"


def gguf_tokenizer(path: Path) -> TextTokenizer:
    """The tokenizer a GGUF file describes, made once into the cache (where the cache cannot
    be written: in a temporary folder, at every start, said once)."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_root() / "tokenizers" / f"{path.stem}-{key}"
    if disk_cache.damage(folder, TOKENIZER_MANIFEST) is None:
        return _read(folder)
    with disk_cache.lock(folder) as unwritable:
        damage = disk_cache.damage(folder, TOKENIZER_MANIFEST) if folder.exists() else "absent"
        if damage is None:
            return _read(folder)  # another process made it while this one waited
        if unwritable is not None:
            disk_cache.say_once(f"{folder.parent} cannot be written ({unwritable.strerror}): the tokenizer of "
                                f"{path.name} is made at every start")
            with tempfile.TemporaryDirectory() as scratch:
                _write_tokenizer(path, Path(scratch))
                return _read(Path(scratch))
        if damage != "absent":
            disk_cache.say(f"the tokenizer cache {folder} is damaged ({damage}): making it again")
        disk_cache.write_folder(folder, TOKENIZER_MANIFEST, lambda written: _write_tokenizer(path, written))
    return _read(folder)


def _read(folder: Path) -> TextTokenizer:
    eos = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    return TextTokenizer.from_checkpoint(folder, eos)


def _write_tokenizer(path: Path, folder: Path) -> None:
    """tokenizer.json, tokenizer_config.json (chat template, special tokens) and the ids that
    end generation, from the file's metadata through transformers' GGUF converter."""
    print(f"{path.name}: making its tokenizer from the file's metadata (once; it is kept in the cache) ...",
          file=sys.stderr, flush=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError:
        raise ImportError(f"making the tokenizer of {path} needs transformers 5 or later (pip install "
                          "'speculative[hf]')") from None
    arch, tokenizer_dict, config = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    bos = config.get("bos_token")
    if config.get("add_bos_token") and bos is not None:  # as transformers' tokenizer adds it (Gemma, Llama 2)
        from tokenizers.processors import TemplateProcessing

        bos_id = backend.token_to_id(bos)
        backend.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                    special_tokens=[(bos, bos_id)])
    metadata = read_metadata(path, arrays=("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"))
    backend.save(str(folder / "tokenizer.json"))
    special = {key: value for key, value in config.items() if key.endswith("_token") and isinstance(value, str)}
    template = metadata.get("tokenizer.chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**special, **({"chat_template": template} if isinstance(template, str) else {})}, indent=1))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": end_of_turn_ids(metadata)}))
