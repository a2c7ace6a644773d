"""Greedy rows' logits without most of a large output layer: an int8 screen, then exact scores.

A greedy row reads only the argmax of its logits. With a 262k-token vocabulary (Gemma 3) the
output layer is a third or more of a forward; an int8 copy of it is a quarter of a float32
layer's bytes (half of a bfloat16 one's) and runs on the width-invariant int8 kernel. Its
scores A_v are within a bound b_v of the exact ones, proven per token and row:

    w.h - A = (w - s q).h + s q.(h - x q_x)   (weights w = s q + e, activations h = x q_x + r)
    |w.h - A| <= |e|_2 |h|_2 + s |q|_2 |r|_2 + float rounding,

with |e|_2 and s|q|_2 computed once per vocabulary row, and r computed per hidden state as the
kernel quantizes it. The screen's best token u is scored exactly first; every token whose
exact score could reach u's (A_v + b_v reaches it, less a rounding margin) is a candidate: a
few to tens of them on Gemma 3's decoding (against hundreds to thousands with the screen's
own lower bound A_u - b_u as the floor: 4 ms of a verify step of 16 tokens). Candidates
are scored exactly, in float64 (the products are exact, the sum rounds at 1e-16), and
rounded to float32. Every other logit is -inf: the argmax, ties to the lowest token as
`argmax` breaks them, is that of the float32-rounded exact logits, the same at every width
and in every batch. A bfloat16 layer's greedy rows therefore read exact scores, not scores
rounded to bfloat16 (whose ties, a step of 0.0625 at a logit of 10, `argmax` would break to
the lowest token).

Only the argmax may be read from such logits (the engine asks for them on greedy rows only).
Screening r as well (a second int8 product) made the bound 3-4x tighter, and decoding 4% slower.
"""

from __future__ import annotations

import os
import weakref

import torch
from torch import nn

from .int8_kernel import compiled_ops
from .kernels import Int8Linear, PackedLinear

# Relative float rounding the bound allows for: the kernel's float epilogue (int32 sum to
# float, two products) and the float32 rounding of an exact score, each a few 2^-24.
ROUNDING = 2.0 ** -19
# Output layers from this many weights up are screened (Gemma 3's has 168M, Qwen2.5 0.5B's 136M).
MIN_WEIGHTS = 1 << 25
# Relative error of a float32 norm of a few thousand elements, with room to spare.
NORM_ROUNDING = 2.0 ** -12


# Rows screened at a time (a bfloat16 weight's made float32 for it: a few MB, not a copy).
SCREEN_CHUNK = 1 << 13


class ArgmaxScreen:
    """An output layer's weight (V, H) in float32 or bfloat16, kept as is, plus its int8 screen."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.dim() != 2:
            raise ValueError("ArgmaxScreen takes a float32 or bfloat16 (V, H) weight, "
                             f"got {weight.dtype} {tuple(weight.shape)}")
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().float()
        # Per vocabulary row: the int8 rows and their scales, |e|_2 (what int8 leaves of w)
        # and s |q|_2 (what multiplies the activations' residual), rounded up. bfloat16 rows
        # are exact in float32, so the bound holds for them as they are.
        self.ops = compiled_ops(required=True)
        parts = [self.ops.screen_weights(self.weight[start:start + SCREEN_CHUNK].float())
                 for start in range(0, len(self.weight), SCREEN_CHUNK)]
        qweight, scale, error, norm = (torch.cat(column) for column in zip(*parts))
        self.int8 = Int8Linear.from_int8(qweight, scale, self.bias)
        self.weight_error, self.weight_norm = error * (1 + NORM_ROUNDING), norm * (1 + NORM_ROUNDING)
        self.widest_error = float(self.weight_error.max()), float(self.weight_norm.max())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits (..., V) of hidden (..., H) in which only the argmax may be read."""
        flat = hidden.reshape(-1, hidden.shape[-1]).float().contiguous()
        screen = self.int8(flat)
        # With w = s q + e and h = x q_x + r: w.h - s q.(x q_x) = e.h + s q.r.
        norms = torch.stack([flat.double().norm(dim=-1), activation_residual(flat).norm(dim=-1)], 1)
        rows, tokens = self.ops.screen_candidates(screen, self.weight_error, self.weight_norm,
                                                  norms * (1 + NORM_ROUNDING), *self.widest_error, ROUNDING,
                                                  self.weight, flat, self.bias)
        scores = self.ops.exact_scores(self.weight, flat, rows, tokens, "auto")
        if self.bias is not None:
            scores = (scores.double() + self.bias[tokens].double()).float()
        out = torch.full((len(flat), len(self.weight)), float("-inf"))
        out[rows, tokens] = scores
        return out.reshape(*hidden.shape[:-1], -1)


def activation_residual(x: torch.Tensor) -> torch.Tensor:
    """h - x q_x in float64 for float32 rows x, quantized as the int8 kernel quantizes them
    (csrc/quantize.h: scale absmax / 127, q = nearbyint(h * (127 / absmax)) within +-127)."""
    peak = x.abs().amax(-1, keepdim=True)
    safe = torch.where(peak > 0, peak, torch.ones_like(peak))
    q = torch.round(x * (127.0 / safe)).clamp_(-127, 127)
    step = torch.where(peak > 0, peak / 127.0, torch.zeros_like(peak))
    return x.double() - q.double() * step.double()


def screen_pays(layer) -> bool:
    """Whether to screen an output layer: a plain linear one (h W^T + b) with a large float32
    or bfloat16 weight on a CPU where the compiled kernels run, unless SPECULATIVE_ARGMAX_SCREEN=0."""
    weight = getattr(layer, "weight", None)
    return (os.environ.get("SPECULATIVE_ARGMAX_SCREEN", "1") != "0" and type(layer) in (nn.Linear, PackedLinear)
            and isinstance(weight, torch.Tensor) and weight.dtype in (torch.float32, torch.bfloat16)
            and weight.device.type == "cpu" and weight.dim() == 2 and weight.numel() >= MIN_WEIGHTS
            and compiled_ops() is not None)


# Output layer -> its ArgmaxScreen, or None where one would not pay; made at load
# (`prepare_screen`) or else at the first forward with an argmax row (0.2-0.4 s for Gemma 3's).
_SCREENS: "weakref.WeakKeyDictionary[nn.Module, ArgmaxScreen | None]" = weakref.WeakKeyDictionary()


def prepare_screen(layer: nn.Module) -> bool:
    """Build the layer's screen now (at load), if it has none and one pays; whether it has one."""
    if layer not in _SCREENS:
        _SCREENS[layer] = ArgmaxScreen(layer.weight, getattr(layer, "bias", None)) if screen_pays(layer) else None
    return _SCREENS[layer] is not None


def screened_logits(layer: nn.Module, hidden: torch.Tensor, argmax_rows: list[bool], full=None) -> torch.Tensor:
    """Float32 logits (B, T, V) of the output layer `layer` over hidden (B, T, H): the rows of
    `argmax_rows` through its screen where one pays, the others by `full` (default: the layer)."""
    full = full or (lambda h: layer(h).float())
    if not any(argmax_rows) or not prepare_screen(layer):
        return full(hidden)
    screen = _SCREENS[layer]
    if all(argmax_rows):
        return screen.logits(hidden)
    screened = torch.tensor(list(argmax_rows), device=hidden.device)
    out = torch.empty(*hidden.shape[:-1], len(screen.weight), dtype=torch.float32, device=hidden.device)
    out[screened] = screen.logits(hidden[screened])
    out[~screened] = full(hidden[~screened]).float()
    return out
