"""Tokenizers behind one small interface: text in, token ids, text out."""

from __future__ import annotations

import json
import weakref
from pathlib import Path


class TextTokenizer:
    """Wraps a transformers tokenizer or a `tokenizers.Tokenizer`.

    `eos_token_ids` are the ids that end generation; `name` says where it came from, for
    error messages that compare two tokenizers.
    """

    def __init__(self, backend, name: str, eos_token_ids: list[int] | None = None):
        self.backend = backend
        self.name = name
        self.is_hf = hasattr(backend, "apply_chat_template")
        if eos_token_ids is None:
            eos = backend.eos_token_id if self.is_hf else backend.token_to_id("<|endoftext|>")
            eos_token_ids = [] if eos is None else [eos]
        self.eos_token_ids = list(eos_token_ids)
        # A Jinja chat template that replaces the tokenizer's own (None: its own, if any).
        self.chat_template: str | None = None
        self.special_tokens: dict[str, str] = {}  # bos_token, eos_token, ...: what chat templates may write

    @classmethod
    def from_checkpoint(cls, path: Path, eos_token_ids: list[int] | None = None) -> "TextTokenizer":
        """A transformers checkpoint's tokenizer read by `tokenizers` alone, from tokenizer.json,
        tokenizer_config.json and chat_template.jinja: the same ids and texts as transformers'
        fast tokenizer (tests/test_text.py), without importing transformers (seconds of a start)."""
        from tokenizers import Tokenizer

        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        tokenizer = cls(Tokenizer.from_file(str(path / "tokenizer.json")), name=str(path), eos_token_ids=[])
        special = {key: value if isinstance(value, str) else value.get("content") for key, value in config.items()
                   if key.endswith("_token") and isinstance(value, (str, dict))}
        tokenizer.special_tokens = {key: value for key, value in special.items() if isinstance(value, str)}
        if eos_token_ids is None:
            eos = tokenizer.backend.token_to_id(special.get("eos_token") or "")
            eos_token_ids = [] if eos is None else [eos]
        tokenizer.eos_token_ids = list(eos_token_ids)
        template_file = path / "chat_template.jinja"
        tokenizer.chat_template = (template_file.read_text() if template_file.is_file()
                                   else config.get("chat_template") if isinstance(config.get("chat_template"), str)
                                   else None)
        return tokenizer

    def __len__(self) -> int:
        return len(self.backend) if self.is_hf else self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        if self.is_hf:
            return self.backend(text, add_special_tokens=True)["input_ids"]
        return self.backend.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        if self.is_hf:
            return self.backend.decode(ids, skip_special_tokens=True)
        return self.backend.decode(ids)

    def vocab(self) -> dict[str, int]:
        return self.backend.get_vocab()

    def grammar_tokenizer(self, vocab_size: int):
        """This tokenizer as grammars see it (core/grammar.py), for a model of `vocab_size`
        tokens; its first end token ends a grammar's output."""
        from ..core.grammar import GrammarTokenizer

        if not self.eos_token_ids:
            raise ValueError(f"tokenizer {self.name} has no end token, which structured output needs")
        backend = self.backend.backend_tokenizer if self.is_hf else self.backend
        return GrammarTokenizer.cached(backend.to_str(), vocab_size, self.eos_token_ids[0])

    def has_chat_template(self) -> bool:
        return self.chat_template is not None or (self.is_hf and bool(getattr(self.backend, "chat_template", None)))

    def chat(self, text: str) -> list[int]:
        """The prompt as one user turn of the tokenizer's chat template."""
        if not self.has_chat_template():
            raise ValueError(f"tokenizer {self.name} has no chat template; drop --chat to use the text as it is")
        return self.chat_messages([{"role": "user", "content": text}])

    def template_source(self) -> str:
        """The chat template's text ("" without one)."""
        return self.chat_template or (getattr(self.backend, "chat_template", None) if self.is_hf else None) or ""

    def chat_messages(self, messages: list[dict], generation_prompt: bool = True,
                      tools: list[dict] | None = None) -> list[int]:
        """Chat turns ({"role", "content"}; an assistant's earlier `tool_calls`, a tool turn's
        `tool_call_id`) through the chat template (`chat_template` when set, else the
        tokenizer's own), ending where the assistant's answer begins (generation_prompt=False:
        where the last turn ends, as training text). `tools`: OpenAI's tool objects, which the
        template describes to the model."""
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError("messages must be a non-empty list of {\"role\": string, \"content\": string} objects, "
                             f"got {str(messages)[:80]}")
        if not self.has_chat_template():
            raise ValueError(f"tokenizer {self.name} has no chat template; give the text as a prompt instead "
                             "(drop --chat, or \"messages\" for \"prompt\")")
        messages = [{key: m[key] for key in ("role", "content", "tool_calls", "tool_call_id") if key in m}
                    for m in messages]
        extra = {} if tools is None else {"tools": tools}
        if self.is_hf:
            ids = self.backend.apply_chat_template(messages, chat_template=self.chat_template,
                                                   add_generation_prompt=generation_prompt, tokenize=True, **extra)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # as transformers renders templates

        def raise_exception(message):  # what templates call to refuse a chat, as in transformers
            raise TemplateError(message)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = raise_exception
        template = environment.from_string(self.chat_template)
        text = template.render(messages=messages, add_generation_prompt=generation_prompt, **self.special_tokens,
                               **extra)
        return self.backend.encode(text, add_special_tokens=False).ids  # the template writes them itself


def same_vocabulary(a: TextTokenizer, b: TextTokenizer) -> bool:
    """Two tokenizers are interchangeable when they map the same strings to the same ids.
    The answer is kept for the pair until a vocabulary grows: comparing two 150k-token
    vocabularies takes a quarter of a second, which every engine's check used to pay."""
    if a is b:
        return True
    sizes = (len(a), len(b))
    pairs = _COMPARED.setdefault(a, weakref.WeakKeyDictionary())
    known = pairs.get(b)
    if known is None or known[0] != sizes:
        known = pairs[b] = (sizes, a.vocab() == b.vocab())
    return known[1]


# Tokenizers compared: a -> {b: ((both vocabulary sizes), same?)}, while both live (kept
# apart from the tokenizers, which stay picklable).
_COMPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
