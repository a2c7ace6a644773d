"""The OpenAI request bodies this server takes, checked field by field.

A body is parsed from JSON by hand rather than by pydantic models: every refusal is an
`APIError` with OpenAI's status, type and `param` (the field at fault), and a message that
says what was wrong and what is allowed. Fields OpenAI defines but this server does not
implement (UNSUPPORTED: `suffix`) are refused when they ask for something, never silently
ignored; unknown fields are refused as OpenAI refuses them. Tools and response_format are
parsed in tools.py and response_format.py. A body that is not plain JSON
(NaN, numbers of thousands of digits, nesting deeper than MAX_DEPTH, strings that are not
Unicode text, such as a lone surrogate "\\ud800") is refused as a whole, with 400.

Chat takes `max_completion_tokens` (OpenAI's current name) or `max_tokens` (the older
one); both together are refused unless they are equal. Errors name the field the client
sent.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ...core.config import MAX_NEW_TOKENS
from ...core.inputs import check_request_seed
from .errors import invalid
from .response_format import parse_response_format
from .tools import earlier_calls, parse_tools

# Fields OpenAI defines that this server takes only at their "off" value.
UNSUPPORTED = {"suffix": None}
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "stream",
          "stream_options", "user", "return_token_ids", "n", "frequency_penalty", "presence_penalty",
          "repetition_penalty", "logit_bias", "min_tokens", "logprobs", "response_format", *UNSUPPORTED}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "best_of"}
CHAT_FIELDS = COMMON - {"best_of", "suffix"} | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                                                 "tool_choice", "parallel_tool_calls"}
# Most choices per prompt (`n`); each is a row of the batch.
MAX_N = 128
# Most alternatives per token: OpenAI's top_logprobs limit (completions' logprobs too, as vLLM).
MAX_LOGPROBS = 20
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 16
# Deepest nesting of arrays and objects a body may have (OpenAI's bodies need 4).
MAX_DEPTH = 32


@dataclass
class GenerationRequest:
    """A checked completion or chat request; `prompts` are text or token ids (completions),
    `messages` the chat turns."""

    model: str
    prompts: list | None = None
    messages: list[dict] | None = None
    # None: what the context leaves (chat only; completions default to 16 as OpenAI's do).
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    # The field that set max_tokens, for errors (chat: max_completion_tokens or max_tokens).
    budget_field: str = "max_tokens"
    # Choices per prompt, each seeded seed + i.
    n: int = 1
    # Penalties, bias and min_tokens, as SamplingParams takes them.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict | None = None
    min_tokens: int = 0
    # Alternatives per returned token (None: no logprobs); completions' `echo` returns the prompt too.
    logprobs: int | None = None
    echo: bool = False
    # What the output must match: (grammar kind, text) for core/grammar.py (None: anything).
    response_format: tuple[str, str] | None = None
    # Chat's tools and tool_choice (tools.Tools; None: none), and whether several calls may come.
    tools: object = None
    parallel_tool_calls: bool = True


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, or a 400 saying why not (never another exception)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except json.JSONDecodeError as error:
        raise invalid(None, f"the request body is not valid JSON: {error.msg} at line {error.lineno} column "
                      f"{error.colno}", "invalid_json") from None
    except UnicodeDecodeError:
        raise invalid(None, "the request body is not valid JSON: it is not UTF-8 text", "invalid_json") from None
    except RecursionError:
        raise invalid(None, f"the request body is nested too deeply: at most {MAX_DEPTH} levels of arrays and "
                      "objects", "invalid_json") from None
    except ValueError as error:  # NaN or Infinity, or an integer of thousands of digits
        what = "it holds a number of more than 4300 digits" if "digits" in str(error) else str(error)
        raise invalid(None, f"the request body is not valid JSON: {what}", "invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(None, f"the request body must be a JSON object, got {json_type(body)}")
    _check_tree(body)
    return body


def _check_tree(body: dict) -> None:
    """Nesting within MAX_DEPTH, and every string and key Unicode text (JSON's \\u escapes
    can spell a lone surrogate, which no encoder or tokenizer takes). Iterative: any depth
    that json.loads returns is walked without recursion."""
    todo = [(body, "", 1)]
    while todo:
        value, where, depth = todo.pop()
        if depth > MAX_DEPTH:
            field = where.split("[")[0].split(".")[0]
            raise invalid(field, f"the request body is nested too deeply (in {field}): at most {MAX_DEPTH} levels "
                          "of arrays and objects", "invalid_json")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            path = f"{where}[{key}]" if isinstance(key, int) else (f"{where}.{key}" if where else key)
            if isinstance(key, str) and not _is_text(key):
                raise invalid(None, f"the request body holds a key that is not Unicode text (a lone surrogate "
                              f"such as \\ud800) in {where or 'the top-level object'}", "invalid_json")
            if isinstance(item, str) and not _is_text(item):
                raise invalid(path, f"{path} is not Unicode text: it holds a lone surrogate (a \\ud800 to \\udfff "
                              "escape without its pair); send UTF-8 text", "invalid_json")
            if isinstance(item, (dict, list)):
                todo.append((item, path, depth + 1))


def json_type(value) -> str:
    """The JSON name of a parsed value's type."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(body: dict, name: str, low: int, default=None, high: int = MAX_NEW_TOKENS):
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or not low <= value <= high:
        raise invalid(name, f"{name} must be an integer in {low}..{high}, got {value!r}")
    return value


def _number(body: dict, name: str, low: float, high: float, default, low_open: bool = False):
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or value > high or value < low or (low_open and value == low):
        bound = f"{low:g} < {name}" if low_open else f"{low:g} <= {name}"
        raise invalid(name, f"{name} must be a number with {bound} <= {high:g}, got {value!r}")
    return float(value)


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(name, f"{name} must be true or false, got {value!r}")
    return value


def _same(value, off) -> bool:
    """`value` is `off` in its own JSON type: true is not 1, and 0 is not false."""
    if isinstance(value, bool) or isinstance(off, bool):
        return value is off
    return _is_number(value) and value == off


def _common(body: dict, fields: set[str], served: str) -> dict:
    """The fields completions and chat share."""
    unknown = sorted(set(body) - fields)
    if unknown:
        raise invalid(unknown[0], f"unrecognized request argument supplied: {unknown[0]}; allowed: "
                      f"{', '.join(sorted(fields))}", "unrecognized_argument")
    for name, off in UNSUPPORTED.items():
        value = body.get(name)
        if name in fields and value is not None and not _same(value, off):
            raise invalid(name, f"{name}={json.dumps(value)} is not supported by this server; allowed: "
                          f"{json.dumps(off)} (or leave it out)", "unsupported")
    model = body.get("model")
    if model is None:
        raise invalid("model", "model is missing: give the served model's name", "missing_required_parameter")
    if not isinstance(model, str):
        raise invalid("model", f"model must be a string, got {model!r}")
    if model != served:
        raise invalid("model", f"the model {model!r} does not exist: this server serves {served!r}", "model_not_found")
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < -1):
        raise invalid("top_k", f"top_k must be an integer >= 1, or -1 or 0 for no limit, got {top_k!r}")
    seed = body.get("seed")
    try:
        check_request_seed(seed, "seed")
    except ValueError as error:
        raise invalid("seed", str(error)) from None
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise invalid("stream_options", "stream_options is only allowed when stream is true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise invalid("stream_options", f"stream_options must be an object with include_usage only, got "
                          f"{json.dumps(options)}")
    include_usage = _flag(options or {}, "include_usage")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise invalid("user", f"user must be a string, got {body['user']!r}")
    top_p = _number(body, "top_p", 0, 1, None, low_open=True)
    return dict(model=model, temperature=_number(body, "temperature", 0, 2, 1.0), n=_integer(body, "n", 1, 1, MAX_N),
                frequency_penalty=_number(body, "frequency_penalty", -2, 2, 0.0),
                presence_penalty=_number(body, "presence_penalty", -2, 2, 0.0),
                repetition_penalty=_number(body, "repetition_penalty", 0, 2, 1.0, low_open=True),
                logit_bias=_logit_bias(body.get("logit_bias")), min_tokens=_integer(body, "min_tokens", 0, 0),
                top_p=None if top_p == 1 else top_p, top_k=top_k if top_k and top_k > 0 else None,
                seed=seed, stop=_stops(body.get("stop")), stop_token_ids=_stop_ids(body.get("stop_token_ids")),
                stream=stream, include_usage=include_usage, return_token_ids=_flag(body, "return_token_ids"),
                response_format=parse_response_format(body.get("response_format")))


def _logit_bias(value) -> dict[int, float] | None:
    """OpenAI's logit_bias: an object whose keys are token ids (as JSON strings) and whose
    values are numbers in -100..100. Ids past the vocabulary are refused by the engine."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("logit_bias", f"logit_bias must be an object mapping token ids to biases, got "
                      f"{json.dumps(value)[:100]}")
    bias = {}
    for key, number in value.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 12:
            raise invalid("logit_bias", f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        if not _is_number(number) or not -100 <= number <= 100:
            raise invalid("logit_bias", f"logit_bias values must be numbers in -100..100, got "
                          f"{json.dumps(number)} for token {key}")
        bias[int(key)] = float(number)
    return bias or None


def _completion_logprobs(body: dict) -> tuple[int | None, bool]:
    """Completions: `logprobs` 0..20 alternatives per token (null: none), and `echo`."""
    logprobs = _integer(body, "logprobs", 0, None, MAX_LOGPROBS)
    return logprobs, _flag(body, "echo")


def _chat_logprobs(body: dict) -> int | None:
    """Chat: `logprobs` true asks for them, `top_logprobs` 0..20 alternatives (logprobs must be true)."""
    wanted = _flag(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, None, MAX_LOGPROBS)
    if top is not None and not wanted:
        raise invalid("top_logprobs", "top_logprobs needs logprobs set to true")
    return (top or 0) if wanted else None


def _stops(value) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise invalid("stop", f"stop must be a non-empty string or a list of at most {MAX_STOPS} non-empty strings, "
                      f"got {json.dumps(value)}")
    return tuple(stops)


def _stop_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(t) and t >= 0 for t in value):
        raise invalid("stop_token_ids", f"stop_token_ids must be a list of token ids (integers >= 0), got "
                      f"{json.dumps(value)}")
    return tuple(value)


def parse_completion(body: dict, served: str) -> GenerationRequest:
    """POST /v1/completions: `prompt` is a string, a list of token ids, or a list of either."""
    common = _common(body, COMPLETION_FIELDS, served)
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("prompt", "prompt is missing: give a string, a list of token ids, or a list of strings",
                      "missing_required_parameter")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(t) for t in p)) for p in prompt):
        prompts = prompt
    else:
        raise invalid("prompt", f"prompt must be a string, a non-empty list of token ids, or a non-empty list of "
                      f"strings or token-id lists; got {json.dumps(prompt)[:100]}")
    for p in prompts:
        if p == "":
            raise invalid("prompt", "prompt is an empty string; give some text")
    n, best_of = common["n"], body.get("best_of")
    if best_of is not None and (not _is_int(best_of) or best_of != n):
        raise invalid("best_of", f"best_of={json.dumps(best_of)} is not supported by this server (it returns every "
                      f"choice it generates); allowed: n ({n}) or leave it out", "unsupported")
    logprobs, echo = _completion_logprobs(body)
    request = GenerationRequest(prompts=prompts, max_tokens=_integer(body, "max_tokens", 1, 16), logprobs=logprobs,
                                echo=echo, **common)
    if request.min_tokens > request.max_tokens:
        raise invalid("min_tokens", f"min_tokens ({request.min_tokens}) is above max_tokens ({request.max_tokens}); "
                      f"allowed 0..{request.max_tokens}")
    return request


def parse_chat(body: dict, served: str) -> GenerationRequest:
    """POST /v1/chat/completions: `messages` go through the tokenizer's chat template."""
    common = _common(body, CHAT_FIELDS, served)
    messages = body.get("messages")
    if messages is None:
        raise invalid("messages", "messages is missing: give a list of {role, content} objects",
                      "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", f"messages must be a non-empty list of {{role, content}} objects, got "
                      f"{json.dumps(messages)[:100]}")
    turns = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise invalid(where, f"{where} must be an object whose role is one of {', '.join(ROLES)}, got "
                          f"{json.dumps(message)[:100]}")
        content = message.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)
        calls = message.get("tool_calls") if message["role"] == "assistant" else None
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise invalid(f"{where}.content", f"{where}.content must be a string or a list of text parts, got "
                          f"{json.dumps(content)[:100]}")
        turn = {"role": "system" if message["role"] == "developer" else message["role"], "content": content}
        if calls is not None:
            turn["tool_calls"] = earlier_calls(calls, f"{where}.tool_calls")
        if message["role"] == "tool" and isinstance(message.get("tool_call_id"), str):
            turn["tool_call_id"] = message["tool_call_id"]
        turns.append(turn)
    limit = _integer(body, "max_completion_tokens", 1)
    older = _integer(body, "max_tokens", 1)
    if limit is not None and older is not None and limit != older:
        raise invalid("max_tokens", f"max_tokens ({older}) and max_completion_tokens ({limit}) disagree; give "
                      "max_completion_tokens alone (max_tokens is its older name)")
    field = "max_tokens" if limit is None and older is not None else "max_completion_tokens"
    request = GenerationRequest(messages=turns, max_tokens=older if limit is None else limit, budget_field=field,
                                logprobs=_chat_logprobs(body), tools=parse_tools(body),
                                parallel_tool_calls=body.get("parallel_tool_calls") is not False, **common)
    if request.tools is not None and request.tools.constrained and request.response_format is not None:
        raise invalid("response_format", "response_format cannot be combined with tool_choice "
                      f"{json.dumps(body.get('tool_choice'))}: the answer is then tool calls")
    if request.max_tokens is not None and request.min_tokens > request.max_tokens:
        raise invalid("min_tokens", f"min_tokens ({request.min_tokens}) is above {field} ({request.max_tokens}); "
                      f"allowed 0..{request.max_tokens}")
    return request
