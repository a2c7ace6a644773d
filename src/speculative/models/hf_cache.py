"""A transformers cache that grows in whole key blocks, for `block_attention` (models/hf.py).

transformers' `DynamicCache` appends a forward's keys and values by concatenation, copying
each layer's whole cache at every forward; width-invariant attention then copied it once
more to pad it to whole KEY_BLOCKs of zeros: about a tenth of a float32 lookup request's
decoding time for Gemma 3 270M at a 1k-token context (dev/LOG.md, 2026-12-06). Here each
layer keeps buffers of whole key blocks: a forward writes its slots in place, the slots
past the layer's length are zeros, and `update` returns the keys and values through the
end of that block, so attention reads whole blocks with no copy. Only `block_attention`
may read a cache whose keys run past the mask: `HFModel` uses one only for models that
run it.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .attention import whole_blocks


class BlockLayer(DynamicLayer):
    """A `DynamicLayer` whose `keys` and `values` are views of the first slots of buffers
    (B, H, capacity, D) holding zeros past them. Code that sets `keys` and `values` to
    tensors of its own (row selection, compaction) is followed: the next `update` copies
    them into new buffers."""

    def lazy_initialization(self, *states: torch.Tensor) -> None:
        super().lazy_initialization(*states)
        self.buffers = None  # (keys, values) that self.keys and self.values are views of

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new slots in place; return the keys and values through the end of
        their last key block (zeros past the layer's length)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if not self._owns_views() or end > self.buffers[0].shape[2]:
            self._reallocate(length, end, key_states, value_states)
        keys, values = self.buffers
        keys[:, :, length:end] = key_states
        values[:, :, length:end] = value_states
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]
        padded = whole_blocks(end)
        return keys[:, :, :padded], values[:, :, :padded]

    def crop(self, tokens_to_remove: int) -> None:
        """As `DynamicLayer.crop`, zeroing the dropped slots (attention reads them as padding)."""
        owned, length = self._owns_views(), self.get_seq_length()
        super().crop(tokens_to_remove)
        if owned:  # the cropped keys and values are still views of the buffers
            for buffer in self.buffers:
                buffer[:, :, self.get_seq_length():length] = 0

    def _owns_views(self) -> bool:
        return (self.buffers is not None and self.keys is not None and self.keys.dim() == 4
                and self.keys.data_ptr() == self.buffers[0].data_ptr()
                and self.values.data_ptr() == self.buffers[1].data_ptr()
                and self.keys.shape[0] == self.buffers[0].shape[0])

    def _reallocate(self, length: int, end: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """New zeroed buffers of whole key blocks for `end` slots, holding the first `length`."""
        buffers = []
        for old, new in ((self.keys, key_states), (self.values, value_states)):
            shape = list(new.shape)
            shape[2] = whole_blocks(end)
            buffer = new.new_zeros(shape)
            if length:
                buffer[:, :, :length] = old[:, :, :length]
            buffers.append(buffer)
        self.buffers = tuple(buffers)


class BlockCache(DynamicCache):
    """A `DynamicCache` of `BlockLayer`s (no config: every layer keeps all its slots)."""

    def __init__(self):
        super().__init__()
        self.layer_class_to_replicate = BlockLayer
