"""Tiny seeded models and a Markov-table model for exact distributions."""

from __future__ import annotations

import torch

from speculative import build_model

TINY_OPTS = {
    "decoder_only": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "max_seq_len": 256},
    "s4d": {"hidden_size": 32, "num_layers": 2, "state_dim": 8},
}


def tiny(model_type: str, vocab: int = 64, seed: int = 0, **opts):
    return build_model(model_type, vocab, {**TINY_OPTS[model_type], **opts}, seed=seed)


def perturbed(model, scale: float, seed: int):
    """A copy of `model` with noise on every weight: a draft that agrees only sometimes."""
    gen = torch.Generator().manual_seed(seed)
    copy = type(model)(model.cfg).eval().requires_grad_(False)
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for param in copy.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * scale * param.std().clamp(min=1e-3))
    return copy


def sharpen(model, factor: float):
    """Scale the output logits so that random models have clearly peaked distributions."""
    with torch.no_grad():
        model.norm.weight.mul_(factor)
    return model


class TableState:
    def __init__(self, batch: int):
        self.lengths = [0] * batch
        self.last = [0] * batch


class TableModel:
    """A Markov model: logits of the next token are table[previous token].

    Implements the model protocol with trivial state, so that exact target distributions
    are easy to write down in statistical tests.
    """

    max_seq_len = None
    device = torch.device("cpu")

    def __init__(self, table: torch.Tensor):
        self.table = table.float()
        self.vocab_size = table.shape[0]

    def new_state(self, batch_size, capacity=None):
        state = TableState(batch_size)
        state.tokens = [[] for _ in range(batch_size)]
        return state

    def forward(self, tokens, state, num_valid=None, keep_logits=True):
        counts = num_valid or [tokens.shape[1]] * tokens.shape[0]
        for row, (seq, n) in enumerate(zip(tokens.tolist(), counts)):
            state.tokens[row] = state.tokens[row][:state.lengths[row]] + seq[:n]
            state.lengths[row] += n
        return self.table[tokens]  # (B, T, V)

    def rollback(self, state, lengths):
        for row, n in enumerate(lengths):
            assert 0 <= n <= state.lengths[row]
            state.lengths[row] = n
            state.tokens[row] = state.tokens[row][:n]

    def select_rows(self, state, rows):
        state.lengths = [state.lengths[r] for r in rows]
        state.tokens = [state.tokens[r] for r in rows]
