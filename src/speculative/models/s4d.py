"""A stack of diagonal state-space layers (S4D, Gu et al. 2022) as a causal language model.

Each channel runs a complex diagonal linear recurrence x_t = dA * x_{t-1} + dB * u_t,
y_t = 2 Re(C . x_t) + D u_t. Over a chunk of T tokens it is computed in parallel: short
chunks (a speculative step) through the closed form for every state of the chunk, long
chunks (a prompt) by an FFT convolution plus the closed form for the final state only.

Rollback never re-runs the prefix: the state keeps the recurrent state after each
position since the last rollback (up to `HISTORY` positions), and rolling back selects
the state at the accepted length, as in the S4 stepping API where a step never mutates
its input.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import check_lengths, valid_counts
from .decoder_only import RMSNorm

# Chunks up to this length keep the state after every position (for rollback).
SHORT_CHUNK = 32
# Positions of state history kept per row; rollback can reach this far back at most.
HISTORY = 128


@dataclass
class S4DConfig:
    vocab_size: int
    # Width of the residual stream (= number of SSM channels).
    hidden_size: int = 128
    # Number of S4D blocks.
    num_layers: int = 2
    # Complex modes per channel (the state size N).
    state_dim: int = 32
    # Width of each block's SwiGLU MLP; None = 2 * hidden_size.
    intermediate_size: int | None = None
    # Range of the initial discretization steps (log-uniform).
    dt_min: float = 0.001
    dt_max: float = 0.1
    # Epsilon of RMSNorm.
    rms_norm_eps: float = 1e-5
    # Share the input embedding with the output projection.
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "state_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"s4d option {name} must be an integer >= 1, got {value!r}")
        if self.intermediate_size is None:
            self.intermediate_size = 2 * self.hidden_size
        if not 0 < self.dt_min <= self.dt_max:
            raise ValueError(f"s4d options need 0 < dt_min <= dt_max, got {self.dt_min}, {self.dt_max}")


class SSMState:
    """Per-generation state: per layer the complex states (B, M, H, N) at positions
    base[b] .. base[b] + M - 1 of each row, and each row's current length."""

    def __init__(self, history: list[torch.Tensor]):
        self.history = history
        self.base = [0] * history[0].shape[0]
        self.lengths = [0] * history[0].shape[0]

    def offsets(self) -> list[int]:
        return [n - b for n, b in zip(self.lengths, self.base)]


class S4DKernel(nn.Module):
    """One diagonal SSM per channel, S4D-Lin initialisation, zero-order-hold discretization."""

    def __init__(self, hidden: int, state_dim: int, dt_min: float, dt_max: float):
        super().__init__()
        log_dt = torch.rand(hidden) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
        self.log_dt = nn.Parameter(log_dt)
        self.log_a_real = nn.Parameter(torch.full((hidden, state_dim), math.log(0.5)))
        self.a_imag = nn.Parameter(math.pi * torch.arange(state_dim).float().repeat(hidden, 1))
        self.c = nn.Parameter(torch.randn(hidden, state_dim, 2) * (0.5 ** 0.5))
        self.d = nn.Parameter(torch.randn(hidden))

    def discrete(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dt*A, dB and C, each (H, N) complex (dA = exp(dt*A))."""
        a = torch.complex(-self.log_a_real.exp(), self.a_imag)
        dt_a = self.log_dt.exp()[:, None] * a
        d_b = (dt_a.exp() - 1) / a
        return dt_a, d_b, torch.view_as_complex(self.c.contiguous())

    def forward(self, u: torch.Tensor, x0: torch.Tensor, counts: list[int], keep_all: bool):
        """u (B, T, H) real, x0 (B, H, N) complex.

        Returns y (B, T, H) and the states: (B, T, H, N) after every position when
        keep_all, else (B, H, N) after counts[b] positions of row b.
        """
        batch, width, _ = u.shape
        dt_a, d_b, c = self.discrete()
        uc = u.to(d_b.dtype)
        if width == 1:  # one recurrent step
            state = dt_a.exp() * x0 + d_b * uc[:, 0, :, None]  # (B, H, N)
            y = 2 * torch.einsum("bhn,hn->bh", state, c).real[:, None] + self.d * u
            return y, (state[:, None] if keep_all else state)
        steps = torch.arange(width + 1, device=u.device)
        powers = torch.exp(dt_a[..., None] * steps)  # (H, N, T+1): dA^t
        if keep_all:
            # x_t = dA^(t+1) x0 + sum_{s<=t} dA^(t-s) dB u_s, every t at once.
            lag = steps[:width, None] - steps[None, :width]  # (T, T): t - s
            decay = powers[..., lag.clamp(min=0)] * (lag >= 0)  # (H, N, T, T)
            states = torch.einsum("hnts,bsh->bthn", decay, uc) * d_b
            states = states + torch.einsum("hnt,bhn->bthn", powers[..., 1:], x0)
            y = 2 * torch.einsum("bthn,hn->bth", states, c).real
            return y + self.d * u, states
        # Long chunk: outputs by FFT convolution with the kernel K_l = 2 Re(C dB dA^l).
        kernel = 2 * torch.einsum("hn,hnl->hl", c * d_b, powers[..., :width]).real  # (H, T)
        size = 2 * width
        conv = torch.fft.irfft(torch.fft.rfft(u.float().transpose(1, 2), n=size)
                               * torch.fft.rfft(kernel, n=size), n=size)[..., :width]  # (B, H, T)
        from_x0 = 2 * torch.einsum("hnt,bhn,hn->bth", powers[..., 1:], x0, c).real
        y = conv.transpose(1, 2).to(u.dtype) + from_x0 + self.d * u
        if counts is None:
            return y, None
        # Final state per row: x_L = dA^L x0 + sum_{s<L} dA^(L-1-s) dB u_s.
        finals = []
        for row, length in enumerate(counts):
            weights = powers[..., :length].flip(-1)  # (H, N, L): dA^(L-1-s)
            state = torch.einsum("hns,sh->hn", weights, uc[row, :length]) * d_b
            finals.append(state + powers[..., length] * x0[row])
        return y, torch.stack(finals)


class S4DBlock(nn.Module):
    def __init__(self, cfg: S4DConfig):
        super().__init__()
        self.ssm_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ssm = S4DKernel(cfg.hidden_size, cfg.state_dim, cfg.dt_min, cfg.dt_max)
        self.ssm_out = nn.Linear(cfg.hidden_size, 2 * cfg.hidden_size, bias=False)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, x0, counts, keep_all):
        y, states = self.ssm(self.ssm_norm(x), x0, counts, keep_all)
        x = x + F.glu(self.ssm_out(F.gelu(y)), dim=-1)
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)), states


class S4DLM(nn.Module):
    """Causal LM implementing the model protocol of `speculative.models.base`."""

    model_type = "s4d"
    max_seq_len = None

    def __init__(self, cfg: S4DConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)  # small, so blocks shape the output
        self.layers = nn.ModuleList(S4DBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def options(self) -> dict:
        return asdict(self.cfg)

    def new_state(self, batch_size: int, capacity: int | None = None) -> SSMState:
        shape = (batch_size, 1, self.cfg.hidden_size, self.cfg.state_dim)
        return SSMState([torch.zeros(shape, dtype=torch.complex64, device=self.device) for _ in self.layers])

    def rollback(self, state: SSMState, lengths: list[int]) -> None:
        check_lengths(lengths, state.lengths, lowest=state.base)
        state.lengths = list(lengths)
        self._collapse(state)

    def select_rows(self, state: SSMState, rows: list[int]) -> None:
        index = torch.tensor(rows, device=self.device)
        state.history = [h.index_select(0, index) for h in state.history]
        state.base = [state.base[r] for r in rows]
        state.lengths = [state.lengths[r] for r in rows]

    def _collapse(self, state: SSMState) -> None:
        """Keep only each row's current state (history starts again at its length)."""
        rows = torch.arange(len(state.lengths), device=self.device)
        at = torch.tensor(state.offsets(), device=self.device)
        state.history = [h[rows, at][:, None] for h in state.history]
        state.base = list(state.lengths)

    def forward(self, tokens: torch.Tensor, state: SSMState | None = None,
                num_valid: list[int] | None = None, keep_logits: bool = True) -> torch.Tensor | None:
        """Append tokens (B, T) to every row of `state`; returns logits (B, T, V).

        Without a state, scores the tokens as whole sequences from a zero state (training).
        keep_logits=False skips the output projection (prompt processing needs no logits).
        """
        if state is None:
            x = self.embed_tokens(tokens)
            zero = torch.zeros(tokens.shape[0], self.cfg.hidden_size, self.cfg.state_dim, dtype=torch.complex64,
                               device=tokens.device)
            for layer in self.layers:
                x, _ = layer(x, zero, None, keep_all=False)
            return self.lm_head(self.norm(x))
        batch, width = tokens.shape
        counts = valid_counts(num_valid, batch, width)
        depth = state.history[0].shape[1]
        if any(offset != depth - 1 for offset in state.offsets()):
            self._collapse(state)  # some row's latest history is padding: start afresh
        keep_all = width <= SHORT_CHUNK
        x = self.embed_tokens(tokens)
        new_history = []
        for layer, history in zip(self.layers, state.history):
            x, states = layer(x, history[:, -1], counts, keep_all)
            if keep_all:
                new_history.append(torch.cat([history, states], dim=1)[:, -HISTORY:])
            else:
                new_history.append(states[:, None])
        state.history = new_history
        state.lengths = [n + c for n, c in zip(state.lengths, counts)]
        if keep_all:
            depth = new_history[0].shape[1]
            # Row b's current state sits at index (counts[b] - width) from the end.
            state.base = [n - (depth - 1) + (width - c) for n, c in zip(state.lengths, counts)]
        else:
            state.base = list(state.lengths)
        return self.lm_head(self.norm(x)) if keep_logits else None
