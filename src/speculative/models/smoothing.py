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
machine, and not the text the quality benchmark scores). How far to smooth differs by model:
one alpha for all blocks was best at 0.8 for Gemma 3 270M and made Qwen2.5-Coder 0.5B worse,
and choosing per layer or per block by simulated error did not serve Gemma (dev/LOG.md). So
each model takes the alpha of ALPHAS (or none) whose whole model, with simulated int8
products, scores the calibration text best: a first pass runs every candidate block by
block, the second smooths the weights as they are read.
"""

from __future__ import annotations

import copy
import logging
import sysconfig
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger("speculative")

# Candidate strengths of smoothing (None: the layers as they are).
ALPHAS = (None, 0.5, 0.8)
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

    On the first block's first request, `choose` runs the calibration text through the
    float blocks (measuring each linear's input peaks) and through each candidate's
    smoothed, simulated-int8 blocks, and keeps the candidate whose logits score the text
    best. Blocks are then smoothed by it as they are read (smoothing leaves what the float
    model computes unchanged)."""

    def __init__(self, read, skeleton, chunks: list[list[int]], alphas: tuple = ALPHAS):
        self.read, self.model, self.chunks, self.alphas = read, skeleton, chunks, alphas
        self.peaks: list[dict] | None = None  # per block: each linear's input peaks
        self.alpha: float | None = None
        self.block: tuple[int, nn.Module] | None = None  # the last block smoothed

    def __call__(self, name: str) -> torch.Tensor:
        if not name.startswith("layers."):
            return self.read(name)
        if self.peaks is None:
            self.choose()
        index = int(name.split(".")[1])
        if self.block is None or self.block[0] != index:  # a block's tensors are read one after another
            block = self._float_block(index)
            with torch.no_grad():
                smooth_block(block, self.peaks[index], self.model.cfg, self.alpha)
            self.block = index, block
        return self.block[1].get_parameter(name.split(".", 2)[2]).data

    def _float_block(self, index: int) -> nn.Module:
        block = copy.deepcopy(self.model.layers[index])
        for name, _ in list(block.named_parameters()):
            parent, _, leaf = name.rpartition(".")
            tensor = self.read(f"layers.{index}.{name}").float()
            setattr(block.get_submodule(parent), leaf, nn.Parameter(tensor, requires_grad=False))
        return block

    def choose(self) -> None:
        tokens = torch.tensor(self.chunks)
        model = self.model
        model.embed_tokens.weight = nn.Parameter(self.read("embed_tokens.weight").float(), requires_grad=False)
        with torch.inference_mode():
            hidden = model.embed(tokens).float()
        model.embed_tokens.weight = None
        streams = {alpha: hidden for alpha in self.alphas}
        positions = torch.arange(tokens.shape[1])[None]
        self.peaks = []
        for index in range(len(model.layers)):
            block = self._float_block(index)
            rope = model.layer_rope(index, positions, tokens.shape[1])
            peaks = {}
            hooks = [module.register_forward_hook(record_peak(peaks, name))
                     for name, module in block.named_modules() if type(module) is nn.Linear]
            with torch.inference_mode():
                hidden = block(hidden, *rope)
            for hook in hooks:
                hook.remove()
            self.peaks.append(peaks)
            for alpha in self.alphas:
                candidate = simulated(block, peaks, model.cfg, alpha)
                with torch.inference_mode():
                    streams[alpha] = candidate(streams[alpha], *rope)
        losses = {alpha: self._loss(stream, tokens) for alpha, stream in streams.items()}
        self.alpha = min(self.alphas, key=losses.get)
        log.info("int8 smoothing: alpha %s (calibration loss by alpha: %s)", self.alpha,
                 ", ".join(f"{a}: {loss:.4f}" for a, loss in losses.items()))

    def _loss(self, hidden: torch.Tensor, tokens: torch.Tensor) -> float:
        """Mean next-token cross-entropy of simulated-int8 logits from final hidden states."""
        norm = copy.deepcopy(self.model.norm)
        norm.weight = nn.Parameter(self.read("norm.weight").float(), requires_grad=False)
        head = SimulatedInt8(self.read("lm_head.weight").float())
        total = 0.0
        with torch.inference_mode():
            for row, ids in zip(hidden, tokens):
                logits = head(norm(row[None]))[0, :-1]
                total += float(nn.functional.cross_entropy(logits, ids[1:]))
        return total / len(tokens)


def record_peak(peaks: dict, name: str):
    def hook(module, args, output):
        peak = args[0].detach().abs().flatten(0, -2).amax(0)
        peaks[name] = peak if name not in peaks else torch.maximum(peaks[name], peak)
    return hook


class SimulatedInt8(nn.Module):
    """A float linear layer computing as Int8Linear does, nearly: each input row quantized
    on its own (about 255 steps over its range), each weight row symmetric int8."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        step = (weight.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
        self.weight = torch.round(weight / step) * step
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        peak = x.abs().amax(-1, keepdim=True).clamp(min=1e-12)
        return nn.functional.linear(torch.round(x / peak * 127.5) / 127.5 * peak, self.weight, self.bias)


def simulated(block: nn.Module, peaks: dict, cfg, alpha: float | None) -> nn.Module:
    """A copy of a float block smoothed by `alpha`, its linears simulating int8."""
    candidate = copy.deepcopy(block)
    with torch.no_grad():
        smooth_block(candidate, peaks, cfg, alpha)
    for name, module in list(candidate.named_modules()):
        if type(module) is nn.Linear:
            parent, _, leaf = name.rpartition(".")
            setattr(candidate.get_submodule(parent), leaf, SimulatedInt8(module.weight, module.bias))
    return candidate


def smooth_block(block: nn.Module, peaks: dict, cfg, alpha: float | None) -> None:
    """Smooth the four linears of a fused block in place by `alpha` (None: leave them);
    `peaks` maps each linear's name to the peak of each of its input channels."""
    if alpha is None:
        return
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
