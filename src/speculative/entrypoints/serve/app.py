"""The FastAPI app: OpenAI's completions and chat completions over the engine loop.

`handlers.Routes` parses and checks a request (`protocol`), tokenizes it and submits it to
the engine loop through one function, reading its events from an asyncio queue; no
handler touches the engine. Every error, ours or the framework's (404, 405), is OpenAI's
{"error": {...}} object (`http`). Every request is logged on the
"speculative.serve.access" logger: method, path, status, tokens (prompt + completion) and
seconds.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI

from .engine_loop import EngineLoop
from .handlers import Routes
from .http import AccessLog, install_error_handlers


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
    """`tokenizer`: a TextTokenizer (speculative.models.text), with `chat_messages` for chat."""

    @asynccontextmanager
    async def lifespan(app):
        loop.start()
        yield
        loop.stop()

    app = FastAPI(title="speculative", lifespan=lifespan)
    app.add_middleware(AccessLog)
    app.state.loop = loop
    install_error_handlers(app)
    routes = Routes(loop, tokenizer, settings)
    app.get("/health")(routes.health)
    app.get("/metrics")(routes.metrics)
    app.get("/v1/models")(routes.models)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat)
    return app
