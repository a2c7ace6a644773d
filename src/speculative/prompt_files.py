"""Prompt files of the command line: plain text, or JSON lines checked whole before any work.

A JSON-lines file holds one object per line: {"prompt": "...", "max_new_tokens": 64,
"chat": true}, the last two optional; other keys (e.g. "kind") are ignored. Every line is
checked before anything is generated, and errors name the file and the line.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path


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


def parse_line(line: str, where: str, number: int) -> PromptLine:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} is not JSON: {error.msg} at column {error.colno}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: each line must be a JSON object like {{\"prompt\": \"...\"}}, got "
                         f"{type(row).__name__}")
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
