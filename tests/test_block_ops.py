"""The compiled block operations (csrc/block_ops.cpp): RMSNorm, cached attention and SwiGLU's
gate in one call each, for the int8 and k-quant models. Each is checked against PyTorch's operations (close:
the order of float operations differs) and for what exactness needs, to the bit: a token's
result alone equals its result among others (rows, widths, a shorter span of key blocks),
every instruction set gives the same bits, and the cache is written as the Python path
writes it. Whole models: test_int8.py and test_kquant.py run them (widths_agree, greedy
identity, G-tests) on models that use these operations."""

import pytest
import torch
import torch.nn.functional as F

from speculative import load_model, save_model
from speculative.models.attention import cached_attention, rope_table, rotate
from tests.helpers import kernel_isas, tiny

B, T, H, G, D, S = 2, 5, 6, 2, 64, 1024


def isas(ops):
    return kernel_isas()


def test_rms_norm_is_pytorchs_and_each_row_gets_its_bits_alone_on_every_instruction_set(ops):
    torch.manual_seed(0)
    x, weight = torch.randn(3, 5, 200) * 3, torch.rand(200) + 0.5  # 200: lanes and a remainder
    results = [ops.block_rms_norm(x, weight, 1e-6, isa) for isa in isas(ops)]
    assert all(torch.equal(result, results[0]) for result in results)
    torch.testing.assert_close(results[0], F.rms_norm(x, (200,), weight, 1e-6))
    assert all(torch.equal(ops.block_rms_norm(x[i, j], weight, 1e-6, "auto"), results[0][i, j])
               for i in range(3) for j in range(5))


def inputs(starts=(300, 700), head_size=D, span=S, windows=False):
    """Causal masks over the span; `windows`: each token also blind to slots more than 100 + 37 t
    behind it (a sliding window's shape, a different first slot per query), with holes (a tree's)."""
    torch.manual_seed(1)
    qkv = torch.randn(B, T, (H + 2 * G) * head_size)
    keys, values = torch.randn(B, G, S, head_size), torch.randn(B, G, S, head_size)
    cos, sin = rope_table(1e4, head_size, 0, 2048, "cpu")
    slots = torch.tensor(starts)[:, None] + torch.arange(T)
    mask = torch.arange(span)[None, None, :] <= slots[:, :, None]
    if windows:
        mask &= torch.arange(span)[None, None, :] > slots[:, :, None] - 100 - 37 * torch.arange(T)[None, :, None]
        mask[:, 1::2, ::7] = False
    return qkv, cos[slots].unsqueeze(1), sin[slots].unsqueeze(1), keys, values, slots, mask


def test_attention_writes_the_cache_as_pytorch_does_and_attends_as_cached_attention(ops):
    qkv, cos, sin, keys, values, slots, mask = inputs()
    expected_keys, expected_values = keys.clone(), values.clone()
    out = ops.block_attention(qkv, cos, sin, keys, values, slots, mask, H, G, 0.125, "auto")
    q = rotate(qkv[..., :H * D].view(B, T, H, D).transpose(1, 2), cos, sin)
    k = rotate(qkv[..., H * D:(H + G) * D].view(B, T, G, D).transpose(1, 2), cos, sin)
    v = qkv[..., (H + G) * D:].view(B, T, G, D).transpose(1, 2)
    rows = torch.arange(B)[:, None]
    expected_keys[rows, :, slots], expected_values[rows, :, slots] = k.transpose(1, 2), v.transpose(1, 2)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    expected = cached_attention(q, keys, values, mask, 0.125).transpose(1, 2).reshape(B, T, H * D)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("head_size, span, windows", [(64, 1024, False), (128, 1000, False), (256, 1010, False),
                                                      (40, 1000, False), (128, 1000, True), (40, 1000, True)])
def test_attention_gives_each_query_its_bits_alone_on_every_instruction_set(ops, head_size, span, windows):
    """Head sizes with AVX512 paths of their own (64, 128, 256) and one without; spans with
    and without a last partial block of 16 slots; masks that start at slot 0 and masks that
    start later with holes (only the slots some query sees are read); slots no query sees hold
    NaN, which must not reach any output."""
    qkv, cos, sin, keys, values, slots, mask = inputs(head_size=head_size, span=span, windows=windows)
    keys[:, :, 720:], values[:, :, 720:] = float("nan"), float("nan")  # past every query's position
    if windows:
        keys[:, :, :50], values[:, :, :50] = float("nan"), float("nan")  # before every window
        keys[:, :, 7 * 70], values[:, :, 7 * 70] = float("nan"), float("nan")  # a hole of odd tokens...
        mask[:, ::2, 7 * 70] = False  # ...and of every token
    results = [ops.block_attention(qkv, cos, sin, keys.clone(), values.clone(), slots, mask, H, G, 0.125, isa)
               for isa in isas(ops)]
    assert not results[0].isnan().any()
    assert all(torch.equal(result, results[0]) for result in results)
    q = rotate(qkv[..., :H * head_size].view(B, T, H, head_size).transpose(1, 2), cos, sin)
    written_k, written_v = keys.clone(), values.clone()
    ops.block_attention(qkv, cos, sin, written_k, written_v, slots, mask, H, G, 0.125, "auto")
    expected = cached_attention(q, written_k[:, :, :span].nan_to_num(), written_v[:, :, :span].nan_to_num(), mask, 0.125)
    torch.testing.assert_close(results[0], expected.transpose(1, 2).reshape(B, T, H * head_size))
    cache_k, cache_v = keys.clone(), values.clone()
    ops.block_attention(qkv, cos, sin, cache_k, cache_v, slots, mask, H, G, 0.125, "auto")  # all written
    for b in range(B):
        for t in range(T):
            seen = (int(slots[b, t]) // 512 + 1) * 512  # only the key blocks it can see
            alone = ops.block_attention(qkv[b:b + 1, t:t + 1], cos[b:b + 1, :, t:t + 1], sin[b:b + 1, :, t:t + 1],
                                        cache_k[b:b + 1].clone(), cache_v[b:b + 1].clone(), slots[b:b + 1, t:t + 1],
                                        mask[b:b + 1, t:t + 1, :min(seen, span)], H, G, 0.125, "auto")
            assert torch.equal(alone[0, 0], results[0][b, t]), (b, t)


def test_silu_mul_is_pytorchs_to_its_rounding_and_the_same_bits_on_every_instruction_set(ops):
    x = torch.randn(7, 2 * 1000, generator=torch.Generator().manual_seed(1)) * 6
    x[0, :4] = torch.tensor([float("nan"), 0.0, 100.0, -100.0])  # NaN stays NaN; exp's argument is clamped
    results = [ops.block_silu_mul(x, isa) for isa in isas(ops)]
    assert all(torch.equal(results[0].nan_to_num(7.0), out.nan_to_num(7.0)) for out in results[1:])
    assert all(torch.equal(ops.block_silu_mul(x[i:i + 1], "auto").nan_to_num(7.0), results[-1][i:i + 1].nan_to_num(7.0))
               for i in range(7))
    gate, up = x.double().chunk(2, -1)
    exact = F.silu(gate) * up
    assert results[0][0, 0].isnan() and not results[0][:, 1:].isnan().any()
    error = (results[-1][1:].double() - exact[1:]).abs() / exact[1:].abs().clamp_min(1e-30)
    assert error.max() < 5e-7  # as close as PyTorch's own float32 silu: a few units in the last place
    assert results[-1][0, 1] == 0 and results[-1][0, 2] == 100 * x[0, 1002]  # silu(0), silu(100) = 0, 100
    assert results[-1][0, 3].abs() < 1e-33  # silu(-100) * up: -4e-42 * up, here -6e-37 * up (the clamp)
    assert ops.block_silu_mul(x.view(7, 1, -1), "auto").shape == (7, 1, 1000)
    with pytest.raises(RuntimeError, match="last dimension .* is even"):
        ops.block_silu_mul(torch.randn(2, 5), "auto")


def test_a_query_that_sees_nothing_gets_zeros_and_bad_inputs_get_clear_errors(ops):
    qkv, cos, sin, keys, values, slots, mask = inputs()
    mask[0, 2] = False
    out = ops.block_attention(qkv, cos, sin, keys, values, slots, mask, H, G, 0.125, "auto")
    assert torch.equal(out[0, 2], torch.zeros(H * D)) and out[0, 1].abs().sum() > 0
    with pytest.raises(RuntimeError, match="target slot 1024 outside 0..1023"):
        ops.block_attention(qkv, cos, sin, keys, values, slots + 1024 - 704, mask, H, G, 0.125, "auto")
    with pytest.raises(RuntimeError, match="heads must be a multiple of kv heads"):
        ops.block_attention(qkv, cos, sin, keys, values, slots, mask, 5, G, 0.125, "auto")
    with pytest.raises(RuntimeError, match="weight must have 200 elements"):
        ops.block_rms_norm(torch.randn(2, 200), torch.ones(100), 1e-6, "auto")


def test_int8_decoders_run_the_compiled_blocks_and_stay_close_to_pytorchs(tmp_path, ops, monkeypatch):
    monkeypatch.setenv("SPECULATIVE_CACHE", str(tmp_path / "cache"))
    save_model(tiny("decoder_only", seed=5, num_kv_heads=2), tmp_path / "m")
    compiled = load_model(tmp_path / "m", dtype="int8")
    assert compiled.layers[0].self_attn.compiled is ops and compiled.norm.compiled is ops
    assert compiled.layers[0].mlp.compiled is ops
    plain = load_model(tmp_path / "m", dtype="int8")
    for module in plain.modules():
        if hasattr(module, "compiled"):
            module.compiled = None
    tokens = torch.randint(0, compiled.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours = compiled.forward(tokens, compiled.new_state(2, 64))
        theirs = plain.forward(tokens, plain.new_state(2, 64))
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
