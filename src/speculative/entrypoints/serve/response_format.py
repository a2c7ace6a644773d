"""OpenAI's response_format: what an answer must match, as a grammar's (kind, text)."""

from __future__ import annotations

import json

from .errors import invalid


def parse_response_format(value) -> tuple[str, str] | None:
    """OpenAI's response_format: text (anything), json_object (any JSON object) or
    json_schema (JSON matching {"json_schema": {"name", "schema", "strict"}})."""
    if value is None:
        return None
    kinds = "text, json_object or json_schema"
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid("response_format", f"response_format must be an object whose type is {kinds}, got "
                      f"{json.dumps(value)[:100]}")
    kind = value["type"]
    extra = sorted(set(value) - {"type", "json_schema"} if kind == "json_schema" else set(value) - {"type"})
    if extra:
        raise invalid("response_format", f"response_format of type {kind} takes no field {extra[0]!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_schema", json.dumps({"type": "object"}))
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise invalid("response_format", "response_format.json_schema must be an object {name, schema, strict, "
                      f"description}} whose schema is a JSON schema object, got {json.dumps(spec)[:100]}")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise invalid("response_format", "response_format.json_schema.name is missing: give the schema a name")
    return ("json_schema", json.dumps(spec.get("schema", {"type": "object"})))
