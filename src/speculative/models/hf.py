"""Adapter: any transformers causal LM as target or draft, in batches, with rollback.

Rows of a batch share the cache's slots but keep their own lengths: every forward
appends T slots to all rows, and a slot a row does not keep (a rejected draft, padding)
becomes a hole that its attention mask hides. We pass the model our own 4-D masks and
per-row position ids, so each row sees exactly its own tokens at their own positions.
Sliding-window layers (Gemma 3) get a mask that measures the window in each row's
positions, not in slots; the cache keeps full layers so no slot a window may need is
dropped. Rollback hides the rolled-back slots and crops the slots no row keeps; when
holes make up more than half the slots, and whenever rows join, each row's slots are
compacted to the front, so a long-running batch keeps a bounded cache.

Long forwards (prompts) run attention by blocks of queries, each over the key slots its
mask leaves open to some query of the block (hf_attention.py): causal and sliding-window
masks then skip work instead of masking it (`python benchmarks/run.py prefill-gemma`).
Models that run it keep their keys and values in a `BlockCache` (models/hf_cache.py),
written in place and read in whole key blocks.
"""

from __future__ import annotations

import inspect

import torch

from .argmax_screen import screened_logits
from .base import OutputHead
from .hf_attention import BLOCK_ATTENTION, CACHE_ONLY, MaskReading, use_block_attention, write_cache_only

# Layer types whose masks we know how to build.
LAYER_TYPES = {"full_attention", "sliding_attention"}


class HFState:
    def __init__(self, cache, batch_size: int, device):
        self.cache = cache
        self.lengths = [0] * batch_size
        # Per slot: whether the row keeps it, and the row's position of the token in it.
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # (B, S)
        self.positions = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # (B, S)
        self.last_width = 0  # tokens the last forward appended (the slots `compact` chooses among)


class HFModel:
    """Wraps a transformers `PreTrainedModel` in the model protocol of `speculative.models.base`."""

    model_type = "transformers"
    screens_argmax = True  # forward takes argmax_rows (models/base.py)

    def __init__(self, model, tokenizer=None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = config
        # Width of the logits (may exceed the tokenizer's size: padded vocabularies).
        head = model.get_output_embeddings()
        self.vocab_size = int(head.out_features if hasattr(head, "out_features") else head.weight.shape[0])
        limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        self.max_seq_len = int(limit) if limit else None
        self.layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        unknown = self.layer_types - LAYER_TYPES
        if unknown:
            raise ValueError(f"{type(model).__name__} has attention layers of type {sorted(unknown)}; "
                             f"supported: {sorted(LAYER_TYPES)}")
        self.window = getattr(config, "sliding_window", None)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        # Settings that make logits more than `hidden @ W.T (+ b)`.
        self._special = [a for a in ("final_logit_softcapping", "logit_scale", "logits_scaling",
                                     "output_multiplier_scale") if getattr(config, a, None) not in (None, 1, 1.0)]
        base = getattr(model, "base_model", None)
        if base is None or base is model:
            self._special.append("no separate base model")
        self._head = self._mkl_head(model)
        use_block_attention(model)
        # Only block_attention reads keys past the mask: other models get transformers' cache.
        self._blocked = getattr(model.config, "_attn_implementation", None) == BLOCK_ATTENTION
        self._cache_only = base is not None and base is not model and write_cache_only(base)

    def _mkl_head(self, model):
        """The output layer when it runs on MKL's float32 GEMM, else None.

        Scoring K+1 rows at once, `W @ hidden.T` runs several times faster on CPUs than
        the usual `hidden @ W.T` for a 262k-token vocabulary (a better GEMM shape). Packed
        (oneDNN) and 16-bit layers need no such help; models that scale or cap their
        logits keep their own path."""
        head = model.get_output_embeddings()
        if self._special or type(head) is not torch.nn.Linear or head.weight.dtype != torch.float32:
            return None
        return head

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def new_state(self, batch_size: int, capacity: int | None = None) -> HFState:
        return HFState(_empty_cache(self._blocked), batch_size, self.device)

    def _masks(self, state: HFState, positions: torch.Tensor, tree: torch.Tensor | None = None):
        """Additive masks (B, 1, T, S+T) for new tokens at `positions` (B, T): each sees the
        slots its row keeps at earlier positions, and the new tokens up to itself (with a
        token tree (B, T, W): among the last W - T slots and the new tokens those `tree`
        allows, its ancestors and itself)."""
        batch, width = positions.shape
        cached = state.valid[:, None, :] & (state.positions[:, None, :] <= positions[:, :, None])  # (B, T, S)
        if tree is None:
            tree = torch.ones(width, width, dtype=torch.bool, device=positions.device).tril().expand(batch, -1, -1)
        elif tree.shape[2] > width:  # the tree began in earlier forwards (a draft model expanding one)
            earlier = tree.shape[2] - width
            cached = torch.cat([cached[:, :, :-earlier], tree[:, :, :earlier] & state.valid[:, None, -earlier:]], 2)
            tree = tree[:, :, earlier:]
        visible = torch.cat([cached, tree], 2)  # (B, T, S+T)
        keys_pos = torch.cat([state.positions, positions], 1)
        blocked = torch.finfo(self.dtype).min

        def additive(allowed):
            mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device).masked_fill(~allowed, blocked)
            return MaskReading.attach(mask[:, None]) if self._blocked else mask[:, None]

        masks = {"full_attention": additive(visible)}
        if "sliding_attention" in self.layer_types:
            near = positions[:, :, None] - keys_pos[:, None, :] < self.window
            masks["sliding_attention"] = additive(visible & near)
        return masks, keys_pos

    def eval(self) -> "HFModel":
        """As torch modules do: the wrapped model in inference mode (`train-head` trains beside it)."""
        self.model.eval()
        return self

    def requires_grad_(self, requires_grad: bool = True) -> "HFModel":
        self.model.requires_grad_(requires_grad)
        return self

    def modules(self):
        return self.model.modules()

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input embeddings (B, T, H) of tokens, scaled as the model scales them (Gemma)."""
        return self.model.get_input_embeddings()(tokens)

    def forward(self, tokens: torch.Tensor, state: HFState, num_valid: list[int] | None = None,
                keep_logits: bool = True, return_hidden: bool = False, positions: torch.Tensor | None = None,
                tree: torch.Tensor | None = None, argmax_rows: list[bool] | None = None):
        """As the protocol says: float32 logits (B, T, V); `positions` (B, T) default to each
        row's next positions; return_hidden=True also returns the final hidden states (B, T, H);
        `tree` (B, T, W): which of the last W slots each new token sees (a token tree's
        ancestor mask; W > T when the tree began in earlier forwards); `argmax_rows`: see
        `argmax_screen.screened_logits`."""
        batch, width = tokens.shape
        screened = keep_logits and not self._special and argmax_rows is not None and any(argmax_rows)
        if argmax_rows is not None and len(argmax_rows) != batch:
            raise ValueError(f"argmax_rows must hold {batch} flags, got {len(argmax_rows)}")
        counts = [width] * batch if num_valid is None else list(num_valid)
        device = tokens.device
        if positions is None:  # padding past a row's end may lie past the position embeddings (GPT-2's): kept inside
            positions = torch.tensor(state.lengths, device=device)[:, None] + torch.arange(width, device=device)
            positions = positions.clamp(max=max(max(n + c for n, c in zip(state.lengths, counts)), 1) - 1)
        elif tuple(positions.shape) != (batch, width):
            raise ValueError(f"positions must have the shape of tokens {(batch, width)}, got {tuple(positions.shape)}")
        masks, keys_pos = self._masks(state, positions, tree)
        mask = masks if len(self.layer_types) > 1 else masks["full_attention"]
        inputs = dict(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True,
                      **{self._cache_arg: state.cache})
        hidden = None
        if keep_logits and not (return_hidden or screened or self._head is not None):
            logits = self.model(**inputs, logits_to_keep=0).logits.float()
        else:  # without logits, no output layer at all (a prompt's: 30-50 ms in float32 for Gemma 3's)
            if not (keep_logits or return_hidden) and self._cache_only:
                inputs[CACHE_ONLY] = True  # nor the last layer's attention and MLP
            hidden = self.model.base_model(**inputs).last_hidden_state  # (B, T, H)
            if screened:
                logits = screened_logits(self.model.get_output_embeddings(), hidden, argmax_rows, self._logits)
            else:
                logits = self._logits(hidden) if keep_logits else None
        kept = torch.arange(width, device=device)[None, :] < torch.tensor(counts, device=device)[:, None]
        state.valid = torch.cat([state.valid, kept], 1)
        state.positions = keys_pos
        state.lengths = [n + c for n, c in zip(state.lengths, counts)]
        state.last_width = width
        return (logits, hidden) if return_hidden else logits

    def compact(self, state: HFState, starts: list[int], kept: list[list[int]]) -> None:
        """After a tree forward: row b keeps only the slots of nodes kept[b] (offsets into
        that forward; their positions already are starts[b] + depth); the others become
        holes, which later compaction or cropping removes."""
        first = state.valid.shape[1] - state.last_width
        keep = torch.zeros(len(kept), state.last_width, dtype=torch.bool, device=state.valid.device)
        for b, offsets in enumerate(kept):
            keep[b, offsets] = True
        state.valid[:, first:] &= keep
        state.lengths = [start + len(offsets) for start, offsets in zip(starts, kept)]
        self._crop(state)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits (B, T, V) from final hidden states, for models with a plain output layer."""
        if self._special:
            raise ValueError(f"{type(self.model).__name__} scales its logits ({', '.join(self._special)}); "
                             "its hidden states cannot be scored apart from its own forward")
        if self._head is None:
            return self.model.get_output_embeddings()(hidden).float()
        batch, width, _ = hidden.shape  # every width: one kernel, the same rounding
        logits = torch.mm(self._head.weight, hidden.reshape(batch * width, -1).t()).t()  # (B*T, V)
        if self._head.bias is not None:
            logits = logits + self._head.bias
        return logits.reshape(batch, width, -1).float().contiguous()

    def output_head(self, token_ids: torch.Tensor | None = None) -> torch.nn.Module:
        """hidden -> float32 logits, over `token_ids` only when given (a reduced draft vocabulary)."""
        if self._special:
            raise ValueError(f"{type(self.model).__name__} scales its logits ({', '.join(self._special)}): "
                             "no reduced vocabulary for it")
        return OutputHead(self.model.get_output_embeddings(), token_ids)

    def rollback(self, state: HFState, lengths: list[int]) -> None:
        if len(lengths) != len(state.lengths) or any(not 0 <= n <= m for n, m in zip(lengths, state.lengths)):
            raise ValueError(f"cannot roll back lengths {state.lengths} to {list(lengths)}")
        keep = torch.tensor(lengths, device=state.valid.device)[:, None]
        state.valid = state.valid & (state.valid.long().cumsum(1) <= keep)
        state.lengths = list(lengths)
        self._crop(state)
        if state.valid.shape[1] > 2 * max(lengths, default=0) + 8:  # mostly holes
            self._compact(state)

    def select_rows(self, state: HFState, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.long, device=state.valid.device)
        state.cache.batch_select_indices(index)
        state.valid, state.positions = state.valid[index], state.positions[index]
        state.lengths = [state.lengths[r] for r in rows]
        self._crop(state)

    def add_rows(self, state: HFState, new: HFState, capacity: int | None = None) -> None:
        """Append the rows of `new`, both compacted first, the shorter side padded with holes."""
        self._compact(state)
        self._compact(new)
        slots = max(state.valid.shape[1], new.valid.shape[1])
        mine, theirs = self._tensors(state), self._tensors(new)
        cache = _empty_cache(self._blocked)
        for index, (k, v) in enumerate(mine or theirs):  # no layers on either side: nothing seen yet
            joined = []
            for side, rows in ((mine, len(state.lengths)), (theirs, len(new.lengths))):
                pair = side[index] if side else [t.new_zeros((rows, t.shape[1], 0, t.shape[3])) for t in (k, v)]
                joined.append([_pad(t, slots, rows, dim=2) for t in pair])
            cache.update(torch.cat([joined[0][0], joined[1][0]]), torch.cat([joined[0][1], joined[1][1]]), index)
        state.cache = cache
        state.valid = torch.cat([_pad(state.valid, slots, dim=1), _pad(new.valid, slots, dim=1)])
        state.positions = torch.cat([_pad(state.positions, slots, dim=1), _pad(new.positions, slots, dim=1)])
        state.lengths = state.lengths + list(new.lengths)

    @staticmethod
    def _tensors(state: HFState) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values (B, H, S, D) per layer; empty before the first forward."""
        layers = state.cache.layers
        if not layers or any(layer.keys is None or layer.keys.dim() != 4 for layer in layers):
            return []
        return [(layer.keys, layer.values) for layer in layers]

    def _compact(self, state: HFState) -> None:
        """Move each row's kept slots to the front, in order; drop the slots no row needs."""
        counts = state.valid.sum(1)
        slots = int(counts.max()) if len(counts) else 0
        if slots == state.valid.shape[1]:
            return
        order = torch.argsort((~state.valid).to(torch.int8), dim=1, stable=True)[:, :slots]  # (B, S')
        state.positions = state.positions.gather(1, order)
        state.valid = torch.arange(slots, device=counts.device)[None, :] < counts[:, None]
        for layer in state.cache.layers:
            if layer.keys is None or layer.keys.dim() != 4:
                continue
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)

    def _crop(self, state: HFState) -> None:
        """Drop the trailing slots that no row keeps."""
        slots = state.valid.shape[1]
        used = state.valid.any(0).nonzero()
        last = int(used[-1]) + 1 if len(used) else 0
        if last < slots:
            if last == 0:  # no slot left: a fresh cache (an emptied one may keep a stale batch size)
                state.cache = _empty_cache(self._blocked)
            else:
                state.cache.crop(last - slots)  # a negative count: slots to remove
            state.valid, state.positions = state.valid[:, :last], state.positions[:, :last]


def _empty_cache(blocked: bool):
    from transformers import DynamicCache

    from .hf_cache import BlockCache

    # No config: every layer keeps all its slots (our masks do the windowing).
    return BlockCache() if blocked else DynamicCache()


def _pad(tensor: torch.Tensor, size: int, rows: int | None = None, dim: int = 1) -> torch.Tensor:
    """`tensor` padded with zeros (False) along `dim` to `size`; `rows` checks its batch."""
    if rows is not None and tensor.shape[0] != rows:
        raise ValueError(f"a cache layer holds {tensor.shape[0]} rows; the state has {rows}")
    missing = size - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim)
