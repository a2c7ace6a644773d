"""The default pair shipped inside the package, and the CLI that uses it."""

import json

import pytest
import torch

from speculative import SpeculativeConfig, SpeculativeDecoder, autoregressive_generate, load_model, load_tokenizer
from speculative.entrypoints.cli import main
from speculative.models.loading import ASSETS

pytestmark = pytest.mark.skipif(not (ASSETS / "verifier" / "config.json").is_file(),
                                reason="the shipped models are not in this checkout")


def test_shipped_files_load_and_match_their_configs():
    sizes = {}
    for preset in ("default", "default-draft", "default-s4d"):
        model = load_model(preset, pack=False)  # raises if a tensor's name or shape disagrees with config.json
        assert model.tokenizer is not None and model.vocab_size == len(model.tokenizer)
        sizes[preset] = sum(p.numel() for p in model.parameters())
    assert 10e6 <= sizes["default"] <= 20e6 and 0.5e6 <= sizes["default-draft"] <= 1.5e6
    on_disk = sum(f.stat().st_size for f in ASSETS.rglob("*.safetensors"))
    assert on_disk <= 40 * 2 ** 20
    assert max(f.stat().st_size for f in ASSETS.rglob("*")) <= 20 * 2 ** 20  # small files for any git host


@pytest.mark.parametrize("draft", ["default-draft", "default-s4d"])
def test_shipped_pair_is_greedy_identical_to_the_target_alone(draft):
    target, tokenizer = load_model("default"), load_tokenizer("default")
    ids = tokenizer.encode("def read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n")
    reference = autoregressive_generate(target, ids, 48)
    decoder = SpeculativeDecoder(target, load_model(draft), SpeculativeConfig(num_draft_tokens=4))
    assert decoder.generate(ids, 48) == reference
    # The draft's quality at a fixed K: adaptive drafting may rightly switch a draft off when
    # the machine is busy, which says nothing about the draft.
    fixed = SpeculativeDecoder(target, load_model(draft), SpeculativeConfig(num_draft_tokens=4, adaptive=False))
    assert fixed.generate(ids, 48) == reference
    assert fixed.acceptance_rate() > 0.05  # a trained draft, not noise (chance: 1 in 4096)


def test_generate_with_no_arguments(capsys):
    assert main(["generate", "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def read_lines(path):")
    assert "tokens/s" in out and "acceptance rate" in out and "tokens per target forward" in out


def test_generate_with_no_draft_prints_the_same_text(capsys):
    assert main(["generate", "--max-new-tokens", "24"]) == 0
    drafted = capsys.readouterr().out
    assert main(["generate", "--draft", "none", "--max-new-tokens", "24"]) == 0
    plain = capsys.readouterr().out
    assert plain.split("\n[")[0] == drafted.split("\n[")[0]
    assert "1.00 tokens per target forward" in plain


def test_generate_with_the_s4d_draft_streaming_and_sampling(capsys):
    assert main(["generate", "--draft", "s4d", "--stream", "--max-new-tokens", "16", "--temperature", "0.8",
                 "--seed", "3", "--prompt", "import os\n"]) == 0
    first = capsys.readouterr().out
    assert main(["generate", "--draft", "s4d", "--stream", "--max-new-tokens", "16", "--temperature", "0.8",
                 "--seed", "3", "--prompt", "import os\n"]) == 0
    assert capsys.readouterr().out.split("[")[0] == first.split("[")[0]  # same seed, same text


def test_generate_a_jsonl_batch_keeps_the_input_order(tmp_path, capsys):
    prompts = ["def add(a, b):\n", "class Point:\n", "import sys\n"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, "max_new_tokens": 8 + i}) for i, p in enumerate(prompts)))
    assert main(["generate", "--prompt-file", str(path), "--batch-size", "2"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2] and [r["tokens"] for r in rows] == [8, 9, 10]
    tokenizer, target = load_tokenizer("default"), load_model("default")
    for row, prompt in zip(rows, prompts):
        expected = autoregressive_generate(target, tokenizer.encode(prompt), row["tokens"])
        assert row["completion"] == tokenizer.decode(expected)


@pytest.mark.parametrize("args, message", [
    (["--target", "someone/some-model"], "looks like a hub model name"),
    (["--prompt-file", "/no/such/file.txt"], "does not exist"),
    (["--chat", "--prompt", "hi"], "has no chat template"),
    (["--top-p", "0"], "--top-p: must be a finite number > 0 and <= 1"),
    (["--prompt", " ".join(map(str, range(1000)))], "exceed the target model's maximum length of 512"),
])
def test_generate_errors(args, message, capsys):
    assert main(["generate", *args]) == 2
    assert message in capsys.readouterr().err


def test_export_the_shipped_verifier(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    assert main(["export", "default-draft", str(tmp_path / "llama")]) == 0
    llama = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float32)
    draft = load_model("default-draft")
    ids = torch.tensor([load_tokenizer("default").encode("def f(x):\n    return")])
    with torch.no_grad():
        torch.testing.assert_close(llama(ids).logits, draft(ids), atol=1e-4, rtol=1e-4)
    assert (tmp_path / "llama" / "tokenizer.json").is_file()
