"""The configuration of the built-in decoder (`decoder_only.py`): its sizes, and the
settings that Llama and Qwen2 checkpoints carry (`native.py` reads them from config.json)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DecoderOnlyConfig:
    vocab_size: int
    # Width of the residual stream.
    hidden_size: int = 512
    # Number of transformer blocks.
    num_layers: int = 8
    # Attention heads; hidden_size must be a multiple of it.
    num_heads: int = 8
    # Key/value heads (grouped-query attention); None = num_heads.
    num_kv_heads: int | None = None
    # Width of the SwiGLU MLP; None = about 8/3 of hidden_size, rounded up to 32.
    intermediate_size: int | None = None
    # Longest sequence (prompt + generated tokens) the model accepts.
    max_seq_len: int = 2048
    # Base of the rotary position frequencies.
    rope_theta: float = 10000.0
    # Epsilon of RMSNorm.
    rms_norm_eps: float = 1e-5
    # Share the input embedding with the output projection.
    tie_embeddings: bool = True
    # Biases on the query, key and value projections (Qwen2).
    attention_bias: bool = False

    def __post_init__(self) -> None:
        # Upper bounds far above any real model's, so that a wrong config (a config.json saying
        # max_seq_len 1e12) is refused here rather than by the OS once tensors are allocated.
        bounds = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "num_layers": 1024, "num_heads": 1 << 12,
                  "num_kv_heads": 1 << 12, "intermediate_size": 1 << 18, "max_seq_len": 1 << 20}
        for name, high in bounds.items():
            value = getattr(self, name)
            if value is None and name in ("num_kv_heads", "intermediate_size"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise ValueError(f"decoder_only option {name} must be an integer in 1..{high}, got {value!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf") \
                    or (name == "rope_theta" and value == 0):
                allowed = "> 0" if name == "rope_theta" else ">= 0"
                raise ValueError(f"decoder_only option {name} must be a finite number {allowed}, got {value!r}")
        for name in ("tie_embeddings", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"decoder_only option {name} must be true or false, got {getattr(self, name)!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"decoder_only hidden_size ({self.hidden_size}) must be a multiple of "
                             f"num_heads ({self.num_heads})")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("decoder_only head size (hidden_size / num_heads) must be even for rotary "
                             f"positions, got {self.hidden_size // self.num_heads}")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"decoder_only num_kv_heads ({self.num_kv_heads}) must divide num_heads "
                             f"({self.num_heads})")
        if self.intermediate_size is None:
            self.intermediate_size = -(-8 * self.hidden_size // 3 // 32) * 32

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads
