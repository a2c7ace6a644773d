"""Prompt files of the command line: plain text, or JSON lines checked whole before any work.

A JSON-lines file holds one object per line: {"prompt": "...", "max_new_tokens": 64,
"chat": true}, the last two optional; other keys (e.g. "kind") are ignored, except the settings
that batch records and the server take per prompt (NOT_LINE_SETTINGS): those are refused, as
the line would be generated without them. Every line is
checked before anything is generated, and errors name the file and the line. A line must
be plain JSON (no NaN, no integers of thousands of digits) whose strings are Unicode text:
JSON's \\u escapes can spell a lone surrogate ("\\ud800"), which no tokenizer and no
UTF-8 output can take.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path


# Per-prompt settings of batch records and the server that a prompt line does not take, with
# what to do instead.
NOT_LINE_SETTINGS = {
    "max_tokens": 'write "max_new_tokens"', "max_completion_tokens": 'write "max_new_tokens"',
    "messages": 'give the text as "prompt" with "chat": true',
    **{name: f"give --{name.replace('_', '-')} for every line" for name in ("temperature", "top_k", "top_p", "seed")},
    **{name: "`speculative batch` takes stop strings per record" for name in ("stop", "stop_token_ids")},
}


@dataclass
class PromptLine:
    # Line number in the file (1 = first line; blank lines count).
    line: int
    prompt: str
    # None: the command's --max-new-tokens.
    max_new_tokens: int | None = None
    # Wrap the prompt in the tokenizer's chat template.
    chat: bool = False


def is_jsonl(path) -> bool:
    return Path(str(path)).suffix.lower() == ".jsonl"


def read_bytes(path, option: str) -> bytes:
    """A file's bytes; pipes such as /dev/stdin work, and '-' reads standard input."""
    if str(path) == "-":
        return sys.stdin.buffer.read()
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{option} {path} is a directory; give a text file, or a .jsonl file of prompts")
    if not path.exists():
        raise FileNotFoundError(f"{option} {path} does not exist")
    try:
        return path.read_bytes()
    except OSError as error:
        raise ValueError(f"{option} {path} cannot be read: {error.strerror or error}") from None


def decode_text(data: bytes, where: str) -> str:
    """UTF-8 text (a leading byte-order mark dropped); binary data is refused."""
    if b"\0" in data:
        raise ValueError(f"{where} holds NUL bytes: it is a binary file, not text")
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        raise ValueError(f"{where} is not UTF-8 text: byte 0x{data[error.start]:02x} on line {line} (offset "
                         f"{error.start}) cannot be decoded") from None


def read_text(path, option: str) -> str:
    return decode_text(read_bytes(path, option), f"{option} {path}")


def read_jsonl(path, option: str) -> list[PromptLine]:
    """Every prompt of a JSON-lines file, each checked; the first bad line raises ValueError."""
    text = read_text(path, option)
    rows = []
    for number, line in enumerate(text.split("\n"), 1):
        if line.strip():
            rows.append(parse_line(line, f"{path} line {number}", number))
    if not rows:
        raise ValueError(f"{option} {path} holds no prompts (one JSON object per line)")
    return rows


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def load_line(line: str, where: str):
    """One JSON line, as json.loads gives it, or a ValueError naming `where` and the problem."""
    try:
        value = json.loads(line, parse_constant=_no_constant)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} is not JSON: {error.msg} at column {error.colno}") from None
    except RecursionError:
        raise ValueError(f"{where} is nested too deeply to read") from None
    except ValueError as error:  # NaN or Infinity, or an integer too long to convert
        raise ValueError(f"{where} is not plain JSON: {error}") from None
    bad = not_text(value)
    if bad is not None:
        raise ValueError(f"{where}: {bad} is not Unicode text: it holds a lone surrogate (a \\ud800 to \\udfff "
                         "escape without its pair); write the text as UTF-8")
    return value


def not_text(value) -> str | None:
    """Where in a JSON value the first string (or key) that is not Unicode text is, e.g.
    '"prompt"' or '"messages"[0]["content"]'; None when every string is text. Iterative."""
    todo = [(value, "")]
    while todo:
        item, where = todo.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return where or "the line"
        elif isinstance(item, dict):
            for key, part in item.items():
                todo.append((key, f"a key of {where or 'the object'}"))
                todo.append((part, f'{where}["{key}"]' if where else f'"{key}"'))
        elif isinstance(item, list):
            todo += [(part, f"{where}[{i}]") for i, part in enumerate(item)]
    return None


def parse_line(line: str, where: str, number: int) -> PromptLine:
    row = load_line(line, where)
    if not isinstance(row, dict):
        raise ValueError(f"{where}: each line must be a JSON object like {{\"prompt\": \"...\"}}, got "
                         f"{type(row).__name__}")
    for key, instead in NOT_LINE_SETTINGS.items():
        if key in row:
            raise ValueError(f"{where}: \"{key}\" is not a setting of a prompt line, which takes \"prompt\", "
                             f"\"max_new_tokens\" and \"chat\"; {instead}")
    prompt = row.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError(f"{where}: \"prompt\" must be a string, got {json.dumps(prompt)}")
    if not prompt:
        raise ValueError(f"{where}: the prompt is empty")
    max_new = row.get("max_new_tokens")
    if "max_new_tokens" in row and (isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0):
        raise ValueError(f"{where}: \"max_new_tokens\" must be an integer >= 0 (or left out for the command's "
                         f"--max-new-tokens), got {json.dumps(max_new)}")
    chat = row.get("chat", False)
    if not isinstance(chat, bool):
        raise ValueError(f"{where}: \"chat\" must be true or false, got {json.dumps(chat)}")
    return PromptLine(number, prompt, max_new, chat)
