"""The server's logprobs, echo, n, penalties, logit_bias and min_tokens, through the official
`openai` client against a real `speculative serve` (the shipped pair, with its draft).

Greedy answers are compared with the plain reference (`plain_generate`) of the same model in
this process, with the same settings: tokens exactly, log-probabilities to TOLERANCE
(float32 forwards of different widths round differently).
"""

from __future__ import annotations

import json

import openai
import pytest

from speculative import SamplingParams, load_model, load_tokenizer
from speculative.models.loading import ASSETS
from speculative.runtime.reference import plain_generate
from tests.serving import TIMEOUT, Server

pytestmark = pytest.mark.skipif(not (ASSETS / "verifier" / "config.json").is_file(),
                                reason="the shipped models are not in this checkout")

MODEL, EOS, TOLERANCE = "default", 0, 1e-4
PROMPT = "def add(a, b):"
BUDGET = 10


@pytest.fixture(scope="module")
def server():
    spec = Server(template=True)
    try:
        yield spec.wait_healthy()
    finally:
        assert spec.stop() == 0


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def target():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


def plain(target, ids, **settings):
    """The plain reference with the server's stop tokens: EOS and any the request adds."""
    stops = [EOS, *settings.pop("stop_token_ids", [])]
    return plain_generate(target, [ids], [SamplingParams(BUDGET, stop_token_ids=stops, **settings)])[0]


def close(a: float, b: float) -> bool:
    return abs(a - b) < TOLERANCE


def test_completion_logprobs_are_plain_decodings(client, target, tokenizer):
    ids = tokenizer.encode(PROMPT)
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=BUDGET, temperature=0, logprobs=3,
                                         extra_body={"return_token_ids": True})
    choice, reference = response.choices[0], plain(target, ids, logprobs=3)
    assert choice.model_extra["token_ids"] == reference.token_ids
    shown = [lp for lp in reference.logprobs if lp.token_id != EOS]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(shown)
    assert "".join(logprobs.tokens) == choice.text
    for j, lp in enumerate(shown):
        assert close(logprobs.token_logprobs[j], lp.logprob)
        top = logprobs.top_logprobs[j]
        for token, value in lp.top:
            assert close(top[tokenizer.decode([token])], value)
        assert len(top) in (3, 4)  # the chosen token is always there
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:j])) for j in range(len(shown))]


def test_echo_returns_the_prompt_and_its_logprobs(client, target, tokenizer):
    ids = tokenizer.encode(PROMPT)
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1,
                                         echo=True)
    choice = response.choices[0]
    reference = plain_generate(target, [ids], [SamplingParams(2, prompt_logprobs=1)])[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    logprobs = choice.logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing precedes it
    assert "".join(logprobs.tokens[:len(ids)]) == PROMPT
    for j in range(1, len(ids)):
        assert close(logprobs.token_logprobs[j], reference.prompt_logprobs[j].logprob)
    assert len(logprobs.tokens) == len(ids) + 2
    assert response.usage.prompt_tokens == len(ids)


def test_streamed_logprobs_are_the_whole_responses(client):
    settings = dict(model=MODEL, prompt=PROMPT, max_tokens=BUDGET, temperature=0, logprobs=2, echo=True)
    whole = client.completions.create(**settings).choices[0]
    tokens, values, offsets, text = [], [], [], ""
    for chunk in client.completions.create(**settings, stream=True):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
                offsets += choice.logprobs.text_offset
    assert text == whole.text and tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert values[0] is None and all(close(a, b) for a, b in zip(values[1:], whole.logprobs.token_logprobs[1:]))


def test_chat_logprobs_in_openais_shape(client, tokenizer):
    messages = [{"role": "user", "content": "Write add(a, b) in Python."}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=BUDGET, temperature=0,
                                              logprobs=True, top_logprobs=4)
    content = response.choices[0].logprobs.content
    assert "".join(item.token for item in content) == response.choices[0].message.content
    for item in content:
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
        assert len(item.top_logprobs) == 4 and item.top_logprobs[0].token == item.token  # greedy: the most likely
        assert item.logprob == item.top_logprobs[0].logprob <= 0
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=BUDGET, temperature=0,
                                                logprobs=True, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [i.token for i in streamed] == [i.token for i in content]
    assert all(close(a.logprob, b.logprob) and a.top_logprobs == [] for a, b in zip(streamed, content))


PENALTIES = {
    "frequency_penalty": dict(frequency_penalty=1.5),
    "presence_penalty": dict(presence_penalty=2.0),
    "repetition_penalty": dict(repetition_penalty=1.6),
    "logit_bias": dict(logit_bias={13: 6.0}),  # and -100 on the second token plain decoding gives
    "min_tokens": dict(min_tokens=8),  # with the third token plain decoding gives as a stop token
}
EXTRAS = ("repetition_penalty", "min_tokens", "stop_token_ids")  # vLLM's fields, beyond OpenAI's


@pytest.mark.parametrize("field", list(PENALTIES))
def test_penalties_give_plain_decodings_tokens(client, target, tokenizer, field):
    ids = tokenizer.encode("import os\n")
    settings = dict(PENALTIES[field])
    unpenalized = plain(target, ids).token_ids
    if field == "min_tokens":
        settings["stop_token_ids"] = [unpenalized[2]]
    if field == "logit_bias":
        settings["logit_bias"] = {**settings["logit_bias"], unpenalized[1]: -100.0}
    reference = plain(target, ids, **dict(settings)).token_ids
    assert reference != unpenalized  # the setting changes what is generated
    if "logit_bias" in settings:
        settings["logit_bias"] = {str(k): v for k, v in settings["logit_bias"].items()}  # JSON keys
    extra = {name: settings.pop(name) for name in EXTRAS if name in settings}
    response = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=BUDGET, temperature=0,
                                         extra_body={"return_token_ids": True, **extra}, **settings)
    assert response.choices[0].model_extra["token_ids"] == reference


def test_n_choices_are_seeded_rows(client, tokenizer):
    settings = dict(model=MODEL, prompt=PROMPT, max_tokens=BUDGET, temperature=1.0, seed=7,
                    extra_body={"return_token_ids": True})
    response = client.completions.create(n=3, **settings)
    assert [c.index for c in response.choices] == [0, 1, 2]
    tokens = [c.model_extra["token_ids"] for c in response.choices]
    assert len({tuple(t) for t in tokens}) > 1  # independent streams
    assert response.usage.prompt_tokens == len(tokenizer.encode(PROMPT))  # the prompt counts once
    assert response.usage.completion_tokens == sum(map(len, tokens))
    again = client.completions.create(n=3, **settings)
    assert [c.model_extra["token_ids"] for c in again.choices] == tokens  # reproducible with a seed
    for i in range(3):  # choice i is the request seeded seed + i
        single = client.completions.create(**{**settings, "seed": 7 + i})
        assert single.choices[0].model_extra["token_ids"] == tokens[i]
    streamed = {0: [], 1: [], 2: []}
    for chunk in client.completions.create(n=3, stream=True, **settings):
        for choice in chunk.choices:
            streamed[choice.index] += choice.model_extra.get("token_ids") or []
    assert [streamed[i] for i in range(3)] == tokens


def test_chat_n_and_prompts_times_n(client):
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                              max_tokens=4, temperature=0.9, seed=1)
    assert [c.index for c in response.choices] == [0, 1]
    both = client.completions.create(model=MODEL, prompt=["def f():", "import re"], n=2, max_tokens=3,
                                     temperature=0)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert both.choices[0].text == both.choices[1].text and both.choices[2].text == both.choices[3].text


BAD = [
    ("/v1/completions", {"logprobs": 21}, "logprobs", "0..20"),
    ("/v1/completions", {"logprobs": True}, "logprobs", "integer"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "0..20"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "logprobs set to true"),
    ("/v1/completions", {"n": 0}, "n", "1..128"),
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ("/v1/completions", {"logit_bias": {"99999": 1}}, "logit_bias", "outside the vocabulary"),
    ("/v1/completions", {"logit_bias": {"5": 100.5}}, "logit_bias", "-100..100"),
    ("/v1/completions", {"frequency_penalty": 2.5}, "frequency_penalty", "-2 <= frequency_penalty <= 2"),
    ("/v1/completions", {"presence_penalty": "1"}, "presence_penalty", "number"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty", "0 < repetition_penalty"),
    ("/v1/completions", {"min_tokens": 20, "max_tokens": 5}, "min_tokens", "allowed 0..5"),
    ("/v1/completions", {"best_of": 2}, "best_of", "not supported"),
    ("/v1/chat/completions", {"echo": True}, "echo", "unrecognized"),
]


@pytest.mark.parametrize("path, fields, param, words", BAD, ids=[f"{p}-{list(f)[0]}" for p, f, *_ in BAD])
def test_bad_values_get_a_400_naming_the_field(server, path, fields, param, words):
    body = {"model": MODEL, "max_tokens": 2, **fields}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    response = server.post(path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_the_parameter_table_in_the_docs_is_what_the_server_takes():
    """docs/server.md's table of OpenAI's parameters against protocol.py's fields."""
    import re
    from pathlib import Path

    from speculative.entrypoints.serve.protocol import CHAT_FIELDS, COMPLETION_FIELDS, UNSUPPORTED

    text = (Path(__file__).parents[1] / "docs" / "server.md").read_text()
    rows = [line.split("|")[1:-1] for line in text[text.index("## OpenAI's request parameters"):].splitlines()
            if line.startswith("| `")]
    assert len(rows) > 8
    for cells in rows:
        names = re.findall(r"`(\w+)`", cells[0])
        verdict = cells[-1].strip()
        for name in names:
            if verdict.startswith("served"):
                assert name in COMPLETION_FIELDS | CHAT_FIELDS and name not in UNSUPPORTED, name
            elif "unknown field" in verdict:
                assert name not in COMPLETION_FIELDS | CHAT_FIELDS, name
            else:
                assert name in UNSUPPORTED or name == "best_of", name


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "size"],
          "properties": {"name": {"type": "string", "maxLength": 10}, "size": {"enum": ["small", "large"]}}}


def test_response_format_json_schema_is_constrained_plain_decoding(client, target, tokenizer):
    """Greedy structured output: the tokens of constrained plain decoding, valid JSON of the schema."""
    pytest.importorskip("llguidance")
    from speculative import Grammar

    ids = tokenizer.encode(PROMPT)
    response_format = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                         extra_body={"return_token_ids": True, "response_format": response_format})
    choice = response.choices[0]
    grammar = Grammar.json_schema(SCHEMA, tokenizer.grammar_tokenizer(target.vocab_size))
    reference = plain_generate(target, [ids], [SamplingParams(40, stop_token_ids=[EOS], grammar=grammar)])[0]
    assert choice.model_extra["token_ids"] == reference.token_ids
    assert choice.finish_reason == "stop"
    value = json.loads(choice.text)
    assert set(value) == {"name", "size"} and value["size"] in ("small", "large") and len(value["name"]) <= 10
    loose = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a JSON object"}],
                                           max_tokens=30, temperature=0, response_format={"type": "json_object"})
    if loose.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(loose.choices[0].message.content), dict)
    else:  # the budget ended it: what it wrote is the start of a JSON object
        assert loose.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("response_format, message", [
    ({"type": "xml"}, "type is text, json_object or json_schema"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "name is missing"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 3}}},
     "cannot be used"),
    ({"type": "json_object", "schema": {}}, "takes no field 'schema'"),
])
def test_a_bad_response_format_is_a_400_that_says_why(client, response_format, message):
    pytest.importorskip("llguidance")
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                  extra_body={"response_format": response_format})
    assert message in caught.value.body["message"] and caught.value.body["param"] == "response_format"
