"""What transformers modules run in place of their own attention, for HFModel (hf.py).

`block_attention`: prompts by blocks of queries, each over the key slots its mask leaves open;
verify-sized float32 forwards through the built-in decoder's width-invariant attention.
`write_cache_only`: a prompt read without logits skips the last layer's attention and MLP.
"""

from __future__ import annotations

import inspect
import types

import torch

from .attention import KEY_BLOCK, cached_attention, whole_blocks

# The attention implementation HFModel gives models that use SDPA, and its block of queries.
BLOCK_ATTENTION = "speculative_block_sdpa"
# A forward's keyword for "keys and values only" (every layer passes it on; the last acts on it),
# and the one the last layer gives its attention module (block_attention then computes nothing).
CACHE_ONLY, NO_OUTPUT = "speculative_cache_only", "speculative_no_output"
QUERY_BLOCK = 128


def block_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, run for each block of QUERY_BLOCK queries over the span
    of key slots that the block's mask leaves open (from the first open slot to the last):
    a sliding-window layer reads only its window, in every forward. Exact: a slot outside
    the span gets no weight from any query of the block. Masks other than additive ones go
    whole. In float32 (an int8 model's activations), forwards of at most one block go
    through `cached_attention` (the built-in decoder's: each token gets the bits of a
    one-token forward) from the first open KEY_BLOCK, over keys padded with hidden zero
    slots to whole KEY_BLOCKs (a copy unless they come so from a `BlockCache`). Keys may
    run past the mask's slots (a `BlockCache`'s zeros, to the end of a key block)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is None or not attention_mask.is_floating_point():
        slots = key.shape[2] if attention_mask is None else attention_mask.shape[-1]
        return sdpa_attention_forward(module, query, key[:, :, :slots], value[:, :, :slots], attention_mask, **kwargs)
    if kwargs.get(NO_OUTPUT):  # `write_cache_only`'s last layer: the cache is written, no one reads this
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None
    read = MaskReading.of(attention_mask)
    if query.dtype == torch.float32 and query.shape[2] <= QUERY_BLOCK and not kwargs.get("softcap"):
        first = read.spans[0][0] // KEY_BLOCK * KEY_BLOCK
        visible = read.visible_from(first)
        slots = visible.shape[-1]
        if key.shape[2] - first < slots:  # keys not kept in whole blocks (not a `BlockCache`)
            key, value = (torch.nn.functional.pad(t, (0, 0, 0, slots - key.shape[2] + first)) for t in (key, value))
        return cached_attention(query, key[:, :, first:first + slots], value[:, :, first:first + slots], visible,
                                kwargs.get("scaling")).transpose(1, 2), None
    outputs = []
    for block, (first, last) in enumerate(read.spans):
        start = block * QUERY_BLOCK
        output, _ = sdpa_attention_forward(module, query[:, :, start:start + QUERY_BLOCK], key[:, :, first:last],
                                           value[:, :, first:last],
                                           attention_mask[:, :, start:start + QUERY_BLOCK, first:last], **kwargs)
        outputs.append(output)  # (B, block, heads, D)
    return torch.cat(outputs, 1), None


def write_cache_only(base) -> bool:
    """Let the last decoder layer of `base` (transformers' layers with `input_layernorm`,
    `self_attn` and `mlp`) skip its attention and MLP when the forward gets CACHE_ONLY: a
    prompt read without logits needs from it only the keys and values its attention module
    writes to the cache (the rest reaches only the output layer). The layer's own forward
    runs every other call; False where the layers are not of that form, or where the model,
    the layer or its attention takes no keywords to pass on."""
    layers = getattr(base, "layers", None)
    last = layers[-1] if isinstance(layers, torch.nn.ModuleList) and len(layers) else None
    if last is None or not all(hasattr(last, part) for part in ("input_layernorm", "self_attn", "mlp")):
        return False
    if not all(takes_keywords(type(module).forward) for module in (base, last, last.self_attn)):
        return False
    if getattr(last.forward, "__func__", None) is not cache_only_forward:  # not by an earlier HFModel
        last.forward = types.MethodType(cache_only_forward, last)  # a method: a deep copy binds its copy
    return True


def takes_keywords(function) -> bool:
    """Whether `function` takes any keyword (a `**kwargs`)."""
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(function).parameters.values())


def cache_only_forward(layer, hidden_states, *args, **kwargs):
    """`write_cache_only`'s forward of a decoder layer."""
    if not kwargs.pop(CACHE_ONLY, False):
        return type(layer).forward(layer, hidden_states, *args, **kwargs)
    # The attention module writes the keys and values; block_attention, told NO_OUTPUT, computes nothing.
    layer.self_attn(layer.input_layernorm(hidden_states), *args, **kwargs, **{NO_OUTPUT: True})
    return hidden_states


class MaskReading:
    """What `block_attention` reads from an additive mask (B, 1, T, S), worked out once per
    mask: every layer of a type gets the same mask object in a forward (18 layers of Gemma 3
    270M: 2.6% of reading a prompt went to finding the spans again in each)."""

    def __init__(self, mask: torch.Tensor):
        self.open = mask[:, 0] != torch.finfo(mask.dtype).min  # (B, T, S)
        # Per block of QUERY_BLOCK queries, the span [first, last) of slots open to one of them.
        self.spans = []
        for start in range(0, self.open.shape[1], QUERY_BLOCK):
            slots = self.open[:, start:start + QUERY_BLOCK].flatten(0, 1).any(0).nonzero()
            self.spans.append((int(slots[0]), int(slots[-1]) + 1) if len(slots) else (0, self.open.shape[-1]))
        self._visible = {}

    @classmethod
    def of(cls, mask: torch.Tensor) -> "MaskReading":
        """The reading `attach` left on the mask, or else a new one."""
        return getattr(mask, "_speculative_reading", None) or cls(mask)

    @classmethod
    def attach(cls, mask: torch.Tensor) -> torch.Tensor:
        """Keep the mask's reading on it: for masks no one writes after (HFModel's own, made
        for each forward)."""
        mask._speculative_reading = cls(mask)
        return mask

    def visible_from(self, first: int) -> torch.Tensor:
        """Which slots from `first` each query sees (B, T, S'), padded with hidden slots to
        whole KEY_BLOCKs (what `cached_attention` reads)."""
        if first not in self._visible:
            visible = self.open[..., first:]
            slots = whole_blocks(visible.shape[-1])
            self._visible[first] = torch.nn.functional.pad(visible, (0, slots - visible.shape[-1]))
        return self._visible[first]


def use_block_attention(model) -> None:
    """Give a model that runs transformers' SDPA attention `block_attention` instead (the
    same masks for transformers' own generate, which then gets the same speed)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(BLOCK_ATTENTION, block_attention)
    AttentionMaskInterface.register(BLOCK_ATTENTION, sdpa_mask)
    model.set_attn_implementation(BLOCK_ATTENTION)
