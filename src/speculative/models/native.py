"""transformers checkpoints that the built-in decoder computes exactly: Llama, Qwen2 and
Gemma 3's text model.

Llama and Qwen2 are the decoder of `decoder_only.py` (Qwen2 adds biases to the query, key
and value projections), Gemma 3 its subclass in `gemma3.py` (sliding windows, more norms),
so their weights load into it as they are, renamed. The built-in decoder
then runs them with its preallocated, position-indexed cache and its width-invariant
attention: rollback is moving a length, a verify forward gives each token the bits it
gets alone, and a forward costs fewer operations than transformers' own. Checkpoints with
anything else (rope scaling, Qwen2's sliding windows, other activations, Gemma's logit
soft-capping) load through transformers.

Weights are read one tensor at a time, cast (or quantized to int8) and dropped, so that
loading a model never holds more than the finished model and one float tensor.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from .decoder_only import DecoderOnlyConfig, DecoderOnlyLM
from .gemma3 import FULL, SLIDING, SLIDING_PATTERN, Gemma3Config, Gemma3LM
from .int8 import load_cached, model_class
from .int8_kernel import compiled_ops
from .layers import FUSED
from .smoothing import SmoothedReader, calibration_ids

log = logging.getLogger("speculative")

ARCHITECTURES = {"llama": False, "qwen2": True}  # model_type -> biases on q, k and v
GEMMA3 = "gemma3_text"


def native_config(config: dict) -> DecoderOnlyConfig | None:
    """The decoder configuration of a transformers config.json, or None when the built-in
    decoder does not compute that model exactly."""
    kind = config.get("model_type")
    if kind == GEMMA3:
        return gemma3_config(config)
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


def gemma3_config(config: dict) -> Gemma3Config | None:
    """Gemma 3's text decoder (`gemma3.py`) for a gemma3_text config.json, or None for what it
    does not compute: logit soft-capping, bidirectional attention, rope scaling, biases,
    other activations or layer kinds."""
    thetas = _gemma3_thetas(config)
    layer_types = config.get("layer_types")
    if layer_types is None:
        pattern = config.get("sliding_window_pattern", config.get("_sliding_window_pattern", SLIDING_PATTERN))
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"sliding_window_pattern must be an integer >= 1, got {pattern!r}")
        layer_types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(config["num_hidden_layers"])]
    window = config.get("sliding_window")
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if (thetas is None or activation != "gelu_pytorch_tanh" or config.get("attention_bias", False)
            or config.get("attn_logit_softcapping") is not None or config.get("final_logit_softcapping") is not None
            or config.get("use_bidirectional_attention") or not isinstance(layer_types, list)
            or not set(layer_types) <= {SLIDING, FULL} or window is None and SLIDING in layer_types):
        return None
    heads = config["num_attention_heads"]
    longest = config.get("max_position_embeddings") or 32768
    return Gemma3Config(
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"], num_layers=config["num_hidden_layers"],
        num_heads=heads, num_kv_heads=config.get("num_key_value_heads") or heads,
        intermediate_size=config["intermediate_size"], max_seq_len=longest, rope_theta=thetas[0],
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
        head_dim=config.get("head_dim") or 256, sliding_window=longest if window is None else window,
        layer_types=layer_types, sliding_rope_theta=thetas[1],
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)))


def _gemma3_thetas(config: dict) -> tuple[float, float] | None:
    """(full layers' rotary base, sliding layers'), from rope_parameters per layer kind (or the
    older rope_theta and rope_local_base_freq); None for rope types other than the default,
    or rope_parameters not given per layer kind."""
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    if parameters and not {FULL, SLIDING} & set(parameters):
        return None
    full, sliding = parameters.get(FULL) or {}, parameters.get(SLIDING) or {}
    if any(part.get("rope_type", part.get("type", "default")) != "default" for part in (full, sliding, scaling)):
        return None
    return (float(full.get("rope_theta", config.get("rope_theta", 1e6))),
            float(sliding.get("rope_theta", config.get("rope_local_base_freq", 1e4))))


def load_native(path: Path, cfg: DecoderOnlyConfig, device, dtype: torch.dtype, int8: bool = False,
                progress: bool = True, read=None, tied: bool | None = None) -> DecoderOnlyLM:
    """A transformers checkpoint directory in the built-in decoder (fused: `DecoderOnlyLM.fuse`),
    in `dtype`, or in int8 (`int8.py`, cached on disk) when `int8`. Parameters of modules
    marked `keep_float32` (Gemma's norms) stay float32. `read(name)` and `tied`: another source
    of the fused model's float parameters (a GGUF file's), and whether it has no output layer."""
    if int8:
        if torch.device(device).type != "cpu":
            raise ValueError(f"int8 models run on CPUs, not on {device}")
        return load_cached(path, cfg, lambda: _smoothed_reader(path, cfg), progress)
    read = read or checkpoint_reader(path, cfg, dtype)
    with torch.device("meta"):
        model = model_class(cfg)(cfg).fuse()
    tied = cfg.tie_embeddings and (_tied(path) if tied is None else tied)
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
            module = model.get_submodule(parent)
            kind = torch.float32 if getattr(module, "keep_float32", False) else dtype
            setattr(module, leaf, nn.Parameter(read(name).to(device=device, dtype=kind), requires_grad=False))
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    if isinstance(model, Gemma3LM):  # its norms compute in float32 in every dtype: compiled where that builds
        model.use_compiled_blocks(compiled_ops())
    return model.eval()


def _smoothed_reader(path: Path, cfg: DecoderOnlyConfig):
    """read(name) of the float weights, smoothed for int8 where calibration text can be tokenized."""
    read = checkpoint_reader(path, cfg)
    chunks = calibration_ids(path)
    if chunks is None:
        log.info("%s: no tokenizer.json, so no calibration text: int8 without smoothing", path)
        return read
    with torch.device("meta"):
        return SmoothedReader(read, model_class(cfg)(cfg).fuse(), chunks)


def checkpoint_reader(path: Path, cfg: DecoderOnlyConfig, dtype: torch.dtype = torch.float32):
    """read(name) -> the float tensor of `name` in the fused built-in decoder, from the
    checkpoint's safetensors files (renamed, and concatenated for fused layers), checked
    against the shape the config gives. A module's `checkpoint_offset` (Gemma's norms store
    weight - 1) is added in float32 to the stored weight rounded to `dtype`, the model's
    weight dtype, as transformers computes (1.0 + w.float())."""
    from safetensors import safe_open

    where = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as weights:
            where.update({name: file for name in weights.keys()})
    with torch.device("meta"):
        skeleton = model_class(cfg)(cfg).fuse()
    shapes = {name: tensor.shape for name, tensor in skeleton.state_dict().items()}
    tied = cfg.tie_embeddings and _tied(path)

    def location(name: str) -> tuple[Path, str]:
        """(file, key) of a checkpoint tensor."""
        for key in (f"model.{name}", name):
            if key in where:
                return where[key], key
        raise ValueError(f"{path} has no weight {name!r} (nor model.{name}), which a {cfg.num_layers}-layer "
                         f"{_architecture(cfg)} model with this config.json needs")

    def stored(name: str) -> torch.Tensor:
        file, key = location(name)
        with safe_open(str(file), "pt") as weights:
            return weights.get_tensor(key)

    def read(name: str) -> torch.Tensor:
        module, _, kind = name.rpartition(".")
        tensor = torch.cat([stored(f"{source}.{kind}") for source in _sources(module, tied)])
        if name in shapes and tensor.shape != shapes[name]:
            raise ValueError(f"{path}: weight {name} has shape {tuple(tensor.shape)}; its config.json gives "
                             f"{tuple(shapes[name])}")
        offset = getattr(skeleton.get_submodule(module), "checkpoint_offset", None) if name in shapes else None
        return tensor if offset is None else offset + tensor.to(dtype).float()

    read.location = location  # where a stored tensor is (to map it rather than read it)
    return read


def _architecture(cfg: DecoderOnlyConfig) -> str:
    """The checkpoint family a config came from, for messages."""
    if isinstance(cfg, Gemma3Config):
        return "Gemma 3"
    return "Qwen2" if cfg.attention_bias else "Llama"


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
