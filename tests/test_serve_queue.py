"""A burst larger than the server holds (issue 62, item 8): `--max-queued` bounds what waits
for a row, and every request of the burst ends with its answer or a 429 at once.

A real `speculative serve` process on 127.0.0.1 with 2 rows and 3 queued places takes a
burst of 24 requests at once (completions and chat, streamed and not) from the official
`openai` client: each ends with its whole answer (finish_reason "length" or "stop") or with
429, OpenAI's error body (code queue_full) and Retry-After; none hangs; at least the 5 the
server holds are answered; /metrics counts the refusals; and afterwards the server answers
as before, with nothing left running. The option's bad values are refused on one line.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from speculative.entrypoints.cli import main
from speculative.models.loading import ASSETS
from tests.serving import TIMEOUT, Server

ROWS, QUEUED, BURST, BUDGET = 2, 3, 24, 40
PROMPTS = ["def add(a, b):", "class Stack:\n    def __init__(self):", "for i in range(10):",
           "import os\n\n\ndef main():"]


def ask(api: openai.AsyncOpenAI, i: int):
    """Request i of the burst: completions or chat, streamed or not, by i; its text, finish
    reason and completion tokens."""
    prompt, stream = PROMPTS[i % len(PROMPTS)], i % 2 == 0
    common = {"model": "default", "max_tokens": BUDGET, "temperature": 0}

    async def run():
        if i % 4 < 2:
            if stream:
                text, finish, usage = "", None, None
                async for chunk in await api.completions.create(prompt=prompt, stream=True,
                                                                stream_options={"include_usage": True}, **common):
                    if chunk.choices:
                        text += chunk.choices[0].text
                        finish = chunk.choices[0].finish_reason or finish
                    else:
                        usage = chunk.usage
                return text, finish, usage.completion_tokens
            answer = await api.completions.create(prompt=prompt, **common)
            return answer.choices[0].text, answer.choices[0].finish_reason, answer.usage.completion_tokens
        messages = [{"role": "user", "content": prompt}]
        if stream:
            text, finish, usage = "", None, None
            async for chunk in await api.chat.completions.create(messages=messages, stream=True,
                                                                 stream_options={"include_usage": True}, **common):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                else:
                    usage = chunk.usage
            return text, finish, usage.completion_tokens
        answer = await api.chat.completions.create(messages=messages, **common)
        return answer.choices[0].message.content, answer.choices[0].finish_reason, answer.usage.completion_tokens
    return run()


@pytest.mark.skipif(not (ASSETS / "verifier" / "config.json").is_file(),
                    reason="the shipped models are not in this checkout")
def test_a_burst_past_the_queue_gets_answers_or_429_and_the_server_goes_on():
    server = Server("--draft", "none", "--max-batch-size", str(ROWS), "--max-queued", str(QUEUED),
                    template=True).wait_healthy()

    async def burst():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                      timeout=TIMEOUT) as api:
            alone = [await ask(api, i) for i in range(4)]  # each kind of request on an idle server
            results = await asyncio.wait_for(asyncio.gather(*(ask(api, i) for i in range(BURST)),
                                                            return_exceptions=True), TIMEOUT)
            after = [await ask(api, i) for i in range(4)]
            return alone, results, after

    try:
        alone, results, after = asyncio.run(burst())
        answered = {i: r for i, r in enumerate(results) if not isinstance(r, BaseException)}
        refused = {i: r for i, r in enumerate(results) if isinstance(r, openai.RateLimitError)}
        other = {i: repr(r)[:300] for i, r in enumerate(results) if i not in answered and i not in refused}
        assert not other, f"requests that ended neither with an answer nor with 429: {other}"
        for i, (text, finish, tokens) in answered.items():  # greedy: the answer it gets alone
            assert (text, finish, tokens) == alone[i % 4] and finish in ("length", "stop"), i
        for i, error in refused.items():
            assert error.status_code == 429 and error.response.headers["retry-after"] == "1"
            body = error.response.json()["error"]
            assert (body["type"], body["code"]) == ("rate_limit_error", "queue_full"), body
            assert f"{QUEUED} queued for a row" in body["message"] and "retry later" in body["message"], body
        # Until ROWS + QUEUED are held none is refused, and the burst outruns any one answer.
        assert len(answered) >= ROWS + QUEUED and len(refused) >= 1, (len(answered), len(refused))
        assert after == alone
        metrics = server.metrics()
        assert metrics["speculative_requests_refused_total"] == len(refused)
        assert metrics["speculative_num_requests_running"] == metrics["speculative_num_requests_waiting"] == 0
        assert metrics.get('speculative_requests_total{finish_reason="error"}', 0) == 0
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("value, shown", [("-1", "-1"), ("1.5", "'1.5'"), ("many", "'many'"), ("", "''")])
def test_a_bad_max_queued_is_refused_on_one_line(capsys, value, shown):
    assert main(["serve", "--max-queued", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"argument --max-queued: must be an integer >= 0, got {shown}" in err, err
