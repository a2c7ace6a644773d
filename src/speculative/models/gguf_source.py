"""A GGUF file as a model source, read without transformers: its metadata as a config, its
tensors under the built-in decoder's names, its tokenizer.

Llama, Qwen2 and Gemma 3 files run on the built-in decoders (`native.py`). What llama.cpp's
converter changed on the way in is undone here: Llama's query and key rows were interleaved
for its rotary layout (rows are put back; the blocks of a row are untouched), and Gemma's
norms were stored as 1 + w (the decoder's `checkpoint_offset` is then not added again).
Float tensors are decoded with `gguf.quants` (norms, biases; a layer the kernels do not run).
The input embeddings stay in the file's blocks: `BlockEmbedding` decodes the rows a forward
reads, as llama.cpp's get_rows does, so that no float copy of the table exists anywhere.
Its tokenizer: `gguf_tokenizer.py`.
"""

from __future__ import annotations

import logging
import mmap
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

log = logging.getLogger("speculative")

# GGUF general.architecture -> the transformers model_type whose decoder computes it.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma3_text"}
# Scalar metadata types: struct format by type number (8: string, 9: array).
_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
def read_metadata(path: Path, arrays: tuple[str, ...] = ()) -> dict:
    """The key-value entries of a GGUF file; array entries are decoded only when named in
    `arrays` (a 150k-token vocabulary takes a second), else given as their length."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
        if view[:4] != b"GGUF" or struct.unpack_from("<I", view, 4)[0] not in (2, 3):
            raise ValueError(f"{path} is not a GGUF file of version 2 or 3")
        entries = struct.unpack_from("<Q", view, 16)[0]
        reader, metadata = _Reader(view, 24), {}
        for _ in range(entries):
            key = reader.string()
            metadata[key] = reader.value(reader.take("I"), decode=key in arrays)
        return metadata


class _Reader:
    """Little-endian fields of a GGUF header, in order."""

    def __init__(self, view, at: int):
        self.view, self.at = view, at

    def take(self, form: str):
        value = struct.unpack_from("<" + form, self.view, self.at)[0]
        self.at += struct.calcsize("<" + form)
        return value

    def string(self) -> str:
        return self.raw_string().decode("utf-8", "replace")

    def raw_string(self) -> bytes:
        length = self.take("Q")
        self.at += length
        return self.view[self.at - length:self.at]

    def value(self, kind: int, decode: bool = True):
        if kind == 8:
            return self.string()
        if kind != 9:
            return self.take(_FORMATS[kind])
        item, count = self.take("I"), self.take("Q")
        if item in _FORMATS:
            form = f"<{count}{_FORMATS[item]}"
            values = struct.unpack_from(form, self.view, self.at) if decode else count
            self.at += struct.calcsize(form)
            return list(values) if decode else values
        if item == 8:
            strings = [self.raw_string() for _ in range(count)]
            return [s.decode("utf-8", "replace") for s in strings] if decode else count
        return [self.value(item, decode) for _ in range(count)]


def architecture(metadata: dict, path: Path) -> str:
    """The file's architecture, refused with a clear message where the built-in decoders do not
    compute it."""
    name = metadata.get("general.architecture")
    if name not in ARCHITECTURES:
        raise ValueError(f"{path} holds a {name!r} model; its own blocks run Llama, Qwen2 and Gemma 3 files "
                         f"({', '.join(ARCHITECTURES)}). Other architectures load through transformers, dequantized: "
                         "pass --dtype float32 (dtype='float32'), with transformers installed")
    return name


def hf_config(metadata: dict, tensors: dict, path: Path) -> dict:
    """The transformers config.json that describes the file's model (what `native_config`
    reads), from its metadata and tensor shapes."""
    arch = architecture(metadata, path)

    def get(key, default=None):
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: the metadata has no {arch}.{key}, which a {arch} model needs")
        return value

    heads = get("attention.head_count")
    if isinstance(heads, list) or isinstance(get("attention.head_count_kv", heads), list):
        raise ValueError(f"{path}: head counts that vary by layer are not supported")
    hidden = get("embedding_length")
    config = {
        "model_type": ARCHITECTURES[arch], "vocab_size": tensors["token_embd.weight"].shape[1],
        "hidden_size": hidden, "num_hidden_layers": get("block_count"), "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": heads, "num_key_value_heads": get("attention.head_count_kv", heads),
        "max_position_embeddings": get("context_length", 2048), "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0), "tie_word_embeddings": "output.weight" not in tensors,
        "head_dim": get("attention.key_length", hidden // heads)}
    if metadata.get(f"{arch}.rope.scaling.type", "none") not in ("none", "linear") or \
            metadata.get(f"{arch}.rope.scaling.factor", 1.0) not in (0.0, 1.0):
        config["rope_scaling"] = {"rope_type": metadata.get(f"{arch}.rope.scaling.type")}  # refused by native_config
    if arch == "llama" and "blk.0.attn_q.bias" in tensors:
        config["attention_bias"] = True  # refused: the built-in Llama has none
    if arch == "gemma3":
        # llama.cpp's Gemma 3 constants where the file does not say: every sixth layer global,
        # local rotary base 10000, queries scaled by the head size (the 27B's by hidden / heads).
        layers = config["num_hidden_layers"]
        config.update(sliding_window=get("attention.sliding_window"),
                      sliding_window_pattern=get("attention.sliding_window_pattern", 6),
                      rope_local_base_freq=get("rope.freq_base_swa", 10000.0),
                      query_pre_attn_scalar=hidden // heads if layers == 62 else config["head_dim"])
        if not isinstance(config["sliding_window_pattern"], int):
            raise ValueError(f"{path}: a sliding-window pattern given per layer is not supported")
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if metadata.get(f"{arch}.{key}"):
                config[key] = metadata[f"{arch}.{key}"]  # refused by native_config
    return config


# The GGUF tensor of each parameter of the built-in decoder (fused layers are the concatenation
# of their parts: models/layers.py FUSED), per layer; `None`: the same for every architecture.
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def tensor_name(name: str, gemma: bool) -> str:
    """The GGUF tensor of an (unfused) parameter of the built-in decoder."""
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        module, _, leaf = rest.rpartition(".")
        if module == "post_attention_layernorm":  # Gemma's norm after attention; Llama's before the MLP
            return f"blk.{index}.{'post_attention_norm' if gemma else 'ffn_norm'}.{leaf}"
        return f"blk.{index}.{_LAYER_NAMES[module]}.{leaf}"
    module, _, leaf = name.rpartition(".")
    return {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}[module] + f".{leaf}"


def rotary_rows(heads: int, head_dim: int) -> np.ndarray:
    """For each row of a Llama query or key projection in transformers' order, its row in a GGUF
    file: llama.cpp's converter interleaves the two halves of each head (for its rotary layout)."""
    half = head_dim // 2
    head, part, pair = np.meshgrid(np.arange(heads), np.arange(2), np.arange(half), indexing="ij")
    return (head * head_dim + pair * 2 + part).reshape(-1)


class TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # GGML's order: columns first
    tensor_type: int  # GGML's type number
    start: int  # byte offset in the file
    nbytes: int


def read_tensor_index(path: Path) -> dict[str, TensorInfo]:
    """Where each tensor of a GGUF file lies (metadata skipped, not decoded)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
        count, entries = struct.unpack_from("<QQ", view, 8)
        reader, alignment = _Reader(view, 24), 32
        for _ in range(entries):
            key, kind = reader.string(), reader.take("I")
            value = reader.value(kind, decode=False)
            alignment = value if key == "general.alignment" else alignment
        index = []
        for _ in range(count):
            name, dims = reader.string(), reader.take("I")
            index.append((name, tuple(reader.take("Q") for _ in range(dims)), reader.take("I"), reader.take("Q")))
        start, size = -(-reader.at // alignment) * alignment, len(view)
    tensors = {}
    for name, shape, kind, offset in index:
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except ValueError:
            raise ValueError(f"{path}: tensor {name} has GGML type {kind}, which this gguf package does not know") from None
        nbytes = int(np.prod(shape)) // block * block_bytes
        if start + offset + nbytes > size:
            raise ValueError(f"{path} is truncated: tensor {name} ends at byte {start + offset + nbytes}, the file has "
                             f"{size} bytes")
        tensors[name] = TensorInfo(name, shape, kind, start + offset, nbytes)
    return tensors


class GGUFTensors:
    """A GGUF file's tensors under the built-in decoder's names: raw blocks (`blocks`) and float
    values (`read`), with Llama's rotary interleaving undone."""

    def __init__(self, path: Path, tensors: dict[str, TensorInfo], cfg, arch: str):
        self.path, self.tensors, self.cfg = path, tensors, cfg
        self.llama, self.gemma = arch == "llama", arch == "gemma3"
        self.data = np.memmap(path, dtype=np.uint8, mode="r")

    def gguf_name(self, name: str) -> str:
        if name == "lm_head.weight" and "output.weight" not in self.tensors:
            return "token_embd.weight"  # tied
        return tensor_name(name, self.gemma)

    def _row_order(self, name: str) -> np.ndarray | None:
        if not self.llama or not name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            return None
        heads = self.cfg.num_heads if ".q_proj." in name else self.cfg.num_kv_heads
        return rotary_rows(heads, self.cfg.head_dim)

    def info(self, name: str) -> TensorInfo:
        gguf_name = self.gguf_name(name)
        if gguf_name not in self.tensors:
            raise ValueError(f"{self.path} has no tensor {gguf_name!r}, which parameter {name} needs")
        return self.tensors[gguf_name]

    def blocks(self, name: str) -> tuple[np.ndarray, int]:
        """(rows of raw blocks (rows, row bytes) uint8, GGML type) of a 2-D tensor; a view of the
        file unless rows were reordered."""
        tensor = self.info(name)
        raw = self.data[tensor.start:tensor.start + tensor.nbytes].reshape(tensor.shape[1], -1)
        order = self._row_order(name)
        return (raw if order is None else raw[order]), tensor.tensor_type

    def read_fused(self, name: str) -> torch.Tensor:
        """The float32 tensor of a parameter of the fused decoder (`DecoderOnlyLM.fuse`)."""
        module, _, leaf = name.rpartition(".")
        return torch.cat([self.read(f"{part}.{leaf}") for part in unfused(module)])

    def read(self, name: str) -> torch.Tensor:
        """The float32 tensor of an unfused parameter, in transformers' layout and convention
        (Gemma's norms as stored: 1 + w)."""
        from gguf.quants import dequantize

        tensor = self.info(name)
        raw = self.data[tensor.start:tensor.start + tensor.nbytes]
        rows = tensor.shape[1] if len(tensor.shape) == 2 else 1
        values = dequantize(np.asarray(raw).reshape(rows, -1), tensor.tensor_type)
        values = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(tuple(reversed(tensor.shape)))
        order = self._row_order(name)
        return values if order is None else values[torch.from_numpy(order)]


class BlockEmbedding(nn.Module):
    """Input embeddings left in a GGUF file's blocks: a forward decodes only the rows it reads
    (float32), so no float table is made (Qwen2.5-Coder 1.5B's would be 0.9 GB)."""

    def __init__(self, raw: np.ndarray, kind: int, width: int):
        super().__init__()
        self.raw, self.kind, self.width = raw, kind, width

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from gguf.quants import dequantize

        ids = tokens.reshape(-1).cpu().numpy()
        rows = dequantize(np.ascontiguousarray(self.raw[ids]), self.kind).astype(np.float32, copy=False)
        return torch.from_numpy(rows).reshape(*tokens.shape, self.width).to(tokens.device)

    def extra_repr(self) -> str:
        return f"{len(self.raw)} rows of {self.width}, GGML type {self.kind}"


def load_gguf(path: Path, device, dtype, reason: str):
    """A Llama, Qwen2 or Gemma 3 GGUF file on the built-in decoder, with its tokenizer. `dtype`:
    "gguf" (the file's own blocks where the kernels run their type, int8 where not: CPUs only) or
    a torch float dtype (the blocks decoded to it); `reason`: what `auto` said, for the log."""
    from .kquant import load_kquant, runs_on_blocks
    from .native import load_native, native_config

    metadata = read_metadata(path)
    arch = architecture(metadata, path)
    tensors = read_tensor_index(path)
    cfg = native_config(hf_config(metadata, tensors, path))
    if cfg is None:
        raise ValueError(f"{path}: this {arch} model uses something the built-in decoder does not compute (rope "
                         "scaling, logit soft-capping, biases where the architecture has none); pass --dtype float32 "
                         "(dtype='float32') to load it through transformers")
    source = GGUFTensors(path, tensors, cfg, arch)
    log.info("%s: %s", path, reason)
    if dtype != "gguf":
        model = load_native(path, cfg, device, dtype, read=source.read_fused, tied="output.weight" not in tensors)
    else:
        if torch.device(device).type != "cpu":
            raise ValueError(f"dtype gguf runs on CPUs, not on {device}")

        def layer_blocks(name: str):
            names = [f"{part}.weight" for part in unfused(name)]
            if not all(runs_on_blocks(source.info(n).shape, source.info(n).tensor_type) for n in names):
                return None, None
            return [source.blocks(n) for n in names], lambda: [GGUFTensors(path, tensors, cfg, arch).blocks(n)
                                                               for n in names]

        table = tensors["token_embd.weight"]  # its own mapping: pages other tensors were read through go
        raw = np.memmap(path, dtype=np.uint8, mode="r")[table.start:table.start + table.nbytes]
        embedding = BlockEmbedding(raw.reshape(table.shape[1], -1), table.tensor_type, table.shape[0])
        model = load_kquant(path, cfg, layer_blocks, source.read_fused, embedding)
    from .gguf_tokenizer import gguf_tokenizer

    model.tokenizer = gguf_tokenizer(path) if "tokenizer.ggml.model" in metadata else None
    return model


def unfused(name: str) -> list[str]:
    """The layers of the unfused decoder behind a layer of the fused one."""
    from .layers import FUSED

    parent, _, leaf = name.rpartition(".")
    return [f"{parent}.{part}" for part in FUSED[leaf]] if leaf in FUSED else [name]
