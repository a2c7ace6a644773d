"""Faster linear layers for inference on CPUs: oneDNN float32 or bfloat16 with prepacked
weights, and int8 for drafts.

PyTorch runs a float32 `nn.Linear` on the CPU through MKL's GEMM. For one row (a
one-token forward) that is a fast matrix-vector product, but for a few rows (a verify
forward of K+1 tokens) MKL can be several times slower per forward than for one row: on
this project's AMD CPUs a 5-row product took 3-11x the time of a 1-row one, far from the
cost of reading the weights once. oneDNN, which PyTorch ships and uses for bfloat16,
runs the same float32 product from weights reordered once into its blocked layout at
1.0-1.5x the one-row time, and the one-row product itself faster than MKL. That is what
makes a verify forward nearly as cheap as a one-token forward, the premise of
speculative decoding.

`pack_linears` swaps every float32 `nn.Linear` of a model for a `PackedLinear` (same
results up to float rounding; widths 1 and K+1 then run the same library). bfloat16 layers
are packed too where oneDNN runs bfloat16 (the CPU multiplies it natively): unpacked, each
call reorders the weights again. On a Zen 4 EPYC (AVX512-BF16, no AMX) Gemma 3 270M's
output layer took 16 ms packed against 26 ms unpacked for one row (float32 packed: 25-30),
with the same results. The packed weight is in oneDNN's private layout: a packed model is
for inference, not for saving or training (load it unpacked for that:
`load_model(..., pack=False)`).

`quantize_linears` makes a draft cheap instead: int8 weights (per output channel) and
int8 activations quantized on the fly (fbgemm's dynamic quantized linear). A forward
reads a quarter of float32's bytes; on this project's CPU the Qwen2.5-Coder 0.5B draft's
layers ran about 6x faster. The rounding changes the draft's proposals, never the output:
only the target decides what is kept. Not for targets, whose output it would change.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn


class PackedLinear(nn.Module):
    """y = x W^T + b with W reordered once for oneDNN."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, None), persistent=False)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)
        # The plain weight too, for an output layer a reduced draft vocabulary takes rows from.
        self.weight = linear.weight if keep_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packing_available(dtype: torch.dtype, device) -> bool:
    """Whether this build and CPU run packed oneDNN linears of this dtype (float32, or
    bfloat16 where oneDNN has native bfloat16 kernels; CPU only)."""
    if torch.device(device).type != "cpu" or dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        probe = nn.Linear(8, 4).to(dtype)
        x = torch.ones(2, 8, dtype=dtype)
        return torch.allclose(PackedLinear(probe)(x).float(), probe(x).float(), atol=1e-2)
    except (RuntimeError, AttributeError):
        return False


def pack_linears(model: nn.Module, keep_weight: nn.Module | None = None) -> int:
    """Replace the float32 and bfloat16 CPU nn.Linear layers of `model` by PackedLinear;
    returns how many. The layer `keep_weight` (the output layer) keeps its plain weight as well."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype in PACKED_DTYPES and child.weight.device.type == "cpu":
                setattr(parent, name, PackedLinear(child, keep_weight=child is keep_weight))
                count += 1
    return count


class Int8Linear(nn.Module):
    """y ~ x W^T + b with W in int8 per output channel, x quantized per call (fbgemm)."""

    def __init__(self, linear: nn.Module, weight: torch.Tensor | None = None):
        super().__init__()
        weight = (linear.weight if weight is None else weight).detach().float()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        scale = (weight.abs().amax(1) / 127).clamp(min=1e-12).double()
        bias = getattr(linear, "bias", None)
        with warnings.catch_warnings():  # quantized tensors are deprecated in favour of torchao
            warnings.simplefilter("ignore")
            quantized = torch.quantize_per_channel(weight, scale, torch.zeros_like(scale, dtype=torch.long), 0,
                                                   torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(quantized, None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x.float(), self.packed, True)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def int8_available(device) -> bool:
    """Whether this build runs int8 dynamic linears (CPUs with fbgemm / x86 engines)."""
    if torch.device(device).type != "cpu" or "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        probe = nn.Linear(8, 4)
        return Int8Linear(probe)(torch.ones(2, 8)).shape == (2, 4)
    except (RuntimeError, AttributeError):
        return False


def quantize_linears(model: nn.Module, keep_weight: nn.Module | None = None) -> int:
    """Replace the float nn.Linear layers of `model` by Int8Linear; returns how many.
    The layer `keep_weight` (the output layer) keeps its float weight as well."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                layer = Int8Linear(child)
                layer.weight = child.weight if child is keep_weight else None
                setattr(parent, name, layer)
                count += 1
    return count
