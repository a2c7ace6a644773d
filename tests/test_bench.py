"""`speculative bench` end to end on a tiny pair, and adaptive K on a useless draft."""

import json

import pytest
import torch

from speculative import SpeculativeConfig, SpeculativeDecoder, autoregressive_generate, save_model
from speculative.cli import main
from helpers import TableModel, perturbed, tiny

pytest.importorskip("matplotlib")


@pytest.fixture()
def tiny_pair(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    target = tiny("decoder_only", vocab=64, seed=1)
    draft = perturbed(target, 0.05, seed=2)
    save_model(target, tmp_path / "target")
    save_model(draft, tmp_path / "draft")
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    for name in ("target", "draft"):
        tokenizer.save(str(tmp_path / name / "tokenizer.json"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": " ".join(f"w{(i * 7 + j) % 64}" for j in range(12))})
                                 for i in range(3)))
    return tmp_path


def test_bench_runs_end_to_end(tiny_pair, capsys):
    plot = tiny_pair / "plot.png"
    code = main(["bench", "--target", str(tiny_pair / "target"), "--draft", str(tiny_pair / "draft"),
                 "--draft", str(tiny_pair / "target"), "--prompts", str(tiny_pair / "prompts.jsonl"),
                 "--max-new-tokens", "12", "--runs", "3", "--k", "1,3", "--json", "--plot", str(plot)])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plot.is_file() and plot.stat().st_size > 1000
    methods = {m["name"]: m for m in report["methods"]}
    assert methods["autoregressive"]["speedup"] == 1.0
    assert methods["autoregressive"]["prompt_speedups"] == [1.0] * report["prompts"]
    for m in report["methods"]:
        assert m["identical"] is True, m["name"]
        assert m["tokens_per_second"] > 0 and len(m["run_tokens_per_second"]) == 3
        assert m["peak_rss_mb"] > 0
        for key in ("speedup", "acceptance_rate", "tokens_per_forward", "draft_share", "verify_share",
                    "overhead_share", "predicted_speedup", "median_prompt_speedup"):
            assert key in m
    self_draft = methods[f"{tiny_pair / 'target'} K=3"]
    assert self_draft["acceptance_rate"] == 1.0  # a perfect draft
    assert self_draft["predicted_speedup"] > 0
    assert any(name.startswith("ngram") for name in methods)
    assert any("adaptive" in name for name in methods)


class SlowUselessDraft:
    """A draft model that is expensive and never agrees with the target."""

    def __init__(self, model):
        self.model, self.vocab_size, self.max_seq_len, self.device = model, model.vocab_size, None, model.device

    def new_state(self, *args):
        return self.model.new_state(*args)

    def forward(self, tokens, state, num_valid=None, keep_logits=True):
        logits = self.model.forward(tokens, state, num_valid, keep_logits)
        torch.sum(torch.randn(300, 300) @ torch.randn(300, 300))  # costs about as much as a target step
        return None if logits is None else -logits  # proposes the target's least likely tokens

    def rollback(self, state, lengths):
        self.model.rollback(state, lengths)

    def select_rows(self, state, rows):
        self.model.select_rows(state, rows)


def test_adaptive_k_stops_drafting_with_a_useless_draft():
    target = tiny("decoder_only", seed=3)
    decoder = SpeculativeDecoder(target, SlowUselessDraft(target), SpeculativeConfig(num_draft_tokens=4))
    ids = [5, 9, 2, 7]
    out = decoder.generate(ids, 120)
    assert out == autoregressive_generate(target, ids, 120)
    steps_with_drafts = sum(decoder.stats.drafted_at[:1])
    assert decoder.stats.accepted == 0
    assert steps_with_drafts <= 0.2 * decoder.stats.target_forwards  # only the first steps and probes


def test_prompt_lookup_goes_on_when_adaptive_k_stops_a_useless_draft_model():
    target = tiny("decoder_only", seed=3)
    useless = SlowUselessDraft(target)
    calls = []
    forward = useless.forward
    useless.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    decoder = SpeculativeDecoder(target, useless, SpeculativeConfig(num_draft_tokens=4, prompt_lookup=True))
    ids = [5, 9, 2, 7] * 3
    reference = autoregressive_generate(target, ids, 120)
    assert len(set(reference)) < 10  # the tiny target repeats itself: lookup has something to find
    assert decoder.generate(ids, 120) == reference
    decoder.reset_stats()
    calls.clear()
    assert decoder.generate(ids, 120) == reference
    assert decoder.stats.tokens_per_forward > 1.5  # lookup drafts, although the policy gives the model K = 0
    assert len(calls) <= 0.2 * decoder.stats.target_forwards  # the draft model runs only for probes


class CostlyTarget(TableModel):
    """A Markov table that takes as long as a real model step."""

    def forward(self, tokens, state, num_valid=None, keep_logits=True):
        torch.sum(torch.randn(400, 400) @ torch.randn(400, 400))
        return super().forward(tokens, state, num_valid, keep_logits)


def test_adaptive_k_drafts_the_most_when_the_draft_is_cheap_and_perfect():
    table = torch.randn(32, 32, generator=torch.Generator().manual_seed(0)) * 3
    target, draft = CostlyTarget(table), TableModel(table)
    decoder = SpeculativeDecoder(target, draft, SpeculativeConfig(num_draft_tokens=6))
    ids = [5, 9, 2, 7]
    assert decoder.generate(ids, 70) == autoregressive_generate(target, ids, 70)
    assert decoder.stats.acceptance_rate == 1.0
    assert decoder.stats.tokens_per_forward > 5  # K = 6 nearly every step


def test_one_stalled_forward_does_not_switch_speculation_off():
    from speculative.adaptive import AdaptivePolicy, Costs

    costs = Costs(v1=0.010, draft=0.001)
    costs.add(2, 0.012, weight=3.0, robust=False)
    costs.add(5, 0.015, weight=3.0, robust=False)
    policy = AdaptivePolicy(max_k=4, costs={1: costs})
    policy.observe([4] * 20, [4] * 20, None)  # a perfect draft
    assert policy.choose(1) == 4
    policy.observe_costs(1, 5, 2.0, 4, 0.004)  # the machine stalled for two seconds once
    assert costs.verify(5) < 0.03
    assert policy.choose(1) == 4
