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

import functools
import platform
import warnings
from types import SimpleNamespace

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
    """y ~ x W^T + b with W in int8 per output channel and each row of x quantized to int8
    on its own, so that a row's result never depends on the other rows of the call:
    width-invariant, bit for bit (tests/test_int8.py). Per-token activation scales with
    per-channel weight scales: the W8A8 scheme of SmoothQuant.

    Two kernels, one per process (`int8_kernel.compiled_ops`): our compiled one
    (`csrc/int8_matmul.cpp`: rows quantized symmetrically, absolute maximum at 127), or, where
    it cannot be built, fbgemm's dynamic quantized linear. fbgemm quantizes the whole input
    with one scale and zero point, so each row is divided by its absolute maximum (it then
    spans at most [-1, 1]), two constant columns +1 and -1 with zero weights are appended
    (every call's input then spans exactly [-1, 1], so every call gets the same scale and
    zero point), and each output row is multiplied back by its maximum. Multiplying and
    adding are separate operations, as a fused multiply-add could round the vectorized
    elements and the remainder differently. The two kernels round differently: a model
    gives the same bits within a process, not across kernels.
    """

    def __init__(self, linear: nn.Module):
        super().__init__()
        self._pack(*quantize_rows(linear.weight.detach()), getattr(linear, "bias", None))

    @classmethod
    def from_int8(cls, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        """A layer from int8 weights (N, K) and their per-channel scales (N,) (a cache on disk)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._pack(qweight, scale, bias)
        return layer

    def _pack(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        from .int8_kernel import compiled_ops

        self.out_features, self.in_features = qweight.shape
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone(), persistent=False)
        ops = compiled_ops()
        self.kernel = "fbgemm" if ops is None else "compiled"
        self.isa = "auto"  # the compiled kernel's instruction set (models/isa.py): auto (the best allowed) or a level
        if ops is not None:  # a copy in the kernel's layout (so the weights may be a view of a file)
            self.packed, self.wsum = ops.int8_pack(qweight.to(torch.int8).cpu())
            self.wscale = torch.zeros(len(self.wsum))
            self.wscale[:self.out_features] = scale.float().cpu()
            return
        # The constant columns +1 and -1, then zeros to a multiple of 8 columns (fbgemm
        # runs some shapes with a ragged K several times slower), all with zero weights.
        extra = -(-(self.in_features + 2) // 8) * 8 - self.in_features
        self.packs = []  # by blocks of PACK_ROWS output rows: fbgemm packs large matrices slowly
        for start in range(0, self.out_features, PACK_ROWS):
            rows = qweight[start:start + PACK_ROWS].to(torch.int8)
            ends = torch.zeros(len(rows), extra, dtype=torch.int8)
            with warnings.catch_warnings():  # quantized tensors are deprecated in favour of torchao
                warnings.simplefilter("ignore")
                quantized = torch._make_per_channel_quantized_tensor(
                    torch.cat([rows.cpu(), ends], 1), scale[start:start + PACK_ROWS].double().cpu(),
                    torch.zeros(len(rows), dtype=torch.long), 0)
                self.packs.append(torch.ops.quantized.linear_prepack(quantized, None))
        self.register_buffer("ends", torch.tensor([1.0, -1.0] + [0.0] * (extra - 2)), persistent=False)
        self._reduce_range = reduce_range()

    @property
    def reduce_range(self) -> bool:
        """fbgemm's 7-bit activations: needed on CPUs without VNNI."""
        return self._reduce_range

    @reduce_range.setter
    def reduce_range(self, value: bool) -> None:
        if not value and reduce_range():
            raise ValueError("fbgemm with 8-bit activations (reduce_range=False) would saturate on this CPU, which "
                             "has no VNNI (relative error 0.17 measured on an AVX2 EPYC); it keeps 7 bits here")
        self._reduce_range = bool(value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x if x.dtype == torch.float32 else x.float()
        if self.kernel == "compiled":
            return torch.ops.speculative_kernels.int8_linear(x, self.packed, self.wscale, self.wsum, self.bias,
                                                             self.out_features, self.isa)
        peak = x.abs().amax(-1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny)  # (..., 1)
        spanned = torch.cat([x / peak, self.ends.expand(*x.shape[:-1], -1)], -1)  # (..., K + extra), in [-1, 1]
        parts = [torch.ops.quantized.linear_dynamic(spanned, packed, self.reduce_range) for packed in self.packs]
        y = (parts[0] if len(parts) == 1 else torch.cat(parts, -1)).mul_(peak)
        return y if self.bias is None else y.add_(self.bias)

    def int8_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 weights (N, K), per-channel scales (N,)), as packed (to save, or to take rows from)."""
        if self.kernel == "compiled":
            groups, steps, rows, four = self.packed.shape
            unpacked = self.packed.permute(0, 2, 1, 3).reshape(groups * rows, steps * four)
            return (unpacked[:self.out_features, :self.in_features].contiguous(),
                    self.wscale[:self.out_features].clone())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parts = [torch.ops.quantized.linear_unpack(packed)[0] for packed in self.packs]
        return (torch.cat([part.int_repr()[:, :self.in_features] for part in parts]),
                torch.cat([part.q_per_channel_scales().float() for part in parts]))

    def select_rows(self, token_ids: torch.Tensor) -> "Int8Linear":
        """The layer over output rows `token_ids` only (a reduced draft vocabulary), as quantized."""
        qweight, scale = self.int8_weights()
        ids = token_ids.cpu()
        return Int8Linear.from_int8(qweight[ids], scale[ids], None if self.bias is None else self.bias[ids])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 ({self.kernel})"


class Int8Embedding(nn.Module):
    """An embedding table in int8 with a scale per row (a quarter of float32's bytes): the
    input embeddings of an int8 model, whose output layer holds its own int8 copy."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None = None):
        super().__init__()
        if scale is None:  # from float rows
            weight, scale = quantize_rows(weight.detach())
        self.register_buffer("qweight", weight.to(torch.int8))
        self.register_buffer("scale", scale.float())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.qweight[tokens].float().mul_(self.scale[tokens, None])


def quantize_rows(weight: torch.Tensor, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 rows, a float32 scale per row) for a float matrix: symmetric, the row's absolute
    maximum at 127. By chunks of rows, so that a large matrix (an output layer of 150k
    rows) needs no float temporaries of its own size."""
    qweight = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], chunk):
        rows = weight[start:start + chunk].to(torch.float32, copy=True)  # divided in place below
        step = (rows.abs().amax(1) / 127).clamp_(min=1e-12)
        qweight[start:start + chunk] = rows.div_(step[:, None]).round_().clamp_(-127, 127)
        scale[start:start + chunk] = step
    return qweight, scale


# Output rows per fbgemm matrix: packing a 150k-row output layer whole took 3.8 s, in
# blocks of 19k rows 1.4 s; the blocks' outputs are concatenated.
PACK_ROWS = 32768


@functools.lru_cache(maxsize=1)
def reduce_range() -> bool:
    """Whether fbgemm's int8 activations keep 7 bits: on x86 CPUs without VNNI, whose multiply-add
    of 8-bit pairs saturates at 16 bits (fbgemm's own advice); with VNNI all 8 bits are exact.
    From the CPU's own flags: fbgemm chooses its code from the CPU, whatever SPECULATIVE_ISA says."""
    from .isa import cpu_flags

    return platform.machine().lower() in ("x86_64", "amd64") and not {"avx512_vnni", "avx_vnni"} & cpu_flags()


def int8_available(device) -> bool:
    """Whether this build runs int8 dynamic linears (CPUs with fbgemm / x86 engines). With
    SPECULATIVE_INT8_KERNEL=compiled, a kernel that does not build raises its own error here
    (the compiler's message), not a word about fbgemm."""
    from .int8_kernel import compiled_ops, kernel_choice

    if torch.device(device).type != "cpu" or "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    if kernel_choice() == "compiled":
        compiled_ops()
    try:
        probe = nn.Linear(8, 4)
        return Int8Linear(probe)(torch.ones(2, 8)).shape == (2, 4)
    except (RuntimeError, AttributeError):
        return False


def quantize_linears(model: nn.Module) -> int:
    """Replace the float linear layers of `model` by Int8Linear (nn.Linear, and transformers'
    Conv1D, which keeps its weight transposed); returns how many. (A reduced draft
    vocabulary takes its rows from the int8 output layer: `select_rows`.)"""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, Int8Linear(child))
            elif type(child).__name__ == "Conv1D" and getattr(child, "weight", None) is not None:
                setattr(parent, name, Int8Linear(SimpleNamespace(weight=child.weight.t(), bias=child.bias)))
            else:
                continue
            count += 1
    return count
