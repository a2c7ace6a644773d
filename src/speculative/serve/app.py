"""The FastAPI app: OpenAI's completions and chat completions over the engine loop.

Handlers parse and check a request (`protocol`), tokenize it, submit it to the engine
loop and read its events from an asyncio queue; they never touch the engine. Streams are
server-sent events (`data: {...}`, then `data: [DONE]`); a client that goes away has its
requests aborted. Every error, ours or the framework's (404, 405), is OpenAI's
{"error": {...}} object. Every request is logged on the "speculative.serve.access" logger:
method, path, status, tokens (prompt + completion) and seconds.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..rows import SamplingParams
from ..stats import RequestStats
from .engine_loop import EngineLoop, Event, Job
from .protocol import APIError, GenerationRequest, invalid, parse_chat, parse_completion, parse_json

# How often a non-streaming handler checks that its client is still there.
DISCONNECT_POLL = 0.5
access_log = logging.getLogger("speculative.serve.access")


@dataclass
class Settings:
    model_name: str
    # The most prompt plus new tokens any request may hold (None: no limit).
    context_length: int | None
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    # Token ids that end every request (the tokenizer's end of text).
    eos_token_ids: tuple[int, ...] = ()
    # Default budget where the context sets none.
    default_max_tokens: int = 256
    # Token ids a prompt may hold are 0..vocab_size-1 (None: not checked here).
    vocab_size: int | None = None


def create_app(loop: EngineLoop, tokenizer, settings: Settings) -> FastAPI:
    """`tokenizer`: a TextTokenizer (speculative.text), with `chat_messages` for chat."""

    @asynccontextmanager
    async def lifespan(app):
        loop.start()
        yield
        loop.stop()

    app = FastAPI(title="speculative", lifespan=lifespan)
    app.add_middleware(AccessLog)
    app.state.loop = loop
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        headers = {"Retry-After": "1"} if error.status == 503 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        what = {404: f"no route {request.method} {request.url.path}: see /v1/completions, "
                     "/v1/chat/completions, /v1/models, /health, /metrics",
                405: f"method {request.method} is not allowed on {request.url.path}"}.get(error.status_code,
                                                                                        str(error.detail))
        return await api_error(request, APIError(error.status_code, what, code={404: "not_found"}.get(
            error.status_code)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, error):
        return await api_error(request, invalid(None, str(error)))

    @app.exception_handler(Exception)
    async def server_error(request, error):
        return await api_error(request, APIError(500, f"{type(error).__name__}: {error}"))

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), settings.api_key.encode()):  # constant time
            raise APIError(401, "invalid or missing API key: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def read_body(request: Request) -> dict:
        limit = settings.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise APIError(413, f"the request body has {int(length)} bytes, more than the limit of {limit}",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body is over the limit of {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        return parse_json(b"".join(chunks))

    @app.get("/health")
    async def health():
        if not loop.alive or loop.draining:
            why = "shutting down" if loop.draining else (loop.failed or "the engine loop has stopped")
            return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(loop.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": created,
                                            "owned_by": "speculative", "max_model_len": settings.context_length}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        req = parse_completion(await read_body(request), settings.model_name)
        if len(req.prompts) > loop.capacity:  # it could never be admitted: not a "retry later"
            raise APIError(413, f"prompt holds {len(req.prompts)} prompts; this server takes at most {loop.capacity} "
                           "at once (--max-batch-size plus --max-waiting): send them in several requests",
                           "prompt", "too_many_prompts")
        prompts = [tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts]
        for i, p in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if not p:
                raise invalid(where, f"{where} encodes to no tokens; give some text")
            bad = [t for t in p if settings.vocab_size is not None and not 0 <= t < settings.vocab_size]
            if bad:
                raise invalid(where, f"{where} holds token id {bad[0]}, outside the vocabulary: allowed "
                              f"0..{settings.vocab_size - 1}")
        return await generate(request, req, prompts, "cmpl", "text_completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        authorize(request)
        req = parse_chat(await read_body(request), settings.model_name)
        try:
            prompt = tokenizer.chat_messages(req.messages)
        except ValueError as error:
            code = "no_chat_template" if "no chat template" in str(error) else None
            raise invalid("messages", str(error), code) from None
        except Exception as error:  # the template itself refused these messages (jinja2's raise_exception)
            raise invalid("messages", f"the chat template cannot render these messages: {type(error).__name__}: "
                          f"{error}", "chat_template_error") from None
        return await generate(request, req, [prompt], "chatcmpl", "chat.completion")

    async def generate(request: Request, req: GenerationRequest, prompts: list[list[int]], prefix: str,
                       kind: str):
        if req.max_tokens is None:  # chat without a budget: what the context leaves
            room = settings.context_length - len(prompts[0]) if settings.context_length else None
            req.max_tokens = max(1, settings.default_max_tokens if room is None else room)
        check_lengths(req, prompts, settings.context_length, "messages" if kind == "chat.completion" else "prompt")
        request.scope.setdefault("state", {})["usage"] = None
        try:
            params = SamplingParams(req.max_tokens, req.temperature, req.top_k, req.top_p, req.seed,
                                    sorted(set(settings.eos_token_ids) | set(req.stop_token_ids)))
        except ValueError as error:
            raise invalid(None, str(error)) from None
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        events: asyncio.Queue[Event] = asyncio.Queue()
        running = asyncio.get_running_loop()
        loop.submit(Job(ids, prompts, params, req.stop, lambda e: running.call_soon_threadsafe(events.put_nowait, e),
                        loop.clock()))
        first = await events.get()
        if first.kind == "error":
            raise first.error
        reply = Reply(response_id, kind, settings.model_name, len(prompts), req)
        request.scope["state"]["usage"] = reply.usage  # for the access log, once the response is sent
        if req.stream:
            return StreamingResponse(stream(reply, events, ids), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            while not reply.complete:
                try:
                    event = await asyncio.wait_for(events.get(), DISCONNECT_POLL)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        break
                    continue
                if event.kind == "error":
                    raise event.error
                reply.add(event)
        finally:
            if not reply.complete:
                loop.abort(ids)
        return reply.whole()

    async def stream(reply: "Reply", events: asyncio.Queue, ids: list[str]):
        """Chunks as the engine gives tokens; the client going away cancels this generator."""
        try:
            if reply.chat:
                yield sse(reply.chunk(0, {"role": "assistant", "content": ""}))
            while not reply.complete:
                event = await events.get()
                if event.kind == "error":
                    yield sse(event.error.body())
                    break
                reply.add(event)
                if event.text or event.finish_reason or (event.token_ids and reply.req.return_token_ids):
                    yield sse(reply.delta(event))
            if reply.req.include_usage and reply.complete:
                yield sse(reply.usage_chunk())
            yield "data: [DONE]\n\n"
        finally:
            if not reply.complete:
                loop.abort(ids)

    return app


def check_lengths(req: GenerationRequest, prompts: list[list[int]], context: int | None, param: str) -> None:
    """Each prompt plus the budget fits the context, or a 400 whose message names the fields
    the client sent (max_tokens or max_completion_tokens, never the engine's max_new_tokens)."""
    if context is None:
        return
    for i, prompt in enumerate(prompts):
        where = param if len(prompts) == 1 else f"{param}[{i}]"
        if len(prompt) >= context:
            raise invalid(where, f"{where} has {len(prompt)} tokens; this model's context holds {context}, prompt "
                          "and completion together: give a shorter prompt", "context_length_exceeded")
        if len(prompt) + req.max_tokens > context:  # param: the prompt, as OpenAI's context_length_exceeded
            field = req.budget_field
            raise invalid(where, f"{where} has {len(prompt)} tokens and {field} is {req.max_tokens}: "
                          f"{len(prompt) + req.max_tokens} tokens exceed this model's context of {context}; allowed "
                          f"{field} <= {context - len(prompt)}", "context_length_exceeded")


class AccessLog:
    """ASGI middleware: one line per HTTP request once its response is sent (or its client
    gone): method, path, status, tokens (prompt + completion) and seconds."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), [None]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException:
            status[0] = status[0] or 500  # answered by the server-error handler, outside this middleware
            raise
        finally:
            usage = scope.get("state", {}).get("usage")
            tokens = ""
            if usage is not None:
                counts = usage()
                tokens = f" tokens {counts['prompt_tokens']}+{counts['completion_tokens']}"
            client = scope.get("client") or ("-", 0)
            access_log.info('%s:%s "%s %s" %s%s %.3f s', client[0], client[1], scope["method"], scope["path"],
                            status[0] or "-", tokens, time.perf_counter() - started)


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
