"""Real clients against a real `speculative serve` (the shipped pair, tests/test_serve_tools.py's
Hermes-style template): LangChain's ChatOpenAI (invoke, with_structured_output both ways,
bind_tools) and litellm (logprobs, n, penalties, response_format, tools), as their users call them."""

from __future__ import annotations

import json
import os

import pytest

from speculative.models.loading import ASSETS
from tests.serving import TIMEOUT, Server
from tests.test_serve_tools import MESSAGES, MODEL, TOOLS_TEMPLATE, WEATHER

pytestmark = [pytest.mark.skipif(not (ASSETS / "verifier" / "config.json").is_file(),
                                 reason="the shipped models are not in this checkout"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]  # litellm's pydantic models at import
pytest.importorskip("llguidance")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm's own table, not a download at import

ITEM = {"title": "Item", "description": "A thing and its size.", "type": "object", "additionalProperties": False,
        "required": ["name", "size"],
        "properties": {"name": {"type": "string", "maxLength": 10}, "size": {"enum": ["small", "large"]}}}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    server = Server("--chat-template", str(template)).wait_healthy()
    try:
        yield f"{server.url}/v1"
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def chat(url):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=url, api_key="none", model=MODEL, temperature=0, max_tokens=96,
                                       timeout=TIMEOUT, max_retries=0)


def is_item(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "size"} and value["size"] in ("small", "large")
            and isinstance(value["name"], str) and len(value["name"]) <= 10)


def test_langchain_invoke(chat):
    message = chat.invoke("def add(a, b):")
    assert isinstance(message.content, str) and message.response_metadata["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(chat, method):
    """json_schema sends response_format; function_calling a tool and a tool_choice naming it."""
    assert is_item(chat.with_structured_output(ITEM, method=method).invoke("Describe a small box."))


def test_langchain_json_object(chat):
    message = chat.bind(response_format={"type": "json_object"}, max_tokens=60).invoke("Describe a box as JSON.")
    if message.response_metadata["finish_reason"] == "stop":
        assert isinstance(json.loads(message.content), dict)
    else:  # the budget ended it: the start of an object
        assert message.content.startswith("{")


def test_langchain_bind_tools(chat):
    message = chat.bind_tools([WEATHER], tool_choice="get_weather").invoke(MESSAGES[0]["content"])
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    arguments = message.tool_calls[0]["args"]
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")


def test_litellm_sampling_logprobs_and_n(url):
    litellm = pytest.importorskip("litellm")
    response = litellm.completion(model=f"openai/{MODEL}", api_base=url, api_key="none", messages=MESSAGES,
                                  max_tokens=6, temperature=0.8, seed=3, n=2, logprobs=True, top_logprobs=2,
                                  frequency_penalty=0.5, presence_penalty=0.3, timeout=TIMEOUT)
    assert len(response.choices) == 2
    for choice in response.choices:
        entries = choice.logprobs["content"] if isinstance(choice.logprobs, dict) else choice.logprobs.content
        assert entries and all(len(e["top_logprobs"] if isinstance(e, dict) else e.top_logprobs) >= 1
                               for e in entries)


def test_litellm_response_format_and_tools(url):
    litellm = pytest.importorskip("litellm")
    common = dict(model=f"openai/{MODEL}", api_base=url, api_key="none", max_tokens=40, temperature=0,
                  timeout=TIMEOUT)
    response = litellm.completion(messages=[{"role": "user", "content": "A small box."}], **common,
                                  response_format={"type": "json_schema",
                                                   "json_schema": {"name": "item", "schema": ITEM}})
    assert is_item(json.loads(response.choices[0].message.content))
    response = litellm.completion(messages=MESSAGES, tools=[WEATHER], tool_choice="required",
                                  parallel_tool_calls=False, **{**common, "max_tokens": 96})
    assert response.choices[0].finish_reason == "tool_calls"
    calls = response.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert set(json.loads(calls[0].function.arguments)) == {"city", "unit"}
