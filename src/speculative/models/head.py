"""A draft head that reads the target's features (EAGLE-style).

The head drafts from the target's own final hidden states instead of re-reading the text
with a model of its own. Token t enters the head as the embedding of x_t (the target's
own, frozen) concatenated with the target's feature at the previous position f_{t-1}
(zeros for t = 0); a linear layer fuses the two, one Llama block (the blocks of
decoder_only, with their position-indexed KV cache) and its final norm give h_t, an
estimate of the target's f_t, which the target's output layer (frozen; over a reduced
vocabulary when `vocab_ids` is set) turns into q for x_{t+1}. From the second drafted
token on, the head feeds its own h in place of the target's feature.

The head keeps no embedding or output weights of its own: the proposer borrows the
target's, after `check_target` has made sure that it is the target the head was trained
for (hidden size, vocabulary and a fingerprint of its embedding, recorded at training).

`quantize()` puts the head's linear layers, and the copy of the target's output layer it
drafts with (`output_layer`), in int8. On CPUs that is what makes a head cheap: each
target forward evicts the head's weights from the caches, so every drafting step reads
them from memory again, and int8 reads a quarter of float32's bytes. The rounding changes
the proposals, never the output.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from .kernels import Int8Linear, quantize_linears
from .attention import KVState
from .base import OutputHead, load_checked
from .decoder_only import DecoderOnlyConfig, DecoderOnlyLM

HEAD_TYPE = "draft_head"
# Token ids whose embedding norms make a target's fingerprint (spread over the vocabulary).
FINGERPRINT_IDS = 16
# Relative difference of the fingerprint's norms up to which a target counts as the same
# one (loading it in another dtype changes the norms by far less).
FINGERPRINT_TOLERANCE = 1e-2


@dataclass
class HeadConfig:
    # The target's hidden size (its features' width, and the head's).
    hidden_size: int
    # The target's vocabulary size.
    vocab_size: int
    # Llama blocks of the head (EAGLE uses one).
    num_layers: int = 1
    # Attention heads of the block; hidden_size must be a multiple of it.
    num_heads: int = 4
    # Width of the block's SwiGLU MLP; None = about 8/3 of hidden_size.
    intermediate_size: int | None = None
    # Longest sequence the head accepts (the target's).
    max_seq_len: int = 2048
    # The target the head was trained for: a name for messages, and its fingerprint
    # (embedding norms of FINGERPRINT_IDS token ids, `fingerprint`).
    target_name: str = "unknown"
    target_fingerprint: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_layers", "num_heads", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"draft head option {name} must be an integer >= 1, got {value!r}")

    def block_config(self) -> DecoderOnlyConfig:
        """The decoder_only configuration of the head's blocks (their own embedding has one
        unused row: the head's inputs are fused vectors, not tokens)."""
        return DecoderOnlyConfig(vocab_size=1, hidden_size=self.hidden_size, num_layers=self.num_layers,
                                 num_heads=self.num_heads, intermediate_size=self.intermediate_size,
                                 max_seq_len=self.max_seq_len, tie_embeddings=True)


def fingerprint(target) -> list[float]:
    """Norms of the target's input embeddings at FINGERPRINT_IDS ids spread over its vocabulary."""
    ids = torch.linspace(0, target.vocab_size - 1, FINGERPRINT_IDS).long().to(target.device)
    with torch.no_grad():
        return [round(float(v), 6) for v in target.embed(ids[None])[0].float().norm(dim=-1)]


def describe(target) -> str:
    tokenizer = getattr(target, "tokenizer", None)
    name = type(target).__name__ + (f" with tokenizer {tokenizer.name}" if tokenizer is not None else "")
    return f"{name} (hidden size {hidden_size(target)}, {target.vocab_size} tokens)"


def hidden_size(target) -> int:
    with torch.no_grad():
        return int(target.embed(torch.zeros(1, 1, dtype=torch.long, device=target.device)).shape[-1])


class DraftHead(nn.Module):
    """The head's own weights: the fusion layer and the block(s). Follows the state part of
    the model protocol (new_state, rollback, select_rows, add_rows) through its blocks."""

    model_type = HEAD_TYPE

    def __init__(self, cfg: HeadConfig, vocab_ids: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        self.fuse = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.blocks = DecoderOnlyLM(cfg.block_config())
        # The reduced vocabulary (FR-Spec): target ids the head scores, most frequent first.
        self.register_buffer("vocab_ids", None if vocab_ids is None else vocab_ids.long(), persistent=False)
        self.int8 = False  # linear layers in int8 (`quantize`)

    def quantize(self) -> int:
        """int8 linear layers (for drafting on CPUs; not for training or saving); returns how many."""
        if self.int8:
            return 0
        self.fuse = Int8Linear(self.fuse)
        self.int8 = True
        return 1 + quantize_linears(self.blocks.layers)

    def output_layer(self, target) -> nn.Module:
        """The target's output layer over the head's vocabulary (all of it without one), as
        hidden -> float32 logits; in int8 when the head is."""
        layer = target.output_head(self.vocab_ids)
        if not self.int8 or isinstance(layer.layer, Int8Linear):
            return layer
        return OutputHead(Int8Linear(layer.layer))

    # --- protocol attributes and state (the blocks' KV cache) -----------------------------
    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.cfg.max_seq_len

    @property
    def device(self) -> torch.device:
        return self.blocks.norm.weight.device

    def new_state(self, batch_size: int, capacity: int) -> KVState:
        return self.blocks.new_state(batch_size, capacity)

    def rollback(self, state: KVState, lengths: list[int]) -> None:
        self.blocks.rollback(state, lengths)

    def select_rows(self, state: KVState, rows: list[int]) -> None:
        self.blocks.select_rows(state, rows)

    def add_rows(self, state: KVState, new: KVState, capacity: int) -> None:
        self.blocks.add_rows(state, new, capacity)

    def forward(self, embedded: torch.Tensor, features: torch.Tensor, state: KVState | None = None,
                num_valid: list[int] | None = None, positions: torch.Tensor | None = None,
                tree: torch.Tensor | None = None) -> torch.Tensor:
        """h (B, T, H) from token embeddings (B, T, H) and the features of the positions
        before them (B, T, H); appended to `state` as a model's forward appends tokens
        (without a state: whole sequences from position 0, for training). `positions` and
        `tree` as for decoder_only (a head expanding a token tree)."""
        dtype = self.blocks.norm.weight.dtype
        x = self.fuse(torch.cat([embedded.to(dtype), features.to(dtype)], -1))
        return self.blocks.run_blocks(x, state, num_valid, positions, tree)

    # --- the target ----------------------------------------------------------------------
    def check_target(self, target) -> None:
        """Refuse a target other than the one the head was trained for, naming both."""
        cfg = self.cfg
        problems = []
        size = hidden_size(target)
        if size != cfg.hidden_size:
            problems.append(f"hidden size {size} != {cfg.hidden_size}")
        if target.vocab_size != cfg.vocab_size:
            problems.append(f"vocabulary {target.vocab_size} != {cfg.vocab_size}")
        if not problems and cfg.target_fingerprint:
            found = fingerprint(target)
            worst = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(found, cfg.target_fingerprint))
            if worst > FINGERPRINT_TOLERANCE:
                problems.append(f"its weights differ (embedding norms off by up to {worst:.0%})")
        if problems:
            raise ValueError(f"this draft head was trained for {cfg.target_name} (hidden size {cfg.hidden_size}, "
                             f"{cfg.vocab_size} tokens), not for the target {describe(target)}: "
                             f"{'; '.join(problems)}. Train a head for this target with `speculative train-head`")

    def record_target(self, target, name: str) -> None:
        """Remember the target this head is trained for (saved with it)."""
        self.cfg.target_name = name
        self.cfg.target_fingerprint = fingerprint(target)


def build_head(target, name: str = "unknown", vocab_ids=None, seed: int | None = None, **opts) -> DraftHead:
    """A fresh head for `target` (its hidden size and vocabulary), the target recorded."""
    cfg = HeadConfig(hidden_size=hidden_size(target), vocab_size=target.vocab_size,
                     max_seq_len=target.max_seq_len or 2048, **opts)
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(f"draft head num_heads ({cfg.num_heads}) must divide the target's hidden size "
                         f"({cfg.hidden_size})")
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        head = DraftHead(cfg, None if vocab_ids is None else torch.as_tensor(vocab_ids))
    head.record_target(target, name)
    return head.to(target.device)


def save_head(head: DraftHead, directory, weight_dtype: torch.dtype | None = None) -> Path:
    """model.safetensors (the head's weights, and its vocabulary ids) plus config.json."""
    from safetensors.torch import save_file

    if head.int8:
        raise ValueError("an int8 draft head is for drafting only: save the float head it was quantized from")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous().cpu() for name, t in head.state_dict().items()
               if name != "blocks.lm_head.weight"}  # tied to the blocks' unused one-row embedding
    if weight_dtype is not None:
        tensors = {n: t.to(weight_dtype) for n, t in tensors.items()}
    if head.vocab_ids is not None:
        tensors["vocab_ids"] = head.vocab_ids.cpu()
    save_file(tensors, str(directory / "model.safetensors"))
    config = {"model_type": HEAD_TYPE, **asdict(head.cfg)}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def load_head(directory, device="cpu", dtype: torch.dtype = torch.float32) -> DraftHead:
    """Read a directory written by `save_head`."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path, weights = directory / "config.json", directory / "model.safetensors"
    if not config_path.is_file() or not weights.is_file():
        raise FileNotFoundError(f"{directory} is not a draft head directory: it needs config.json and "
                                "model.safetensors (written by save_head / speculative train-head)")
    config = json.loads(config_path.read_text())
    if config.pop("model_type", None) != HEAD_TYPE:
        raise ValueError(f"{config_path} does not describe a draft head (model_type {HEAD_TYPE!r})")
    tensors = load_file(str(weights))
    vocab_ids = tensors.pop("vocab_ids", None)
    head = DraftHead(HeadConfig(**config), vocab_ids)
    tensors["blocks.lm_head.weight"] = tensors["blocks.embed_tokens.weight"]
    load_checked(head, tensors, directory, config_path)
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)
