"""Checkpoints that run through transformers rather than the built-in decoders: other
architectures' directories and GGUF files (dequantized by transformers), and their tokenizers.
Always offline: nothing is fetched from a hub."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import torch

from .hf import HFModel
from .text import TextTokenizer


def hf_tokenizer(path: Path, eos: list[int] | None = None) -> TextTokenizer:
    """A transformers tokenizer; `eos`: the ids that end generation (None: the tokenizer's own)."""
    offline()
    from transformers import AutoTokenizer

    if path.is_file():
        backend = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    else:
        backend = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return TextTokenizer(backend, name=str(path), eos_token_ids=eos)


def model_eos(model) -> list[int] | None:
    """The end-of-text ids of a transformers model's generation config."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return eos if eos is None or isinstance(eos, list) else [eos]


def offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def load_transformers(path: Path, device, dtype: torch.dtype, prepare):
    offline()
    from transformers import AutoModelForCausalLM

    if not any(path.glob("*.safetensors")):
        if any(path.glob("*.bin")) or any(path.glob("*.pt")):
            raise ValueError(f"{path} holds only pickled weights (.bin/.pt); only safetensors are loaded")
        raise FileNotFoundError(f"{path} holds config.json but no *.safetensors weights")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True,
                                                 use_safetensors=True).to(device)
    prepare(model)
    # Token ids in and out need no tokenizer: a directory without one loads (text features say so).
    return HFModel(model, hf_tokenizer(path, model_eos(model)) if has_tokenizer(path) else None)


# Files that any transformers tokenizer is loaded from.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                   "vocab.txt")


def has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def load_gguf_file(path: Path, device, dtype: torch.dtype, prepare):
    offline()
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    from transformers import AutoModelForCausalLM

    try:  # the GGUF reader's errors (struct, numpy) do not name the file
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype,
                                                     local_files_only=True).to(device)
        tokenizer = hf_tokenizer(path, model_eos(model))
    except (struct.error, ValueError, IndexError, KeyError, EOFError, OSError) as error:
        raise ValueError(f"{path} cannot be read as a GGUF model (is it truncated or corrupt? {path.stat().st_size} "
                         f"bytes): {type(error).__name__}: {error}") from None
    prepare(model)
    return HFModel(model, tokenizer)
