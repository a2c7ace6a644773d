"""The engine benchmark's harness on a tiny pair: every method serves every request, with
the target's own greedy tokens, and the timings are consistent."""

from speculative import SpeculativeConfig, SpeculativeDecoder
from speculative.entrypoints.bench_engine import Request, batch_one, compare, serve_engine, spread, workload
from speculative.runtime.engine import Engine
from tests.helpers import perturbed, tiny


def test_compare_serves_every_request_with_the_reference_tokens():
    target = tiny("decoder_only", seed=1)
    draft = perturbed(target, 0.05, seed=2)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5] * 2, [7]]
    report = compare(target, draft, SpeculativeConfig(num_draft_tokens=3, prompt_lookup=True),
                     workload(prompts, 5, 8), batch_sizes=(2,), runs=1, log=lambda _: None)
    for name in ("queued", "spread"):
        for size in ("2",):
            for method, entry in report[name][size].items():
                assert entry["identical"] is True, (name, size, method)
                assert entry["tokens"] == 5 * 8
                assert 0 < entry["ttft_p50"] <= entry["latency_p50"] <= entry["latency_p99"]
            assert report[name][size]["engine"]["vs_plain"] > 0


def test_spread_arrivals_are_served_after_they_arrive():
    target = tiny("decoder_only", seed=3)
    requests = spread(workload([[1, 2, 3], [4, 5]], 4, 5), span=0.05, seed=1)
    assert [r.arrival for r in requests] == sorted(r.arrival for r in requests) and requests[-1].arrival <= 0.05
    served = serve_engine(Engine(target, None, max_batch_size=2), requests)
    assert all(s.first >= r.arrival and s.finish >= s.first and len(s.tokens) == 5 for s, r in zip(served, requests))
    assert isinstance(requests[0], Request)


def test_batch_one_compares_decoders_on_the_same_prompts():
    target = tiny("decoder_only", seed=4)
    draft = perturbed(target, 0.05, seed=5)
    decoders = {"a": SpeculativeDecoder(target, draft), "b": SpeculativeDecoder(target, draft)}
    result = batch_one(decoders, [[1, 2, 3], [4, 5, 6, 7]], 6, runs=1)
    assert result["b"]["identical"] and result["a"]["vs_a"] == 1.0 and result["b"]["tokens_per_second"] > 0
