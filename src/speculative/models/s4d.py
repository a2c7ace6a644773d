"""A stack of diagonal state-space layers (S4D, Gu et al. 2022) as a causal language model.

Each channel runs a complex diagonal linear recurrence x_t = dA * x_{t-1} + dB * u_t,
y_t = 2 Re(C . x_t) + D u_t. Long chunks (a prompt) are computed in parallel: an FFT
convolution for the outputs plus the closed form for each row's final state. Short
chunks (a speculative step, at most SHORT_CHUNK tokens) run the recurrence and keep the
state after every position, which is what rollback needs.

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

from .base import OutputHead, check_lengths, output, valid_counts
from .layers import RMSNorm

# Chunks up to this length keep the state after every position (for rollback).
SHORT_CHUNK = 32
# Most states kept per row; a longer run of forwards without rollback keeps only the last.
HISTORY = 64


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
        # Upper bounds far above any real model's: a wrong config is refused before allocation.
        bounds = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "num_layers": 1024, "state_dim": 1 << 12,
                  "intermediate_size": 1 << 18}
        for name, high in bounds.items():
            value = getattr(self, name)
            if value is None and name == "intermediate_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise ValueError(f"s4d option {name} must be an integer in 1..{high}, got {value!r}")
        if self.intermediate_size is None:
            self.intermediate_size = 2 * self.hidden_size
        for name in ("dt_min", "dt_max", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"s4d option {name} must be a finite number >= 0, got {value!r}")
        if not 0 < self.dt_min <= self.dt_max:
            raise ValueError(f"s4d options need 0 < dt_min <= dt_max, got {self.dt_min}, {self.dt_max}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"s4d option tie_embeddings must be true or false, got {self.tie_embeddings!r}")


class SSMState:
    """Per-generation state: per layer a buffer (B, capacity, H, N) whose first `depth`
    entries are the complex states of row b at lengths base[b] .. base[b] + depth - 1,
    and each row's current length. The buffer grows on demand, up to HISTORY entries."""

    def __init__(self, history: list[torch.Tensor]):
        self.history = history
        self.depth = 1
        self.base = [0] * history[0].shape[0]
        self.lengths = [0] * history[0].shape[0]

    def offsets(self) -> list[int]:
        return [n - b for n, b in zip(self.lengths, self.base)]


class S4DKernel(nn.Module):
    """One diagonal SSM per channel, S4D-Lin initialisation, zero-order-hold discretization."""

    # Stays float32 when the model runs in 16 bits: rounding would move the poles.
    keep_float32 = True

    def __init__(self, hidden: int, state_dim: int, dt_min: float, dt_max: float):
        super().__init__()
        log_dt = torch.rand(hidden) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
        self.log_dt = nn.Parameter(log_dt)
        self.log_a_real = nn.Parameter(torch.full((hidden, state_dim), math.log(0.5)))
        self.a_imag = nn.Parameter(math.pi * torch.arange(state_dim).float().repeat(hidden, 1))
        self.c = nn.Parameter(torch.randn(hidden, state_dim, 2) * (0.5 ** 0.5))
        self.d = nn.Parameter(torch.randn(hidden))
        self._discrete = None

    def discrete(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """dt*A, dA = exp(dt*A), dB and C, each (H, N) complex.

        Cached while the parameters are unchanged and no gradient is needed: a complex exp
        costs more than the rest of a decoding step."""
        params = (self.log_dt, self.log_a_real, self.a_imag, self.c)
        key = tuple((p.data_ptr(), p._version) for p in params)
        if not torch.is_grad_enabled() and self._discrete is not None and self._discrete[0] == key:
            return self._discrete[1]
        a = torch.complex(-self.log_a_real.exp(), self.a_imag)
        dt_a = self.log_dt.exp()[:, None] * a
        d_a = dt_a.exp()
        values = (dt_a, d_a, (d_a - 1) / a, torch.view_as_complex(self.c.contiguous()))
        if not torch.is_grad_enabled():
            self._discrete = (key, values)
        return values

    def forward(self, u: torch.Tensor, x0: torch.Tensor, counts: list[int], keep_all: bool):
        """u (B, T, H) real, x0 (B, H, N) complex.

        Returns y (B, T, H) and the states: (B, T, H, N) after every position when
        keep_all, else (B, H, N) after counts[b] positions of row b.
        """
        batch, width, _ = u.shape
        dt_a, d_a, d_b, c = self.discrete()
        uc = u.to(d_b.dtype)
        if width == 1:  # one recurrent step
            state = d_a * x0 + d_b * uc[:, 0, :, None]  # (B, H, N)
            y = 2 * torch.einsum("bhn,hn->bh", state, c).real[:, None] + self.d * u
            return y, (state[:, None] if keep_all else state)
        steps = torch.arange(width + 1, device=u.device)
        powers = torch.exp(dt_a[..., None] * steps)  # (H, N, T+1): dA^t
        if keep_all:
            # A short chunk: the recurrence itself, keeping every state (cheaper than any
            # closed form at these lengths).
            inputs = d_b * uc[..., None]  # (B, T, H, N)
            state, states = x0, []
            for t in range(width):
                state = d_a * state + inputs[:, t]
                states.append(state)
            states = torch.stack(states, 1)  # (B, T, H, N)
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
        x = x + F.glu(self.ssm_out(F.gelu(y.to(x.dtype))), dim=-1)  # the SSM itself runs in float32
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
        state.lengths = list(lengths)  # the next forward starts from the state at these lengths

    def select_rows(self, state: SSMState, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        state.history = [h.index_select(0, index) for h in state.history]
        state.base = [state.base[r] for r in rows]
        state.lengths = [state.lengths[r] for r in rows]

    def add_rows(self, state: SSMState, new: SSMState, capacity: int | None = None) -> None:
        """Append the rows of `new` (their current states only: rows join between steps)."""
        grown = []
        for mine, theirs in zip(self._current(state), self._current(new)):
            buffer = mine.new_zeros((len(mine) + len(theirs), state.history[0].shape[1], *mine.shape[1:]))
            buffer[:len(mine), 0] = mine
            buffer[len(mine):, 0] = theirs
            grown.append(buffer)
        state.history, state.depth = grown, 1
        state.lengths = state.lengths + list(new.lengths)
        state.base = list(state.lengths)

    def _current(self, state: SSMState) -> list[torch.Tensor]:
        """Per layer, each row's state at its current length (B, H, N)."""
        rows = torch.arange(len(state.lengths), device=self.device)
        at = torch.tensor(state.offsets(), device=self.device, dtype=torch.long)
        return [buffer[rows, at] for buffer in state.history]

    def _collapse(self, state: SSMState) -> None:
        """Keep only each row's current state, at index 0 (history starts again at its length)."""
        for buffer, current in zip(state.history, self._current(state)):
            buffer[:, 0] = current
        state.depth = 1
        state.base = list(state.lengths)

    def _make_room(self, state: SSMState, width: int) -> None:
        """Ensure `width` more states fit after the first `depth` entries of every buffer."""
        if state.depth + width > HISTORY:
            self._collapse(state)
        capacity = state.history[0].shape[1]
        if state.depth + width > capacity:
            capacity = min(HISTORY, max(2 * capacity, state.depth + width))
            grown = []
            for buffer in state.history:
                new = buffer.new_zeros((buffer.shape[0], capacity, *buffer.shape[2:]))
                new[:, :state.depth] = buffer[:, :state.depth]
                grown.append(new)
            state.history = grown

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input embeddings (B, T, H) of tokens (what a draft head reads beside the features)."""
        return self.embed_tokens(tokens)

    def forward(self, tokens: torch.Tensor, state: SSMState | None = None, num_valid: list[int] | None = None,
                keep_logits: bool = True, return_hidden: bool = False, positions: torch.Tensor | None = None):
        """Append tokens (B, T) to every row of `state`; returns float32 logits (B, T, V).

        A recurrence reads tokens in order: `positions`, when given, must be each row's
        next positions (a token tree needs a model with attention). Without a state, scores
        the tokens as whole sequences from a zero state (training). keep_logits=False skips
        the output projection (prompt processing needs no logits); return_hidden=True
        returns (logits or None, the final hidden states (B, T, H)).
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
        if positions is not None:
            expected = torch.tensor(state.lengths, device=positions.device)[:, None] + torch.arange(
                width, device=positions.device)
            if tuple(positions.shape) != (batch, width) or not torch.equal(positions, expected):
                raise ValueError("s4d models read tokens in sequence: positions must be each row's next positions "
                                 f"{expected.tolist()}, got {positions.tolist()}")
        if any(offset != state.depth - 1 for offset in state.offsets()):
            self._collapse(state)  # a rollback, or padding in some row: start from each row's state
        keep_all = width <= SHORT_CHUNK
        if keep_all:
            self._make_room(state, width)
        depth = state.depth
        x = self.embed_tokens(tokens)
        for layer, buffer in zip(self.layers, state.history):
            x, states = layer(x, buffer[:, depth - 1], counts, keep_all)
            if keep_all:
                buffer[:, depth:depth + width] = states  # row b's state after t + 1 tokens at depth + t
            else:
                buffer[:, 0] = states
        state.lengths = [n + c for n, c in zip(state.lengths, counts)]
        if keep_all:
            state.depth += width  # base stays: row b's current state sits at depth - 1 + counts[b]
        else:
            state.depth, state.base = 1, list(state.lengths)
        return output(self.lm_head, self.norm(x), keep_logits, return_hidden)

    def output_head(self, token_ids: torch.Tensor | None = None) -> nn.Module:
        """hidden -> float32 logits, over `token_ids` only when given (a reduced draft vocabulary)."""
        return OutputHead(self.lm_head, token_ids)
