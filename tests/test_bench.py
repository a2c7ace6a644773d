"""`speculative bench` end to end on a tiny pair, and adaptive K on a useless draft."""

import json

import pytest
import torch

from speculative import NGramProposer, SpeculativeConfig, SpeculativeDecoder, autoregressive_generate, save_model
from speculative.entrypoints.cli import main
from speculative.entrypoints.bench import identical_words
from speculative.core.rows import SamplingParams
from tests.helpers import TableModel, perturbed, tiny

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
        assert m["identical"] is True and m["identical_prompts"] == report["prompts"], m["name"]
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
    decoder = SpeculativeDecoder(target, SlowUselessDraft(target), SpeculativeConfig(num_draft_tokens=4,
                                                                                    prompt_lookup=False))
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
    decoder = SpeculativeDecoder(target, draft, SpeculativeConfig(num_draft_tokens=6, prompt_lookup=False))
    ids = [5, 9, 2, 7]
    assert decoder.generate(ids, 70) == autoregressive_generate(target, ids, 70)
    assert decoder.stats.acceptance_rate == 1.0
    assert decoder.stats.tokens_per_forward > 5  # K = 6 nearly every step


def test_one_stalled_forward_does_not_switch_speculation_off():
    from speculative.policy.adaptive import AdaptivePolicy, Costs

    costs = Costs(v1=0.010, draft=0.001)
    costs.add(2, 0.012, weight=3.0, robust=False)
    costs.add(5, 0.015, weight=3.0, robust=False)
    policy = AdaptivePolicy(longest_draft=4, costs={1: costs})
    policy.model.observe([4] * 20, [4] * 20)  # a perfect draft
    assert policy.plan(1, [0], [False], [4], has_model=True).k == 4
    policy.observe_costs(1, 5, 2.0, 4, 0.004)  # the machine stalled for two seconds once
    assert costs.verify(5) < 0.03
    assert policy.plan(1, [0], [False], [4], has_model=True).k == 4


def cyclic_table(vocab: int = 16, cycle: int = 7) -> torch.Tensor:
    """Greedy decoding repeats a cycle of `cycle` tokens: prompt lookup finds the next ones."""
    table = torch.zeros(vocab, vocab)
    for token in range(vocab):
        table[token, (token + 1) % cycle if token < cycle else 0] = 10.0
    return table


class HalfWrongLookup(NGramProposer):
    """Prompt lookup whose drafts are wrong from their first token at every other step."""

    calls = 0

    def lookup(self, sequences, limits):
        drafts, matched = super().lookup(sequences, limits)
        self.calls += 1
        if self.calls % 2:
            drafts = [[(d[0] + 1) % 7] + d[1:] if d else d for d in drafts]
        return drafts, matched


def test_adaptive_drafting_stops_at_a_batch_size_where_it_cannot_pay():
    """On a fake clock that each forward moves by 5 ms plus 2 ms per token in the batch (a
    CPU, where one row leaves the matrix units idle and many rows fill them)."""
    from speculative.runtime.engine import Engine
    from tests.test_policy import Clock, Timed

    clock = Clock()
    target = Timed(TableModel(cyclic_table()), clock, per_forward=0.005, per_token=0.002, seed=4)
    drafted_per_row = {}
    for size in (1, 16):
        prompts = [[(i + j) % 7 for j in range(8)] for i in range(size)]
        engine = Engine(target, HalfWrongLookup(num_draft_tokens=4), SpeculativeConfig(num_draft_tokens=4),
                        max_batch_size=size, clock=clock)
        ids = [engine.add_request(prompt, SamplingParams(60)) for prompt in prompts]
        outputs = {request: [] for request in ids}
        while engine.has_unfinished():
            for out in engine.step():
                outputs[out.request_id] += out.new_token_ids
        assert [outputs[request] for request in ids] == autoregressive_generate(target.model, prompts, 60)
        drafted_per_row[size] = engine.stats.drafted / size / engine.stats.target_forwards
    # Drafts of 4 tokens, all kept half the time: 3 tokens a step. One row: a forward of 5
    # tokens costs 15 ms against 7 ms for one, so nearly every step drafts. 16 rows: 165 ms against
    # 37 ms, more than the tokens it saves (narrower drafts neither), so only probes draft.
    assert drafted_per_row[1] > 2
    assert drafted_per_row[16] < 0.3


def test_plan_charges_the_verify_width_once_for_the_batch():
    from speculative.policy.adaptive import AdaptivePolicy, Costs

    costs = Costs(v1=0.010, draft=0.0001)
    costs.add(2, 0.011, weight=3.0, robust=False)
    costs.add(5, 0.020, weight=3.0, robust=False)  # each token of width costs 3 ms
    policy = AdaptivePolicy(longest_draft=4, costs={4: costs})
    policy.lookup.observe([4] * 30, [4] * 30)  # lookup is always right
    policy.model.observe([4] * 30, [1] * 30)  # the draft model's first token is kept, never the second
    # No lookup drafts: the model's rows pay for the width they need, one token.
    plan = policy.plan(4, [0, 0, 0, 0], [False] * 4, [4] * 4, has_model=True)
    assert plan.k == 1 and plan.use_model
    # Three rows have 4-token lookup drafts: the forward is 5 wide whatever the fourth row
    # does, so the model drafting 4 tokens for it costs only the draft's forwards.
    plan = policy.plan(4, [4, 4, 4, 0], [True, True, True, False], [4] * 4, has_model=True)
    assert plan.k == 4 and plan.use_model


def test_identical_words_say_how_many_outputs_differ():
    assert identical_words({"identical": True, "identical_prompts": 6}, 6) == "yes"
    assert identical_words({"identical": False, "identical_prompts": 5}, 6) == "NO (5/6)"
    assert identical_words({"identical": False}, 6) == "NO"  # reports from before the count
    assert identical_words({"identical": None}, 6) == "-"
