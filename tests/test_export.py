"""Export to transformers' Llama format: the very same model, run by transformers."""

import pytest
import torch

from speculative import autoregressive_generate
from speculative.export import export_llama
from helpers import tiny

pytest.importorskip("transformers")


def test_exported_llama_gives_the_same_logits_and_greedy_output(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny("decoder_only", vocab=64, seed=3, num_kv_heads=2)
    export_llama(model, tmp_path / "llama")
    llama = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float32)
    ids = torch.randint(1, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(llama(ids).logits, model(ids), atol=1e-5, rtol=1e-5)
    out = llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                         pad_token_id=0)
    assert out[0, 20:].tolist() == autoregressive_generate(model, ids[0].tolist(), 20)


def test_only_decoder_only_exports(tmp_path):
    with pytest.raises(ValueError, match="only decoder_only models export"):
        export_llama(tiny("s4d"), tmp_path / "x")
