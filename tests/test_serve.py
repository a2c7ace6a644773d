"""`speculative serve` as users run it: a real server process on 127.0.0.1, the shipped pair,
the official `openai` client (sync and async).

Greedy answers are compared token for token with the plain autoregressive reference of the
same model in this process; seeded sampling with the step engine run offline on the same
draft; stop strings, usage and the speculative figures are checked against what the
reference implies. Two servers serve the whole module: `spec` (the default draft, an API
key, a chat template) and `plain` (no draft, one row, one queued request).
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest
import torch

from speculative import Engine, SamplingParams, SpeculativeConfig, autoregressive_generate, load_model, load_tokenizer
from speculative.models.loading import ASSETS, load_draft
from speculative.proposers import as_proposer
from speculative.entrypoints.serve.text_stream import TextStream
from tests.serving import KEY, TIMEOUT, Server, chat_text

pytestmark = pytest.mark.skipif(not (ASSETS / "verifier" / "config.json").is_file(),
                                reason="the shipped models are not in this checkout")

MODEL = "default"
EOS = 0  # the shipped tokenizer's <|endoftext|>: every request stops there, as `generate` does
PROMPTS = [
    'def read_lines(path):\n    """Return the lines of a text file, without their line endings."""',
    "def add(a, b):",
    "import os\nimport sys\n\n\ndef main(argv):",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "for i in range(10):\n    if i % 2 == 0:",
    "    def __repr__(self):\n        return",
    "# Parse the command line\nparser = argparse.ArgumentParser(description=",
    "def fib(n):\n    if n < 2:\n        return n",
]


@pytest.fixture(scope="module")
def servers():
    """Both servers start together (each is an interpreter, torch and the models: a few seconds)."""
    spec = Server(key=KEY, template=True)
    plain = Server("--draft", "none", "--max-batch-size", "1", "--max-queued", "1")
    try:
        yield spec.wait_healthy(), plain.wait_healthy()
    finally:
        codes = spec.stop(), plain.stop()
        assert codes == (0, 0), codes


@pytest.fixture(scope="module")
def spec(servers):
    return servers[0]


@pytest.fixture(scope="module")
def plain(servers):
    return servers[1]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def target():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def reference(target, tokenizer):
    """The target's own greedy tokens for a prompt (ids), cut at its budget and at EOS; the
    test prompts are decoded once, together."""
    def generate(ids, budget):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # beside two servers on a shared machine
        try:
            return autoregressive_generate(target, ids, budget, eos_token_id=[EOS])
        finally:
            torch.set_num_threads(threads)

    prompts = [tokenizer.encode(p) for p in PROMPTS]
    cache = {tuple(p): out for p, out in zip(prompts, generate(prompts, 96))}

    def greedy(ids: list[int], budget: int) -> list[int]:
        full = cache.get(tuple(ids))
        if full is None or (len(full) < budget and EOS not in full):
            full = cache[tuple(ids)] = generate(ids, max(budget, 96))
        out = full[:budget]
        return out[:out.index(EOS) + 1] if EOS in out else out
    return greedy


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.key or "none", max_retries=0, timeout=TIMEOUT)


def async_client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.key or "none", max_retries=0, timeout=TIMEOUT)


def text_of(tokenizer, tokens: list[int]) -> str:
    """The text a client gets for these tokens: a final stop token is not part of it."""
    return tokenizer.decode(tokens[:-1] if tokens and tokens[-1] == EOS else tokens)


def usage_of(usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens}


def complete(server: Server, stream: bool, **kwargs) -> tuple[str, list[int], str, dict, dict]:
    """One completion through the openai client: text, token ids, finish reason, usage, figures."""
    kwargs.setdefault("extra_body", {})["return_token_ids"] = True
    if not stream:
        r = client(server).completions.create(model=MODEL, **kwargs)
        choice = r.choices[0]
        return choice.text, choice.token_ids, choice.finish_reason, usage_of(r.usage), r.speculative
    text, tokens, finish, usage, figures = "", [], None, None, None
    for chunk in client(server).completions.create(model=MODEL, stream=True, stream_options={"include_usage": True},
                                                   **kwargs):
        if chunk.choices:
            text += chunk.choices[0].text
            tokens += chunk.choices[0].token_ids
            finish = chunk.choices[0].finish_reason or finish
        else:
            usage, figures = usage_of(chunk.usage), chunk.speculative
    return text, tokens, finish, usage, figures


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("which", ["spec", "plain"])
def test_greedy_completion_equals_the_reference(which, stream, servers, tokenizer, reference):
    server = servers[which == "plain"]
    for prompt, budget in ((PROMPTS[0], 64), (PROMPTS[1], 40)):
        ids = tokenizer.encode(prompt)
        expected = reference(ids, budget)
        text, tokens, finish, usage, figures = complete(server, stream, prompt=prompt, max_tokens=budget,
                                                        temperature=0)
        assert tokens == expected
        assert text == text_of(tokenizer, expected)
        assert finish == ("stop" if expected[-1] == EOS else "length")
        assert usage == {"prompt_tokens": len(ids), "completion_tokens": len(expected),
                         "total_tokens": len(ids) + len(expected)}
        assert figures["target_forwards"] >= 1 and 0 <= figures["accepted"] <= figures["drafted"]
        if which == "plain":
            assert figures["drafted"] == 0 and figures["target_forwards"] == len(expected)
        else:  # the shipped pair's lookup drafts these repetitive continuations: fewer forwards than tokens
            assert figures["drafted"] > 0 and figures["target_forwards"] < len(expected)
            assert figures["mean_acceptance_length"] == pytest.approx(1 + figures["accepted"]
                                                                      / figures["target_forwards"])


def test_token_ids_and_several_prompts(spec, tokenizer, reference):
    """A prompt of token ids, and a list of prompts (one choice each, in order)."""
    ids = tokenizer.encode(PROMPTS[2])
    r = client(spec).completions.create(model=MODEL, prompt=ids, max_tokens=30, temperature=0,
                                        extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == reference(ids, 30)
    r = client(spec).completions.create(model=MODEL, prompt=PROMPTS[3:6], max_tokens=25, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    expected = [reference(tokenizer.encode(p), 25) for p in PROMPTS[3:6]]
    assert [c.text for c in r.choices] == [text_of(tokenizer, e) for e in expected]
    assert r.usage.completion_tokens == sum(map(len, expected))
    assert r.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS[3:6])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_equals_the_reference(stream, spec, tokenizer, reference):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "def square(x):"}]
    ids = tokenizer.encode(chat_text(messages))
    expected = reference(ids, 48)
    chat = client(spec).chat.completions
    if stream:
        text, roles, finish, usage = "", [], None, None
        for chunk in chat.create(model=MODEL, messages=messages, max_tokens=48, temperature=0, stream=True,
                                 stream_options={"include_usage": True}):
            if chunk.choices:
                roles += [chunk.choices[0].delta.role] if chunk.choices[0].delta.role else []
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            else:
                usage = chunk.usage
        assert roles == ["assistant"]
    else:
        r = chat.create(model=MODEL, messages=messages, max_tokens=48, temperature=0)
        text, finish, usage = r.choices[0].message.content, r.choices[0].finish_reason, r.usage
        assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    assert text == text_of(tokenizer, expected)
    assert finish == ("stop" if expected[-1] == EOS else "length")
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(expected))


def test_chat_without_a_template_is_refused(plain):
    with pytest.raises(openai.BadRequestError) as caught:
        client(plain).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    error = caught.value.body
    assert caught.value.status_code == 400 and error["code"] == "no_chat_template" and error["param"] == "messages"
    assert "chat template" in error["message"]


def test_seeded_sampling_is_reproducible_and_equals_the_engine(spec, tokenizer, target):
    """The same seed gives the same tokens (also streamed, and beside other requests); another
    seed gives others; and they are the step engine's own tokens for that seed, run here on
    the same draft, so the server passes sampling settings through unchanged (the engine's
    G-tests check its distribution)."""
    ids = tokenizer.encode(PROMPTS[4])
    settings = dict(prompt=PROMPTS[4], max_tokens=40, temperature=0.8, top_p=0.95)
    first = complete(spec, False, seed=7, **settings)[1]
    assert complete(spec, True, seed=7, **settings)[1] == first
    assert complete(spec, False, seed=8, **settings)[1] != first
    config = SpeculativeConfig(num_draft_tokens=4, prompt_lookup=True)
    engine = Engine(target, as_proposer(load_draft("default-draft"), config), config)
    engine.add_request(ids, SamplingParams(40, 0.8, None, 0.95, 7, [EOS]), "r")
    offline = []
    while engine.has_unfinished():
        for out in engine.step():
            offline += out.new_token_ids
    assert first == offline


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_strings_across_token_boundaries(stream, spec, tokenizer, reference):
    """A stop string that spans two tokens: the text ends before it, the tokens at the one that
    completes it, and the row left the batch at once (no more forwards than tokens)."""
    ids = tokenizer.encode(PROMPTS[1])
    expected = reference(ids, 96)
    pieces = [tokenizer.decode([t]) for t in expected]
    i = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    full = tokenizer.decode(expected)
    cut = full.index(stop)
    upto = next(n for n in range(1, len(expected) + 1) if stop in tokenizer.decode(expected[:n]))
    text, tokens, finish, usage, figures = complete(spec, stream, prompt=PROMPTS[1], max_tokens=96, temperature=0,
                                                    stop=["never-there", stop])
    assert (text, finish) == (full[:cut], "stop")
    assert tokens == expected[:upto] and usage["completion_tokens"] == upto
    assert figures["target_forwards"] <= upto


def test_stop_token_ids(spec, tokenizer, reference):
    ids = tokenizer.encode(PROMPTS[0])
    expected = reference(ids, 40)
    stop = expected[5]
    text, tokens, finish, _, _ = complete(spec, False, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                          extra_body={"stop_token_ids": [stop]})
    end = expected.index(stop) + 1
    assert (tokens, finish) == (expected[:end], "stop")
    assert text == tokenizer.decode(expected[:end - 1])


def test_models_and_health(spec):
    assert [m.id for m in client(spec).models.list().data] == [MODEL]
    assert httpx.get(f"{spec.url}/health", timeout=TIMEOUT).json() == {"status": "ok"}


def test_32_concurrent_streams(spec, tokenizer, reference):
    """32 streaming requests at once, mixed prompts and lengths, through the async client:
    each gets exactly its own greedy tokens, and /metrics counts what the clients received."""
    jobs = [(PROMPTS[i % len(PROMPTS)], (8, 24, 48, 96)[(i // len(PROMPTS)) % 4]) for i in range(32)]
    before = spec.metrics()

    async def one(api, prompt, budget):
        tokens, text, usage, finish = [], "", None, None
        stream = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=budget, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"return_token_ids": True})
        async for chunk in stream:
            if chunk.choices:
                tokens += chunk.choices[0].token_ids
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            else:
                usage = chunk.usage
        return tokens, text, usage, finish

    async def run_all():
        async with async_client(spec) as api:
            return await asyncio.wait_for(asyncio.gather(*(one(api, p, b) for p, b in jobs)), 600)

    results = asyncio.run(run_all())
    for (prompt, budget), (tokens, text, usage, finish) in zip(jobs, results):
        expected = reference(tokenizer.encode(prompt), budget)
        assert tokens == expected, (prompt, budget)
        assert text == text_of(tokenizer, expected)
        assert usage.completion_tokens == len(expected) and finish is not None
    after = spec.metrics()
    delta = lambda name: after.get(name, 0) - before.get(name, 0)  # noqa: E731
    assert delta("speculative_generation_tokens_total") == sum(r[2].completion_tokens for r in results)
    assert delta("speculative_prompt_tokens_total") == sum(r[2].prompt_tokens for r in results)
    finished = sum(delta(f'speculative_requests_total{{finish_reason="{f}"}}') for f in ("stop", "length", "abort"))
    assert finished == 32 and delta('speculative_requests_total{finish_reason="abort"}') == 0
    assert delta("speculative_time_to_first_token_seconds_count") == 32
    assert delta("speculative_e2e_request_latency_seconds_count") == 32
    assert delta("speculative_spec_decode_num_accepted_tokens_total") <= delta(
        "speculative_spec_decode_num_draft_tokens_total")
    per_position = sum(v - before.get(k, 0) for k, v in after.items()
                       if k.startswith("speculative_spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_position == delta("speculative_spec_decode_num_accepted_tokens_total") > 0
    assert after["speculative_num_requests_running"] == 0 and after["speculative_num_requests_waiting"] == 0


def test_text_stream_holds_back_what_may_begin_a_stop():
    """Offline: text comes out once it cannot be the start of a stop string; multi-byte
    characters split over tokens come out whole."""
    tokenizer = load_tokenizer(MODEL)
    ids = tokenizer.encode('x = "héllo wörld ✓ 😀"  # end\n')
    stream, out = TextStream(tokenizer.decode), ""
    for token in ids:
        stream.add(token)
        piece = stream.take()
        assert "\ufffd" not in piece
        out += piece
    assert out + stream.take(final=True) == tokenizer.decode(ids)
    stream, out = TextStream(tokenizer.decode, ("wörld ✓",)), ""
    for token in ids:
        if stream.add(token):
            break
        out += stream.take()
    assert out + stream.take(final=True) == 'x = "héllo '


def normal_request_works(server: Server) -> None:
    r = client(server).completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


GOOD = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 4}
BAD_REQUESTS = {  # name: (path, body, status, param)
    "malformed JSON": ("/v1/completions", b'{"model": "default", "prompt": ', 400, None),
    "not an object": ("/v1/completions", b"[1, 2]", 400, None),
    "missing model": ("/v1/completions", {"prompt": "x"}, 400, "model"),
    "unknown model": ("/v1/completions", {**GOOD, "model": "gpt-9"}, 400, "model"),
    "missing prompt": ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    "prompt of a wrong type": ("/v1/completions", {**GOOD, "prompt": 42}, 400, "prompt"),
    "empty prompt": ("/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt"),
    "max_tokens a string": ("/v1/completions", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens"),
    "max_tokens 0": ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    "temperature above 2": ("/v1/completions", {**GOOD, "temperature": 2.5}, 400, "temperature"),
    "negative temperature": ("/v1/completions", {**GOOD, "temperature": -0.1}, 400, "temperature"),
    "top_p 0": ("/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    "top_p above 1": ("/v1/completions", {**GOOD, "top_p": 1.5}, 400, "top_p"),
    "top_k negative": ("/v1/completions", {**GOOD, "top_k": -5}, 400, "top_k"),
    "seed not an integer": ("/v1/completions", {**GOOD, "seed": 1.5}, 400, "seed"),
    "n 0": ("/v1/completions", {**GOOD, "n": 0}, 400, "n"),
    "logprobs above 20": ("/v1/completions", {**GOOD, "logprobs": 21}, 400, "logprobs"),
    "best_of above 1": ("/v1/completions", {**GOOD, "best_of": 2}, 400, "best_of"),
    "stop of a wrong type": ("/v1/completions", {**GOOD, "stop": 5}, 400, "stop"),
    "stream_options without stream": ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, 400,
                                      "stream_options"),
    "unknown field": ("/v1/completions", {**GOOD, "frobnicate": 1}, 400, "frobnicate"),
    "over the context": ("/v1/completions", {**GOOD, "max_tokens": 600}, 400, "prompt"),
    "token id outside the vocabulary": ("/v1/completions", {**GOOD, "prompt": [1, 2, 99999]}, 400, "prompt"),
    "chat message without a role": ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}, 400,
                                    "messages[0]"),
    "chat content of a wrong type": ("/v1/chat/completions",
                                     {"model": MODEL, "messages": [{"role": "user", "content": 3}]}, 400,
                                     "messages[0].content"),
    "chat logprobs a number": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                        "logprobs": 2}, 400, "logprobs"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request(name, spec):
    path, body, status, param = BAD_REQUESTS[name]
    error = error_of(spec.post(path, body), status)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    normal_request_works(spec)


def test_auth_routes_and_size_limits(spec):
    """401 (wrong or missing key), 404, 405, 413: each in OpenAI's schema, and the server serves on."""
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{spec.url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert error_of(spec.post("/v1/completions", GOOD, headers={"Authorization": ""}), 401)["code"] == \
        "invalid_api_key"
    assert error_of(httpx.get(f"{spec.url}/v1/nothing-here", timeout=TIMEOUT), 404)["code"] == "not_found"
    error_of(httpx.get(f"{spec.url}/v1/completions", headers=spec.headers(), timeout=TIMEOUT), 405)
    big = json.dumps({**GOOD, "prompt": "x" * (2 << 20)}).encode()
    assert error_of(spec.post("/v1/completions", big), 413)["code"] == "request_too_large"
    with pytest.raises(openai.BadRequestError) as caught:  # the client's own exception for a 400
        client(spec).completions.create(model=MODEL, prompt="x", n=0)
    assert caught.value.body["param"] == "n"
    normal_request_works(spec)


class Chunks:
    """The server-sent events of a streaming response, read a few at a time. One line iterator
    for the whole response: dropping an unfinished one closes the connection."""

    def __init__(self, response: httpx.Response):
        self.lines = response.iter_lines()

    def take(self, count: int) -> list[dict]:
        chunks = []
        while len(chunks) < count:
            line = next(self.lines)
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
        return chunks

    def rest(self) -> list[str]:
        return [line for line in self.lines if line.startswith("data: ")]


def test_disconnect_mid_stream_aborts_the_request(spec):
    """A client that goes away mid-stream: its row leaves the batch (running drops to 0, one
    request counted as aborted) and generation stops."""
    before = spec.metrics()
    body = {**GOOD, "prompt": PROMPTS[0], "max_tokens": 400, "stream": True}
    with httpx.Client(timeout=TIMEOUT) as http:
        with http.stream("POST", f"{spec.url}/v1/completions", json=body, headers=spec.headers()) as response:
            assert response.status_code == 200
            chunks = Chunks(response)
            assert len(chunks.take(3)) == 3
            assert spec.metrics()["speculative_num_requests_running"] == 1
    assert spec.wait_metric("speculative_num_requests_running", 0, deadline=TIMEOUT) == 0
    aborted = 'speculative_requests_total{finish_reason="abort"}'
    assert spec.wait_metric(aborted, before[aborted] + 1, deadline=TIMEOUT) == before[aborted] + 1
    generated = spec.metrics()["speculative_generation_tokens_total"]
    assert generated - before["speculative_generation_tokens_total"] < 400
    normal_request_works(spec)
    assert spec.metrics()["speculative_generation_tokens_total"] == generated + 4  # nothing ran on for nobody


def test_full_queue_is_refused(plain):
    """One row and one queued place: a third request gets 429 in OpenAI's schema, with
    Retry-After; the others are served, and so is the next one."""
    body = {**GOOD, "prompt": PROMPTS[1], "max_tokens": 400, "stream": True}
    with httpx.Client(timeout=TIMEOUT) as http:
        with http.stream("POST", f"{plain.url}/v1/completions", json=body) as running:
            chunks = Chunks(running)
            assert chunks.take(1)
            waiting_result = {}

            def wait_in_line():
                waiting_result["response"] = httpx.post(f"{plain.url}/v1/completions", timeout=TIMEOUT,
                                                        json={**GOOD, "prompt": PROMPTS[2], "max_tokens": 3})
            waiter = threading.Thread(target=wait_in_line)
            waiter.start()
            assert plain.wait_metric("speculative_num_requests_waiting", 1, deadline=TIMEOUT) == 1
            with pytest.raises(openai.RateLimitError) as caught:
                client(plain).completions.create(model=MODEL, prompt="x", max_tokens=3)
            assert caught.value.status_code == 429 and caught.value.body["code"] == "queue_full"
            assert "1 queued for a row" in caught.value.body["message"]
            assert caught.value.response.headers["retry-after"] == "1"
    waiter.join(30)
    assert waiting_result["response"].status_code == 200
    assert waiting_result["response"].json()["usage"]["completion_tokens"] == 3
    normal_request_works(plain)


def test_sigterm_while_streaming():
    """SIGTERM: the port closes to new clients, the running stream is aborted after the grace
    period with a final chunk and [DONE], and the process exits 0."""
    server = Server("--draft", "ngram", "--shutdown-grace", "0")
    try:
        server.wait_healthy()
        body = {**GOOD, "prompt": PROMPTS[0], "max_tokens": 400, "stream": True}
        with httpx.Client(timeout=TIMEOUT) as http:
            with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
                stream = Chunks(response)
                chunks = stream.take(2)
                server.process.terminate()
                lines = stream.rest()
        assert lines[-1] == "data: [DONE]"
        chunks += [json.loads(line[6:]) for line in lines[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "abort"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        assert server.process.wait(30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health", timeout=5)
    finally:
        assert server.stop() == 0, server.output()


@pytest.mark.parametrize("args, words", [
    (["--draft", "none", "--ngram-max", "3"], ["--ngram-min/--ngram-max", "none"]),
    (["--max-body-bytes", "10"], ["--max-body-bytes", "1024"]),
    (["--chat-template", "/no/such/template.jinja"], ["--chat-template", "not a file"]),
    (["--max-batch-size", "0"], ["--max-batch-size", "in 1..65536"]),
])
def test_bad_options_are_one_line(args, words, capsys):
    from speculative.entrypoints.cli import main

    assert main(["serve", *args]) == 2
    line = capsys.readouterr().err
    assert len(line.splitlines()) == 1 and all(w in line for w in words), line


def test_missing_extra_is_named():
    """Without fastapi (hidden from a real process), the command says which extra to install."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent / "blocker") + os.pathsep
           + os.environ.get("PYTHONPATH", ""), "SPECULATIVE_TEST_BLOCK": "fastapi"}
    result = subprocess.run([sys.executable, "-m", "speculative.entrypoints.cli", "serve"], capture_output=True,
                            env=env, timeout=TIMEOUT)
    assert result.returncode == 2
    assert result.stderr.decode().strip() == ("error: speculative serve needs fastapi, which is not installed: "
                                              "pip install 'speculative[serve]'")
