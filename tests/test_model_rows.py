"""The model protocol's row operations on every model kind: rows join a running state
(add_rows), leave it in any order (select_rows), forwards take explicit positions, and the
transformers adapter keeps its cache bounded. Each result equals the row run alone."""

import pytest
import torch

from tests.helpers import tiny

KINDS = ["decoder_only", "s4d", "transformers"]


def make(kind, seed=1):
    if kind == "transformers":
        pytest.importorskip("transformers")
        from tests.test_transformers import llama
        from speculative.models.hf import HFModel
        return HFModel(llama(seed, vocab=64))
    return tiny(kind, seed=seed)


def ids(n, seed):
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(model, tokens):
    """Logits of one sequence fed in one forward into a fresh state."""
    with torch.inference_mode():
        return model.forward(torch.tensor([tokens]), model.new_state(1, len(tokens) + 1))[0]


def feed(model, state, rows, capacity=None):
    """Append one list of tokens per row (ragged: padded, num_valid) and return the logits."""
    width = max(1, max(map(len, rows)))
    batch = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    return model.forward(batch, state, num_valid=[len(r) for r in rows])


@pytest.mark.parametrize("kind", KINDS)
def test_rows_added_to_a_running_state_continue_like_rows_alone(kind):
    model = make(kind)
    seqs = [ids(12, 1), ids(5, 2), ids(20, 3), ids(7, 4)]
    with torch.inference_mode():
        running = model.new_state(2, 64)
        feed(model, running, [seqs[0][:10], seqs[1][:5]])
        feed(model, running, [seqs[0][10:12] + [9, 9], [3]])  # drafts, then a ragged rollback
        model.rollback(running, [12, 5])
        joining = model.new_state(2, 32)
        feed(model, joining, [seqs[2], seqs[3]])
        model.add_rows(running, joining, 64)
        assert running.lengths == [12, 5, 20, 7]
        model.select_rows(running, [3, 1, 2])  # the first row leaves; the last takes its place
        tails = [[5, 6], [7, 8, 9], [1]]
        out = feed(model, running, tails)
    for i, (row, tail) in enumerate(zip([3, 1, 2], tails)):
        expected = alone(model, seqs[row] + tail)[-len(tail):]
        torch.testing.assert_close(out[i, :len(tail)], expected, atol=1e-4, rtol=1e-4)
    assert running.lengths == [9, 8, 21]


@pytest.mark.parametrize("kind", KINDS)
def test_rows_join_a_state_whose_rows_all_left(kind):
    model = make(kind, seed=2)
    with torch.inference_mode():
        state = model.new_state(1, 16)
        feed(model, state, [ids(6, 5)])
        model.select_rows(state, [])
        joining = model.new_state(1, 16)
        feed(model, joining, [ids(9, 6)])
        model.add_rows(state, joining, 16)
        out = feed(model, state, [[4, 2]])
    torch.testing.assert_close(out[0], alone(model, ids(9, 6) + [4, 2])[-2:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["decoder_only", "transformers"])
def test_explicit_positions_are_the_rotary_positions(kind):
    """Rotary attention depends on relative positions only: shifting every position of a
    sequence leaves its logits as they are, and moving one token changes them."""
    model = make(kind, seed=3)
    tokens = torch.tensor([ids(10, 7)])
    with torch.inference_mode():
        plain = model.forward(tokens, model.new_state(1, 16))
        shifted = model.forward(tokens, model.new_state(1, 16), positions=torch.arange(10)[None] + 7)
        gap = torch.arange(10)[None].clone()
        gap[0, -1] = 12
        moved = model.forward(tokens, model.new_state(1, 16), positions=gap)
    torch.testing.assert_close(shifted, plain, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(moved[:, :-1], plain[:, :-1], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(moved[:, -1], plain[:, -1], atol=1e-3)


def test_a_recurrent_model_refuses_positions_out_of_sequence():
    model = make("s4d")
    state = model.new_state(1)
    with torch.inference_mode():
        model.forward(torch.tensor([[1, 2, 3]]), state, positions=torch.tensor([[0, 1, 2]]))  # in sequence: fine
        with pytest.raises(ValueError, match="s4d models read tokens in sequence"):
            model.forward(torch.tensor([[4, 5]]), state, positions=torch.tensor([[3, 3]]))


def test_a_full_row_shares_a_forward_with_rows_that_feed_more():
    """Padding past a row's num_valid goes to the scratch slot, not past its capacity."""
    model = make("decoder_only", seed=4)
    a, b = ids(15, 8), ids(3, 9)
    with torch.inference_mode():
        state = model.new_state(2, 16)
        feed(model, state, [a, b])
        out = feed(model, state, [[7], [1, 2, 3, 4, 5, 6, 7, 8]])  # row 0 reaches its capacity of 16
        with pytest.raises(ValueError, match="KV cache holds 16 positions; this forward needs 17"):
            feed(model, state, [[1], []])
    torch.testing.assert_close(out[0, 0], alone(model, a + [7])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1], alone(model, b + list(range(1, 9)))[-8:], atol=1e-4, rtol=1e-4)


def test_the_transformers_cache_compacts_its_holes():
    """Rows that keep different numbers of drafts leave holes (here each step one row of three
    keeps all four tokens, the others none); the cache compacts them, so its slots stay
    within twice the longest row, and every row still reads as if alone."""
    model = make("transformers", seed=5)
    seqs = [ids(4, 10), ids(6, 11), ids(5, 12)]
    shrank = 0
    with torch.inference_mode():
        state = model.new_state(3)
        feed(model, state, seqs)
        for step in range(30):
            drafts = [[(step + i + j) % 64 for i in range(4)] for j in range(3)]
            before = state.valid.shape[1]
            feed(model, state, drafts)
            seqs = [s + (d if j == step % 3 else []) for j, (s, d) in enumerate(zip(seqs, drafts))]
            model.rollback(state, [len(s) for s in seqs])
            slots = state.cache.layers[0].keys.shape[2]
            shrank += slots < before
            assert slots == state.valid.shape[1] <= 2 * max(state.lengths) + 8
        out = feed(model, state, [[1], [2], [3]])
    assert shrank > 0  # without compaction the slots would grow by 4 every step
    assert state.valid.sum(1).tolist() == [len(s) + 1 for s in seqs]
    for i, tail in enumerate([[1], [2], [3]]):
        torch.testing.assert_close(out[i, 0], alone(model, seqs[i] + tail)[-1], atol=1e-4, rtol=1e-4)
