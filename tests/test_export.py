"""Export to transformers' Llama format: the very same model, run by transformers."""

from pathlib import Path

import pytest
import torch

from speculative import autoregressive_generate
from speculative.entrypoints.export import export_llama
from tests.helpers import tiny

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


def test_export_refuses_a_full_directory_a_file_and_the_models_own_directory(tmp_path):
    from speculative import save_model

    model = tiny("decoder_only", seed=3)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="full is not empty; pass --force"):
        export_llama(model, tmp_path / "full")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["config.json"]
    assert (tmp_path / "full" / "config.json").read_text() == "{}"
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="file is a file; export writes a directory"):
        export_llama(model, tmp_path / "file", force=True)
    assert (tmp_path / "file").read_text() == "x"
    save_model(model, tmp_path / "runs" / "own")
    for out in (tmp_path / "runs" / "own", tmp_path / "runs"):  # the model's directory, or one holding it
        with pytest.raises(ValueError, match="holds the model being exported"):
            export_llama(model, out, force=True, source=tmp_path / "runs" / "own")
    assert sorted(p.name for p in (tmp_path / "runs" / "own").iterdir()) == ["config.json", "model.safetensors"]


def test_export_with_force_replaces_the_whole_directory(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny("decoder_only", seed=3)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.bin").write_bytes(b"x")
    assert export_llama(model, out, force=True) == out
    assert not (out / "stale.bin").exists() and (out / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing left beside it
    llama = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(llama(ids).logits, model(ids), atol=1e-5, rtol=1e-5)


def test_a_failed_export_leaves_no_half_written_directory(tmp_path, monkeypatch):
    from transformers import LlamaForCausalLM

    def half_written(self, directory, **kwargs):
        (Path(directory) / "config.json").write_text("{")
        raise OSError("No space left on device")

    monkeypatch.setattr(LlamaForCausalLM, "save_pretrained", half_written)
    with pytest.raises(OSError, match="No space left on device"):
        export_llama(tiny("decoder_only"), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_an_export_that_wrote_nothing_is_not_reported_as_done(tmp_path, monkeypatch):
    from transformers import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "save_pretrained", lambda self, directory, **kwargs: None)
    with pytest.raises(OSError, match="transformers wrote no config.json and safetensors weights"):
        export_llama(tiny("decoder_only"), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
