"""Execution dtypes: choosing them, loading in them, and exactness in bfloat16.

In bfloat16 a verify forward of K+1 tokens may round differently from K+1 one-token
forwards, so greedy speculative output may leave the same-dtype autoregressive output
where the reference's two best logits are a near-tie. The policy these tests enforce:
outputs are identical, or they first differ at a near-tie (the reference's top two
logits within 4 bfloat16 units in the last place of each other); nothing else.
"""

import subprocess
import sys

import pytest
import torch

from speculative import (NGramProposer, SpeculativeConfig, SpeculativeDecoder, autoregressive_generate, load_model,
                         save_model)
from speculative.models.kernels import PackedLinear, pack_linears, packing_available
from speculative.models import to_dtype
from speculative.models.precision import first_divergence, resolve_dtype, tie_tolerance
from tests.helpers import perturbed, tiny

BF16 = frozenset({"avx512_bf16", "avx512f"})
PLAIN = frozenset({"avx2", "fma"})


@pytest.mark.parametrize("asked, features, expected, words", [
    ("auto", BF16, torch.bfloat16, "natively"),
    ("auto", PLAIN, torch.float32, "no native bfloat16"),
    ("float32", BF16, torch.float32, "as asked"),
    ("bfloat16", PLAIN, torch.bfloat16, "slower than float32"),
    (torch.bfloat16, BF16, torch.bfloat16, "as asked"),
    ("float16", frozenset({"avx512_fp16"}), torch.float16, "as asked"),
])
def test_dtype_choice_and_reason(asked, features, expected, words):
    dtype, reason = resolve_dtype(asked, "cpu", features)
    assert dtype == expected and words in reason


@pytest.mark.parametrize("asked, words", [
    ("float64", "dtype 'float64' is not supported; allowed: auto, int8, gguf, float32, bfloat16, float16"),
    ("bf16", "dtype 'bf16' is not supported"),
    (torch.int8, "dtype torch.int8 is not supported"),
    (3, "dtype 3 is not supported"),
])
def test_unsupported_dtypes_are_refused(asked, words):
    with pytest.raises(ValueError, match=words):
        resolve_dtype(asked, "cpu", PLAIN)


def test_float16_on_a_cpu_without_it_is_refused():
    with pytest.raises(ValueError, match="float16 on this CPU .* use --dtype bfloat16 or float32"):
        resolve_dtype("float16", "cpu", PLAIN)


def test_cli_refuses_an_unknown_dtype():
    run = subprocess.run([sys.executable, "-m", "speculative.entrypoints.cli", "generate", "--dtype", "float64"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "invalid choice: 'float64'" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("model_type", ["decoder_only", "s4d"])
def test_load_model_in_bfloat16(tmp_path, model_type):
    save_model(tiny(model_type, seed=3), tmp_path / "m")
    model = load_model(tmp_path / "m", dtype="bfloat16")
    kinds = {name.split(".")[-1]: p.dtype for name, p in model.named_parameters()}
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    if model_type == "s4d":  # the poles stay float32
        assert kinds["log_dt"] == kinds["log_a_real"] == torch.float32
    with torch.inference_mode():
        logits = model.forward(torch.tensor([[1, 2, 3]]), model.new_state(1, 8))
    assert logits.dtype == torch.float32  # verification and sampling never see 16-bit logits


def test_packed_linear_equals_linear():
    if not packing_available(torch.float32, "cpu"):
        pytest.skip("this torch build has no oneDNN")
    layer = torch.nn.Linear(48, 20)
    packed = PackedLinear(layer)
    x = torch.randn(3, 5, 48)
    torch.testing.assert_close(packed(x), layer(x), atol=1e-5, rtol=1e-5)
    model = tiny("decoder_only", seed=4)
    assert pack_linears(model) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    with pytest.raises(ValueError, match="packed for inference .* load_model\\(..., pack=False\\) to save it"):
        save_model(model, "never-written")


def test_packed_model_speculative_equals_its_own_reference(tmp_path):
    save_model(tiny("decoder_only", seed=5), tmp_path / "t")
    save_model(perturbed(tiny("decoder_only", seed=5), 0.05, seed=6), tmp_path / "d")
    target, draft = load_model(tmp_path / "t"), load_model(tmp_path / "d")
    ids = list(range(3, 20))
    decoder = SpeculativeDecoder(target, draft, SpeculativeConfig(adaptive=False, num_draft_tokens=4))
    assert decoder.generate(ids, 40) == autoregressive_generate(target, ids, 40)
    assert 0 < decoder.acceptance_rate() < 1


def test_packed_bfloat16_linear_equals_linear_and_keeps_greedy_decoding():
    """Packing changes where the weights lie, not the arithmetic: a bfloat16 model packed
    decodes greedily what it decodes unpacked (a tiny model has no near-ties to flip)."""
    if not packing_available(torch.bfloat16, "cpu"):
        pytest.skip("no oneDNN bfloat16 kernels on this CPU")
    layer = torch.nn.Linear(48, 20).to(torch.bfloat16)
    x = torch.randn(3, 5, 48).to(torch.bfloat16)
    torch.testing.assert_close(PackedLinear(layer)(x).float(), layer(x).float(), atol=2e-2, rtol=2e-2)
    plain = to_dtype(tiny("decoder_only", seed=4), torch.bfloat16)
    packed = to_dtype(tiny("decoder_only", seed=4), torch.bfloat16)
    assert pack_linears(packed) == 2 * 7 + 1
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    ids = prompt(12, seed=3)
    assert autoregressive_generate(packed, ids, 30) == autoregressive_generate(plain, ids, 30)


def bf16_pair(model_type, seed=1):
    target = tiny(model_type, seed=seed)
    draft = perturbed(target, 0.05, seed=seed + 1)
    return to_dtype(draft, torch.bfloat16), to_dtype(target, torch.bfloat16)


def prompt(length, seed, vocab=64):
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_within_policy(target, ids, out, ref):
    found = first_divergence(target, ids, ref, out)
    if found is not None:
        at, gap, tolerance = found
        assert gap <= tolerance, f"output leaves the reference at {at}, where its top-2 gap {gap} is no near-tie"
    return found is None


@pytest.mark.parametrize("model_type", ["decoder_only", "s4d"])
def test_bfloat16_greedy_is_exact_up_to_near_ties(model_type):
    draft, target = bf16_pair(model_type)
    identical = total = 0
    for k in (1, 2, 4, 8):
        for proposer in (draft, NGramProposer(max_ngram=3)):
            decoder = SpeculativeDecoder(target, proposer, SpeculativeConfig(adaptive=False, num_draft_tokens=k))
            prompts = [prompt(n, seed=10 * n + k) for n in (1, 9, 33)]
            outs = decoder.generate(prompts, 30)  # a batch: rows of different lengths
            for ids, out in zip(prompts, outs):
                identical += assert_within_policy(target, ids, out, autoregressive_generate(target, ids, 30))
                total += 1
    assert identical >= 0.75 * total  # near-ties are the exception, not the rule


def test_bfloat16_transformers_model_is_exact_up_to_near_ties(tmp_path):
    pytest.importorskip("transformers")
    from tests.test_transformers import llama, saved

    saved(llama(7), tmp_path / "t")
    saved(llama(8), tmp_path / "d")
    target, draft = load_model(tmp_path / "t", dtype="bfloat16"), load_model(tmp_path / "d", dtype="bfloat16")
    assert target.dtype == draft.dtype == torch.bfloat16
    identical = 0
    for k in (2, 4):
        decoder = SpeculativeDecoder(target, draft, SpeculativeConfig(adaptive=False, num_draft_tokens=k))
        for n in (3, 17):
            ids = prompt(n, seed=n + k, vocab=128)
            identical += assert_within_policy(target, ids, decoder.generate(ids, 24),
                                              autoregressive_generate(target, ids, 24))
    assert identical >= 3


def test_the_policy_check_catches_a_real_difference():
    """Negative control: outputs that differ where the target is sure are no near-ties."""
    _, target = bf16_pair("decoder_only")
    ids = prompt(9, seed=3)
    ref = autoregressive_generate(target, ids, 10)
    caught = 0
    for at in range(10):
        wrong = ref[:at] + [(ref[at] + 1) % 64] + ref[at + 1:]
        assert first_divergence(target, ids, ref, wrong)[0] == at
        try:
            assert_within_policy(target, ids, wrong, ref)
        except AssertionError as error:
            caught += "no near-tie" in str(error)
    assert caught >= 8


def test_tie_tolerance_scales_with_magnitude():
    assert tie_tolerance(0.25, torch.bfloat16, ulps=1) == 2 ** -9
    assert tie_tolerance(20.0, torch.bfloat16, ulps=4) == 4 * 2 ** -7 * 16
    assert tie_tolerance(20.0, torch.float32, ulps=1) == 2 ** -23 * 16


@pytest.mark.slow  # statistical: 20,000 draws
def test_bfloat16_sampling_is_lossless():
    """A G-test over 20,000 draws of three tokens from bfloat16 models (test_lossless.py has
    the method), and its negative control: draws at another temperature are rejected."""
    from tests.test_lossless import DRAWS, LENGTH, P_MIN, PROMPT, VOCAB, draw, exact_joint, g_test_pvalue
    from tests.helpers import sharpen

    target = to_dtype(sharpen(tiny("decoder_only", vocab=VOCAB, seed=11), 4.0), torch.bfloat16)
    draft = to_dtype(sharpen(tiny("decoder_only", vocab=VOCAB, seed=12), 4.0), torch.bfloat16)
    config = SpeculativeConfig(adaptive=False, greedy_verification=False, num_draft_tokens=2)
    decoder = SpeculativeDecoder(target, draft, config)
    exact = exact_joint(target, config)
    assert g_test_pvalue(draw(decoder), exact) > P_MIN
    assert 0 < decoder.acceptance_rate() < 1
    hot = SpeculativeConfig(adaptive=False, greedy_verification=False, target_temperature=1.4)
    outs = autoregressive_generate(target, [PROMPT] * DRAWS, LENGTH, hot, seeds=list(range(DRAWS)))
    index = torch.tensor([o[0] * VOCAB ** 2 + o[1] * VOCAB + o[2] for o in outs])
    assert g_test_pvalue(torch.bincount(index, minlength=VOCAB ** LENGTH), exact) < P_MIN


def test_int8_linear_approximates_linear():
    from speculative.models.kernels import Int8Linear, int8_available

    if not int8_available("cpu"):
        pytest.skip("this torch build has no fbgemm")
    layer = torch.nn.Linear(64, 32)
    x = torch.randn(2, 3, 64)
    error = (Int8Linear(layer)(x) - layer(x)).norm() / layer(x).norm()
    assert error < 0.05


def test_int8_draft_changes_proposals_never_the_output(tmp_path, monkeypatch):
    """An int8 draft, with and without a reduced vocabulary: the output is the float32
    target's own; and load_draft picks int8 only for drafts that are not small."""
    import speculative.models.loading as loading
    from speculative.models.kernels import Int8Linear, int8_available

    if not int8_available("cpu"):
        pytest.skip("this torch build has no fbgemm")
    save_model(tiny("decoder_only", seed=5), tmp_path / "t")
    save_model(perturbed(tiny("decoder_only", seed=5), 0.05, seed=6), tmp_path / "d")
    target = load_model(tmp_path / "t")
    assert isinstance(loading.load_draft(tmp_path / "d").lm_head, torch.nn.Linear)  # small: left as it is
    monkeypatch.setattr(loading, "SMALL_MODEL", 1000)
    draft = loading.load_draft(tmp_path / "d")
    assert isinstance(draft.lm_head, Int8Linear)
    ids = list(range(3, 20))
    for vocab in (None, torch.arange(0, 64, 2)):
        decoder = SpeculativeDecoder(target, draft, SpeculativeConfig(adaptive=False, num_draft_tokens=4),
                                     draft_vocab=vocab)
        assert decoder.generate(ids, 40) == autoregressive_generate(target, ids, 40)
        assert 0 < decoder.acceptance_rate() < 1


def test_int8_is_refused_where_it_cannot_run(tmp_path, monkeypatch):
    import speculative.models.loading as loading

    save_model(tiny("decoder_only", seed=5), tmp_path / "d")
    monkeypatch.setattr(loading, "int8_available", lambda device: False)  # a build or device without fbgemm
    with pytest.raises(ValueError, match="int8 needs PyTorch's fbgemm engine on a CPU; not available on cpu"):
        load_model(tmp_path / "d", dtype="int8")


def test_auto_keeps_small_models_in_float32_even_where_bfloat16_is_fast():
    dtype, reason = resolve_dtype("auto", "cpu", BF16, weights=15_000_000)
    assert dtype == torch.float32 and "too small for 16 bits to pay" in reason
    assert resolve_dtype("auto", "cpu", BF16, weights=300_000_000)[0] == torch.bfloat16
