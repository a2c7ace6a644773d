"""Structured output: a grammar a request's output must match, run by llguidance.

A `Grammar` is what a request asks for (a JSON schema, a regular expression, a Lark
grammar) compiled for one tokenizer; each row that uses it gets its own `Constraint`, the
grammar's state after the row's committed tokens. The constraint changes the target's
distribution the plain way (tokens the grammar forbids get probability 0 at every
verified position), so greedy output equals constrained plain decoding and sampling stays
exact. Speculation gains twice: where the grammar allows one spelling only (keys, braces,
the rest of an enum value), those tokens are a free draft (`Constraint.forced`), and a
draft is cut where it leaves the grammar (it could never be accepted there).
"""

from __future__ import annotations

import json
import threading

import torch

# JSON as `json.dumps` writes it (", " and ": ", no other whitespace): every key, quote and
# separator is then forced, and the output is what OpenAI's structured outputs look like.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "regex", "lark")

_TOKENIZERS: dict = {}
_TOKENIZERS_LOCK = threading.Lock()


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ImportError("structured output needs llguidance: pip install 'speculative[serve]' "
                          "(or pip install llguidance)") from None
    return llguidance


class GrammarTokenizer:
    """llguidance's view of a tokenizer: built once per (tokenizer, vocabulary size, end token),
    about 2 s for a 150k vocabulary. `source`: a `tokenizers` JSON string, or an object with
    `tokens` (each id's bytes), `eos_token_id`, `bos_token_id` and a call that encodes text
    (llguidance's TokenizerWrapper takes it)."""

    def __init__(self, source, vocab_size: int, end_token: int):
        llg = _llguidance()
        self.vocab_size, self.end_token = vocab_size, end_token
        wrapped = source if isinstance(source, str) else llg.TokenizerWrapper(source)
        self.backend = llg.LLTokenizer(wrapped, n_vocab=vocab_size, eos_token=end_token)

    @classmethod
    def cached(cls, tokenizer_json: str, vocab_size: int, end_token: int) -> "GrammarTokenizer":
        key = (hash(tokenizer_json), len(tokenizer_json), vocab_size, end_token)
        with _TOKENIZERS_LOCK:
            if key not in _TOKENIZERS:
                _TOKENIZERS[key] = cls(tokenizer_json, vocab_size, end_token)
            return _TOKENIZERS[key]


class Grammar:
    """What a request's output must match; equal grammars compare equal (kind and text)."""

    def __init__(self, kind: str, text: str, tokenizer: GrammarTokenizer):
        if kind not in KINDS:
            raise ValueError(f"a grammar's kind must be one of {', '.join(KINDS)}, got {kind!r}")
        llg = _llguidance()
        if kind == "json_schema":
            try:
                schema = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"the JSON schema is not valid JSON: {error}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema must be an object, got {text[:80]}")
            source = llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)
        elif kind == "regex":
            source = llg.LLMatcher.grammar_from_regex(text)
        else:
            source = llg.LLMatcher.grammar_from_lark(text)
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(source, tokenizer.backend)
        if failed:
            raise ValueError(f"the {kind.replace('_', ' ')} cannot be used: {messages[0]}")
        self.kind, self.text, self.tokenizer, self.source = kind, text, tokenizer, source

    @classmethod
    def json_schema(cls, schema: dict | str, tokenizer: GrammarTokenizer) -> "Grammar":
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema), tokenizer)

    @property
    def end_token(self) -> int:
        """The token the output ends with once the grammar is complete (a stop token)."""
        return self.tokenizer.end_token

    def constraint(self) -> "Constraint":
        return Constraint(self)

    def __eq__(self, other) -> bool:
        return isinstance(other, Grammar) and (self.kind, self.text, self.tokenizer) == (
            other.kind, other.text, other.tokenizer)

    def __hash__(self) -> int:
        return hash((self.kind, self.text))

    def __repr__(self) -> str:
        return f"Grammar({self.kind}, {self.text[:60]!r})"


class Constraint:
    """One row's place in its grammar: the state after its committed tokens."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self.matcher = _llguidance().LLMatcher(grammar.tokenizer.backend, grammar.source, log_level=0)
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ValueError(f"grammar error: {self.matcher.get_error()}")

    def forced(self) -> list[int]:
        """Tokens the grammar allows alone from here (its one spelling): a free draft."""
        return self.matcher.compute_ff_tokens()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar allows in a row from here."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def allowed(self, vocab_size: int, device) -> torch.Tensor:
        """(vocab_size,) bool: the tokens the grammar allows next."""
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
        bits = (words[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # little-endian bits
        return bits.flatten()[:vocab_size].bool().to(device)

    def mask(self, logits: torch.Tensor, drafted: list[int]) -> None:
        """Forbid what the grammar forbids at each position of logits (T, V), in place: position
        j follows drafted[:j]. Positions after the first drafted token the grammar refuses are
        left as they are: acceptance stops at that token (its probability is 0)."""
        valid, consumed = min(self.valid_prefix(drafted), logits.shape[0] - 1), 0
        try:
            for j in range(valid + 1):
                if j:
                    self.matcher.consume_token(drafted[j - 1])
                    consumed += 1
                logits[j].masked_fill_(~self.allowed(logits.shape[-1], logits.device), float("-inf"))
        finally:  # the state stays the committed tokens', whatever interrupts this
            self.matcher.rollback(consumed)
        self._check()

    def advance(self, tokens: list[int]) -> None:
        """The row committed `tokens` (each one the grammar allowed; the end token, which ends
        the row, once the grammar is complete)."""
        for token in tokens:
            if token == self.grammar.end_token and self.matcher.is_accepting():
                return
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"grammar refused committed token {token}: {self.matcher.get_error()}")
