"""Gemma 3 checkpoints on the built-in decoder (models/gemma3.py): transformers' logits and
greedy output in float32, and in int8 a model width-invariant to the bit, cached on disk.

A tiny random Gemma3ForCausalLM stands in for the real one: sliding windows of 8 positions
beside full layers (prompts run past the window), separate rotary bases per kind of
layer, one key/value head, and norm weights far from zero so that the (1 + w) folded at
load time counts.
"""

import json

import pytest
import torch

from speculative import (NGramProposer, SpeculativeConfig, SpeculativeDecoder, autoregressive_generate, load_model)
from speculative.models.kernels import Int8Embedding, Int8Linear, int8_available
from speculative.models.gemma3 import Gemma3LM
from speculative.models.native import native_config
from tests.test_int8 import widths_agree

transformers = pytest.importorskip("transformers")

VOCAB = 128
WINDOW = 8
LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
needs_int8 = pytest.mark.skipif(not int8_available("cpu"), reason="this torch build has no fbgemm")


def gemma(seed, hidden=64, head_dim=32, layers=LAYERS, noise=0.0, **options):
    """A tiny Gemma3ForCausalLM with random norms and peaked logits (a large final norm), so
    that greedy choices are not near-ties; `noise` perturbs a copy into a draft."""
    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=len(layers),
        num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim, sliding_window=WINDOW, layer_types=layers,
        max_position_embeddings=256, rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                      "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **options)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(0, 0.3)
        model.model.norm.weight.fill_(7.0)  # (1 + 7): logits 8x sharper
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape) * noise * parameter.std().clamp(min=1e-3))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(directory, transformers model) of a target and of a perturbed copy (a draft)."""
    root = tmp_path_factory.mktemp("gemma3")
    made = {}
    for name, model in {"target": gemma(0), "draft": gemma(0, noise=0.05)}.items():
        model.save_pretrained(root / name)
        made[name] = root / name, model
    return made


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULATIVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def prompt(length, seed):
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(model, ids, n):
    """transformers' own greedy generate()."""
    inputs = torch.tensor([ids])
    out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def test_float32_logits_are_transformers_past_the_window(checkpoints):
    path, reference = checkpoints["target"]
    model = load_model(path, dtype="float32")
    assert isinstance(model, Gemma3LM) and model.dtype == torch.float32
    ids = torch.tensor([prompt(40, 1), prompt(40, 2)])  # 5 windows long
    with torch.inference_mode():
        expected = reference(ids).logits
        cached = model.forward(ids, model.new_state(2, 40))
        whole = model.forward(ids)  # no state: whole sequences from position 0
    assert (cached - expected).abs().max() < 1e-4
    assert (whole - expected).abs().max() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_run_compiled_and_compute_pytorchs_formula(checkpoints, dtype):
    from speculative.models.gemma3 import GemmaRMSNorm
    from speculative.models.int8_kernel import compiled_ops
    ops = compiled_ops()
    if ops is None:
        pytest.skip("the compiled kernels do not build here")
    model = load_model(checkpoints["target"][0], dtype=str(dtype).removeprefix("torch."))
    norms = [module for module in model.modules() if isinstance(module, GemmaRMSNorm)]
    assert len(norms) == 6 * len(LAYERS) + 1 and all(norm.compiled is ops for norm in norms)
    calls = []

    class Counted:  # the compiled operations, counting the norms they compute
        def block_rms_norm(self, *args):
            calls.append(args[0].shape)
            return ops.block_rms_norm(*args)

    norms[0].compiled = Counted()
    x = torch.randn(3, 5, 64).to(dtype)
    compiled = norms[0](x)
    assert calls == [(3, 5, 64)] and compiled.dtype == dtype
    x.requires_grad_(True)  # a norm that autograd needs runs PyTorch's, which has a gradient
    norms[0](x).sum().backward()
    assert len(calls) == 1 and x.grad is not None
    norms[0].compiled = None
    torch.testing.assert_close(compiled, norms[0](x.detach()), rtol=1e-6 if dtype == torch.float32 else 1e-2,
                               atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", pytest.param("int8", marks=needs_int8)])
def test_a_prompt_without_logits_skips_the_last_blocks_outputs_with_the_same_cache(checkpoints, cache, dtype):
    from tests.helpers import reads_prompts_without_the_last_block

    model = load_model(checkpoints["target"][0], dtype=dtype)
    assert isinstance(model, Gemma3LM)
    assert reads_prompts_without_the_last_block(model, prompt_length=29)  # past the window: sliding layers


def test_bfloat16_keeps_float32_norms_and_follows_transformers(checkpoints):
    path, reference = checkpoints["target"]
    model = load_model(path, dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and model.layers[0].input_layernorm.weight.dtype == torch.float32
    half = transformers.Gemma3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.tensor([prompt(30, 3)])
    with torch.inference_mode():
        ours, theirs = model.forward(ids, model.new_state(1, 30)), half(ids).logits.float()
    assert ((ours - theirs).norm() / theirs.norm()) < 0.02
    assert model.embed(ids).dtype == torch.bfloat16


@pytest.mark.parametrize("options", [{"final_logit_softcapping": 30.0}, {"attn_logit_softcapping": 50.0},
                                     {"hidden_activation": "gelu"}, {"use_bidirectional_attention": True}])
def test_what_the_decoder_does_not_compute_loads_through_transformers(tmp_path, options):
    from speculative.models.hf import HFModel

    gemma(5, hidden=32, head_dim=16, layers=LAYERS[:2], **options).save_pretrained(tmp_path / "m")
    assert native_config(json.loads((tmp_path / "m" / "config.json").read_text())) is None
    assert isinstance(load_model(tmp_path / "m", dtype="float32"), HFModel)


def test_transformers_gemma_norms_are_swapped_for_compiled_ones_with_their_logits(tmp_path):
    from speculative.models.gemma3 import GemmaRMSNorm
    from speculative.models.int8_kernel import compiled_ops
    if compiled_ops() is None:
        pytest.skip("the compiled kernels do not build here")
    reference = gemma(5, hidden=32, head_dim=16, layers=LAYERS[:2], final_logit_softcapping=30.0)
    reference.save_pretrained(tmp_path / "m")
    model = load_model(tmp_path / "m", dtype="float32")
    norms = [module for module in model.modules() if isinstance(module, GemmaRMSNorm)]
    assert len(norms) == 6 * 2 + 1 and all(norm.compiled is not None for norm in norms)
    ids = torch.tensor([prompt(20, 7)])
    with torch.inference_mode():
        assert (model.forward(ids, model.new_state(1, 20)) - reference(ids).logits).abs().max() < 1e-4
    unpacked = load_model(tmp_path / "m", dtype="float32", pack=False)  # for saving: transformers' own
    assert not any(isinstance(module, GemmaRMSNorm) for module in unpacked.modules())


def test_a_bad_layer_count_is_named(tmp_path):
    gemma(6, hidden=32, head_dim=16, layers=LAYERS[:2]).save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * 3
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: gemma3 option layer_types must hold 2 entries"):
        load_model(tmp_path / "m")


@pytest.mark.parametrize("draft_kind", ["ngram", "draft model", "self"])
def test_greedy_speculation_equals_transformers_generate(checkpoints, draft_kind):
    path, reference = checkpoints["target"]
    target = load_model(path)
    draft = {"ngram": lambda: NGramProposer(max_ngram=3, num_draft_tokens=6),
             "draft model": lambda: load_model(checkpoints["draft"][0]), "self": lambda: target}[draft_kind]()
    decoder = SpeculativeDecoder(target, draft, SpeculativeConfig(adaptive=False, num_draft_tokens=4,
                                                                  prompt_lookup=False))
    for length, seed in [(1, 0), (5, 1), (20, 2)]:
        ids = prompt(length, seed) * 2  # past the window; repeats give n-grams to find
        assert decoder.generate(ids, 30) == generate(reference, ids, 30)
    prompts = [prompt(3, 4), prompt(25, 5), prompt(11, 6)]  # rows of different lengths in one batch
    assert decoder.generate(prompts, 20) == [generate(reference, ids, 20) for ids in prompts]
    if draft_kind == "self":
        assert decoder.acceptance_rate() == 1.0
    if draft_kind == "draft model":
        assert decoder.acceptance_rate() > 0.3


@needs_int8
def test_int8_gives_each_token_the_bits_of_a_forward_of_its_own(checkpoints, cache):
    model = load_model(checkpoints["target"][0], dtype="int8")
    assert isinstance(model, Gemma3LM) and model.dtype == torch.float32
    assert isinstance(model.lm_head, Int8Linear) and isinstance(model.embed_tokens, Int8Embedding)
    assert widths_agree(model, prompt_length=30)  # the 17 tokens cross two more windows
    ids = torch.tensor([[3, 77, 5]])
    scale = torch.tensor(64 ** 0.5, dtype=torch.float32)
    assert torch.equal(model.embed(ids), model.embed_tokens(ids) * scale)  # the int8 lookup, then the scale


@needs_int8
def test_int8_batch_rows_get_the_bits_they_get_alone(checkpoints, cache):
    model = load_model(checkpoints["target"][0], dtype="int8")
    prompts = [prompt(n, n) for n in (5, 23, 11)]
    with torch.inference_mode():
        batch = model.forward(torch.tensor([p + [0] * (23 - len(p)) for p in prompts]), model.new_state(3, 64),
                              [len(p) for p in prompts])
        for row, ids in enumerate(prompts):
            alone = model.forward(torch.tensor([ids]), model.new_state(1, 64))
            assert torch.equal(batch[row, :len(ids)], alone[0])


@needs_int8
@pytest.mark.parametrize("draft_kind", ["ngram", "int8 draft", "tree"])
def test_greedy_speculation_on_int8_is_its_own_greedy_decoding(checkpoints, cache, draft_kind):
    target = load_model(checkpoints["target"][0], dtype="int8")
    draft = NGramProposer(max_ngram=3) if draft_kind == "ngram" else load_model(checkpoints["draft"][0], dtype="int8")
    config = SpeculativeConfig(adaptive=False, num_draft_tokens=5,
                               **({"tree_top_k": 2, "tree_max_tokens": 7} if draft_kind == "tree" else {}))
    decoder = SpeculativeDecoder(target, draft, config)
    ids = prompt(12, 8) * 2  # past the window
    assert decoder.generate(ids, 32) == autoregressive_generate(target, ids, 32)
    prompts = [prompt(3, 7), ids, [9] * 5]
    assert decoder.generate(prompts, 20) == autoregressive_generate(target, prompts, 20)


@needs_int8
def test_the_int8_cache_gives_back_the_same_model(checkpoints, cache, monkeypatch):
    import speculative.models.int8 as int8

    path = checkpoints["target"][0]
    first = load_model(path, dtype="int8")
    (entry,) = [p for p in (cache / "int8").iterdir() if p.is_dir()]  # (beside it: its lock)
    saved = json.loads((entry / "config.json").read_text())
    assert saved["layer_types"] == LAYERS and saved["sliding_window"] == WINDOW and saved["head_dim"] == 32
    monkeypatch.setattr(int8, "_quantize_and_write", lambda *a: pytest.fail("re-quantized"))
    again = load_model(path, dtype="int8")
    assert isinstance(again, Gemma3LM)
    assert torch.equal(again.norm.weight, first.norm.weight) and again.norm.weight.dtype == torch.float32
    ids = torch.tensor([prompt(20, 9)])
    with torch.inference_mode():
        assert torch.equal(first.forward(ids, first.new_state(1, 20)), again.forward(ids, again.new_state(1, 20)))


def test_attention_skipping_leading_hidden_blocks_keeps_the_bits():
    """cached_attention over keys whose first blocks no query sees, with and without them."""
    from speculative.models.attention import KEY_BLOCK, cached_attention
    gen = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(1, 1, 3 * KEY_BLOCK, 32, generator=gen) for _ in range(2))
    positions = torch.arange(2 * KEY_BLOCK + 100, 2 * KEY_BLOCK + 111)
    slots = torch.arange(3 * KEY_BLOCK)
    mask = (slots <= positions[:, None]) & (slots > positions[:, None] - 300)  # (T, S): a window of 300
    queries = torch.randn(1, 2, len(positions), 32, generator=gen)
    whole = cached_attention(queries, keys, values, mask[None])
    for first in (KEY_BLOCK, 2 * KEY_BLOCK):
        if first > int(positions.min()) - 300:
            continue
        skipped = cached_attention(queries, keys[:, :, first:], values[:, :, first:], mask[None, :, first:])
        assert torch.equal(skipped, whole)
    one = cached_attention(queries[:, :, 4:5], keys[:, :, KEY_BLOCK:], values[:, :, KEY_BLOCK:],
                           mask[None, 4:5, KEY_BLOCK:])
    assert torch.equal(one, whole[:, :, 4:5])


def test_a_prompts_query_blocks_read_only_the_key_blocks_they_see(monkeypatch):
    """A forward of several query blocks (a prompt, causal, in a sliding window) gives each query
    the bits of a one-query forward over every slot, and a query block reads no key block past
    the last one it sees: NaN keys and values there would make its outputs NaN."""
    import speculative.models.attention as attention
    monkeypatch.setattr(attention, "KEY_BLOCK", 16)
    monkeypatch.setattr(attention, "QUERY_BLOCK", 8)
    gen = torch.Generator().manual_seed(1)
    slots, window = 64, 20
    keys, values = (torch.randn(1, 1, slots, 32, generator=gen) for _ in range(2))
    positions = torch.arange(45)
    mask = (torch.arange(slots) <= positions[:, None]) & (torch.arange(slots) > positions[:, None] - window)
    queries = torch.randn(1, 2, len(positions), 32, generator=gen)
    prompt = attention.cached_attention(queries, keys, values, mask[None])
    for t in range(len(positions)):
        alone = attention.cached_attention(queries[:, :, t:t + 1], keys, values, mask[None, t:t + 1])
        assert torch.equal(prompt[:, :, t:t + 1], alone)
    unseen = 32  # the first key block that no query of the first four blocks (queries 0-31) sees
    keys[:, :, unseen:], values[:, :, unseen:] = float("nan"), float("nan")
    prompt = attention.cached_attention(queries, keys, values, mask[None])
    assert torch.isfinite(prompt[:, :, :unseen]).all()


@pytest.mark.parametrize("width", [1, 3, 20])
def test_fused_attention_gives_each_head_its_key_value_head_and_each_query_its_mask(monkeypatch, width):
    """16-bit attention (PyTorch's kernel; queries of the heads sharing a key/value head go in
    as rows of that head up to one query block, by blocks past it) against float64 arithmetic:
    4 query heads over 2 key/value heads, each query with its own causal sliding-window mask.
    A head read against the other key/value head, or a query given another's mask, is off by
    far more than bfloat16's rounding."""
    import speculative.models.attention as attention
    monkeypatch.setattr(attention, "KEY_BLOCK", 16)
    monkeypatch.setattr(attention, "QUERY_BLOCK", 8)
    gen = torch.Generator().manual_seed(2)
    slots, window, dim = 48, 12, 32
    positions = torch.arange(40 - width, 40)
    mask = (torch.arange(slots) <= positions[:, None]) & (torch.arange(slots) > positions[:, None] - window)
    keys, values = (torch.randn(1, 2, slots, dim, generator=gen) for _ in range(2))
    queries = torch.randn(1, 4, width, dim, generator=gen)
    half = [t.bfloat16() for t in (queries, keys, values)]
    got = attention.fused_attention(*half, mask[None], scale=0.3)
    q, k, v = (t.double() for t in half)
    k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))  # head h reads key/value head h // 2
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))
    expected = scores.softmax(-1) @ v
    assert got.dtype == torch.bfloat16 and got.shape == queries.shape
    assert torch.allclose(got.double(), expected, atol=2e-2, rtol=0)


@pytest.fixture
def small_key_blocks(monkeypatch):
    """Key blocks of 16 slots, so that a sliding window of 8 leaves whole blocks behind it
    within the tiny model's context."""
    import speculative.models.attention as attention
    import speculative.models.decoder_only as decoder_only
    import speculative.models.gemma3 as gemma3
    for module in (attention, gemma3):  # decoder_only rounds by attention.whole_blocks
        monkeypatch.setattr(module, "KEY_BLOCK", 16)
    read = []
    attention = decoder_only.cached_attention
    monkeypatch.setattr(decoder_only, "cached_attention",
                        lambda q, keys, *rest: read.append(keys.shape[2]) or attention(q, keys, *rest))
    return read


@needs_int8
def test_sliding_layers_read_only_the_blocks_their_window_reaches(checkpoints, cache, small_key_blocks):
    model = load_model(checkpoints["target"][0], dtype="int8")
    assert widths_agree(model, prompt_length=60)  # 60..77: the window leaves 3-4 blocks behind
    small_key_blocks.clear()
    with torch.inference_mode():
        state = model.new_state(1, 128)
        model.forward(torch.tensor([prompt(70, 3)]), state)
        model.forward(torch.tensor([[5]]), state)  # slot 70: the window sees slots 63..70
    layers = len(LAYERS)
    assert small_key_blocks[-layers:] == [32 if kind == "sliding_attention" else 80 for kind in LAYERS]
    ids = prompt(40, 9)
    decoder = SpeculativeDecoder(model, NGramProposer(max_ngram=3), SpeculativeConfig(adaptive=False,
                                                                                     num_draft_tokens=5))
    assert decoder.generate(ids * 2, 40) == autoregressive_generate(model, ids * 2, 40)
