"""A Llama-style decoder-only transformer with a preallocated, position-indexed KV cache.

The block is Llama's (RMSNorm, rotary positions, SwiGLU MLP, no biases) and the
parameter names are Llama's, so the weights export to transformers' Llama format as they
are. The cache (gpt-fast style) is indexed by position, one length per row: rolling back
is moving the length; entries past it are masked and later overwritten.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch import nn

from .attention import (KVState, SlotWrite, cached_attention, fused_attention, key_slots, rope_table, rotate, tree_mask,
                        whole_blocks)
from .base import OutputHead, check_lengths, output, valid_counts
from .decoder_config import DecoderOnlyConfig
from .layers import RMSNorm, fused


class Attention(nn.Module):
    compiled = None  # the compiled block operations (`use_compiled_blocks`), or None: PyTorch's

    def __init__(self, cfg: DecoderOnlyConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.qkv_proj: nn.Module | None = None  # q, k and v in one product (`fuse`)
        self.scale: float | None = None  # scales the attention scores; None = 1/sqrt(head_dim)

    def fuse(self) -> None:
        """One product for q, k and v (one call, one read of the input): for inference only."""
        self.qkv_proj = fused(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, T, D), k and v (B, H_kv, T, D) of inputs x (B, T, hidden), not rotated."""
        batch, width, _ = x.shape
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is None:
            return (self.q_proj(x).view(batch, width, heads, dim).transpose(1, 2),
                    self.k_proj(x).view(batch, width, kv_heads, dim).transpose(1, 2),
                    self.v_proj(x).view(batch, width, kv_heads, dim).transpose(1, 2))
        qkv = self.qkv_proj(x).view(batch, width, heads + 2 * kv_heads, dim).transpose(1, 2)
        return qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]

    def project(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor):
        """q (B, H, T, D), k and v (B, H_kv, T, D), with q and k rotated: fused, in one pass
        (a small model's forward is bound by the number of operations)."""
        if self.qkv_proj is None:
            q, k, v = self.heads(x)
            return rotate(q, cos, signed_sin), rotate(k, cos, signed_sin), v
        batch, width, _ = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(batch, width, heads + 2 * kv_heads, self.head_dim).transpose(1, 2)
        qk = rotate(qkv[:, :heads + kv_heads], cos, signed_sin)
        return qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]

    def forward(self, x, cos, sin, cache=None, outputs=True):
        """cache = (write, cache_k, cache_v, slots, mask) during generation; None scores a whole
        sequence with plain causal attention (training). outputs=False only writes the keys and
        values to the cache and returns None (the last layer of a prompt that needs no logits).

        With a cache, the queries attend over the slots of the slice `slots` (whole
        KEY_BLOCKs), as `mask` (B, T, those slots) allows: in float32 by `cached_attention`, which gives every
        token the bits it gets in a forward of its own; in 16 bits by PyTorch's fused kernel
        (`fused_attention`);
        in an int8 or k-quant model by one compiled call (`use_compiled_blocks`)."""
        batch, width, _ = x.shape
        if cache is not None and self.compiled is not None:  # rotation, cache write and attention in one call
            write, cache_k, cache_v, _, mask = cache
            scale = self.head_dim ** -0.5 if self.scale is None else self.scale
            out = self.compiled.block_attention(self.qkv_proj(x), cos, sin, cache_k, cache_v, write.targets, mask,
                                                self.num_heads, self.num_kv_heads, scale, "auto")
            return self.o_proj(out) if outputs else None
        q, k, v = self.project(x, cos, sin)
        if cache is None:
            gqa = self.num_kv_heads != self.num_heads
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=self.scale)
        else:
            write, cache_k, cache_v, slots, mask = cache
            write(cache_k, k)
            write(cache_v, v)
            if not outputs:
                return None
            if q.dtype == torch.float32:
                out = cached_attention(q, cache_k[:, :, slots], cache_v[:, :, slots], mask, self.scale)
            else:
                out = fused_attention(q, cache_k[:, :, slots], cache_v[:, :, slots], mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(batch, width, -1))


class MLP(nn.Module):
    # The gate's activation (SwiGLU's; a subclass may change it: Gemma 3's GeGLU).
    activation = staticmethod(F.silu)
    compiled = None  # the compiled block operations for SwiGLU (`use_compiled_blocks`), or None

    def __init__(self, cfg: DecoderOnlyConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate and up in one product (`fuse`)

    def fuse(self) -> None:
        """One product for gate and up: for inference only."""
        self.gate_up_proj = fused(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x):
        if self.gate_up_proj is None:
            return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))
        if self.compiled is not None:  # silu(gate) * up in one pass over the product
            return self.down_proj(self.compiled.block_silu_mul(self.gate_up_proj(x), "auto"))
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(self.activation(gate) * up)


class Block(nn.Module):
    mlp_norm = "post_attention_layernorm"  # the norm whose output the MLP reads

    def __init__(self, cfg: DecoderOnlyConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache=None, outputs=True):
        """outputs=False: only this block's keys and values, written to the cache; None."""
        attended = self.self_attn(self.input_layernorm(x), cos, sin, cache, outputs)
        if attended is None:
            return None
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x))


def last_outputs(model: nn.Module, index: int, outputs: bool) -> bool:
    """Whether block `index` must compute its outputs: every block but the last always does;
    the last only when the forward's outputs are wanted (else it writes the cache alone)."""
    return outputs or index < len(model.layers) - 1


class DecoderOnlyLM(nn.Module):
    """Causal LM implementing the model protocol of `speculative.models.base`."""

    model_type = "decoder_only"
    screens_argmax = True  # forward takes argmax_rows (models/base.py)

    def __init__(self, cfg: DecoderOnlyConfig):
        super().__init__()
        self.cfg = cfg
        if torch.empty(0).is_meta:  # a skeleton (under a device context, normal_ imports torch._dynamo: seconds)
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size,
                                                                                                 cfg.hidden_size))
        else:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            nn.init.normal_(self.embed_tokens.weight, std=0.02)  # small, so blocks shape the output
        self.layers = nn.ModuleList(self.new_block(cfg, index) for index in range(cfg.num_layers))
        self.norm = self.new_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._rope_tables: dict[float, tuple[torch.Tensor, torch.Tensor]] = {}  # rotary base -> (cos, sin)

    # --- parts (a subclass with other blocks overrides these: Gemma 3) ---------------------
    def new_block(self, cfg: DecoderOnlyConfig, index: int) -> nn.Module:
        """Block number `index`."""
        return Block(cfg)

    def new_norm(self, cfg: DecoderOnlyConfig) -> nn.Module:
        """The final norm."""
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    # --- protocol attributes -------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.cfg.max_seq_len

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of activations and the cache (float32 in an int8 model)."""
        return self.norm.weight.dtype

    def options(self) -> dict:
        """The JSON-able options that rebuild this model (saved beside the weights)."""
        return asdict(self.cfg)

    # --- state ---------------------------------------------------------------------------
    def new_state(self, batch_size: int, capacity: int) -> KVState:
        cfg, dtype, device = self.cfg, self.dtype, self.device
        shape = (batch_size, cfg.num_kv_heads, key_slots(capacity), cfg.head_dim)
        return KVState([torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers],
                       [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers], capacity)

    def rollback(self, state: KVState, lengths: list[int]) -> None:
        check_lengths(lengths, state.lengths)
        state.lengths = list(lengths)

    @torch.inference_mode()  # the buffers are updated in place, and usually made in inference mode
    def select_rows(self, state: KVState, rows: list[int]) -> None:
        # Only rows that change place are copied, and only their used slots.
        moves = [(i, r) for i, r in enumerate(rows) if i != r]
        if moves:
            dst = torch.tensor([i for i, _ in moves], device=self.device)
            src = torch.tensor([r for _, r in moves], device=self.device)
            used = max(state.lengths[r] for _, r in moves)
            for buffer in state.keys + state.values:
                buffer[dst, :, :used] = buffer[src, :, :used]
        state.lengths = [state.lengths[r] for r in rows]

    @torch.inference_mode()
    def add_rows(self, state: KVState, new: KVState, capacity: int) -> None:
        batch, joining = len(state.lengths), len(new.lengths)
        rows, room = state.keys[0].shape[0], max(capacity, state.capacity)
        if batch + joining > rows or room > state.capacity:  # rare: the batch or the longest request grew
            grown = self.new_state(max(rows, batch + joining), room)
            used = max(state.lengths, default=0)
            for old, buffer in zip(state.keys + state.values, grown.keys + grown.values):
                buffer[:batch, :, :used] = old[:batch, :, :used]
            state.keys, state.values, state.capacity = grown.keys, grown.values, grown.capacity
        used = max(new.lengths, default=0)
        if used > state.capacity:
            raise ValueError(f"joining rows hold {used} positions; the cache holds {state.capacity}")
        for buffer, part in zip(state.keys + state.values, new.keys + new.values):
            buffer[batch:batch + joining, :, :used] = part[:joining, :, :used]
        state.lengths = state.lengths + list(new.lengths)

    # --- forward -------------------------------------------------------------------------
    def layer_rope(self, index: int, positions: torch.Tensor, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of layer `index` (one rotary base here; Gemma 3's differ by kind)."""
        return self._rope(positions, needed)

    def _rope(self, positions: torch.Tensor, needed: int, theta: float | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (B, 1, T, D) for positions (B, T) below `needed`, with rotary base `theta`
        (default: the config's), the sine's first half negated (`rotate`)."""
        table = self._rope_table(self.cfg.rope_theta if theta is None else theta, needed, positions.device)
        dtype = self.dtype
        cos, sin = (t[positions].to(dtype).unsqueeze(1) for t in table)
        return cos, sin

    def _rope_table(self, theta: float, needed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 table (`rope_table`) of base `theta` over at least `needed` positions,
        made once over max_seq_len (read once into a local: several threads may share the model)."""
        table = self._rope_tables.get(theta)
        if table is None or table[0].shape[0] < needed or table[0].device != device:
            table = self._rope_tables[theta] = rope_table(theta, self.cfg.head_dim, 0,
                                                          max(needed, self.cfg.max_seq_len), device)
        return table

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input embeddings (B, T, H) of tokens (what a draft head reads beside the features)."""
        return self.embed_tokens(tokens)

    def forward(self, tokens: torch.Tensor, state: KVState | None = None, num_valid: list[int] | None = None,
                keep_logits: bool = True, return_hidden: bool = False, positions: torch.Tensor | None = None,
                tree: torch.Tensor | None = None, argmax_rows: list[bool] | None = None):
        """Append tokens (B, T) to every row of `state`; returns float32 logits (B, T, V).

        Token i of row b goes to cache slot lengths[b] + i and sees the slots before it;
        `positions` (B, T) are the positions its rotary embedding encodes (default: its
        slot). Without a state, scores the tokens as whole sequences from position 0
        (training). keep_logits=False skips the output projection (prompts need no logits),
        and the last block's attention and MLP, whose results reach only that projection;
        return_hidden=True returns (logits or None, the final hidden states (B, T, H)).
        `tree` (B, T, W) bool, W >= T: which of the row's last W slots (this forward's T
        tokens, after the W - T slots fed just before them) each token sees (a token tree's
        ancestor mask, tree.py; a draft model expands its tree over several forwards); every
        token still sees its row's slots before those. `argmax_rows`: see `base.output`."""
        if state is None:
            return self.lm_head(self.run_blocks(self.embed(tokens)))
        hidden = self.run_blocks(self.embed(tokens), state, num_valid, positions, tree, keep_logits or return_hidden)
        if hidden is None:
            return None
        return output(self.lm_head, hidden, keep_logits, return_hidden, argmax_rows)

    def run_blocks(self, x: torch.Tensor, state: KVState | None = None, num_valid: list[int] | None = None,
                   positions: torch.Tensor | None = None, tree: torch.Tensor | None = None,
                   outputs: bool = True) -> torch.Tensor | None:
        """The blocks and the final norm over input vectors x (B, T, H), appended to `state` as
        `forward` appends tokens; without a state, whole sequences from position 0 (training).
        A draft head runs its own inputs (embeddings fused with features) through it.
        outputs=False: the cache only (the last block writes its keys and values; None)."""
        if state is None:
            positions = torch.arange(x.shape[1], device=x.device)[None]
            return self.norm(self.apply_layers(x, positions, x.shape[1]))
        batch, width = x.shape[:2]
        counts = valid_counts(num_valid, batch, width)
        starts = state.lengths
        keys = max(s + c for s, c in zip(starts, counts))  # slots holding valid tokens after this forward
        if keys > state.capacity:
            raise ValueError(f"KV cache holds {state.capacity} positions; this forward needs {keys}")
        device = x.device
        slots = torch.tensor(starts, device=device)[:, None] + torch.arange(width, device=device)  # (B, T)
        if positions is None:  # padding past a row's end may lie past the rotary table: give it a position inside
            positions, needed = slots.clamp(max=max(keys, 1) - 1), keys
        elif tuple(positions.shape) != (batch, width):
            raise ValueError(f"positions must have the shape of tokens {(batch, width)}, got {tuple(positions.shape)}")
        else:
            needed = int(positions.max()) + 1
        if min(starts) == max(starts) and starts[0] + width <= state.capacity:
            write = SlotWrite(slots, starts[0])
        else:
            padding = torch.arange(width, device=device)[None, :] >= torch.tensor(counts, device=device)[:, None]
            write = SlotWrite(slots.masked_fill(padding, state.capacity))  # padding goes to the scratch slot
        # A query in slot s sees the keys in slots <= s (stale entries lie beyond), read in whole blocks.
        span = min(whole_blocks(keys), state.keys[0].shape[2])
        if tree is None:
            mask = torch.arange(span, device=device)[None, None, :] <= slots[:, :, None]  # (B, T, span)
        else:
            mask = tree_mask(tree, torch.tensor(starts, device=device), span)
        x = self.apply_layers(x, positions, needed, (write, span, mask), state, outputs)
        state.lengths = [s + c for s, c in zip(starts, counts)]
        return None if x is None else self.norm(x)

    def apply_layers(self, x: torch.Tensor, positions: torch.Tensor, needed: int, attend: tuple | None = None,
                     state: KVState | None = None, outputs: bool = True) -> torch.Tensor | None:
        """The blocks over x (B, T, H) whose rotary positions are `positions` (B, T), all below
        `needed`; with attend = (write, span, mask) (`run_blocks`), through the cache of `state`,
        else with plain causal attention. A model whose layers differ in kind (Gemma 3's
        sliding windows) gives each kind its own table and mask here. outputs=False: the last
        block only writes its keys and values (`last_outputs`), and None comes back."""
        cos, sin = self._rope(positions, needed)
        if attend is None:
            for layer in self.layers:
                x = layer(x, cos, sin)
            return x
        write, span, mask = attend
        for index, (layer, cache_k, cache_v) in enumerate(zip(self.layers, *state.in_use())):
            x = layer(x, cos, sin, (write, cache_k, cache_v, slice(0, span), mask), last_outputs(self, index, outputs))
        return x

    @torch.inference_mode()
    def compact(self, state: KVState, starts: list[int], kept: list[list[int]]) -> None:
        """After a tree step: row b keeps the entries of slots starts[b] + kept[b][j], moved to
        slots starts[b] + j (their rotary positions already are those slots), and ends there."""
        for b, (start, keep) in enumerate(zip(starts, kept)):
            if keep != list(range(len(keep))):
                src = torch.tensor(keep, device=self.device) + start
                dst = torch.arange(start, start + len(keep), device=self.device)
                for buffer in state.keys + state.values:
                    buffer[b, :, dst] = buffer[b, :, src]
            state.lengths[b] = start + len(keep)

    def fuse(self) -> "DecoderOnlyLM":
        """q, k and v, and gate and up, each in one product: fewer, larger calls per block,
        with the same sums. For inference: a fused model cannot be saved or trained."""
        for layer in self.layers:
            if layer.self_attn.qkv_proj is None:
                layer.self_attn.fuse()
                layer.mlp.fuse()
        return self

    def use_compiled_blocks(self, ops) -> bool:
        """Norms, attention and SwiGLU through the compiled block operations `ops`
        (csrc/block_ops.cpp): one call each instead of dozens, width-invariant by construction.
        For a fused float32 model on a CPU (the int8 and k-quant models); False elsewhere."""
        if ops is None or self.device.type != "cpu" or self.dtype != torch.float32 \
                or any(layer.self_attn.qkv_proj is None for layer in self.layers):
            return False
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention)) or isinstance(module, MLP) and module.activation is F.silu:
                module.compiled = ops
        return True

    def output_head(self, token_ids: torch.Tensor | None = None) -> nn.Module:
        """hidden -> float32 logits, over `token_ids` only when given (a reduced draft vocabulary)."""
        return OutputHead(self.lm_head, token_ids)
