"""Gemma 3's text decoder on the built-in decoder's cache, attention and protocol.

Gemma 3 is the decoder of `decoder_only.py` with these differences, all kept here:

- RMSNorm computed in float32 and scaled by (1 + w), then cast back; four norms per
  block (before and after attention, before and after the MLP) and one over each query
  and key head (q_norm, k_norm) before the rotary embedding;
- a GeGLU MLP (tanh-approximated GELU), attention scores scaled by
  query_pre_attn_scalar ** -0.5, heads whose width is not hidden_size / num_heads;
- input embeddings multiplied by sqrt(hidden_size), rounded to the embeddings' dtype;
- two kinds of layer: sliding-window layers, whose query at position p sees only keys at
  positions > p - sliding_window, with rotary base sliding_rope_theta, and full layers
  with rope_theta. Each kind gets its own mask and rotary table in `apply_layers`.

The cache stays the decoder's (every slot of every layer kept, masked by position), so
rollback, rows and trees work unchanged, and in float32 (the int8 model's activations)
`cached_attention` gives each token the bits it gets alone. The (1 + w) of the norms is
folded into the stored weight when a checkpoint is read (`checkpoint_offset`) and kept in
float32 in every dtype (`keep_float32`), as transformers computes (1.0 + w.float()) in
float32 too. On CPUs the norms run compiled (`use_compiled_blocks`): the same formula, the
sum of squares in another order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import KEY_BLOCK, KVState, rope_table, rotate
from .decoder_only import MLP, Attention, DecoderOnlyConfig, DecoderOnlyLM, last_outputs
from .int8_kernel import compiled_ops

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' default layer pattern: five sliding layers, then a full one.
SLIDING_PATTERN = 6
# Positions per block of a rotary table. Tables grow by whole blocks, each computed by a call
# of its own shape, so a position's bits never depend on how far a table has grown, and a
# table need not span max_seq_len (32k positions x 256 dimensions x 2 bases for the 270M).
ROPE_BLOCK = 1024


@dataclass
class Gemma3Config(DecoderOnlyConfig):
    # Width of each attention head (Gemma's is not hidden_size / num_heads).
    head_dim: int = 256
    # A sliding layer's query at position p sees the keys at positions > p - sliding_window.
    sliding_window: int = 512
    # SLIDING or FULL per layer; None = five sliding layers then one full, repeated.
    layer_types: list[str] | None = None
    # Rotary base of the sliding layers (rope_theta is the full layers').
    sliding_rope_theta: float = 10000.0
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5.
    query_pre_attn_scalar: float = 256.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, high in (("head_dim", 1 << 12), ("sliding_window", 1 << 20)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise ValueError(f"gemma3 option {name} must be an integer in 1..{high}, got {value!r}")
        if self.head_dim % 2:
            raise ValueError(f"gemma3 option head_dim must be even for rotary positions, got {self.head_dim}")
        for name in ("sliding_rope_theta", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"gemma3 option {name} must be a finite number > 0, got {value!r}")
        if self.attention_bias:
            raise ValueError("gemma3 option attention_bias must be false (biases on q, k, v and o are not built)")
        if self.layer_types is None:
            self.layer_types = [FULL if (i + 1) % SLIDING_PATTERN == 0 else SLIDING for i in range(self.num_layers)]
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {SLIDING, FULL}:
            raise ValueError(f"gemma3 option layer_types must hold {self.num_layers} entries, each {SLIDING!r} "
                             f"or {FULL!r}, got {self.layer_types!r}")


class GemmaRMSNorm(nn.Module):
    """RMSNorm in float32, times `weight`, cast back to the input's dtype. `weight` holds
    1 + the checkpoint's weight (its `checkpoint_offset`), in float32 in every dtype."""

    keep_float32 = True  # loaders and `to_dtype` leave the weight float32
    checkpoint_offset = 1.0  # checkpoints store weight - 1
    compiled = None  # the compiled block operations (`Gemma3LM.use_compiled_blocks`), or None: PyTorch's

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        differentiable = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if self.compiled is not None and not differentiable:  # one call for PyTorch's seven, in float32 too
            return self.compiled.block_rms_norm(x.float(), self.weight, self.eps, "auto").to(x.dtype)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight).to(x.dtype)


def compile_transformers_norms(model: nn.Module) -> int:
    """Swap transformers' Gemma 3 norms on the CPU in `model` for `GemmaRMSNorm`s over the same
    1 + w, compiled (`Gemma3LM.use_compiled_blocks`: their formula, one call instead of seven);
    how many (none where the compiled kernels do not build)."""
    norms = [(name, module) for name, module in model.named_modules()
             if type(module).__name__ == "Gemma3RMSNorm" and type(module).__module__.startswith("transformers.")
             and module.weight.device.type == "cpu"]
    if not norms or (ops := compiled_ops()) is None:
        return 0
    for name, module in norms:
        norm = GemmaRMSNorm(module.weight.shape[0], module.eps)
        norm.weight = nn.Parameter(1.0 + module.weight.detach().float(), requires_grad=False)
        norm.compiled = ops
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, norm)
    return len(norms)


class Gemma3Attention(Attention):
    """The decoder's attention with each query and key head normalized before its rotation."""

    def __init__(self, cfg: Gemma3Config):
        super().__init__(cfg)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.query_pre_attn_scalar ** -0.5

    def project(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor):
        """q (B, H, T, D), k and v (B, H_kv, T, D), q and k normalized, then rotated."""
        q, k, v = self.heads(x)
        return rotate(self.q_norm(q), cos, signed_sin), rotate(self.k_norm(k), cos, signed_sin), v


class Gemma3MLP(MLP):
    activation = staticmethod(functools.partial(F.gelu, approximate="tanh"))  # transformers' gelu_pytorch_tanh


class Gemma3Block(nn.Module):
    """Attention and MLP, each between a norm before it and a norm after it, then added."""

    mlp_norm = "pre_feedforward_layernorm"

    def __init__(self, cfg: Gemma3Config):
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Gemma3Attention(cfg)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Gemma3MLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache=None, outputs=True):
        """outputs=False: only this block's keys and values, written to the cache; None."""
        attended = self.self_attn(self.input_layernorm(x), cos, sin, cache, outputs)
        if attended is None:
            return None
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3LM(DecoderOnlyLM):
    """Gemma 3's text model, implementing the model protocol as DecoderOnlyLM does."""

    model_type = "gemma3"
    cfg: Gemma3Config

    def new_block(self, cfg: Gemma3Config, index: int) -> nn.Module:
        return Gemma3Block(cfg)

    def new_norm(self, cfg: Gemma3Config) -> nn.Module:
        return GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of activations and the cache: the embeddings' (float32 in an int8 model,
        whose embeddings are int8; the norms' weights are float32 in every dtype)."""
        weight = getattr(self.embed_tokens, "weight", None)
        return torch.float32 if weight is None else weight.dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input embeddings (B, T, H) times sqrt(hidden_size), that factor first rounded to
        float32 then to the embeddings' dtype as transformers rounds it (25.25 in bfloat16
        for the 270M's 640)."""
        x = self.embed_tokens(tokens)
        return x * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=torch.float32).to(x.device, x.dtype)

    def run_blocks(self, x: torch.Tensor, state: KVState | None = None, num_valid: list[int] | None = None,
                   positions: torch.Tensor | None = None, tree: torch.Tensor | None = None,
                   outputs: bool = True) -> torch.Tensor | None:
        """As DecoderOnlyLM's; without a state, whole sequences go through a cache of their own,
        whose masks give the sliding windows."""
        if state is None:
            state = self.new_state(x.shape[0], x.shape[1])
        return super().run_blocks(x, state, num_valid, positions, tree, outputs)

    def apply_layers(self, x: torch.Tensor, positions: torch.Tensor, needed: int, attend: tuple | None = None,
                     state: KVState | None = None, outputs: bool = True) -> torch.Tensor | None:
        """The blocks, each kind with its rotary base and mask: a sliding layer's query at
        position p sees only the keys in slots > p - sliding_window. A slot is its key's
        position for chains, so that is exact; in a token tree an ancestor's slot is at least
        its position, which is exact while the tree is shallower than the window.

        A sliding layer reads only the key blocks its queries can see, from the block of the
        earliest slot any of them sees: cached_attention gives a token the same bits however
        many leading blocks it skips, so this costs no exactness."""
        if attend is None:
            raise ValueError("Gemma 3 runs its blocks through a cache (run_blocks makes one)")
        write, span, mask = attend
        kinds = {}
        for kind in set(self.cfg.layer_types):
            if kind == SLIDING:
                earliest = int(positions.min()) - self.cfg.sliding_window + 1
                first = min(max(earliest, 0) // KEY_BLOCK * KEY_BLOCK, span - KEY_BLOCK)
                slots = torch.arange(first, span, device=x.device)
                window = slots[None, None, :] > positions[:, :, None] - self.cfg.sliding_window  # (B, T, span - first)
                seen = slice(first, span), mask[..., first:] & window
                kinds[kind] = self._rope(positions, needed, self.cfg.sliding_rope_theta), seen
            else:
                kinds[kind] = self._rope(positions, needed), (slice(0, span), mask)
        for index, (layer, kind, cache_k, cache_v) in enumerate(zip(self.layers, self.cfg.layer_types,
                                                                    *state.in_use())):
            (cos, sin), (slots, seen) = kinds[kind]
            x = layer(x, cos, sin, (write, cache_k, cache_v, slots, seen), last_outputs(self, index, outputs))
        return x

    def use_compiled_blocks(self, ops) -> bool:
        """The norms through the compiled block operations `ops` (csrc/block_ops.cpp), in every
        dtype on a CPU (they compute in float32 whatever the activations): six a block, each one
        call instead of seven (a tenth of a one-token forward of the 270M, 3-5% of a prompt's).
        Attention and the MLP stay PyTorch's: queries and keys are normalized, the gate is GELU."""
        if ops is None or self.device.type != "cpu":
            return False
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.compiled = ops
        return True

    def layer_rope(self, index: int, positions: torch.Tensor, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        sliding = self.cfg.layer_types[index] == SLIDING
        return self._rope(positions, needed, self.cfg.sliding_rope_theta if sliding else None)

    def _rope_table(self, theta: float, needed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The table of base `theta` over at least `needed` positions, grown by ROPE_BLOCKs."""
        table = self._rope_tables.get(theta)
        if table is not None and table[0].device != device:
            table = None
        have = 0 if table is None else table[0].shape[0]
        if have < needed:
            blocks = [rope_table(theta, self.cfg.head_dim, start, start + ROPE_BLOCK, device)
                      for start in range(have, needed, ROPE_BLOCK)]
            old = [] if table is None else [table]
            table = self._rope_tables[theta] = tuple(torch.cat(parts) for parts in zip(*old, *blocks))
        return table
