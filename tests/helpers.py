"""Tiny seeded models and a Markov-table model for exact distributions."""

from __future__ import annotations

import torch

from speculative import build_model
from speculative.models import isa

TINY_OPTS = {
    "decoder_only": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "max_seq_len": 256},
    "s4d": {"hidden_size": 32, "num_layers": 2, "state_dim": 8},
}


def kernel_isas(amx: bool = False) -> list[str]:
    """The compiled kernels' instruction sets this CPU runs (models/isa.py), "auto" last: each
    path's exactness is tested on every machine that can execute it (AMX for the int8 product only)."""
    levels = [level for level in isa.runnable() if amx or level != "amx"]
    return [*levels, "auto"]


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


def reads_prompts_without_the_last_block(model, prompt_length: int = 37, capacity: int = 64, mlp=None,
                                         tensors=lambda state: state.keys + state.values) -> bool:
    """A prompt read without logits skips the last block's MLP (`mlp`, by default
    model.layers[-1].mlp), yet leaves the cache that a read with logits leaves (`tensors` of
    the state), to the bit, and the next forward's logits the same. Asserts what it checks;
    True when all holds."""
    vocab = getattr(model, "vocab_size", None) or model.cfg.vocab_size
    mlp = model.layers[-1].mlp if mlp is None else mlp
    gen = torch.Generator().manual_seed(prompt_length)
    prompt, new = torch.randint(0, vocab, (1, prompt_length), generator=gen), torch.randint(0, vocab, (1, 3),
                                                                                          generator=gen)
    calls = []
    hook = mlp.register_forward_hook(lambda *args: calls.append(1))
    try:
        with torch.inference_mode():
            full, bare = model.new_state(1, capacity), model.new_state(1, capacity)
            model.forward(prompt, full)
            assert len(calls) == 1
            assert model.forward(prompt, bare, keep_logits=False) is None
            assert len(calls) == 1, "the last block's MLP ran for a prompt that needs no logits"
            assert bare.lengths == full.lengths
            assert len(tensors(bare)) == len(tensors(full)) > 0
            for ours, theirs in zip(tensors(bare), tensors(full)):
                assert torch.equal(ours, theirs)
            assert torch.equal(model.forward(new, bare), model.forward(new, full))
    finally:
        hook.remove()
    return True
