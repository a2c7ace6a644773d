"""Built-in models, `build_pair` (the Edifice design), and safetensors save/load."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from .base import LanguageModel, load_checked
from .decoder_only import DecoderOnlyConfig, DecoderOnlyLM
from .gemma3 import Gemma3Config, Gemma3LM
from .kernels import PackedLinear
from .s4d import S4DConfig, S4DLM

MODEL_TYPES = {"decoder_only": (DecoderOnlyConfig, DecoderOnlyLM), "s4d": (S4DConfig, S4DLM)}
DEFAULT_DRAFT_OPTS = {"hidden_size": 128, "num_layers": 2}
DEFAULT_VERIFIER_OPTS = {"hidden_size": 512, "num_layers": 8}
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# Weights above this size are split into shards (model-00001-of-00002.safetensors, ...),
# which keeps every file of the shipped models small enough for any git host.
SHARD_BYTES = 16 * 2 ** 20


def build_model(model_type: str, vocab_size: int, opts: dict | None = None, seed: int | None = None):
    """One built-in model with the given options; unknown types or options raise ValueError."""
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unknown model type {model_type!r}; allowed: {', '.join(MODEL_TYPES)}")
    config_cls, model_cls = MODEL_TYPES[model_type]
    opts = dict(opts or {})
    allowed = [f.name for f in dataclasses.fields(config_cls) if f.name != "vocab_size"]
    unknown = sorted(set(opts) - set(allowed))
    if unknown:
        raise ValueError(f"unknown {model_type} option(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    cfg = config_cls(vocab_size=vocab_size, **opts)
    if seed is None:
        model = model_cls(cfg)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls(cfg)
    return model.eval().requires_grad_(False)


def build_pair(vocab_size: int, embed_dim: int | None = None, draft_model_type: str = "decoder_only",
               draft_model_opts: dict | None = None, verifier_model_type: str = "decoder_only",
               verifier_model_opts: dict | None = None, seed: int | None = None):
    """(draft, verifier): two causal LMs over the same vocabulary.

    `embed_dim`, as in the Edifice design, is the draft's width when draft_model_opts do
    not set hidden_size. Defaults: draft 128 wide / 2 layers, verifier 512 wide / 8 layers.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
    draft_opts = {**DEFAULT_DRAFT_OPTS, **(draft_model_opts or {})}
    if embed_dim is not None and "hidden_size" not in (draft_model_opts or {}):
        draft_opts["hidden_size"] = embed_dim
    verifier_opts = {**DEFAULT_VERIFIER_OPTS, **(verifier_model_opts or {})}
    draft = build_model(draft_model_type, vocab_size, draft_opts, None if seed is None else seed)
    verifier = build_model(verifier_model_type, vocab_size, verifier_opts, None if seed is None else seed + 1)
    return draft, verifier


def output_size(opts: dict | None = None) -> int:
    """The verifier's hidden size for these verifier options (the Edifice design)."""
    return int({**DEFAULT_VERIFIER_OPTS, **(opts or {})}["hidden_size"])


def save_model(model, directory, weight_dtype: torch.dtype | None = None) -> Path:
    """Write a built-in model as model.safetensors plus config.json (no pickle).

    `weight_dtype` (e.g. torch.float16) stores the `*.weight` matrices smaller; the few
    SSM parameters stay float32, where fp16 rounding would move their poles.
    """
    from safetensors.torch import save_file

    if getattr(model, "model_type", None) not in MODEL_TYPES:
        raise ValueError(f"save_model saves built-in models ({', '.join(MODEL_TYPES)}), got {type(model).__name__}")
    if any(isinstance(m, PackedLinear) for m in model.modules()):
        raise ValueError("this model's linear layers are packed for inference (load_model packs float32 models on "
                         "CPUs); load it with load_model(..., pack=False) to save it")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()
               if not (model.cfg.tie_embeddings and name == "lm_head.weight")}
    if weight_dtype is not None:
        tensors = {n: t.to(weight_dtype) if n.endswith(".weight") else t for n, t in tensors.items()}
    dtype = str(tensors["embed_tokens.weight"].dtype).removeprefix("torch.")
    shards, size = [{}], 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    for old in directory.glob("model*.safetensors"):
        old.unlink()
    for i, shard in enumerate(shards, 1):
        name = WEIGHTS_FILE if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name))
    config = {"model_type": model.model_type, "dtype": dtype, **model.options()}
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return directory


def load_builtin(directory, device="cpu", dtype: torch.dtype | None = torch.float32):
    """Read a directory written by `save_model`; weights are cast to `dtype` (float32 by default)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path = directory / CONFIG_FILE
    weight_files = sorted(directory.glob("model*.safetensors"))
    if not config_path.is_file() or not weight_files:
        missing = config_path if not config_path.is_file() else directory / WEIGHTS_FILE
        raise FileNotFoundError(f"{missing} does not exist; a built-in model directory holds "
                                f"{CONFIG_FILE} and {WEIGHTS_FILE} (or its shards)")
    config = json.loads(config_path.read_text())
    model_type = config.pop("model_type", None)
    config.pop("dtype", None)
    model = build_model(model_type, config.pop("vocab_size"), config)
    tensors = {}
    for path in weight_files:
        tensors.update(load_file(str(path)))
    if model.cfg.tie_embeddings:
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]
    load_checked(model, tensors, directory, config_path)
    return to_dtype(model.to(device=device), dtype)


def to_dtype(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
    """Cast a built-in model's weights, leaving float32 the parts that ask for it (S4D poles)."""
    if dtype is not None:
        model.to(dtype=dtype)
        for module in model.modules():
            if getattr(module, "keep_float32", False):
                module.float()
    return model


__all__ = ["LanguageModel", "DecoderOnlyConfig", "DecoderOnlyLM", "Gemma3Config", "Gemma3LM", "S4DConfig", "S4DLM",
           "MODEL_TYPES", "build_model", "build_pair", "output_size", "save_model", "load_builtin", "to_dtype"]
