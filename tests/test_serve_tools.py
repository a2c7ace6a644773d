"""Tool calls through the official `openai` client against a real `speculative serve` (the
shipped pair, with a Hermes-style chat template written here): forced calls are constrained
plain decoding's tokens, read back as OpenAI's tool_calls; bad tools are 400s that say why."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import openai
import pytest

from speculative import Grammar, SamplingParams, load_model, load_tokenizer
from speculative.entrypoints.serve.tools import Tools, split_calls
from speculative.models.loading import ASSETS
from speculative.runtime.reference import plain_generate
from tests.serving import TIMEOUT, Server

pytestmark = [pytest.mark.skipif(not (ASSETS / "verifier" / "config.json").is_file(),
                                 reason="the shipped models are not in this checkout"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]
pytest.importorskip("llguidance")

MODEL, EOS, BUDGET = "default", 0, 80
# Tools described in the system turn, calls written as Qwen2.5's template asks the model to.
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>\nTools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call one as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "additionalProperties": False, "required": ["query"],
                                     "properties": {"query": {"type": "string", "maxLength": 10}}}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def template_file():
    with tempfile.NamedTemporaryFile("w", suffix=".jinja", delete=False) as f:
        f.write(TOOLS_TEMPLATE)
    yield f.name
    Path(f.name).unlink()


@pytest.fixture(scope="module")
def client(template_file):
    server = Server("--chat-template", template_file).wait_healthy()
    try:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def reference():
    """Constrained plain decoding of a chat with tools, in this process."""
    target, tokenizer = load_model(MODEL), load_tokenizer(MODEL)
    tokenizer.chat_template = TOOLS_TEMPLATE
    grammar_tokenizer = tokenizer.grammar_tokenizer(target.vocab_size)

    def run(tools: list[dict], choice: str, parallel: bool) -> list[int]:
        spec = Tools([t["function"] for t in tools], choice)
        grammar = Grammar(*spec.grammar(tokenizer.vocab().get, parallel), grammar_tokenizer)
        ids = tokenizer.chat_messages(MESSAGES, tools=tools)
        params = SamplingParams(BUDGET, stop_token_ids=[EOS], grammar=grammar)
        return plain_generate(target, [ids], [params])[0].token_ids
    return run


def check_weather_call(call) -> None:
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 12


def test_a_named_tool_choice_gives_that_call_as_constrained_plain_decoding(client, reference):
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER, SEARCH], max_tokens=BUDGET, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False,
        extra_body={"return_token_ids": True})
    choice = response.choices[0]
    assert choice.model_extra["token_ids"] == reference([WEATHER, SEARCH], "get_weather", False)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    check_weather_call(choice.message.tool_calls[0])


def test_required_calls_one_of_the_tools_and_streams_whole(client, reference):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[SEARCH, WEATHER],
                                            max_tokens=BUDGET, temperature=0, tool_choice="required", stream=True,
                                            parallel_tool_calls=False, extra_body={"return_token_ids": True})
    chunks = list(stream)
    last = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert last.choices[0].finish_reason == "tool_calls"
    calls = last.choices[0].delta.tool_calls
    assert len(calls) == 1 and calls[0].index == 0
    for call in calls:
        assert call.function.name in ("search", "get_weather")
        json.loads(call.function.arguments)
    tokens = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []]
    assert tokens == reference([SEARCH, WEATHER], "required", False)


def test_a_conversation_with_earlier_calls_and_tool_results_is_taken(client):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8,
                                              temperature=0, tool_choice="auto")
    assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("fields, param, message", [
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0].function.name",
     "1-64 letters"),
    (dict(tools={"a": 1}), "tools", "non-empty list"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "not among the tools"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=[WEATHER, WEATHER]), "tools", "name a function twice"),
    (dict(tools=[WEATHER], tool_choice="maybe"), "tool_choice", "must be \"none\""),
])
def test_bad_tools_are_400s_that_say_why(client, fields, param, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **fields)
    assert message in caught.value.body["message"] and caught.value.body["param"] == param


def test_a_template_without_tools_refuses_them():
    server = Server(template=True).wait_healthy()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
        with pytest.raises(openai.BadRequestError, match="does not take tools"):
            client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=4)
    finally:
        assert server.stop() == 0


def test_calls_are_read_out_of_the_text():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\nnot json\n</tool_call>')
    content, calls = split_calls(text)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert content == "Let me check.\n\n<tool_call>\nnot json\n</tool_call>"
    assert split_calls("no calls here") == ("no calls here", [])
