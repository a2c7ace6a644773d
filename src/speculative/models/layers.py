"""Layers the built-in decoders share: the RMS norm, and linear layers fused side by side."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    compiled = None  # the compiled block operations (`use_compiled_blocks`), or None: PyTorch's

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compiled is not None:
            return self.compiled.block_rms_norm(x, self.weight, self.eps, "auto")
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # the same bits, in one call
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def fused(*layers: nn.Linear) -> nn.Linear:
    """One linear layer computing `layers` side by side (their outputs concatenated)."""
    first = layers[0]
    bias = first.bias is not None
    out = sum(layer.out_features for layer in layers)
    layer = nn.Linear(first.in_features, out, bias=bias, device=first.weight.device, dtype=first.weight.dtype)
    if first.weight.is_meta:  # a skeleton (torch.cat on "meta" would import torch._dynamo: seconds)
        return layer
    layer.weight = nn.Parameter(torch.cat([part.weight.detach() for part in layers]), requires_grad=False)
    if bias:
        layer.bias = nn.Parameter(torch.cat([part.bias.detach() for part in layers]), requires_grad=False)
    return layer


# Fused layers (`DecoderOnlyLM.fuse`) and the layers they are made of.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
