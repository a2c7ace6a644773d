"""One name per concept (the glossary in engine.py): the old public names still work for one
release, each with a DeprecationWarning naming the new one, and give the same results."""

import dataclasses
import warnings

import pytest
import torch

from speculative import SpeculativeConfig, SpeculativeDecoder, accept_reject, autoregressive_generate
from speculative.policy.adaptive import Plan
from tests.helpers import perturbed, tiny


def test_the_new_names_raise_no_warning():
    target = tiny("decoder_only", seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = SpeculativeConfig(target_temperature=0.5, adaptive=False)
        decoder = SpeculativeDecoder(target, perturbed(target, 0.05, seed=4), config)
        assert config.target_temperature == 0.5 and decoder.target is target
        assert int(accept_reject([1, 2, 3], target_tokens=[1, 2, 4])) == 2


def test_main_temperature_is_the_target_temperature():
    with pytest.warns(DeprecationWarning, match="'main_temperature' is now 'target_temperature'"):
        old = SpeculativeConfig(main_temperature=0.7, greedy_verification=False)
    assert old == SpeculativeConfig(target_temperature=0.7, greedy_verification=False)
    with pytest.warns(DeprecationWarning, match="main_temperature is now SpeculativeConfig.target_temperature"):
        assert old.main_temperature == 0.7
    assert dataclasses.replace(old, top_k=5).target_temperature == 0.7
    with pytest.raises(TypeError, match="got both 'target_temperature' and its old name 'main_temperature'"):
        SpeculativeConfig(main_temperature=0.7, target_temperature=0.5)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="target_temperature must be a number"):
        SpeculativeConfig(main_temperature=-1)  # checked as the new name


def test_the_decoder_takes_main_model_and_draft_model_as_target_and_draft():
    target = tiny("decoder_only", seed=5)
    draft = perturbed(target, 0.05, seed=6)
    config = SpeculativeConfig(adaptive=False)
    with pytest.warns(DeprecationWarning) as warned:
        old = SpeculativeDecoder(main_model=target, draft_model=draft, config=config)
    assert [str(w.message) for w in warned] == ["SpeculativeDecoder(): the keyword 'main_model' is now 'target'",
                                                "SpeculativeDecoder(): the keyword 'draft_model' is now 'draft'"]
    new = SpeculativeDecoder(target, draft, config)
    with pytest.warns(DeprecationWarning, match="main_model is now SpeculativeDecoder.target"):
        assert old.main_model is target
    with pytest.warns(DeprecationWarning, match="draft_model is now SpeculativeDecoder.draft"):
        assert old.draft_model is draft
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert old.generate(prompt, 12) == new.generate(prompt, 12) == autoregressive_generate(target, prompt, 12)


def test_accept_reject_takes_verifier_tokens_as_target_tokens():
    draft, target = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[1, 2, 0], [0, 5, 6]])
    with pytest.warns(DeprecationWarning, match="'verifier_tokens' is now 'target_tokens'"):
        old = accept_reject(draft, verifier_tokens=target)
    assert torch.equal(old, accept_reject(draft, target)) and old.tolist() == [2, 0]


def test_a_plans_width_is_its_k():
    with pytest.warns(DeprecationWarning, match="Plan.width is now Plan.k"):
        assert Plan(3, True).width == 3
