"""Requests at the end of the context (issue 62, item 8).

A forward whose rows feed different numbers of tokens pads the shorter rows; near the end
of the model's length their padding lies past the last position the model has (its rotary
table, or GPT-2's position embeddings). That padding must not be looked up there: a burst
of streams at the context limit ended requests with an IndexError from the engine. Tested
on the models directly, and on a real server with a burst of streams that each fill the
context, split differently between prompt and budget (rows near their end beside rows that
draft wide).
"""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from speculative.models.base import prefill
from speculative.models.loading import ASSETS
from tests.helpers import tiny
from tests.serving import TIMEOUT, Server

LENGTH = 32  # the tiny models' context


def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    from speculative.models.hf import HFModel

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=LENGTH,
                                     bos_token_id=None, eos_token_id=None)
    return HFModel(transformers.GPT2LMHeadModel(config).eval())


MODELS = {"decoder_only": lambda: tiny("decoder_only", max_seq_len=LENGTH), "gpt2": tiny_gpt2}


@pytest.mark.parametrize("kind", list(MODELS))
def test_padding_past_the_last_position_gives_each_row_its_own_logits(kind):
    """Row 0 holds LENGTH - 1 tokens and feeds its last one, padded to the width of row 1,
    which feeds 4: its padding would sit at positions LENGTH..LENGTH + 2."""
    model = MODELS[kind]()
    long, short = [(7 * i) % 60 + 2 for i in range(LENGTH - 1)], [3, 5, 8, 13, 21]
    fed = [[9], [34, 55, 12, 40]]
    with torch.inference_mode():
        state = prefill(model, [long, short], LENGTH + 4)
        together = model.forward(torch.tensor([fed[0] + [0, 0, 0], fed[1]]), state, [1, 4])
        for row, (prompt, tokens) in enumerate(zip((long, short), fed)):
            alone = model.forward(torch.tensor([tokens]), prefill(model, [prompt], LENGTH + 4))
            torch.testing.assert_close(together[row, :len(tokens)], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # a server of its own and 40 streams of 500 tokens each (about a minute)
@pytest.mark.skipif(not (ASSETS / "verifier" / "config.json").is_file(),
                    reason="the shipped models are not in this checkout")
def test_a_burst_of_streams_at_the_context_limit_ends_every_request_cleanly():
    """40 streams at once, each prompt plus max_tokens = 511 of the context's 512, against 8
    rows of the default drafting (prompt lookup on repetitive prompts, else the draft model:
    the draft model has different numbers of tokens to catch up on per row): every stream
    ends with its whole budget (or the end-of-text token), its usage chunk, and no error;
    /metrics counts no failed request."""
    server = Server("--max-batch-size", "8").wait_healthy()
    budgets = [4 + (7 * i) % 40 for i in range(40)]
    prompts = [([100 + i, 200, 300, 400] * 128)[:511 - budget] for i, budget in enumerate(budgets)]

    async def one(api, i):
        sampled = {"temperature": 0.8, "seed": i} if i % 2 else {"temperature": 0}
        stream = await api.completions.create(model="default", prompt=prompts[i], max_tokens=budgets[i],
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"return_token_ids": True}, **sampled)
        tokens, finish, usage = [], None, None
        async for chunk in stream:
            if chunk.choices:
                tokens += chunk.choices[0].token_ids
                finish = chunk.choices[0].finish_reason or finish
            else:
                usage = chunk.usage
        return tokens, finish, usage

    async def burst():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                      timeout=TIMEOUT) as api:
            return await asyncio.gather(*(one(api, i) for i in range(40)), return_exceptions=True)

    try:
        results = asyncio.run(burst())
        failed = {i: repr(r)[:300] for i, r in enumerate(results) if isinstance(r, BaseException)}
        assert not failed, f"{len(failed)} of 40 streams failed: {failed}"
        for i, (tokens, finish, usage) in enumerate(results):
            ended = finish == "length" and len(tokens) == budgets[i] or finish == "stop" and tokens[-1] == 0
            assert ended and usage.completion_tokens == len(tokens), (i, finish, len(tokens), budgets[i])
        metrics = server.metrics()
        assert metrics.get('speculative_requests_total{finish_reason="error"}', 0) == 0
        assert metrics["speculative_num_requests_running"] == metrics["speculative_num_requests_waiting"] == 0
    finally:
        assert server.stop() == 0
