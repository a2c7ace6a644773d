"""The precision a model runs in: `auto` picks what this device runs fast, and says why.

Weights and activations take the execution dtype; logits leave every model as float32, so
verification, sampling and the acceptance ratio p/q never see rounded probabilities.

`int8` is a model of its own (`models/int8.py`): int8 weights, each token's activations
quantized on their own, float32 for the rest. Its forward reads a quarter of float32's
bytes and half of bfloat16's, and it is width-invariant: a verify forward gives each
token the bits of a one-token forward, so speculative output is exactly the int8 model's
own. Where int8 products run fast (`int8_runs_fast`: CPUs whose cores multiply 8-bit integers
natively, VNNI, and AVX2 CPUs on this project's compiled kernel), `auto` picks it for models
of INT8_MIN_WEIGHTS weights or more: decoding reads weights, and int8 reads half of
bfloat16's bytes and a quarter of float32's. On a Zen 4 EPYC (AVX512-BF16 and VNNI, no AMX)
Qwen2.5-Coder 1.5B decoded 2.2x faster in int8 than in packed bfloat16, Gemma 3 270M 1.5x
(BENCHMARKS.md, llama-cpp); on an Intel Xeon with AMX a one-token forward took 108 ms in int8
against 312 ms in bfloat16 on its matrix units (Qwen 1.5B), 26 against 42 ms (Gemma 3 270M);
on an AVX2-only Zen 3 EPYC, Qwen 1.5B decoded at 9-16 tokens/s in int8 against 3.6-3.8 in
float32 (issue 58). Without the compiled kernel an AVX2 CPU would run fbgemm with 7-bit
activations (`kernels.reduce_range`), so `auto` keeps float32 there. Where it would pick int8 for a preset made from a GGUF file
that is mostly Q4_K/Q6_K, `load_model` runs the file's own blocks instead, unless int8 runs
on AMX tiles, which verify wide drafts and read prompts faster (`kquant.auto_reason`).

On CPUs, bfloat16 pays where the CPU multiplies it natively (AVX512-BF16 or AMX on x86,
the BF16 extension on Arm) and its linear layers are prepacked for oneDNN (kernels.py): a
forward then reads half the bytes and a verify forward of a few tokens costs about one
single-token forward. (Unpacked, on a Zen 4 EPYC with AVX512-BF16 and no AMX, bfloat16
decoded Gemma 3 270M 15% slower than float32; packed, 1.5x faster.) Without native
bfloat16 it is converted in software and float32 is faster, so `auto` chooses float32. On
CUDA, bfloat16 where the GPU supports it, else float16.
"""

from __future__ import annotations

import math
import platform

import torch

from . import isa

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# int8 linear layers and embeddings, float32 for the rest (`models/int8.py`).
INT8 = "int8"
# A GGUF preset's own Q4_K and Q6_K blocks, int8 for other layers, float32 else (`models/kquant.py`).
GGUF = "gguf"
CHOICES = ("auto", INT8, GGUF, *DTYPES)


def cpu_features() -> frozenset[str]:
    """The CPU's feature flags, as a CPU of SPECULATIVE_ISA's class would show them (`isa.py`)."""
    return isa.visible_flags()


def cpu_has_fast(dtype: torch.dtype, features: frozenset[str] | None = None) -> bool:
    """Whether the CPU has native arithmetic for this 16-bit dtype."""
    features = cpu_features() if features is None else features
    wanted = {torch.bfloat16: {"avx512_bf16", "amx_bf16", "bf16"},
              torch.float16: {"avx512_fp16", "amx_fp16", "fphp", "asimdhp"}}.get(dtype, set())
    return bool(wanted & features)


# Weights below which `auto` keeps float32 on CPUs: a forward that small is bound by
# per-operation overhead, not by reading weights, so 16 bits would gain nothing.
SMALL_FOR_16_BITS = 100_000_000
# Weights from which `auto` picks int8 where it runs fast: as for 16 bits, smaller models are
# bound by per-operation overhead. With smoothing (models/smoothing.py), int8 perplexity is
# within 1% of bfloat16's for Gemma 3 270M and Qwen2.5-Coder 0.5B (BENCHMARKS.md, int8
# quality), and Gemma 3 270M decodes about 1.5x faster in int8 than in bfloat16 on a Zen 4.
INT8_MIN_WEIGHTS = SMALL_FOR_16_BITS


def int8_runs_fast(features: frozenset[str] | None = None) -> bool:
    """Whether int8 products run fast here: the CPU multiplies 8-bit integers natively (VNNI;
    with AMX too, whose bfloat16 units do not make up for reading twice int8's bytes), or it
    has AVX2 and this project's compiled kernel builds (its AVX2 path reads each weight once for
    up to 8 tokens, as VNNI's does)."""
    features = cpu_features() if features is None else features
    if {"avx512_vnni", "avx_vnni"} & features:
        return True
    from .int8_kernel import compiled_ops

    return "avx2" in features and compiled_ops() is not None


def int8_units(features: frozenset[str] | None = None) -> str:
    """What runs int8 products here, in words."""
    features = cpu_features() if features is None else features
    if "amx_int8" in features:
        return "natively, on VNNI and AMX tiles"
    if {"avx512_vnni", "avx_vnni"} & features:
        return "natively (VNNI)"
    return "fast on AVX2 with this project's kernel"


def resolve_precision(dtype, device="cpu", features: frozenset[str] | None = None,
                      weights: int | None = None, int8_runs: bool = True) -> tuple[bool, torch.dtype, str]:
    """(int8 or not, the torch dtype of activations, the reason) for a name in CHOICES or a
    torch dtype. `int8_runs`: whether this build and device run int8 layers (fbgemm)."""
    device = torch.device(device)
    if dtype == INT8:
        if not int8_runs:
            raise ValueError(f"int8 needs PyTorch's fbgemm engine on a CPU; not available on {device}: use auto, "
                             "float32 or bfloat16")
        return True, torch.float32, "int8, as asked (int8 weights, each token's activations in int8, float32 else)"
    if (dtype == "auto" and device.type == "cpu" and int8_runs and (weights is None or weights >= INT8_MIN_WEIGHTS)
            and int8_runs_fast(features)):
        machine = platform.machine() or "this CPU"
        return True, torch.float32, (f"auto: int8, since this CPU ({machine}) multiplies 8-bit integers "
                                     f"{int8_units(features)}: a forward reads half of bfloat16's bytes and a "
                                     "quarter of float32's")
    return (False, *resolve_dtype(dtype, device, features, weights))


def resolve_dtype(dtype, device="cpu", features: frozenset[str] | None = None,
                  weights: int | None = None) -> tuple[torch.dtype, str]:
    """(torch dtype, the reason for it) for a name in CHOICES but int8 and gguf, or a torch.dtype;
    `weights` (the model's matrix weights, when known) keeps small models in float32 on CPUs.

    Raises ValueError for other dtypes, and for float16 on a CPU without native float16
    arithmetic (it would run emulated, slower than float32)."""
    device = torch.device(device)
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; allowed: {', '.join(CHOICES)}")
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str) and dtype in CHOICES and dtype not in (INT8, GGUF):
        name = dtype
    else:
        raise ValueError(f"dtype {dtype!r} is not supported; allowed: {', '.join(CHOICES)}")
    cpu = device.type == "cpu"
    machine = platform.machine() or "this CPU"
    if name != "auto":
        chosen = DTYPES[name]
        if cpu and chosen == torch.float16 and not cpu_has_fast(torch.float16, features):
            raise ValueError(f"float16 on this CPU ({machine}, no native float16 arithmetic such as AVX512-FP16) "
                             "would be emulated and slower than float32; use --dtype bfloat16 or float32")
        note = "" if not cpu or chosen == torch.float32 or cpu_has_fast(chosen, features) else \
            " (this CPU has no native bfloat16 arithmetic: expect it to be slower than float32)"
        return chosen, f"{name}, as asked{note}"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: bfloat16, which this GPU supports"
        return torch.float16, "auto: float16 (this GPU has no bfloat16)"
    if cpu and weights is not None and weights < SMALL_FOR_16_BITS:
        return torch.float32, (f"auto: float32, since a model of {weights / 1e6:.1f}M weights is too small for "
                               "16 bits to pay on a CPU")
    if cpu and cpu_has_fast(torch.bfloat16, features):
        return torch.bfloat16, f"auto: bfloat16, since this CPU ({machine}) multiplies bfloat16 natively"
    if cpu:
        return torch.float32, (f"auto: float32, since this CPU ({machine}) has no native bfloat16 arithmetic "
                               "(AVX512-BF16, AMX or Arm BF16)")
    return torch.float32, f"auto: float32 on {device.type}"


def tie_tolerance(top: float, dtype: torch.dtype, ulps: int = 4) -> float:
    """How close two logits near `top` may be and still swap order between forwards of
    different widths (different kernels round differently): `ulps` units in the last
    place of `dtype` at that magnitude."""
    magnitude = 2.0 ** math.floor(math.log2(abs(top))) if top else torch.finfo(dtype).tiny
    return ulps * torch.finfo(dtype).eps * magnitude


def model_dtype(model) -> torch.dtype:
    """The dtype a model's weights (and so its activations) are in."""
    return getattr(model, "dtype", None) or next(model.parameters()).dtype


def first_divergence(model, prompt: list[int], reference: list[int], output: list[int], ulps: int = 4):
    """Where greedy `output` leaves the autoregressive `reference` of the same model: None
    when identical, else (position, gap between the reference's top two logits there, the
    tolerance for the model's dtype). A divergence at a gap within tolerance is a near-tie
    that the rounding of a wider forward can flip; anything else is a bug."""
    if output == reference:
        return None
    at = next((i for i, (a, b) in enumerate(zip(reference, output)) if a != b), min(len(reference), len(output)))
    sequence = prompt + reference[:at]
    with torch.inference_mode():  # as the reference ran: the prompt in one forward, then a token per forward
        state = model.new_state(1, len(sequence) + 1)
        if len(prompt) > 1:
            model.forward(torch.tensor([prompt[:-1]], device=model.device), state, keep_logits=False)
        for token in sequence[len(prompt) - 1:]:
            logits = model.forward(torch.tensor([[token]], device=model.device), state)
    top = logits[0, -1].float().topk(2).values
    return at, float(top[0] - top[1]), tie_tolerance(float(top[0]), model_dtype(model), ulps)
