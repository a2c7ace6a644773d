"""k-quant models (`--dtype gguf`): every linear layer that a GGUF file stores in Q4_K or Q6_K
blocks runs on those blocks as stored (`csrc/kquant_matmul.cpp`), with each token's
activations in int8 per 256 columns; in Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 blocks (32 columns: what
Q4_K_M keeps where rows are no multiple of 256 columns, and files of those types), on those
(`csrc/q32_matmul.cpp`), activations in int8 per 32 columns; the rest as an int8 model's
(`int8.py`), attention and norms in float32.

Why: the weights are then the file's own (what llama.cpp computes with), read at 4.5-8.5 bits
a weight instead of int8's 8 (Qwen2.5-Coder 1.5B, Q4_K_M: 1.02 GB a token against 1.54; the
0.5B draft, mostly Q5_0: 16.9 ms a token against 19.8-23.7), and the kernels give each token
the same bits at any width, so speculative output is exactly this model's own one-token decoding.
Layers of other types (float16, Q5_K, ...) are quantized to int8 from their decoded values,
without smoothing.

The float checkpoint (made from the same file by `presets.py`) supplies the norms, biases
and input embeddings (a view of its file: only the rows read become resident); nothing is
cached beyond the GGUF file itself: packing its blocks takes about a second.
"""

from __future__ import annotations

import functools
import logging
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from .decoder_only import DecoderOnlyConfig, DecoderOnlyLM
from .int8 import _mapped, _replace, model_class, release_freed_memory
from .int8_kernel import compiled_ops
from .kernels import Int8Linear
from .layers import FUSED

log = logging.getLogger("speculative")

# The GGML types the kernels run, by type number: the k-quants of 256 columns
# (csrc/kquant_matmul.cpp, which takes their bits per quant) and the blocks of 32
# (csrc/q32_matmul.cpp, which takes the type number).
K_QUANTS = {12: 4, 14: 6}  # Q4_K, Q6_K -> bits
TYPE_NAMES = {12: "Q4_K", 14: "Q6_K", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0"}
KERNEL_TYPES = frozenset(TYPE_NAMES)
# The GGUF tensors (llama.cpp's names) behind each linear layer of the fused decoder.
GGUF_NAMES = {"o_proj": ("attn_output",), "down_proj": ("ffn_down",), "q_proj": ("attn_q",), "k_proj": ("attn_k",),
              "v_proj": ("attn_v",), "gate_proj": ("ffn_gate",), "up_proj": ("ffn_up",)}


class KQuantLinear(nn.Module):
    """y ~ x W^T + b with W in the blocks of a GGUF file (TYPE_NAMES); width-invariant,
    bit for bit. A fused layer whose parts have different types (Q4_K_M keeps some value
    projections in Q6_K) runs one product per run of parts of one type."""

    def __init__(self, parts: list[tuple[np.ndarray, int]], in_features: int, bias: torch.Tensor | None = None,
                 source=None):
        """`parts`: (rows of raw blocks (N_i, row bytes) uint8, GGML type), in output order.
        `source()` gives them again, for `select_rows` (kept, views of a file would keep its
        pages resident: 1 GB for Qwen2.5-Coder 1.5B); None: select_rows takes `parts`' rows."""
        super().__init__()
        ops = compiled_ops(required=True)
        self.in_features = in_features
        self.out_features = sum(len(raw) for raw, _ in parts)
        self.isa = "auto"  # the instruction set (models/isa.py): auto (the best allowed here) or a level by name
        self.source = source if source is not None else lambda: parts
        self.runs = []  # (packed blocks, GGML type, rows)
        for kind in _runs(parts):
            raw = np.concatenate([raw for raw, _ in kind]) if len(kind) > 1 else kind[0][0]
            with warnings.catch_warnings():  # a read-only view of the file: packing only reads it
                warnings.simplefilter("ignore")
                blocks = torch.from_numpy(np.ascontiguousarray(raw))
            pack = ops.kquant_pack if kind[0][1] in K_QUANTS else ops.q32_pack
            self.runs.append((pack(blocks, kind[0][1], in_features), kind[0][1], len(raw)))
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x if x.dtype == torch.float32 else x.float()
        outputs, start = [], 0
        for packed, kind, rows in self.runs:
            bias = None if self.bias is None else self.bias[start:start + rows]
            if kind in K_QUANTS:
                outputs.append(torch.ops.speculative_kernels.kquant_linear(x, packed, K_QUANTS[kind], bias, rows, self.isa))
            else:
                outputs.append(torch.ops.speculative_kernels.q32_linear(x, packed, kind, bias, rows, self.isa))
            start += rows
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, -1)

    def select_rows(self, token_ids: torch.Tensor) -> "KQuantLinear":
        """The layer over output rows `token_ids` only (a reduced draft vocabulary), as stored."""
        parts = self.source()
        if len(parts) != 1:
            raise ValueError("select_rows takes the rows of a layer of one GGUF tensor (an output layer)")
        raw, kind = parts[0]
        ids = token_ids.cpu().numpy()
        return KQuantLinear([(raw[ids], kind)], self.in_features, None if self.bias is None else self.bias[ids])

    def extra_repr(self) -> str:
        kinds = "+".join(TYPE_NAMES[kind] for _, kind, _ in self.runs)
        return f"in_features={self.in_features}, out_features={self.out_features}, {kinds}"


def _runs(parts: list[tuple[np.ndarray, int]]) -> list[list[tuple[np.ndarray, int]]]:
    """Consecutive parts of one type, together."""
    runs = []
    for part in parts:
        if runs and runs[-1][-1][1] == part[1]:
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGML's order: columns first
    tensor_type: int  # GGML's type number
    data: np.ndarray | None  # (rows, row bytes) uint8, a view of the file; None for types the kernel does not run


# Bytes of the values that a GGUF key-value entry may hold, by type number (8: string, 9: array).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# Q4_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: (columns, bytes) per block.
_BLOCK = {12: (256, 144), 14: (256, 210), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34)}


def runs_on_blocks(shape: tuple[int, ...], kind: int) -> bool:
    """Whether the kernels multiply a 2-D GGUF tensor of this shape (GGML's order) and type."""
    return kind in _BLOCK and len(shape) == 2 and shape[0] % _BLOCK[kind][0] == 0


def read_gguf_tensors(path: Path) -> dict[str, GGUFTensor]:
    """The tensors of a GGUF file (version 2 or 3); those of a type the kernels run hold a view
    of the file. Only the tensor index is parsed: gguf's GGUFReader also decodes every metadata
    entry (the tokenizer's 150k strings: 9 s for Qwen2.5-Coder 1.5B)."""
    file = np.memmap(path, dtype=np.uint8, mode="r")
    header = _Header(memoryview(file))
    if bytes(header.buffer[:4]) != b"GGUF" or header.take("I") not in (2, 3):
        raise ValueError(f"{path} is not a GGUF file of version 2 or 3")
    tensor_count, entry_count = header.take("Q"), header.take("Q")
    alignment = 32
    for _ in range(entry_count):
        key, kind = header.string(), header.take("I")
        if key == "general.alignment" and kind == 4:
            alignment = header.take("I")
        else:
            header.skip(kind)
    index = []
    for _ in range(tensor_count):
        name, dims = header.string(), header.take("I")
        shape = tuple(header.take("Q") for _ in range(dims))
        index.append((name, shape, header.take("I"), header.take("Q")))
    start = -(-header.at // alignment) * alignment
    tensors = {}
    for name, shape, kind, offset in index:
        data = None
        if runs_on_blocks(shape, kind):
            row = shape[0] // _BLOCK[kind][0] * _BLOCK[kind][1]
            data = file[start + offset:start + offset + row * shape[1]].reshape(shape[1], row)
        tensors[name] = GGUFTensor(name, shape, kind, data)
    return tensors


class _Header:
    """Reads a GGUF header's little-endian fields in order."""

    def __init__(self, buffer: memoryview):
        self.buffer, self.at = buffer, 4

    def take(self, form: str):
        value = struct.unpack_from("<" + form, self.buffer, self.at)[0]
        self.at += struct.calcsize("<" + form)
        return value

    def string(self) -> str:
        length = self.take("Q")
        self.at += length
        return bytes(self.buffer[self.at - length:self.at]).decode("utf-8", "replace")

    def skip(self, kind: int) -> None:
        """Past a metadata value of type `kind` (8: a string; 9: an array)."""
        if kind == 8:
            length = self.take("Q")  # (before `self.at +=`, which would read the position first)
            self.at += length
        elif kind == 9:
            item, count = self.take("I"), self.take("Q")
            if item in _SCALAR_BYTES:
                self.at += _SCALAR_BYTES[item] * count
            else:
                for _ in range(count):
                    self.skip(item)
        else:
            self.at += _SCALAR_BYTES[kind]


def gguf_tensor_names(name: str, tensors) -> list[str]:
    """The GGUF tensors behind linear layer `name` of the fused decoder (the output layer: the
    file's `output.weight`, or its token embeddings where the two are tied)."""
    if name == "lm_head":
        return ["output.weight" if "output.weight" in tensors else "token_embd.weight"]
    layer, leaf = name.split(".")[1], name.rpartition(".")[2]
    parts = FUSED.get(leaf, (leaf,))
    return [f"blk.{layer}.{GGUF_NAMES[part][0]}.weight" for part in parts]


def kquant_share(gguf: Path, kinds=K_QUANTS) -> float:
    """Of the weights in a GGUF file's layer matrices (blk.*), the share stored in blocks of
    `kinds` (GGML type numbers; default the k-quants Q4_K and Q6_K): nearly all of
    Qwen2.5-Coder 1.5B's Q4_K_M file, a fifth of the 0.5B's (mostly Q5_0: its rows of 896
    columns are no multiple of 256), little of Gemma 3 270M's (Q5_0 and Q8_0 mostly)."""
    total = kernel = 0
    for tensor in read_gguf_tensors(gguf).values():
        if tensor.name.startswith("blk.") and len(tensor.shape) == 2:
            total += tensor.shape[0] * tensor.shape[1]
            kernel += tensor.shape[0] * tensor.shape[1] if tensor.tensor_type in kinds else 0
    return kernel / total if total else 0.0


def int8_on_tiles() -> bool:
    """Whether int8 products run on AMX tiles here (csrc/amx.h). The k-quant blocks have no
    AMX path (one tried was slower than VNNI: dev/LOG.md, 2026-12-05)."""
    ops = compiled_ops()
    return ops is not None and ops.isa() == "amx"


def auto_reason(path: Path, device, weights: int, draft: bool = False) -> str | None:
    """Why `auto` runs a model directory of `weights` matrix weights on the blocks of the GGUF
    file it was made from, or None where it does not: only where int8 runs fast (VNNI, or AVX2
    on the compiled kernel: `precision.int8_runs_fast`, where `auto` picks int8). A target (INT8_MIN_WEIGHTS or more; a draft's size is load_draft's)
    needs half of its layers' weights in Q4_K or Q6_K: there the file's own blocks decode
    faster than int8 (fewer bytes a token) and are the weights llama.cpp computes with; the
    int8 model is quantized again from their float copy. Not where int8 runs on AMX tiles:
    there a target's int8 forward of 16 tokens costs 1.3 one-token forwards (the blocks' 2.4),
    and it reads prompts faster; with the Qwen pair's default drafting, on a Xeon, int8 ran
    grounded editing 1.36x as fast as the blocks, code completion 0.96x, chat 0.88x
    (BENCHMARKS.md). A `draft` needs half in any type the kernels run (Q5_0, Q8_0, ... too):
    its forward is bound by the bytes it reads, and Q5_0 reads 5.5 bits a weight where int8
    reads 8 (the 0.5B draft, full vocabulary: 16.9 ms a token against 19.8-23.7)."""
    from . import presets, precision

    if (torch.device(device).type != "cpu" or not precision.int8_runs_fast() or not path.is_dir()
            or not draft and (weights < precision.INT8_MIN_WEIGHTS or int8_on_tiles())):
        return None
    gguf = presets.source_gguf(path)
    if gguf is None or kquant_share(gguf, KERNEL_TYPES if draft else K_QUANTS) < 0.5 or compiled_ops() is None:
        return None
    return (f"auto: gguf, the blocks of {gguf.name}, since this CPU multiplies 8-bit integers "
            f"{precision.int8_units()}: a forward reads about two thirds of int8's bytes, and every width gets the "
            "same bits")


def load_preset(path: Path, config: dict, device, reason: str | None = None) -> DecoderOnlyLM:
    """A preset's checkpoint directory (config.json `config`) on the blocks of the GGUF
    file it was made from; a clear error for anything else. `reason`: why (None: asked for)."""
    from . import presets
    from .native import checkpoint_reader, native_config

    gguf = presets.source_gguf(path) if path.is_dir() else None
    native = native_config(config) if gguf is not None else None
    if gguf is None or native is None:
        made = ", ".join(sorted([*presets.CHUNKED, presets.GEMMA]))
        raise ValueError(f"dtype gguf runs a model made from a GGUF file by a preset ({made}); {path} is not one "
                         "(use int8, auto, float32 or bfloat16)")
    if torch.device(device).type != "cpu":
        raise ValueError(f"dtype gguf runs on CPUs, not on {device}")
    log.info("%s: %s", path, reason or f"gguf, as asked (the blocks of {gguf}, int8 activations per 256 or 32 "
             "columns, float32 else)")
    return load_checkpoint_blocks(path, native, gguf, checkpoint_reader(path, native))


def load_checkpoint_blocks(path: Path, cfg: DecoderOnlyConfig, gguf: Path, read_float) -> DecoderOnlyLM:
    """A checkpoint directory (`read_float` reads it) on the blocks of the GGUF file `gguf` it
    was made from, its input embeddings from the checkpoint."""
    tensors = read_gguf_tensors(gguf)

    def layer_blocks(name: str):
        sources = [tensors.get(source) for source in gguf_tensor_names(name, tensors)]
        if not all(source is not None and source.data is not None for source in sources):
            return None, None
        names = [source.name for source in sources]
        return [(source.data, source.tensor_type) for source in sources], functools.partial(_parts, gguf, names)

    table = _mapped(*read_float.location("embed_tokens.weight"))
    table = table if table.dtype == torch.float32 else read_float("embed_tokens.weight").float()
    return load_kquant(path, cfg, layer_blocks, read_float, nn.Embedding.from_pretrained(table, freeze=True))


def load_kquant(path: Path, cfg: DecoderOnlyConfig, layer_blocks, read_float, embedding: nn.Module) -> DecoderOnlyLM:
    """The model `cfg` from a GGUF file's blocks, with layers on them where the kernels run their
    types, int8 where not. `layer_blocks(name)`: (the raw blocks of each part of linear layer
    `name` of the fused model, in output order, and a function giving them again), or (None,
    None) where a part's type has no kernel; `read_float(name)`: any parameter as a float tensor."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg).fuse()
    counts = {"blocks": 0, "int8": 0}
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        bias = read_float(f"{name}.bias") if module.bias is not None else None
        parts, source = layer_blocks(name)
        if parts is not None:
            _check_shapes(name, module, parts, path)
            layer = KQuantLinear(parts, module.in_features, bias, source=source)
            counts["blocks"] += 1
        else:
            layer = Int8Linear(SimpleNamespace(weight=read_float(f"{name}.weight"), bias=bias))
            counts["int8"] += 1
        _replace(model, name, layer)
    model.embed_tokens = embedding
    for name, parameter in list(model.named_parameters()):
        if parameter.is_meta:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, nn.Parameter(read_float(name).float(), requires_grad=False))
    log.info("%s: %d linear layers on the GGUF's blocks, %d in int8", path, counts["blocks"], counts["int8"])
    model.use_compiled_blocks(compiled_ops(required=True))
    release_freed_memory()
    return model.eval()


def _parts(gguf: Path, names: list[str]) -> list[tuple[np.ndarray, int]]:
    """The raw blocks of tensors `names` of a GGUF file, read again (views of the file)."""
    tensors = read_gguf_tensors(gguf)
    return [(tensors[name].data, tensors[name].tensor_type) for name in names]


def _check_shapes(name: str, module: nn.Linear, parts, path: Path) -> None:
    """Refuse blocks that do not hold the layer the config describes (a file that is not the
    checkpoint's source, or metadata that does not match its tensors)."""
    rows = sum(len(raw) for raw, _ in parts)
    columns = {raw.shape[1] // _BLOCK[kind][1] * _BLOCK[kind][0] for raw, kind in parts}
    if columns != {module.in_features} or rows != module.out_features:
        raise ValueError(f"{path}: the GGUF tensors of layer {name} hold {rows} rows of {sorted(columns)} columns, "
                         f"the model's config gives {module.out_features} x {module.in_features}")
