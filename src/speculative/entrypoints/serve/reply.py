"""What an HTTP request has been given so far, as OpenAI's response, chunk and usage objects."""

from __future__ import annotations

import json
import time

from ...core.stats import RequestStats
from .engine_loop import Event
from .protocol import GenerationRequest


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class Reply:
    """What one HTTP request has been given so far, and its response or chunk objects."""

    def __init__(self, response_id: str, kind: str, model: str, count: int, req: GenerationRequest):
        self.id, self.kind, self.model, self.req = response_id, kind, model, req
        self.chat = kind == "chat.completion"
        self.created = int(time.time())
        self.texts = [""] * count
        self.tokens: list[list[int]] = [[] for _ in range(count)]
        self.finish: list[str | None] = [None] * count
        self.prompt_tokens = [0] * count
        self.stats = [RequestStats() for _ in range(count)]

    @property
    def complete(self) -> bool:
        return all(f is not None for f in self.finish)

    def add(self, event: Event) -> None:
        i = event.index
        self.texts[i] += event.text
        self.tokens[i] += event.token_ids
        if event.finish_reason is not None:
            self.finish[i] = event.finish_reason
            self.prompt_tokens[i] = event.prompt_tokens
            self.stats[i] = event.stats or RequestStats()

    def usage(self) -> dict:
        prompt, completion = sum(self.prompt_tokens), sum(map(len, self.tokens))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def figures(self, stats: list[RequestStats]) -> dict:
        """The speculative extension: what was drafted and kept for these requests."""
        drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
        forwards = sum(s.target_forwards for s in stats)
        return {"drafted": drafted, "accepted": accepted, "acceptance_rate": accepted / drafted if drafted else 0.0,
                "mean_acceptance_length": 1 + accepted / forwards if forwards else 0.0,
                "target_forwards": forwards}

    def _choice(self, i: int, text: str, tokens: list[int], finish: str | None, delta: bool) -> dict:
        if self.chat:
            body = {"delta": text} if delta else {"message": {"role": "assistant", "content": text}}
            choice = {"index": i, **body, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
        if self.req.return_token_ids:
            choice["token_ids"] = tokens
        return choice

    def _object(self, choices: list[dict], chunk: bool) -> dict:
        kind = f"{self.kind}.chunk" if chunk and self.chat else self.kind
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def whole(self) -> dict:
        choices = [self._choice(i, t, ids, f, False) for i, (t, ids, f) in
                   enumerate(zip(self.texts, self.tokens, self.finish))]
        return {**self._object(choices, False), "usage": self.usage(), "speculative": self.figures(self.stats)}

    def chunk(self, i: int, delta: dict) -> dict:
        return self._object([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}], True)

    def delta(self, event: Event) -> dict:
        text = {"content": event.text} if self.chat else event.text
        out = self._object([self._choice(event.index, text, event.token_ids, event.finish_reason, True)], True)
        if event.finish_reason is not None:
            out["speculative"] = self.figures([self.stats[event.index]])
        return out

    def usage_chunk(self) -> dict:
        return {**self._object([], True), "usage": self.usage(), "speculative": self.figures(self.stats)}
