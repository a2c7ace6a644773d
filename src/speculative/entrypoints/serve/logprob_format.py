"""Log-probabilities in OpenAI's shapes: completions' `{tokens, token_logprobs, top_logprobs,
text_offset}` and chat's `{content: [{token, logprob, bytes, top_logprobs}]}`.

A token's text is its own bytes (a byte-level BPE token may hold part of a character:
vLLM's "bytes:\\xe2\\x80" then), and -inf (a token top-k or top-p removed) is written
-9999.0, as OpenAI writes the log-probability of a token it deems impossible: JSON has no
infinity.
"""

from __future__ import annotations

import math
from functools import lru_cache

from ...core.logprobs import TokenLogprob

IMPOSSIBLE = -9999.0


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character to byte (what byte-level BPE vocabularies spell)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenText:
    """Each token's bytes and text, for one tokenizer (kept per token id)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, bytes] = {}

    def bytes_of(self, token: int) -> bytes:
        cached = self.cache.get(token)
        if cached is None:
            cached = self.cache[token] = self._bytes(token)
        return cached

    def _bytes(self, token: int) -> bytes:
        backend = self.tokenizer.backend
        piece = backend.convert_ids_to_tokens(token) if self.tokenizer.is_hf else backend.id_to_token(token)
        table = byte_decoder()
        if piece is not None and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return self.tokenizer.decode([token]).encode("utf-8")

    def text(self, token: int) -> str:
        raw = self.bytes_of(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def number(value: float) -> float:
    return value if math.isfinite(value) else IMPOSSIBLE


def completion_logprobs(texts: TokenText, tokens: list[int], entries: list[TokenLogprob | None],
                        offset: int) -> dict:
    """Completions' shape for these tokens, text offsets counted from `offset`. A prompt's
    first token has no log-probability (entry None: null), as in OpenAI's echo."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, entries):
        text = texts.text(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(number(entry.logprob))
        top = {texts.text(t): number(v) for t, v in entry.top}
        top.setdefault(text, number(entry.logprob))  # the chosen token is always there, as in OpenAI's
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(texts: TokenText, entries: list[TokenLogprob]) -> dict:
    """Chat's shape for these tokens."""
    def item(token: int, value: float) -> dict:
        return {"token": texts.text(token), "logprob": number(value), "bytes": list(texts.bytes_of(token))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]}
                        for e in entries], "refusal": None}
