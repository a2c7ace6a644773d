"""Smoothing before int8 (models/smoothing.py): the float model computes the same function
after it, int8 follows float more closely with it where activations have outlier channels,
and a checkpoint with a tokenizer is smoothed when it is quantized, width invariance kept."""

import pytest
import torch

from speculative import load_model
from speculative.models.kernels import int8_available
from speculative.models.int8 import quantize_model
from speculative.models.smoothing import CHUNK, SmoothedReader, calibration_ids
from tests.helpers import tiny
from tests.test_int8 import widths_agree

needs_int8 = pytest.mark.skipif(not int8_available("cpu"), reason="this torch build has no fbgemm")
transformers = pytest.importorskip("transformers")


def outlier_model(seed=0):
    """A tiny fused decoder whose blocks read a few input channels 40x larger than the rest
    (the norms' weights), as LLM activations do."""
    model = tiny("decoder_only", vocab=96, seed=seed, num_kv_heads=2).fuse().eval()
    with torch.no_grad():
        for block in model.layers:
            for norm in (block.input_layernorm, block.post_attention_layernorm):
                norm.weight[:3] *= 40
    return model


def reader_of(model):
    tensors = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    return lambda name: tensors[name].clone()


def calibration(model, chunks=2, length=48):
    return torch.randint(0, model.vocab_size, (chunks, length), generator=torch.Generator().manual_seed(5)).tolist()


def smoothed_copy(model):
    read = SmoothedReader(reader_of(model), type(model)(model.cfg).fuse(), calibration(model))
    copy = type(model)(model.cfg).fuse().eval()
    copy.load_state_dict({name: read(name) for name in model.state_dict()})
    return copy


def test_smoothing_keeps_what_the_float_model_computes():
    model = outlier_model()
    copy = smoothed_copy(model)
    tokens = torch.tensor(calibration(model, 1, 30))
    assert not torch.equal(copy.layers[0].input_layernorm.weight, model.layers[0].input_layernorm.weight)
    with torch.inference_mode():
        torch.testing.assert_close(copy.forward(tokens), model.forward(tokens), rtol=1e-4, atol=1e-4)


@needs_int8
def test_smoothed_int8_follows_float_more_closely():
    model = outlier_model()
    tokens = torch.randint(0, model.vocab_size, (1, 40), generator=torch.Generator().manual_seed(11))  # unseen
    with torch.inference_mode():
        reference = model.forward(tokens)
        errors = {}
        for name, candidate in {"plain": type(model)(model.cfg).fuse(), "smoothed": smoothed_copy(model)}.items():
            if name == "plain":
                candidate.load_state_dict(model.state_dict())
            quantize_model(candidate.eval())
            errors[name] = float((candidate.forward(tokens) - reference).abs().mean())
    assert errors["smoothed"] < 0.8 * errors["plain"], errors  # 0.69x on this CPU


def test_the_model_takes_the_alpha_whose_simulated_int8_scores_calibration_best():
    model = outlier_model()
    read = SmoothedReader(reader_of(model), type(model)(model.cfg).fuse(), calibration(model))
    first = read("layers.0.input_layernorm.weight")  # the choice is made on the first block's first read
    assert read.alpha is not None  # 40x outlier channels: smoothing pays
    assert len(read.peaks) == len(model.layers)
    assert not torch.equal(first, model.layers[0].input_layernorm.weight)
    plain = SmoothedReader(reader_of(model), type(model)(model.cfg).fuse(), calibration(model), alphas=(None,))
    assert torch.equal(plain("layers.0.input_layernorm.weight"), model.layers[0].input_layernorm.weight)


@pytest.fixture
def llama_with_tokenizer(tmp_path, monkeypatch):
    """A transformers Llama checkpoint with a word-level tokenizer.json, and a cache of its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    monkeypatch.setenv("SPECULATIVE_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(3)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024)
    path = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    words = ["[UNK]", "def", "self", "the", "return", "if", "in", "for", "=", "(", ")", ":", ".", ",", "a", "of"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@needs_int8
def test_a_checkpoint_with_a_tokenizer_is_smoothed_when_quantized(llama_with_tokenizer, monkeypatch):
    chunks = calibration_ids(llama_with_tokenizer)
    assert chunks and all(len(chunk) == CHUNK for chunk in chunks)
    import speculative.models.smoothing as smoothing

    smoothed = []
    monkeypatch.setattr(smoothing.SmoothedReader, "choose",
                        lambda self, choose=smoothing.SmoothedReader.choose: smoothed.append(1) or choose(self))
    model = load_model(llama_with_tokenizer, dtype="int8")
    assert len(smoothed) == 1  # once, while quantizing
    assert widths_agree(model)
    again = load_model(llama_with_tokenizer, dtype="int8")  # from the cache: nothing smoothed again
    assert len(smoothed) == 1
    tokens = torch.tensor([chunks[0][:40]])
    with torch.inference_mode():
        assert torch.equal(again.forward(tokens), model.forward(tokens))
