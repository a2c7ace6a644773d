"""Attention over a position-indexed KV cache, the same bits at every width (float32).

The cache (`KVState`) holds each row's keys and values at their positions, in whole
KEY_BLOCKs of slots; `cached_attention` gives a token the bits that a forward of that token
alone gives, whatever else the forward holds and however many key blocks it reads (see its
docstring); `tree_mask` lets a token tree's nodes see their ancestors; rotary positions
come from float32 tables (`rope_table`) and `rotate`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Attention reads keys in spans of whole blocks of this many slots (see `Attention`).
KEY_BLOCK = 512


def whole_blocks(slots: int) -> int:
    """`slots` rounded up to whole KEY_BLOCKs."""
    return -(-slots // KEY_BLOCK) * KEY_BLOCK


def key_slots(capacity: int) -> int:
    """Slots of a cache for `capacity` positions: those, a scratch slot, rounded up to KEY_BLOCK."""
    return whole_blocks(capacity + 1)


class KVState:
    """Per-generation cache: keys and values per layer in buffers (R, H_kv, S, D) whose
    first B rows are in use, one length per row. R >= B: slots of rows that left are
    reused by rows that join, so a running batch does not reallocate or copy its cache.
    Slot `capacity` is scratch: padding tokens (past a row's num_valid) write there, so a
    row near its capacity can share a forward with rows that feed more tokens. S rounds
    capacity + 1 up to whole key blocks; the slots past a row's length are masked."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], capacity: int):
        self.keys = keys
        self.values = values
        self.capacity = capacity
        self.lengths = [0] * keys[0].shape[0]

    def in_use(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Views (B, H_kv, S, D) of the rows in use."""
        batch = len(self.lengths)
        return [k[:batch] for k in self.keys], [v[:batch] for v in self.values]


class SlotWrite:
    """Writes a forward's keys or values (B, H_kv, T, D) into a cache (B, H_kv, S, D): token t
    of row b to slot targets[b, t]; `first`: every row's tokens go to slots first.. (one slice)."""

    def __init__(self, targets: torch.Tensor, first: int | None = None):
        self.targets, self.first = targets, first
        self.rows = torch.arange(len(targets), device=targets.device)[:, None]

    def __call__(self, cache: torch.Tensor, new: torch.Tensor) -> None:
        if self.first is not None:
            cache[:, :, self.first:self.first + new.shape[2]] = new
        else:
            cache[self.rows, :, self.targets] = new.transpose(1, 2)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions: x cos + rotate_half(x) sin, with rotate_half(x) = (-x2, x1) taken
    as roll(x) = (x2, x1) times a sine whose first half is negated (the same bits)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * signed_sin

# Queries that `cached_attention` scores in one product (bounds its (B, H, T, S) scores).
QUERY_BLOCK = 256
# Fewest rows a product of `cached_attention` multiplies: BLAS libraries run products of a
# few rows through kernels of their own (rounding differently), so fewer are padded to it.
MIN_ROWS = 16


def cached_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """Attention (B, H, T, D) of queries q (B, H, T, D) over keys and values (B, H_kv, S, D)
    where mask (B, T, S) is True, as explicit products and a softmax over the slots.

    Width-invariant, bit for bit: a query's scores and output come out of products whose
    reductions (over D, then over S) run the same whatever the other rows of the call
    (at least MIN_ROWS of them), and slots it cannot see add exact zeros, so a verify
    forward gives each token what a forward of that token alone gives, provided S is the
    same or differs by whole key blocks at either end (tests/test_int8.py). PyTorch's fused kernel
    splits its work by the number of queries, so its rounding depends on the width.
    `scale` multiplies the queries (default 1/sqrt(D)).

    A forward of several blocks of queries (a prompt) scores each block over the key blocks
    its queries see, from the first to the last (`seen_blocks`): by the same property, the
    same bits as over all S, for half the work or less on a causal or sliding-window mask."""
    batch, heads, width, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    for start, block, block_keys, block_values, seen in query_blocks(q, keys, values, mask):
        rows = block.shape[2]
        grouped = (block * (dim ** -0.5 if scale is None else scale)).reshape(batch, kv_heads, group * rows, dim)
        padding = MIN_ROWS - group * rows
        if padding > 0:
            grouped = torch.cat([grouped, grouped.new_zeros(batch, kv_heads, padding, dim)], 2)
        scores = grouped @ block_keys.transpose(-1, -2)  # (B, H_kv, g*t + padding, S')
        hidden = ~seen[:, None, None]  # (B, 1, 1, t, S')
        scores[:, :, :group * rows].view(batch, kv_heads, group, rows, -1).masked_fill_(hidden, float("-inf"))
        mixed = blockwise_product(torch.softmax(scores, -1), block_values)  # (B, H_kv, g*t + padding, D)
        out[:, :, start:start + rows] = mixed[:, :, :group * rows].reshape(batch, heads, rows, dim)
    return out


def fused_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    scale: float | None = None) -> torch.Tensor:
    """`cached_attention`'s arguments through PyTorch's fused kernel (16-bit activations, whose
    rounding depends on the width anyway): a forward of several blocks of queries (a prompt)
    attends by blocks of QUERY_BLOCK queries, each over the key blocks it sees (`seen_blocks`).

    Up to one block (decoding, verifying), the queries of the heads that share a key/value head
    go in as rows of that one head, as in `cached_attention`: PyTorch's CPU kernel is slow on one
    query row a head (Gemma 3 270M, bfloat16, 1,024 slots, Zen 4: 1.28 ms a layer with
    `enable_gqa`, 0.17 ms as rows of one head)."""
    batch, heads, width, dim = q.shape
    kv_heads = keys.shape[1]
    if width <= QUERY_BLOCK:
        group = heads // kv_heads
        rows = q.reshape(batch, kv_heads, group * width, dim)
        # Row g * width + t is query t of the group's head g; at width 1 this is a view, no copy.
        seen = mask[:, None, None].expand(-1, -1, group, -1, -1).reshape(batch, 1, group * width, -1)
        return F.scaled_dot_product_attention(rows, keys, values, attn_mask=seen, scale=scale).reshape(
            batch, heads, width, -1)
    gqa = kv_heads != heads
    out = torch.empty_like(q)
    for start, block, block_keys, block_values, seen in query_blocks(q, keys, values, mask):
        out[:, :, start:start + block.shape[2]] = F.scaled_dot_product_attention(
            block, block_keys, block_values, attn_mask=seen[:, None], enable_gqa=gqa, scale=scale)
    return out


def query_blocks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor):
    """(start, queries, keys, values, mask) for each block of QUERY_BLOCK queries; when there are
    several (a prompt), each block's keys, values and mask cut to the key blocks it sees."""
    width = q.shape[2]
    for start in range(0, width, QUERY_BLOCK):
        seen = mask[:, start:start + QUERY_BLOCK]
        first, last = seen_blocks(seen) if width > QUERY_BLOCK else (0, seen.shape[-1])
        yield (start, q[:, :, start:start + QUERY_BLOCK], keys[:, :, first:last], values[:, :, first:last],
               seen[..., first:last])


def seen_blocks(seen: torch.Tensor) -> tuple[int, int]:
    """The slots [first, last) of the key blocks from the first that a query sees to the last
    one sees (to S at most), for queries' masks `seen` (B, T, S); all S when no query sees
    a slot."""
    slots = seen.shape[-1]
    open_slots = seen.any(1).any(0).nonzero()
    if len(open_slots) == 0:
        return 0, slots
    return int(open_slots[0]) // KEY_BLOCK * KEY_BLOCK, min(whole_blocks(int(open_slots[-1]) + 1), slots)


def blockwise_product(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """weights (..., R, S) @ values (..., S, D), summed one KEY_BLOCK of slots at a time in
    order. A BLAS product's rounding depends on where its reduction starts; summed by
    blocks, leading blocks of zero weight add exact zeros, so a caller may drop them (a
    sliding window's span) and a token keeps the bits it gets over the whole cache."""
    mixed = weights[..., :KEY_BLOCK] @ values[..., :KEY_BLOCK, :]
    for start in range(KEY_BLOCK, weights.shape[-1], KEY_BLOCK):
        mixed += weights[..., start:start + KEY_BLOCK] @ values[..., start:start + KEY_BLOCK, :]
    return mixed

def rope_table(theta: float, dim: int, start: int, stop: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (stop - start, dim) of rotary base `theta` for positions start..stop - 1,
    the sine's first half negated (`rotate`)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device).float() / dim))
    freqs = torch.outer(torch.arange(start, stop, device=device).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    sin[:, :dim // 2] *= -1
    return emb.cos(), sin


def tree_mask(tree: torch.Tensor, starts: torch.Tensor, keys: int) -> torch.Tensor:
    """(B, T, keys) attention mask: row b's slots before the tree's (< starts[b] - (W - T)),
    and among the W slots from there the ones `tree` (B, T, W) allows."""
    batch, width, span = tree.shape
    if span < width:
        raise ValueError(f"a tree mask (B, T, W) needs W >= T, got {tuple(tree.shape)}")
    offset = torch.arange(keys, device=tree.device)[None, :] - (starts[:, None] - (span - width))  # (B, keys)
    inside = (offset >= 0) & (offset < span)
    picked = tree.gather(2, offset.clamp(0, span - 1)[:, None, :].expand(batch, width, keys))
    return (offset < 0)[:, None, :] | (picked & inside[:, None, :])
