"""The routes: small handlers over one request-to-engine function, `Routes.generate`.

A handler checks its request (`protocol`), turns it into token ids and hands it to
`generate`, which submits it to the engine loop and answers from the loop's events, as one
response or as server-sent events (`data: {...}`, then `data: [DONE]`). A client that goes
away has its requests aborted. Handlers never touch the engine.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ...core.grammar import Grammar
from ...core.rows import SamplingParams
from .engine_loop import EngineLoop, Event, Job
from .http import authorize, read_body
from .logprob_format import TokenText
from .errors import APIError, invalid
from .protocol import GenerationRequest, parse_chat, parse_completion
from .reply import Reply, sse
from .tools import OPEN as TOOL_OPEN

# How often a non-streaming handler checks that its client is still there.
DISCONNECT_POLL = 0.5


class Routes:
    """The handlers of one server: its engine loop, tokenizer and settings (app.Settings)."""

    def __init__(self, loop: EngineLoop, tokenizer, settings):
        self.loop, self.tokenizer, self.settings = loop, tokenizer, settings
        self.token_text = TokenText(tokenizer)
        self.created = int(time.time())
        self._grammar_tokenizer = None  # built at the first structured request (seconds)

    async def health(self):
        loop = self.loop
        if not loop.alive or loop.draining:
            why = "shutting down" if loop.draining else (loop.failed or "the engine loop has stopped")
            return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)
        return {"status": "ok"}

    async def metrics(self):
        gather = getattr(self.loop.metrics, "gather", None)  # on Ray: every replica's, asked for now
        body = await gather() if gather is not None else self.loop.metrics.exposition()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request):
        authorize(request, self.settings.api_key)
        return {"object": "list", "data": [{"id": self.settings.model_name, "object": "model", "created": self.created,
                                            "owned_by": "speculative", "max_model_len": self.settings.context_length}]}

    async def completions(self, request: Request):
        authorize(request, self.settings.api_key)
        req = parse_completion(await read_body(request, self.settings.max_body_bytes), self.settings.model_name)
        rows = len(req.prompts) * req.n
        if rows > self.loop.capacity:  # it could never be admitted: not a "retry later"
            what = f"{len(req.prompts)} prompts" + (f" times n = {req.n} choices" if req.n > 1 else "")
            raise APIError(413, f"this request asks for {rows} rows ({what}); this server takes at most "
                           f"{self.loop.capacity} at once (--max-batch-size plus --max-queued): send them in "
                           "several requests", "n" if req.n > 1 else "prompt", "too_many_prompts")
        self.loop.check_room(rows)  # a full queue refuses before the prompts are tokenized
        prompts = [self.tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts]
        for i, prompt in enumerate(prompts):
            self.check_prompt(prompt, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
        return await self.generate(request, req, prompts, "cmpl", "text_completion")

    def check_prompt(self, prompt: list[int], where: str) -> None:
        if not prompt:
            raise invalid(where, f"{where} encodes to no tokens; give some text")
        vocab = self.settings.vocab_size
        bad = [t for t in prompt if vocab is not None and not 0 <= t < vocab]
        if bad:
            raise invalid(where, f"{where} holds token id {bad[0]}, outside the vocabulary: allowed 0..{vocab - 1}")

    async def chat(self, request: Request):
        authorize(request, self.settings.api_key)
        req = parse_chat(await read_body(request, self.settings.max_body_bytes), self.settings.model_name)
        if req.n > self.loop.capacity:
            raise APIError(413, f"n is {req.n}; this server takes at most {self.loop.capacity} rows at once "
                           "(--max-batch-size plus --max-queued)", "n", "too_many_prompts")
        self.loop.check_room(req.n)
        if req.tools is not None:
            check_takes_tools(self.tokenizer.template_source())
        try:
            prompt = self.tokenizer.chat_messages(req.messages, tools=req.tools and req.tools.template_tools())
        except ValueError as error:
            code = "no_chat_template" if "no chat template" in str(error) else None
            raise invalid("messages", str(error), code) from None
        except Exception as error:  # the template itself refused these messages (jinja2's raise_exception)
            raise invalid("messages", f"the chat template cannot render these messages: {type(error).__name__}: "
                          f"{error}", "chat_template_error") from None
        return await self.generate(request, req, [prompt], "chatcmpl", "chat.completion")

    async def generate(self, request: Request, req: GenerationRequest, prompts: list[list[int]], prefix: str,
                       kind: str):
        """A checked request to the engine, and its answer: whole, or streamed."""
        spec = req.response_format
        if req.tools is not None and req.tools.constrained:
            spec = req.tools.grammar(self.special_id, req.parallel_tool_calls)
        grammar = await self.grammar(spec, "tool_choice" if spec is not req.response_format else
                                     "response_format") if spec else None
        params = self.sampling(req, prompts, kind, grammar).choices(req.n)
        request.scope.setdefault("state", {})["usage"] = None
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        rows = [prompt for prompt in prompts for _ in range(req.n)]  # choice index: prompt * n + i
        ids = [f"{response_id}-{i}" for i in range(len(rows))]
        events: asyncio.Queue[Event] = asyncio.Queue()
        running = asyncio.get_running_loop()
        self.loop.submit(Job(ids, rows, params * len(prompts), req.stop,
                             lambda e: running.call_soon_threadsafe(events.put_nowait, e), self.loop.clock()))
        first = await events.get()
        if first.kind == "error":
            raise first.error
        echoes = [self.echo_text(req, i // req.n, rows[i]) for i in range(len(rows))] if req.echo else None
        reply = Reply(response_id, kind, self.settings.model_name, len(rows), req, self.token_text, echoes, rows)
        request.scope["state"]["usage"] = reply.usage  # for the access log, once the response is sent
        if req.stream:
            return StreamingResponse(self.stream(reply, events, ids), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self.collect(request, reply, events, ids)

    async def grammar(self, spec: tuple[str, str], param: str) -> Grammar:
        """A grammar (kind, text) compiled for this tokenizer, off the event loop; `param`
        names the field it came from, for errors."""
        def build() -> Grammar:
            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = self.tokenizer.grammar_tokenizer(
                    self.settings.vocab_size or len(self.tokenizer))
            return Grammar(*spec, self._grammar_tokenizer)

        try:
            return await asyncio.to_thread(build)
        except ValueError as error:
            raise invalid(param, str(error)) from None
        except ImportError as error:
            raise APIError(400, f"{param} needs llguidance on the server: {error}", param, "unsupported") from None

    def special_id(self, text: str) -> int | None:
        """The id of `text` when the tokenizer holds it as one token."""
        return self.tokenizer.vocab().get(text)

    def sampling(self, req: GenerationRequest, prompts: list[list[int]], kind: str,
                 grammar: Grammar | None = None) -> SamplingParams:
        """The request's budget (a chat without one: what the context leaves) and sampling,
        checked against the context."""
        context = self.settings.context_length
        if req.max_tokens is None:
            room = context - len(prompts[0]) if context else None
            req.max_tokens = max(1, self.settings.default_max_tokens if room is None else room)
        check_lengths(req, prompts, context, "messages" if kind == "chat.completion" else "prompt")
        if req.min_tokens > req.max_tokens:
            raise invalid("min_tokens", f"min_tokens ({req.min_tokens}) is above the {req.max_tokens} tokens this "
                          f"request may get; allowed 0..{req.max_tokens}")
        try:
            return SamplingParams(req.max_tokens, req.temperature, req.top_k, req.top_p, req.seed,
                                  sorted(set(self.settings.eos_token_ids) | set(req.stop_token_ids)),
                                  frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
                                  repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias,
                                  min_tokens=req.min_tokens, logprobs=req.logprobs,
                                  prompt_logprobs=req.logprobs if req.echo else None, grammar=grammar)
        except ValueError as error:
            raise invalid(None, str(error)) from None

    def echo_text(self, req: GenerationRequest, prompt_index: int, ids: list[int]) -> str:
        """The prompt as `echo` returns it: the text sent, or the ids decoded."""
        prompt = req.prompts[prompt_index]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)

    async def collect(self, request: Request, reply: Reply, events: asyncio.Queue, ids: list[str]) -> dict:
        """The whole response, once every prompt has finished (or its client has gone)."""
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
                self.loop.abort(ids)
        return reply.whole()

    async def stream(self, reply: Reply, events: asyncio.Queue, ids: list[str]):
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
                if reply.holds_text and event.finish_reason is None:
                    continue  # tools: the answer comes whole with its finish, its tool calls read
                if (event.text or event.finish_reason or reply.echo_pending(event.index)
                        or (event.token_ids and (reply.req.return_token_ids or reply.req.logprobs is not None))):
                    yield sse(reply.delta(event))
            if reply.req.include_usage and reply.complete:
                yield sse(reply.usage_chunk())
            yield "data: [DONE]\n\n"
        finally:
            if not reply.complete:
                self.loop.abort(ids)


def check_takes_tools(template: str) -> None:
    """Tools need a chat template that describes them in the format tools.py reads."""
    if "tools" not in template or TOOL_OPEN not in template:
        raise invalid("tools", f"this model's chat template does not take tools in the {TOOL_OPEN} format this "
                      "server reads (Qwen2.5's and Hermes'); leave tools out", "unsupported")


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
