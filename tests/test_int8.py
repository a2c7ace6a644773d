"""int8 models: width-invariant to the bit, their own reference for exactness, cached on disk.

An int8 model is a model of its own; what speculation must reproduce is that model
decoding one token at a time. That holds exactly only because every part of its forward
gives a token the same bits whatever else the forward holds: its linear layers (each
row quantized on its own) and its attention (`cached_attention`). These tests check that
property bit for bit (torch.equal) for widths 1..17, then greedy identity and lossless
sampling on top of it, on the CPU this runs on.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from speculative import (NGramProposer, SpeculativeConfig, SpeculativeDecoder, autoregressive_generate, load_model,
                         save_model)
from speculative.models import isa
from speculative.models.int8_kernel import compiled_ops
from speculative.models import kernels
from speculative.models.kernels import Int8Embedding, Int8Linear, int8_available
from speculative.models.precision import resolve_precision
from tests.helpers import kernel_isas, perturbed, sharpen, tiny
from tests.test_lossless import DRAWS, LENGTH, P_MIN, PROMPT, VOCAB, draw, exact_joint, g_test_pvalue

pytestmark = pytest.mark.skipif(not int8_available("cpu"), reason="this torch build has no fbgemm")

WIDTHS = range(1, 18)


def rows_alone(layer, x):
    return torch.cat([layer(x[i:i + 1]) for i in range(len(x))])


@pytest.fixture(params=["compiled", "fbgemm"])
def kernel(request, monkeypatch):
    """Each int8 kernel in turn (models/int8_kernel.py; a missing compiler skips "compiled")."""
    monkeypatch.setenv("SPECULATIVE_INT8_KERNEL", request.param)
    if request.param == "compiled":
        try:
            compiled_ops()
        except RuntimeError as error:
            pytest.skip(str(error))
    return request.param


KERNEL_VARIANTS = [("compiled", level) for level in ("auto", *isa.LEVELS)] + [("fbgemm", False), ("fbgemm", True)]


def compiled_isas() -> list[str]:
    """The compiled kernel's instruction sets that this CPU runs, "auto" last."""
    return kernel_isas(amx=True)


@pytest.mark.parametrize("kernel, variant", KERNEL_VARIANTS, indirect=["kernel"])
@pytest.mark.parametrize("out_features, in_features", [(48, 64), (40, 37), (256, 1536), (33, 8)])
def test_an_int8_layer_gives_each_row_the_bits_it_gets_alone(kernel, variant, out_features, in_features):
    torch.manual_seed(out_features + in_features)
    layer = Int8Linear(torch.nn.Linear(in_features, out_features))
    assert layer.kernel == kernel
    if kernel == "fbgemm":
        if variant is False and not {"avx512_vnni", "avx_vnni"} & isa.cpu_flags():
            pytest.skip("fbgemm's 8-bit activations saturate without VNNI: refused there (test below)")
        layer.reduce_range = variant  # 7-bit activations, as on CPUs without VNNI
    else:
        layer.isa = variant  # the instruction set (auto: the best this CPU has)
        if variant not in compiled_isas():
            pytest.skip(f"this CPU has no {variant}")
    reduce_range = variant is True
    x = torch.randn(17, in_features) * torch.rand(17, 1) * 10
    x[:, 0] *= 30  # an outlier channel, as real activations have
    x[3] = 0  # a row of zeros
    alone = rows_alone(layer, x)
    for width in WIDTHS:
        assert torch.equal(layer(x[:width]), alone[:width]), width
    assert torch.equal(layer(x.view(1, 17, -1))[0], alone)  # (B, T, K) as models call it
    plain = torch.randn(17, in_features)  # without the outlier: int8 activations lose little
    reference = torch.nn.functional.linear(plain, layer_weight(layer), layer.bias)
    assert ((layer(plain) - reference).norm() / reference.norm()) < (0.04 if reduce_range else 0.02)


def layer_weight(layer):
    qweight, scale = layer.int8_weights()
    return qweight.float() * scale[:, None]


def test_every_instruction_set_of_the_compiled_kernel_gives_the_same_bits(kernel):
    if kernel == "fbgemm":
        pytest.skip("one kernel of fbgemm's per CPU")
    torch.manual_seed(0)
    layer = Int8Linear(torch.nn.Linear(200, 70, bias=True))
    x = torch.randn(37, 200) * 5  # two passes of 16 rows, then 5; 3 tiles of 64 columns, then 8
    isas = compiled_isas()
    results = []
    for isa in isas:
        layer.isa = isa
        results.append(layer(x))
    assert all(torch.equal(result, results[0]) for result in results), isas
    qweight, scale = layer.int8_weights()  # and each is the exact integer product, scaled
    peak = x.abs().amax(-1, keepdim=True)
    q = torch.round(x * (torch.full_like(peak, 127.0) / peak)).clamp(-127, 127)  # 127 / t is 127 * t.reciprocal()
    exact = (q.double() @ qweight.double().T).float() * ((peak / 127) * scale)
    assert torch.equal(results[0], exact + layer.bias)


def test_int8_weights_round_trip_and_rows_are_taken_as_quantized(kernel):
    layer = Int8Linear(torch.nn.Linear(24, 70000, bias=True))  # more rows than one fbgemm block
    if kernel == "fbgemm":
        assert len(layer.packs) == 3
    else:  # groups of 16 rows, each 4 columns of each row side by side
        assert layer.packed.shape[1:] == (24 // 4, 16, 4) and 70000 <= layer.packed.shape[0] * 16 < 70000 + 64
    qweight, scale = layer.int8_weights()
    again = Int8Linear.from_int8(qweight, scale, layer.bias)
    x = torch.randn(3, 24)
    assert torch.equal(again(x), layer(x))
    ids = torch.tensor([5, 69999, 40000])
    assert torch.equal(layer.select_rows(ids)(x), layer(x)[:, ids])
    embedding = Int8Embedding(torch.randn(100, 16))
    assert torch.allclose(embedding(torch.tensor([[3]])), embedding.qweight[3].float() * embedding.scale[3])


def widths_agree(model, prompt_length=30, vocab=None):
    """Logits of 17 tokens fed in one forward of width w (w = 1..17, then one at a time)
    against the same tokens fed one at a time, after the same prompt."""
    vocab = vocab or model.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (1, prompt_length), generator=gen)
    new = torch.randint(0, vocab, (1, 17), generator=gen)
    with torch.inference_mode():
        state = model.new_state(1, 128)
        model.forward(prompt, state, keep_logits=False)
        alone = torch.cat([model.forward(new[:, i:i + 1], state) for i in range(17)], 1)
        results = []
        for width in WIDTHS:
            model.rollback(state, [prompt_length])
            done = 0
            for start in range(0, 17, width):
                out = model.forward(new[:, start:start + width], state)
                results.append(torch.equal(out, alone[:, start:start + width]))
                done += out.shape[1]
    return all(results)


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A transformers Llama checkpoint (grouped-query attention, 64-wide heads): it loads
    into the built-in decoder."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    path = tmp_path_factory.mktemp("llama") / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULATIVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_int8_models_give_each_token_the_bits_of_a_forward_of_its_own(tmp_path, llama_checkpoint, cache):
    save_model(tiny("decoder_only", seed=5, num_kv_heads=2), tmp_path / "builtin")
    builtin = load_model(tmp_path / "builtin", dtype="int8")
    assert isinstance(builtin.lm_head, Int8Linear) and isinstance(builtin.embed_tokens, Int8Embedding)
    assert widths_agree(builtin)
    native = load_model(llama_checkpoint, dtype="int8")
    assert widths_agree(native)
    assert not widths_agree(load_model(tmp_path / "builtin", dtype="float32")), \
        "float32 linears differ by width on this CPU; if not, this check shows nothing"


@pytest.mark.parametrize("level", isa.LEVELS)
def test_every_instruction_set_runs_a_whole_int8_model_width_invariant_and_exact(level, int8_pair):
    """Under each ceiling this CPU runs (SPECULATIVE_ISA, models/isa.py), an int8 model's products,
    norms and attention take that level's code, and give every width the bits of the CPU's best level."""
    if level not in isa.runnable():
        pytest.skip(f"this CPU does not run {level}")
    target, _ = int8_pair
    if not isinstance(target.lm_head, Int8Linear) or target.lm_head.kernel != "compiled":
        pytest.skip("int8 layers run fbgemm here (no compiler)")
    prompt = torch.tensor([list(range(10, 40))])
    with torch.inference_mode():
        best = target.forward(prompt, target.new_state(1, 64))
        with isa.forced(level):
            assert torch.ops.speculative_kernels.isa() == level
            assert widths_agree(target)
            assert torch.equal(target.forward(prompt, target.new_state(1, 64)), best)
            decoder = SpeculativeDecoder(target, NGramProposer(max_ngram=3), SpeculativeConfig(num_draft_tokens=5))
            assert decoder.generate(prompt[0].tolist(), 30) == autoregressive_generate(target, prompt[0].tolist(), 30)


def test_fbgemm_never_runs_8_bit_activations_where_they_saturate(monkeypatch):
    """fbgemm's multiply-add of 8-bit pairs saturates at 16 bits without VNNI (relative error 0.17
    measured on an AVX2 EPYC): a layer there keeps 7-bit activations, and asking for 8 is refused."""
    monkeypatch.setenv("SPECULATIVE_INT8_KERNEL", "fbgemm")
    monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma", "f16c"}))
    kernels.reduce_range.cache_clear()
    try:
        layer = Int8Linear(torch.nn.Linear(16, 8))
        assert layer.kernel == "fbgemm" and layer.reduce_range is True
        with pytest.raises(ValueError, match="saturate"):
            layer.reduce_range = False
    finally:
        kernels.reduce_range.cache_clear()
    assert Int8Linear(torch.nn.Linear(16, 8)).reduce_range == (not {"avx512_vnni", "avx_vnni"} & isa.cpu_flags())


def test_an_int8_transformers_model_is_width_invariant_too():
    transformers = pytest.importorskip("transformers")
    from speculative.models.kernels import quantize_linears
    from speculative.models.hf import HFModel

    torch.manual_seed(4)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=64, n_layer=2, n_head=2,
                                                                n_positions=256)).eval()
    quantize_linears(gpt2)
    assert widths_agree(HFModel(gpt2))


def test_batch_rows_of_an_int8_model_get_what_they_get_alone(tmp_path):
    save_model(tiny("decoder_only", seed=6), tmp_path / "m")
    model = load_model(tmp_path / "m", dtype="int8")
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 23, 11)]
    with torch.inference_mode():
        state = model.new_state(3, 64)
        batch = model.forward(torch.tensor([p + [0] * (23 - len(p)) for p in prompts]), state,
                              [len(p) for p in prompts])
        for row, prompt in enumerate(prompts):
            alone = model.forward(torch.tensor([prompt]), model.new_state(1, 64))
            assert torch.equal(batch[row, :len(prompt)], alone[0])


@pytest.fixture(scope="module")
def int8_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    base = sharpen(tiny("decoder_only", seed=21), 6.0)
    save_model(base, root / "target")
    save_model(perturbed(base, 0.1, seed=22), root / "draft")
    return load_model(root / "target", dtype="int8"), root


@pytest.mark.parametrize("draft_kind", ["int8 draft", "float draft", "ngram", "tree", "self"])
def test_greedy_speculation_on_an_int8_target_is_its_own_greedy_decoding(int8_pair, draft_kind):
    target, root = int8_pair
    draft = {"int8 draft": lambda: load_model(root / "draft", dtype="int8"),
             "float draft": lambda: load_model(root / "draft", dtype="float32"),
             "ngram": lambda: NGramProposer(max_ngram=3),
             "tree": lambda: load_model(root / "draft", dtype="int8"),
             "self": lambda: target}[draft_kind]()
    config = SpeculativeConfig(adaptive=False, num_draft_tokens=5, prompt_lookup=False,
                               **({"tree_top_k": 2, "tree_max_tokens": 9} if draft_kind == "tree" else {}))
    decoder = SpeculativeDecoder(target, draft, config)
    prompts = [[1, 2, 3], list(range(10, 40)) * 2, [7] * 5]
    for prompt in prompts:
        assert decoder.generate(prompt, 48) == autoregressive_generate(target, prompt, 48)
    assert decoder.generate(prompts, 30) == [autoregressive_generate(target, p, 30) for p in prompts]
    assert 0 < decoder.acceptance_rate() <= 1
    if draft_kind == "self":
        assert decoder.acceptance_rate() == 1.0


@pytest.mark.slow
def test_sampling_from_an_int8_target_follows_its_own_distribution():
    """G-test against the int8 model's exact distribution (computed from wide forwards:
    exact only because the model is width-invariant); negative control: the same model
    at temperature 1.3, which the test must reject."""
    from speculative.models.int8 import quantize_model

    draft = sharpen(tiny("decoder_only", vocab=VOCAB, seed=12), 12.0)
    target = sharpen(tiny("decoder_only", vocab=VOCAB, seed=11), 12.0)
    quantize_model(target)
    config = SpeculativeConfig(adaptive=False, greedy_verification=False, num_draft_tokens=3, seed=0)
    decoder = SpeculativeDecoder(target, draft, config)
    counts = draw(decoder)
    assert 0 < decoder.acceptance_rate() < 1
    assert g_test_pvalue(counts, exact_joint(target, config)) > P_MIN
    warmer = SpeculativeConfig(adaptive=False, greedy_verification=False, target_temperature=1.3)
    assert g_test_pvalue(counts, exact_joint(target, warmer)) < P_MIN
    assert counts.sum() == DRAWS and LENGTH == 3


def test_the_int8_cache_is_written_once_read_after_and_rebuilt_when_damaged(llama_checkpoint, cache, monkeypatch):
    import speculative.models.int8 as int8

    first = load_model(llama_checkpoint, dtype="int8")
    entries = [p for p in (cache / "int8").iterdir() if p.is_dir()]
    assert len(entries) == 1 and (entries[0] / int8.MANIFEST).is_file()
    writes = []
    monkeypatch.setattr(int8, "_quantize_and_write", lambda *a: writes.append(a) or pytest.fail("re-quantized"))
    again = load_model(llama_checkpoint, dtype="int8")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        assert torch.equal(first.forward(ids, first.new_state(1, 8)), again.forward(ids, again.new_state(1, 8)))
    monkeypatch.undo()
    monkeypatch.setenv("SPECULATIVE_CACHE", str(cache))
    damaged = entries[0] / "layers.0.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:100])  # truncated: the manifest's size no longer matches
    rebuilt = load_model(llama_checkpoint, dtype="int8")
    with torch.inference_mode():
        assert torch.equal(rebuilt.forward(ids, rebuilt.new_state(1, 8)), first.forward(ids, first.new_state(1, 8)))
    config = llama_checkpoint / "config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10_000_000_000))  # a changed checkpoint: a new entry
    load_model(llama_checkpoint, dtype="int8")
    assert len([p for p in (cache / "int8").iterdir() if p.is_dir()]) == 2 and not list((cache / "int8").glob("*partial"))
    assert json.loads((entries[0] / "config.json").read_text())["num_layers"] == 2


VNNI = frozenset({"avx512f", "avx512_bf16", "avx512_vnni"})
AMX = frozenset({"avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"})
AVX2 = frozenset({"avx2", "fma"})


@pytest.mark.parametrize("features, weights, int8, words", [
    (VNNI, 1_500_000_000, True, "auto: int8, since this CPU"),
    (VNNI, None, True, "natively (VNNI)"),
    (VNNI, 15_000_000, False, "too small for 16 bits to pay"),
    (VNNI, 268_000_000, True, "auto: int8"),  # Gemma 3 270M: smoothed, within 1% of bfloat16's perplexity
    (VNNI, 60_000_000, False, "too small for 16 bits to pay"),
    (AMX, 1_500_000_000, True, "on VNNI and AMX tiles"),  # AMX's bfloat16 read twice the bytes: slower
    (AMX, 60_000_000, False, "too small for 16 bits to pay"),
    (AVX2, 1_500_000_000, "compiled", "fast on AVX2 with this project's kernel"),
    (AVX2, 60_000_000, False, "too small for 16 bits to pay"),
    (AVX2 - {"avx2"}, 1_500_000_000, False, "auto: float32"),
])
def test_auto_picks_int8_where_int8_products_run_fast(features, weights, int8, words, monkeypatch):
    """With VNNI, and on AVX2 where the compiled kernel builds (without it, fbgemm's 7-bit
    activations there: float32)."""
    if int8 == "compiled":
        int8 = compiled_ops() is not None
        words = words if int8 else "auto: float32"
    chosen, dtype, reason = resolve_precision("auto", "cpu", features, weights)
    assert chosen == int8 and words in reason, reason
    monkeypatch.setenv("SPECULATIVE_INT8_KERNEL", "fbgemm")
    assert resolve_precision("auto", "cpu", AVX2, 10 ** 9)[0] is False
    assert resolve_precision("auto", "cpu", VNNI, 10 ** 9, int8_runs=False)[0] is False


@pytest.mark.slow  # end to end (a process quantizing the target); int8 exactness is tested in-process above
def test_generate_runs_an_int8_target_and_says_so():
    run = subprocess.run([sys.executable, "-m", "speculative.entrypoints.cli", "generate", "--dtype", "int8",
                          "--max-new-tokens", "24", "--verbose"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "int8, as asked" in run.stderr and "tokens/s" in run.stdout
