"""transformers checkpoints that the built-in decoder computes exactly: Llama and Qwen2.

Both are the decoder of `decoder_only.py` (Qwen2 adds biases to the query, key and value
projections), so their weights load into it as they are, renamed. The built-in decoder
then runs them with its preallocated, position-indexed cache and its width-invariant
attention: rollback is moving a length, a verify forward gives each token the bits it
gets alone, and a forward costs fewer operations than transformers' own. Checkpoints with
anything else (rope scaling, sliding windows, other activations) load through
transformers.

Weights are read one tensor at a time, cast (or quantized to int8) and dropped, so that
loading a model never holds more than the finished model and one float tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .decoder_only import FUSED, DecoderOnlyConfig, DecoderOnlyLM
from .int8 import load_cached

ARCHITECTURES = {"llama": False, "qwen2": True}  # model_type -> biases on q, k and v


def native_config(config: dict) -> DecoderOnlyConfig | None:
    """The decoder configuration of a transformers config.json, or None when the built-in
    decoder does not compute that model exactly."""
    kind = config.get("model_type")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    heads = config.get("num_attention_heads")
    plain = (kind in ARCHITECTURES and config.get("hidden_act", "silu") == "silu"
             and rope.get("rope_type", rope.get("type", "default")) == "default"
             and not config.get("use_sliding_window", False)
             and not config.get("mlp_bias", False) and config.get("attention_bias", ARCHITECTURES.get(kind)) ==
             ARCHITECTURES.get(kind)
             and isinstance(heads, int) and heads > 0
             and config.get("head_dim", config.get("hidden_size", 0) // heads) * heads == config.get("hidden_size"))
    if not plain:
        return None
    return DecoderOnlyConfig(
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"], num_layers=config["num_hidden_layers"],
        num_heads=heads, num_kv_heads=config.get("num_key_value_heads") or heads,
        intermediate_size=config["intermediate_size"], max_seq_len=config.get("max_position_embeddings") or 2048,
        rope_theta=float(theta), rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), attention_bias=ARCHITECTURES[kind])


def load_native(path: Path, cfg: DecoderOnlyConfig, device, dtype: torch.dtype, int8: bool = False,
                progress: bool = True) -> DecoderOnlyLM:
    """A transformers checkpoint directory in the built-in decoder (fused: `DecoderOnlyLM.fuse`),
    in `dtype`, or in int8 (`int8.py`, cached on disk) when `int8`."""
    read = checkpoint_reader(path, cfg)
    if int8:
        if torch.device(device).type != "cpu":
            raise ValueError(f"int8 models run on CPUs (fbgemm), not on {device}")
        return load_cached(path, cfg, read, progress)
    with torch.device("meta"):
        model = DecoderOnlyLM(cfg).fuse()
    tied = cfg.tie_embeddings and _tied(path)
    for name, child in list(model.named_modules()):
        if type(child) is not nn.Linear or name == "lm_head" and tied:
            continue
        layer = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
        layer.weight = nn.Parameter(read(f"{name}.weight").to(device=device, dtype=dtype), requires_grad=False)
        if child.bias is not None:
            layer.bias = nn.Parameter(read(f"{name}.bias").to(device=device, dtype=dtype), requires_grad=False)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, layer)
    for name, parameter in list(model.named_parameters()):
        if parameter.is_meta:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf,
                    nn.Parameter(read(name).to(device=device, dtype=dtype), requires_grad=False))
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def checkpoint_reader(path: Path, cfg: DecoderOnlyConfig):
    """read(name) -> the float tensor of `name` in the fused built-in decoder, from the
    checkpoint's safetensors files (renamed, and concatenated for fused layers), checked
    against the shape the config gives."""
    from safetensors import safe_open

    where = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as weights:
            where.update({name: file for name in weights.keys()})
    with torch.device("meta"):
        shapes = {name: tensor.shape for name, tensor in DecoderOnlyLM(cfg).fuse().state_dict().items()}
    tied = cfg.tie_embeddings and _tied(path)

    def stored(name: str) -> torch.Tensor:
        for key in (f"model.{name}", name):
            if key in where:
                with safe_open(str(where[key]), "pt") as weights:
                    return weights.get_tensor(key)
        raise ValueError(f"{path} has no weight {name!r} (nor model.{name}), which a {cfg.num_layers}-layer "
                         f"{'Qwen2' if cfg.attention_bias else 'Llama'} model with this config.json needs")

    def read(name: str) -> torch.Tensor:
        module, _, kind = name.rpartition(".")
        tensor = torch.cat([stored(f"{source}.{kind}") for source in _sources(module, tied)])
        if name in shapes and tensor.shape != shapes[name]:
            raise ValueError(f"{path}: weight {name} has shape {tuple(tensor.shape)}; its config.json gives "
                             f"{tuple(shapes[name])}")
        return tensor

    return read


def _tied(path: Path) -> bool:
    """Whether the checkpoint stores no output layer of its own (it reuses the embeddings)."""
    from safetensors import safe_open

    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as weights:
            if {"lm_head.weight", "model.lm_head.weight"} & set(weights.keys()):
                return False
    return True


def _sources(name: str, tied: bool) -> list[str]:
    """The checkpoint's layers behind a layer of the fused model."""
    if name == "lm_head" and tied:
        return ["embed_tokens"]
    parent, _, leaf = name.rpartition(".")
    return [f"{parent}.{part}" for part in FUSED[leaf]] if leaf in FUSED else [name]


def generation_eos(path: Path) -> list[int] | None:
    """The end-of-text ids of a checkpoint's generation_config.json (None when it has none)."""
    file = path / "generation_config.json"
    if not file.is_file():
        return None
    eos = json.loads(file.read_text()).get("eos_token_id")
    return None if eos is None else (eos if isinstance(eos, list) else [eos])
