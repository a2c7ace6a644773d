"""`speculative train` on a tiny budget: end to end, loadable output, and --resume."""

import json

import pytest
import torch

from speculative import build_model, load_model
from speculative.entrypoints.cli import main
from speculative.train import loop
from speculative.train.loop import PhaseConfig, train_phase

TINY = ["--max-files", "12", "--vocab-size", "300", "--seq-len", "32", "--batch-size", "4",
        "--verifier-size", "32x1x2", "--draft-size", "16x1x2", "--s4d-size", "16x1x4", "--eval-prompts", "2"]


@pytest.mark.slow  # long end to end: two training runs
def test_train_end_to_end_then_resume(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--max-minutes", "0.15", *TINY]) == 0
    report = json.loads((out / "report.json").read_text())
    assert set(report["models"]) == {"verifier", "draft", "draft_data_only", "draft_s4d"}
    for name in ("verifier", "draft", "draft_s4d"):
        model = load_model(out / name)
        assert model.tokenizer is not None and model.vocab_size == report["corpus"]["vocab_size"]
        assert report["models"][name]["held_out_perplexity"] > 1
    assert 0 <= report["models"]["draft"]["greedy"]["acceptance_rate"] <= 1
    assert report["models"]["draft"]["greedy"]["identical_to_target"] is True
    # The drafts trained for the same number of steps: distilled against data-only.
    assert report["models"]["draft"]["training"]["steps"] == report["models"]["draft_data_only"]["training"]["steps"]
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--max-minutes", "0.15", "--resume", *TINY]) == 0
    again = json.loads((out / "report.json").read_text())
    assert again["models"]["verifier"]["training"] == report["models"]["verifier"]["training"]  # not retrained


def test_an_interrupted_phase_resumes_from_its_checkpoint(tmp_path, monkeypatch, capsys):
    data = torch.randint(0, 50, (5000,), dtype=torch.int32)
    real = loop.batches

    def failing(*args):
        stream = real(*args)
        for _ in range(3):
            yield next(stream)
        raise KeyboardInterrupt

    cfg = PhaseConfig(name="tiny", seconds=0, steps=6, batch_size=2, seq_len=16, bf16=False, checkpoint_minutes=0)
    model = build_model("decoder_only", 50, {"hidden_size": 16, "num_layers": 1, "num_heads": 2}, seed=0)
    monkeypatch.setattr(loop, "batches", failing)
    with pytest.raises(KeyboardInterrupt):
        train_phase(model, data, cfg, tmp_path / "tiny.pt")
    saved = torch.load(tmp_path / "tiny.pt", weights_only=True)
    assert saved["step"] == 3 and not saved["done"]
    monkeypatch.setattr(loop, "batches", real)
    fresh = build_model("decoder_only", 50, {"hidden_size": 16, "num_layers": 1, "num_heads": 2}, seed=1)
    summary = train_phase(fresh, data, cfg, tmp_path / "tiny.pt", resume=True)
    assert "resuming at step 3/6" in capsys.readouterr().out
    assert summary["steps"] == 6
