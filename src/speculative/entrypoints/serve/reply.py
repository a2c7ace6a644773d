"""What an HTTP request has been given so far, as OpenAI's response, chunk and usage objects."""

from __future__ import annotations

import json
import time

from ...core.stats import RequestStats
from .engine_loop import Event
from .logprob_format import TokenText, chat_logprobs, completion_logprobs
from .protocol import GenerationRequest
from .tools import split_calls


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class Reply:
    """What one HTTP request has been given so far, and its response or chunk objects.
    Choice i is choice i % n of prompt i // n."""

    def __init__(self, response_id: str, kind: str, model: str, count: int, req: GenerationRequest,
                 token_text: TokenText | None = None, echoes: list[str] | None = None,
                 prompts: list[list[int]] | None = None):
        self.id, self.kind, self.model, self.req = response_id, kind, model, req
        self.chat = kind == "chat.completion"
        self.created = int(time.time())
        self.token_text = token_text
        self.texts = [""] * count
        self.tokens: list[list[int]] = [[] for _ in range(count)]
        self.finish: list[str | None] = [None] * count
        self.prompt_tokens = [0] * count
        self.stats = [RequestStats() for _ in range(count)]
        self.replica = ""  # on Ray: the engine replica that served the request (one call, one replica)
        # With `echo`: each choice's prompt text and tokens (whose logprobs come with its first output).
        self.echoes, self.prompts = echoes, prompts
        self.echoed = [False] * count
        # With logprobs: each choice's (token, TokenLogprob or None) so far, and its text offset.
        self.logprobs: list[list[tuple]] = [[] for _ in range(count)]
        self.offsets = [0] * count

    @property
    def complete(self) -> bool:
        return all(f is not None for f in self.finish)

    def echo_pending(self, i: int) -> bool:
        return self.echoes is not None and not self.echoed[i]

    def add(self, event: Event) -> None:
        i = event.index
        self.texts[i] += event.text
        self.tokens[i] += event.token_ids
        if event.prompt_logprobs is not None:
            self.logprobs[i] = list(zip(self.prompts[i], event.prompt_logprobs)) + self.logprobs[i]
        if event.logprobs is not None:
            self.logprobs[i] += list(zip(event.token_ids, event.logprobs))
        if event.finish_reason is not None:
            self.finish[i] = event.finish_reason
            self.prompt_tokens[i] = event.prompt_tokens
            self.stats[i] = event.stats or RequestStats()
            self.replica = event.replica or self.replica

    def usage(self) -> dict:
        # Each prompt counts once, however many choices it has (as OpenAI counts `n`).
        prompt, completion = sum(self.prompt_tokens[::self.req.n]), sum(map(len, self.tokens))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def figures(self, stats: list[RequestStats]) -> dict:
        """The speculative extension: what was drafted and kept for these requests."""
        drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
        forwards = sum(s.target_forwards for s in stats)
        figures = {"drafted": drafted, "accepted": accepted, "acceptance_rate": accepted / drafted if drafted else 0.0,
                   "mean_acceptance_length": 1 + accepted / forwards if forwards else 0.0,
                   "target_forwards": forwards}
        return {**figures, "replica": self.replica} if self.replica else figures

    def _logprobs(self, i: int, entries: list[tuple]) -> dict | None:
        """Choice i's logprobs object for these (token, logprob) entries (None: not asked for)."""
        if self.req.logprobs is None:
            return None
        tokens = [token for token, _ in entries]
        values = [value for _, value in entries]
        if self.chat:
            return chat_logprobs(self.token_text, values)
        shaped = completion_logprobs(self.token_text, tokens, values, self.offsets[i])
        self.offsets[i] += sum(map(len, shaped["tokens"]))
        return shaped

    @property
    def holds_text(self) -> bool:
        """With tools, a stream's text is held to its end, where its tool calls are read."""
        return self.req.tools is not None

    def message(self, i: int, text: str, finish: str | None) -> tuple[dict, str | None]:
        """Choice i's chat message (its tool calls read out of the text, with tools) and finish reason."""
        if self.req.tools is None:
            return {"role": "assistant", "content": text}, finish
        content, calls = split_calls(text)
        if not calls:
            return {"role": "assistant", "content": text}, finish
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls" if finish == "stop" \
            else finish

    def _choice(self, i: int, text: str, tokens: list[int], finish: str | None, delta: bool,
                logprobs: dict | None) -> dict:
        if self.chat:
            if delta:
                body = {"delta": text}
            else:
                message, finish = self.message(i, text, finish)
                body = {"message": message}
            choice = {"index": i, **body, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if self.req.return_token_ids:
            choice["token_ids"] = tokens
        return choice

    def _object(self, choices: list[dict], chunk: bool) -> dict:
        kind = f"{self.kind}.chunk" if chunk and self.chat else self.kind
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def whole(self) -> dict:
        choices = []
        for i, (text, ids, finish) in enumerate(zip(self.texts, self.tokens, self.finish)):
            self.offsets[i] = 0
            choices.append(self._choice(i, (self.echoes[i] if self.echoes else "") + text, ids, finish, False,
                                        self._logprobs(i, self.logprobs[i])))
        return {**self._object(choices, False), "usage": self.usage(), "speculative": self.figures(self.stats)}

    def chunk(self, i: int, delta: dict) -> dict:
        return self._object([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}], True)

    def delta(self, event: Event) -> dict:
        """The chunk of one event: its text and tokens (the echoed prompt first, in a choice's first chunk)."""
        i, text = event.index, event.text
        entries = self.logprobs[i][-len(event.logprobs):] if event.logprobs else []
        if self.echo_pending(i):
            self.echoed[i] = True
            text = self.echoes[i] + text
            entries = self.logprobs[i][:len(self.logprobs[i]) - len(entries)] + entries
        finish, tokens = event.finish_reason, event.token_ids
        if self.chat and self.holds_text:  # the whole answer comes with its finish, tool calls read
            tokens = self.tokens[i]
            text, finish = self.message(i, self.texts[i], finish) if finish is not None else ({"content": ""}, None)
            if "tool_calls" in text:
                text["tool_calls"] = [{"index": n, **call} for n, call in enumerate(text["tool_calls"])]
            text.pop("role", None)
        elif self.chat:
            text = {"content": text}
        logprobs = self._logprobs(i, entries)
        out = self._object([self._choice(i, text, tokens, finish, True, logprobs)], True)
        if event.finish_reason is not None:
            out["speculative"] = self.figures([self.stats[event.index]])
        return out

    def usage_chunk(self) -> dict:
        return {**self._object([], True), "usage": self.usage(), "speculative": self.figures(self.stats)}
