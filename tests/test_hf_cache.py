"""BlockCache: transformers' DynamicCache with its slots written in place and read in whole
key blocks of zeros past each layer's length (models/hf_cache.py)."""

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel  # noqa: E402

from speculative.models.attention import KEY_BLOCK  # noqa: E402
from speculative.models.hf import HFModel  # noqa: E402
from speculative.models.hf_cache import BlockCache  # noqa: E402


def states(rows, width, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 2, width, 4, generator=generator) for _ in range(2)]


def check_layer(blocked, dynamic, returned=None):
    """Same keys and values as transformers' cache; what `update` returned is them followed by
    zeros to the end of their key block."""
    for mine, theirs in ((blocked.keys, dynamic.keys), (blocked.values, dynamic.values)):
        assert torch.equal(mine, theirs)
    assert blocked.get_seq_length() == dynamic.get_seq_length()
    if returned is not None:
        length = dynamic.get_seq_length()
        for padded, exact in zip(returned, (dynamic.keys, dynamic.values)):
            assert padded.shape[2] == -(-length // KEY_BLOCK) * KEY_BLOCK
            assert torch.equal(padded[:, :, :length], exact)
            assert not padded[:, :, length:].any()


@pytest.mark.parametrize("seed", range(3))
def test_block_cache_follows_dynamic_cache_through_every_operation(seed):
    """Appends across key blocks, crops (rollback), row selection and keys set from outside
    (HFModel's compaction) leave BlockCache holding what DynamicCache holds, with zeros
    after it: a crop that left the dropped slots in place would show through the padding."""
    rng = random.Random(seed)
    blocked, dynamic = BlockCache(), DynamicCache()
    rows = 3
    for step in range(40):
        op = rng.choice(["update"] * 4 + ["crop", "select", "gather"])
        length = dynamic.get_seq_length()
        if op == "update" or length == 0:
            new = states(rows, rng.choice([1, 5, 17, 300, 700]), seed * 100 + step)
            returned = blocked.update(*new, 0)
            dynamic.update(*new, 0)
            check_layer(blocked.layers[0], dynamic.layers[0], returned)
            continue
        if op == "crop":
            cut = -rng.randint(1, length)
            blocked.crop(cut)
            dynamic.crop(cut)
        elif op == "select":
            index = torch.tensor(sorted(rng.sample(range(rows), rng.randint(1, rows))))
            rows = len(index)
            blocked.batch_select_indices(index)
            dynamic.batch_select_indices(index)
        else:  # as HFModel._compact does: new tensors assigned to the layer
            order = torch.stack([torch.randperm(length, generator=torch.Generator().manual_seed(step))] * rows)
            for layer in (blocked.layers[0], dynamic.layers[0]):
                index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
                layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
        check_layer(blocked.layers[0], dynamic.layers[0])


def test_block_cache_writes_in_place_within_a_key_block():
    """Appends that fit the layer's buffers neither copy nor move them; one past their last
    block moves them once."""
    cache = BlockCache()
    cache.update(*states(1, 10, 0), 0)
    buffer = cache.layers[0].buffers[0]
    for step in range(KEY_BLOCK - 10):
        cache.update(*states(1, 1, step + 1), 0)
        assert cache.layers[0].buffers[0] is buffer
    cache.update(*states(1, 1, 0), 0)
    assert cache.layers[0].buffers[0] is not buffer and cache.layers[0].buffers[0].shape[2] == 2 * KEY_BLOCK


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_only_models_that_run_block_attention_get_a_block_cache(attention):
    """Only `block_attention` reads keys past the mask; an eager model gets transformers' cache."""
    torch.manual_seed(0)
    module = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                        attn_implementation=attention)).eval()
    model = HFModel(module)
    state = model.new_state(1)
    with torch.inference_mode():
        model.forward(torch.tensor([[1, 2, 3]]), state)
    assert type(state.cache) is (BlockCache if attention == "sdpa" else DynamicCache)
