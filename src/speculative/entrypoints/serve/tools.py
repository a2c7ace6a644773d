"""Tool calls (chat's `tools` and `tool_choice`) in the Hermes format that Qwen2.5's and
many other chat templates describe: the model writes each call as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

The request's tools go into the chat template; `tool_choice` "required" or a named function
constrains the answer with a grammar (core/grammar.py) to such calls, whose names and
arguments follow the tools' JSON schemas; "auto" leaves the model free and reads any calls
it wrote. The answer's calls become OpenAI's `tool_calls` (finish_reason "tool_calls").
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ...core.grammar import JSON_STYLE
from .errors import invalid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass
class Tools:
    """A request's checked tools and choice: "auto", "required", or a function's name."""

    functions: list[dict]
    choice: str

    @property
    def constrained(self) -> bool:
        return self.choice != "auto"

    def template_tools(self) -> list[dict]:
        """The tools as chat templates take them (OpenAI's objects)."""
        return [{"type": "function", "function": f} for f in self.functions]

    def grammar(self, special_id, parallel: bool) -> tuple[str, str]:
        """("lark", text): one call (or several, `parallel`) of the allowed functions.
        `special_id(text)`: the tokenizer's id of a special token, or None."""
        allowed = [f for f in self.functions if self.choice in ("required", f["name"])]
        body = {"oneOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                           "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]}}
                          for f in allowed]} if len(allowed) > 1 else {
            "type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": allowed[0]["name"]}, "arguments": allowed[0]["parameters"]}}
        body["x-guidance"] = JSON_STYLE
        start, end = (f"<[{i}]>" if i is not None else json.dumps(text)
                      for i, text in ((special_id(OPEN), OPEN), (special_id(CLOSE), CLOSE)))
        lark = (f"start: call{'+' if parallel else ''}\n"
                f'call: {start} "\\n" body "\\n" {end} "\\n"?\n'
                f"body: %json {json.dumps(body)}\n")
        return ("lark", lark)


def parse_tools(body: dict) -> Tools | None:
    """Chat's tools and tool_choice, checked (None: no tools, or tool_choice "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise invalid("tool_choice", "tool_choice needs tools: give tools, or leave tool_choice out")
        return None
    if not isinstance(tools, list) or not tools:
        raise invalid("tools", f"tools must be a non-empty list of {{type: function, function: {{name, parameters}}}}"
                      f" objects, got {json.dumps(tools)[:100]}")
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise invalid(where, f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}, got "
                          f"{json.dumps(tool)[:100]}")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise invalid(f"{where}.function.name", f"{where}.function.name must be 1-64 letters, digits, _ or -, "
                          f"got {name!r}")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise invalid(f"{where}.function.parameters", f"{where}.function.parameters must be a JSON schema "
                          f"object, got {json.dumps(parameters)[:100]}")
        functions.append({**function, "parameters": parameters})
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise invalid("tools", f"tools name a function twice: {sorted(n for n in names if names.count(n) > 1)[0]}")
    if choice in (None, "auto", "required", "none"):
        choice = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        choice = choice["function"].get("name")
        if choice not in names:
            raise invalid("tool_choice", f"tool_choice names {choice!r}, which is not among the tools: "
                          f"{', '.join(names)}")
    else:
        raise invalid("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                      f"\"function\": {{\"name\": ...}}}}, got {json.dumps(choice)[:100]}")
    return None if choice == "none" else Tools(functions, choice)


def split_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an answer: the calls it wrote as OpenAI's objects, and the
    text around them (None when nothing else is there). A call that is not JSON with a name
    stays in the content."""
    calls, kept, last = [], [], 0
    for match in CALL.finditer(text):
        try:
            value = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            continue
        arguments = value.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": value["name"], "arguments": json.dumps(arguments)}})
        kept.append(text[last:match.start()])
        last = match.end()
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def earlier_calls(calls, where: str) -> list[dict]:
    """An assistant turn's earlier tool calls, as chat templates take them (arguments as objects)."""
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                              and isinstance(c["function"].get("name"), str) for c in calls):
        raise invalid(where, f"{where} must be a list of {{id, type: function, function: {{name, arguments}}}}, got "
                      f"{json.dumps(calls)[:100]}")
    out = []
    for call in calls:
        arguments = call["function"].get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise invalid(where, f"{where}: arguments must be a JSON object (or its text), got "
                              f"{arguments[:100]!r}") from None
        out.append({**call, "function": {"name": call["function"]["name"], "arguments": arguments}})
    return out
