"""SmoothQuant-style smoothing before int8: move activation outliers into the weights.

An int8 layer quantizes each input row with one scale, its absolute maximum (kernels.Int8Linear),
so a few channels that run 10-100x larger than the rest (LLM activations have them: Gemma 3's
most) leave the other channels a handful of int8 steps. Smoothing divides each input channel
j by s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) and multiplies the weights' column j by it:
the float model computes the same function, but its activations are flatter and int8 loses
less (Xiao et al. 2023). The division is folded into what produces the input: the norm
before q/k/v and before the MLP's gate/up, the rows of v before the output projection (a
head's output is a mix of its values), the rows of up before down (gelu(gate) * up).

Peaks of X come from calibration text run through the float model block by block (the
Python standard library's argparse source and its English documentation topics: on every
machine, and not the text the quality benchmark scores). Measured on Gemma 3 270M
(benchmarks/quality.py chunks, against float32): int8 perplexity +6.5% on ShareGPT replies
without smoothing; see dev/LOG.md for alpha.
"""

from __future__ import annotations

import logging
import sysconfig
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger("speculative")

ALPHA = 0.8
CALIBRATION_FILES = ("argparse.py", "pydoc_data/topics.py")
CHUNK, CHUNKS_PER_FILE = 512, 2


def calibration_ids(path: Path) -> list[list[int]] | None:
    """Token chunks of the calibration text, from the checkpoint's tokenizer.json (None without one)."""
    if not (path / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks = []
    for name in CALIBRATION_FILES:
        ids = tokenizer.encode((stdlib / name).read_text(encoding="utf-8")).ids
        chunks += [ids[i:i + CHUNK] for i in range(0, CHUNKS_PER_FILE * CHUNK, CHUNK) if len(ids) >= i + CHUNK]
    return chunks or None


class SmoothedReader:
    """read(name) of the fused built-in decoder's float weights, smoothed.

    Blocks are smoothed in order on first request: block i's float weights run the
    calibration hidden states (their peaks are measured at each linear's input), its
    tensors are smoothed, and the hidden states move on to block i + 1 (through the float
    block: smoothing does not change what it computes)."""

    def __init__(self, read, skeleton, chunks: list[list[int]], alpha: float = ALPHA):
        self.read, self.model, self.chunks, self.alpha = read, skeleton, chunks, alpha
        self.hidden = None  # calibration hidden states entering block `next_block`
        self.smoothed: dict[str, torch.Tensor] = {}
        self.next_block = 0

    def _embed(self) -> None:
        self.model.embed_tokens.weight = nn.Parameter(self.read("embed_tokens.weight").float(), requires_grad=False)
        with torch.inference_mode():
            self.hidden = self.model.embed(torch.tensor(self.chunks)).float()  # (chunks, CHUNK, hidden)
        self.model.embed_tokens.weight = None  # the skeleton keeps no more weights than one block's

    def __call__(self, name: str) -> torch.Tensor:
        if name.startswith("layers."):
            index = int(name.split(".")[1])
            if self.hidden is None:
                self._embed()
            while self.next_block <= index:
                self._smooth_block(self.next_block)
                self.next_block += 1
            if name in self.smoothed:
                return self.smoothed.pop(name)
        return self.read(name)

    def _smooth_block(self, index: int) -> None:
        prefix = f"layers.{index}."
        block = self.model.layers[index]
        for name, _ in list(block.named_parameters()):
            parent, _, leaf = name.rpartition(".")
            setattr(block.get_submodule(parent), leaf, nn.Parameter(self.read(prefix + name).float(),
                                                                     requires_grad=False))
        peaks = {}
        hooks = [module.register_forward_hook(record_peak(peaks, name)) for name, module in block.named_modules()
                 if type(module) is nn.Linear]
        positions = torch.arange(self.hidden.shape[1])[None]
        cos, sin = self.model.layer_rope(index, positions, self.hidden.shape[1])
        with torch.inference_mode():
            self.hidden = block(self.hidden, cos, sin)
        for hook in hooks:
            hook.remove()
        with torch.no_grad():
            smooth_block(block, peaks, self.model.cfg, self.alpha)
        self.smoothed.update({prefix + name: parameter.data for name, parameter in block.named_parameters()})
        self.model.layers[index] = nn.Identity()  # its weights now live in `smoothed` until read


def record_peak(peaks: dict, name: str):
    def hook(module, inputs, output):
        peak = inputs[0].detach().abs().flatten(0, -2).amax(0)
        peaks[name] = peak if name not in peaks else torch.maximum(peaks[name], peak)
    return hook


def smooth_block(block: nn.Module, peaks: dict, cfg, alpha: float) -> None:
    """Smooth the four linears of a fused block in place (see the module docstring)."""
    attention, mlp = block.self_attn, block.mlp
    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def scales(linear: nn.Linear, name: str) -> torch.Tensor:
        weight = linear.weight.abs().amax(0).clamp(min=1e-5)
        return (peaks[name].clamp(min=1e-5).pow(alpha) / weight.pow(1 - alpha)).clamp(min=1e-5)

    s = scales(attention.qkv_proj, "self_attn.qkv_proj")
    block.input_layernorm.weight.div_(s)
    attention.qkv_proj.weight.mul_(s)
    s = scales(mlp.gate_up_proj, "mlp.gate_up_proj")
    block.get_submodule(block.mlp_norm).weight.div_(s)
    mlp.gate_up_proj.weight.mul_(s)
    s = scales(mlp.down_proj, "mlp.down_proj")
    mlp.gate_up_proj.weight[s.numel():].div_(s[:, None])  # the up rows
    mlp.down_proj.weight.mul_(s)
    # The output projection's input channel (head h, j) is value channel j of head h's kv
    # head, shared by the query heads of its group: one scale per value channel.
    group = heads // kv_heads
    s = scales(attention.o_proj, "self_attn.o_proj").view(kv_heads, group, dim).amax(1)  # (kv_heads, dim)
    values = slice((heads + kv_heads) * dim, None)
    attention.qkv_proj.weight[values].div_(s.reshape(-1, 1))
    if attention.qkv_proj.bias is not None:
        attention.qkv_proj.bias[values].div_(s.reshape(-1))
    attention.o_proj.weight.mul_(s[:, None, :].expand(kv_heads, group, dim).reshape(-1))
