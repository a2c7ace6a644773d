"""Bad input to the Python API gets a ValueError or TypeError that names the bad value, before any compute."""

import dataclasses

import numpy as np
import pytest
import torch

from speculative import NGramProposer, SpeculativeConfig, SpeculativeDecoder, autoregressive_generate, load_model
from speculative import save_model
from tests.helpers import perturbed, tiny
from tests.test_batch import cycle_tables


@pytest.fixture(scope="module")
def pair():
    target = tiny("decoder_only", seed=1)  # max_seq_len 256
    return perturbed(target, 0.05, seed=2), target


@pytest.mark.parametrize("draft, message", [
    ("default-draft", "draft_model must be a loaded model, got the name 'default-draft'"),
    (None, "draft_model is None"),
    (object(), "draft_model must follow the model protocol .* object lacks vocab_size"),
])
def test_a_draft_that_is_not_a_model_is_refused(pair, draft, message):
    with pytest.raises(TypeError, match=message):
        SpeculativeDecoder(pair[1], draft)


def test_a_target_that_is_not_a_model_is_refused(pair):
    with pytest.raises(TypeError, match="target must be a loaded model, got the name 'default'"):
        SpeculativeDecoder("default", pair[0])
    with pytest.raises(TypeError, match="model is None"):
        autoregressive_generate(None, [1, 2], 3)


def test_a_config_that_is_not_a_speculative_config_is_refused(pair):
    with pytest.raises(TypeError, match=r"must be a SpeculativeConfig or None, got dict .*SpeculativeConfig\(\*\*"):
        SpeculativeDecoder(pair[1], pair[0], {"num_draft_tokens": 2})
    with pytest.raises(TypeError, match="config must be a SpeculativeConfig or None, got str"):
        autoregressive_generate(pair[1], [1, 2], 3, "greedy")


def test_config_takes_numpy_numbers_as_python_ones():
    config = SpeculativeConfig(num_draft_tokens=np.int64(4), top_k=np.int32(5), target_temperature=np.float32(0.5),
                               seed=np.uint64(7), adaptive=np.bool_(False))
    assert (config.num_draft_tokens, config.top_k, config.target_temperature, config.seed, config.adaptive) == \
        (4, 5, 0.5, 7, False)
    assert all(type(v) in (int, float, bool) for v in (config.num_draft_tokens, config.top_k,
                                                        config.target_temperature, config.seed, config.adaptive))
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer >= 1, got np.float64"):
        SpeculativeConfig(num_draft_tokens=np.float64(4.0))


def test_config_is_frozen_so_that_no_setting_skips_validation():
    config = SpeculativeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_draft_tokens = 0
    assert config.num_draft_tokens == 4
    with pytest.raises(ValueError, match="num_draft_tokens must be >= 1, got 0"):
        dataclasses.replace(config, num_draft_tokens=0)  # the way to change a setting checks it again


@pytest.mark.parametrize("kwargs, message", [
    (dict(target_temperature=float("inf")), "target_temperature must be a number >= 0 .* finite, got inf"),
    (dict(draft_temperature=float("nan")), "draft_temperature must be a number >= 0 .* finite, got nan"),
    (dict(seed=2 ** 64), "seed must be None or an integer in 0..18446744073709551615, got 18446744073709551616"),
    (dict(seed=-1), "seed must be None or an integer in 0..18446744073709551615, got -1"),
    (dict(min_ngram=3, max_ngram=2), "min_ngram <= max_ngram, got min_ngram=3, max_ngram=2"),
    (dict(max_ngram=0), "max_ngram must be >= 1, got 0"),
])
def test_config_refuses_non_finite_temperatures_seeds_outside_64_bits_and_bad_ngram_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kwargs)


@pytest.mark.parametrize("seeds, error, message", [
    (3, TypeError, "seeds must be a list of 2 integers .* got 3"),
    ([1], ValueError, "seeds has 1 entries for 2 prompts"),
    ([1, 2 ** 64], ValueError, "seeds must be integers in 0..18446744073709551615, got 18446744073709551616"),
    ([1, -1], ValueError, "seeds must be integers in 0..18446744073709551615, got -1"),
    ([1, 2.0], ValueError, "got 2.0"),
])
def test_bad_seeds_are_refused_before_any_row_is_generated(pair, seeds, error, message):
    decoder = SpeculativeDecoder(pair[1], pair[0], SpeculativeConfig(greedy_verification=False))
    with pytest.raises(error, match=message):
        next(decoder.stream([[1, 2], [3]], 5, seeds=seeds))
    assert decoder.stats.target_forwards == 0
    with pytest.raises(error, match=message):
        autoregressive_generate(pair[1], [[1, 2], [3]], 5, seeds=seeds)


def test_numpy_seeds_work_and_the_last_row_of_a_config_seed_must_fit_64_bits(pair):
    decoder = SpeculativeDecoder(pair[1], pair[0], SpeculativeConfig(greedy_verification=False, seed=3))
    assert decoder.generate([[1, 2], [3]], 4, seeds=np.array([5, 6]).tolist()) == \
        decoder.generate([[1, 2], [3]], 4, seeds=[np.int64(5), np.int64(6)])
    top = SpeculativeConfig(greedy_verification=False, seed=2 ** 64 - 1)
    assert len(SpeculativeDecoder(pair[1], pair[0], top).generate([1, 2], 3)) == 3  # one row: seed 2**64 - 1
    with pytest.raises(ValueError, match="gives row 1 the seed 18446744073709551616, above the largest seed"):
        SpeculativeDecoder(pair[1], pair[0], top).generate([[1, 2], [3]], 3)


@pytest.mark.parametrize("prompt", [torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 0, dtype=torch.long)])
def test_a_tensor_batch_without_rows_is_refused(pair, prompt):
    with pytest.raises(ValueError, match=r"the batch is empty: a prompt tensor of shape \(0, \d\) holds no prompts"):
        SpeculativeDecoder(pair[1], pair[0]).generate(prompt, 3)
    with pytest.raises(ValueError, match="the batch is empty"):
        autoregressive_generate(pair[1], prompt, 3)


def test_k_that_cannot_fit_the_models_length_is_refused_before_any_compute():
    target = tiny("decoder_only", seed=1, max_seq_len=32)  # K is bounded (64): short models show the length check
    draft = perturbed(target, 0.05, seed=2)
    calls = []
    forward = target.forward
    target.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    try:
        decoder = SpeculativeDecoder(target, NGramProposer(), SpeculativeConfig(num_draft_tokens=40))
        with pytest.raises(ValueError, match="num_draft_tokens is 40, .* target model holds 32: allowed K <= 31"):
            decoder.generate([1, 2, 3], 5)
        assert calls == []  # not even the prompt was read
    finally:
        del target.forward
    s4d_target = tiny("s4d", seed=1)  # unbounded; the draft model is not
    with pytest.raises(ValueError, match="the draft model holds 32: allowed K <= 31"):
        SpeculativeDecoder(s4d_target, draft, SpeculativeConfig(num_draft_tokens=32)).generate([1, 2], 3)
    assert len(SpeculativeDecoder(target, draft, SpeculativeConfig(num_draft_tokens=31)).generate([1, 2], 3)) == 3


def test_prompt_lookup_uses_the_configured_ngram_sizes():
    """Target and draft follow their cycles; on tokens 8..15 the draft is always wrong,
    so only prompt lookup gets tokens accepted. Lookup prefers matches of 2 tokens or
    more, so with max_ngram=1 it never drafts: the configured sizes are used."""
    target, draft = cycle_tables()
    prompt = [8, 11, 14, 9, 12, 15, 10, 13]  # one turn of the target's cycle
    reference = autoregressive_generate(target, prompt, 24)
    accepted = {}
    for max_ngram in (1, 4):
        config = SpeculativeConfig(adaptive=False, num_draft_tokens=4, prompt_lookup=True, max_ngram=max_ngram)
        decoder = SpeculativeDecoder(target, draft, config)
        assert decoder.generate(prompt, 24) == reference
        accepted[max_ngram] = decoder.stats.accepted
    assert accepted[1] == 0 and accepted[4] >= 16


def corrupt(tmp_path, how: str):
    save_model(tiny("decoder_only"), tmp_path / "m")
    weights, config = tmp_path / "m" / "model.safetensors", tmp_path / "m" / "config.json"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif how == "random":
        weights.write_bytes(torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0),
                                          dtype=torch.uint8).numpy().tobytes())
    elif how == "garbage config":
        config.write_text("{garbage")
    elif how == "list config":
        config.write_text("[1, 2]")
    elif how == "no vocab_size":
        config.write_text(config.read_text().replace('"vocab_size"', '"vocab"'))
    return weights if how in ("truncated", "random") else config


@pytest.mark.parametrize("how, message", [
    ("truncated", r"model.safetensors is truncated: its tensors end at byte \d+, the file has \d+ bytes"),
    ("random", "model.safetensors is truncated or not a safetensors file"),
    ("garbage config", "config.json is not valid JSON: Expecting property name .* at line 1 column 2"),
    ("list config", "config.json must hold a JSON object .* got list"),
    ("no vocab_size", "config.json has no 'vocab_size' entry"),
])
def test_corrupt_model_files_are_named_with_their_problem(tmp_path, how, message):
    path = corrupt(tmp_path, how)
    with pytest.raises(ValueError, match=message) as error:
        load_model(tmp_path / "m")
    assert str(path) in str(error.value)


@pytest.mark.parametrize("device, message", [
    ("nonsense", "device 'nonsense' is not a torch device; allowed: cpu, cuda"),
    ("meta", "device 'meta' holds no weights"),
    ("cuda:99", "device 'cuda:99'"),
])
def test_load_model_refuses_devices_it_cannot_run_on(device, message):
    with pytest.raises(ValueError, match=message):
        load_model("default-draft", device=device)
