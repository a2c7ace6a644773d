"""Built-in models: chunked == stepwise, rollback == fresh run, ragged rows == separate rows."""

import pytest
import torch

from speculative import build_pair, load_model, output_size, save_model
from speculative.models.s4d import SHORT_CHUNK
from tests.helpers import reads_prompts_without_the_last_block, tiny

TYPES = ["decoder_only", "s4d"]


def tokens(n, seed=0, vocab=64):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def run(model, chunks):
    """Logits of feeding the chunks one after another into a fresh state."""
    state = model.new_state(1, 256)
    with torch.inference_mode():
        return torch.cat([model.forward(c, state) for c in chunks], 1), state


@pytest.mark.parametrize("model_type", TYPES)
def test_recurrent_steps_equal_parallel_forward(model_type):
    model = tiny(model_type, seed=1)
    ids = tokens(2 * SHORT_CHUNK + 7)  # longer than a short chunk: the FFT path for s4d
    whole, _ = run(model, [ids])
    steps, _ = run(model, list(ids.split(1, dim=1)))
    chunks, _ = run(model, list(ids.split(5, dim=1)))
    torch.testing.assert_close(steps, whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chunks, whole, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["float32", "fused", "bfloat16", "int8"])
def test_a_prompt_without_logits_skips_the_last_blocks_outputs_with_the_same_cache(tmp_path, variant):
    model = tiny("decoder_only", seed=3, num_kv_heads=2)
    if variant == "fused":
        model.fuse()
    elif variant == "bfloat16":
        model = model.to(torch.bfloat16)
    elif variant == "int8":
        from speculative.models.kernels import int8_available

        if not int8_available("cpu"):
            pytest.skip("this torch build has no fbgemm")
        save_model(model, tmp_path / "m")
        model = load_model(tmp_path / "m", dtype="int8")  # fused, the compiled attention where it builds
    assert reads_prompts_without_the_last_block(model)


@pytest.mark.parametrize("model_type", TYPES)
def test_rollback_then_continue_equals_a_fresh_run(model_type):
    model = tiny(model_type, seed=2)
    ids = tokens(40, seed=1)
    _, state = run(model, [ids[:, :20]])
    with torch.inference_mode():
        model.forward(ids[:, 20:25], state)        # 5 drafted tokens scored at once
        model.forward(ids[:, 25:27], state)        # and two more
        model.rollback(state, [22])                # keep only 2 of them
        after = model.forward(ids[:, 30:34], state)
    fresh, _ = run(model, [torch.cat([ids[:, :22], ids[:, 30:34]], 1)])
    torch.testing.assert_close(after, fresh[:, -4:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", TYPES)
def test_ragged_rows_equal_separate_rows(model_type):
    model = tiny(model_type, seed=3)
    rows = [tokens(n, seed=n)[0].tolist() for n in (3, 11, 30)]
    width = max(map(len, rows))
    batch = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    state = model.new_state(3, 64)
    with torch.inference_mode():
        logits = model.forward(batch, state, num_valid=[len(r) for r in rows])
        model.rollback(state, [len(r) - 1 for r in rows])  # each row drops its last token
        nxt = model.forward(torch.tensor([[5, 6], [7, 8], [9, 10]]), state, num_valid=[2, 1, 2])
    for i, r in enumerate(rows):
        alone, _ = run(model, [torch.tensor([r])])
        torch.testing.assert_close(logits[i, :len(r)], alone[0], atol=1e-4, rtol=1e-4)
        extra = [[5, 6], [7], [9, 10]][i]
        cont, _ = run(model, [torch.tensor([r[:-1] + extra])])
        torch.testing.assert_close(nxt[i, :len(extra)], cont[0, -len(extra):], atol=1e-4, rtol=1e-4)
    assert state.lengths == [4, 11, 31]


def test_select_rows_keeps_the_chosen_rows():
    model = tiny("s4d", seed=4)
    state = model.new_state(3, 64)
    ids = tokens(3 * 6).view(3, 6)
    with torch.inference_mode():
        model.forward(ids, state)
        model.select_rows(state, [2, 0])
        out = model.forward(torch.tensor([[1], [2]]), state)
    alone, _ = run(model, [torch.cat([ids[2:3], torch.tensor([[1]])], 1)])
    torch.testing.assert_close(out[0, -1], alone[0, -1], atol=1e-4, rtol=1e-4)


def test_rollback_outside_the_kept_range_is_refused():
    model = tiny("s4d", seed=5)
    _, state = run(model, [tokens(40)])  # a prompt-sized chunk keeps only its final state
    with torch.inference_mode():
        model.forward(tokens(3), state)
        model.rollback(state, [41])
        with pytest.raises(ValueError, match="allowed 40..41"):
            model.rollback(state, [39])
        with pytest.raises(ValueError, match="cannot roll back"):
            model.rollback(state, [42])


def test_s4d_keeps_a_bounded_history_without_rollbacks():
    model = tiny("s4d", seed=6)
    ids = tokens(150)
    state = model.new_state(1)
    with torch.inference_mode():
        steps = torch.cat([model.forward(t, state) for t in ids.split(1, dim=1)], 1)
    assert state.history[0].shape[1] <= 64
    torch.testing.assert_close(steps, run(model, [ids])[0], atol=1e-4, rtol=1e-4)


def test_build_pair_defaults_and_output_size():
    draft, verifier = build_pair(100, seed=0)
    assert (draft.cfg.hidden_size, draft.cfg.num_layers) == (128, 2)
    assert (verifier.cfg.hidden_size, verifier.cfg.num_layers) == (512, 8)
    assert output_size() == 512 and output_size({"hidden_size": 256}) == 256
    draft, _ = build_pair(100, embed_dim=64, draft_model_type="s4d", seed=0)
    assert draft.cfg.hidden_size == 64 and draft.model_type == "s4d"


def test_build_pair_is_seeded():
    a = build_pair(50, seed=3, verifier_model_opts={"hidden_size": 64, "num_layers": 1})[1]
    b = build_pair(50, seed=3, verifier_model_opts={"hidden_size": 64, "num_layers": 1})[1]
    c = build_pair(50, seed=4, verifier_model_opts={"hidden_size": 64, "num_layers": 1})[1]
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


@pytest.mark.parametrize("bad, message", [
    (dict(draft_model_type="rnn"), "unknown model type 'rnn'; allowed: decoder_only, s4d"),
    (dict(verifier_model_opts={"width": 3}), "unknown decoder_only option"),
    (dict(draft_model_type="s4d", draft_model_opts={"num_heads": 2}), "unknown s4d option"),
    (dict(verifier_model_opts={"hidden_size": 30, "num_heads": 4}), "must be a multiple of num_heads"),
])
def test_build_pair_rejects_bad_options(bad, message):
    with pytest.raises(ValueError, match=message):
        build_pair(100, **bad)


@pytest.mark.parametrize("model_type", TYPES)
def test_save_and_load_round_trip(tmp_path, model_type):
    model = tiny(model_type, seed=6)
    save_model(model, tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_model(tmp_path / "m")
    ids = tokens(12)
    torch.testing.assert_close(run(loaded, [ids])[0], run(model, [ids])[0])


def test_load_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "missing")
    save_model(tiny("decoder_only"), tmp_path / "m")
    config = (tmp_path / "m" / "config.json")
    config.write_text(config.read_text().replace('"hidden_size": 32', '"hidden_size": 64'))
    with pytest.raises(ValueError, match="do not match"):
        load_model(tmp_path / "m")


def test_large_weights_are_saved_in_shards(tmp_path, monkeypatch):
    import speculative.models as models

    monkeypatch.setattr(models, "SHARD_BYTES", 20_000)
    model = tiny("decoder_only", seed=7)
    save_model(model, tmp_path / "m")
    shards = sorted(p.name for p in (tmp_path / "m").glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    ids = tokens(9)
    torch.testing.assert_close(run(load_model(tmp_path / "m"), [ids])[0], run(model, [ids])[0])
