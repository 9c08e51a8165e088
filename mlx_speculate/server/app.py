"""The FastAPI app: OpenAI's routes, and Anthropic's (messages.py), over the generation worker.

The event loop only validates and relays: every MLX call happens on the worker's thread, and
templates, tokenization and grammar compilation on the gateway's prompt thread. Each
generation request watches its connection, so a client that goes away cancels its generation,
streamed or not.
"""

from __future__ import annotations

import secrets
import time
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..grammar import Grammar
from . import MAX_BODY, messages
from .errors import APIError, BodyLimit, install
from .gateway import Gateway
from .metrics import Metrics
from .responses import Completion
from .schemas import ChatCompletionRequest, CompletionRequest, ResponseFormat
from .sessions import SessionPool
from .tool_parser import Tools
from .tools import call_grammar, tool_format
from .worker import Worker

# Module level: FastAPI resolves the (postponed) annotations of routes in the module's globals.
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(HTTPBearer(auto_error=False))]


def create_app(
    worker: Worker,
    model_id: str,
    metrics: Metrics,
    *,
    api_key: str | None = None,
    max_body: int = MAX_BODY,
) -> FastAPI:
    """The app serving `worker`'s model as `model_id`; the worker starts and stops with it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        gateway.close()
        worker.close()

    app = FastAPI(title="mlx_speculate", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body)
    install(app, metrics)
    started = int(time.time())
    gateway = Gateway(worker, model_id, metrics)

    def authorized(request: Request, credentials: Credentials) -> None:
        """The key as OpenAI's clients send it (a bearer token) or Anthropic's (x-api-key)."""
        if api_key is None:
            return
        given = request.headers.get("x-api-key")
        if credentials is not None:
            given = credentials.credentials
        if given is None or not secrets.compare_digest(given.encode(), api_key.encode()):
            message = "missing API key" if given is None else "incorrect API key"
            raise APIError(401, message, code="invalid_api_key")

    @app.get("/health")
    async def health() -> JSONResponse:
        if worker.ready is not None:
            return JSONResponse({"status": "ok"})
        status = "failed" if worker.load_error else "loading"
        return JSONResponse({"status": status, "error": worker.load_error}, status_code=503)

    @app.get("/debug/state")
    async def debug_state() -> dict:
        """What the generation thread holds (after its last step): a self-check that an idle
        server holds no sequence, no cache row beyond one empty one, and bounded sessions."""
        state = worker.state
        return {
            "decoding": state.decoding,
            "waiting": worker.waiting,
            "batch_cache_rows": state.cache_rows,
            "batch_cache_slots": state.cache_slots,
            "sessions": state.sessions,
            "busy_sessions": state.busy_sessions,
            "active_memory_bytes": state.active_memory,
            "max_batch": worker.max_batch,
            "max_queue": worker.max_queue,
            "max_sessions": None if worker.pool is None else worker.pool.max_sessions,
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict:
        pool = gateway.loaded()
        model = {"id": model_id, "object": "model", "created": started, "owned_by": "local"}
        model["speculative_methods"] = list(pool.methods)  # extension: what requests can ask
        return {"object": "list", "data": [model]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        pool = gateway.served(body.model)
        tokens, parser, grammar = await gateway.prepare(_chat_prompt, pool, body)
        completion = Completion(
            True,
            model_id,
            body.top_count() is not None,
            body.stream and body.include_usage,
            tools=parser,
        )
        return await gateway.respond(
            request, body, tokens, pool, completion, where="messages", grammar=grammar
        )

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        pool = gateway.served(body.model)
        tokens, grammar = await gateway.prepare(_text_prompt, pool, body)
        completion = Completion(
            False, model_id, body.top_count() is not None, body.stream and body.include_usage
        )
        return await gateway.respond(
            request, body, tokens, pool, completion, where="prompt", grammar=grammar
        )

    messages.install(app, gateway, authorized)
    return app


def _chat_prompt(
    pool: SessionPool, body: ChatCompletionRequest
) -> tuple[list[int], Tools | None, Grammar | None]:
    """The chat's prompt tokens, the parser of tool calls when the model may make them, and
    the grammar the output must follow (response_format, or the calls when one is required).
    Runs on the gateway's prompt thread."""
    mode = body.tool_mode
    tools, parser, grammar = None, None, None
    if body.response_format is not None:
        if mode in ("required", "function") and body.response_format.type != "text":
            raise APIError(
                400,
                "response_format and a required tool call cannot both shape the output",
                param="response_format",
            )
        grammar = _response_grammar(body.response_format)
    if mode != "none":
        format_ = tool_format(pool.tokenizer)
        if format_ is None:
            raise APIError(400, "the model's chat template does not take tools", param="tools")
        offered = body.tools or []
        tools = [tool.as_template_input() for tool in offered]
        names = frozenset(tool.function.name for tool in offered)
        # A named function is one call, as vLLM and llama.cpp read it.
        parallel = body.parallel_tool_calls and mode != "function"
        forced = mode in ("required", "function")
        parser = Tools(format_, names, parallel, forced)
        if forced:
            schemas = {t.function.name: t.arguments_schema() for t in offered}
            if body.forced_tool is not None:
                schemas = {body.forced_tool: schemas[body.forced_tool]}
            try:
                grammar = call_grammar(format_, schemas, parallel)
            except ValueError as e:
                raise APIError(400, f"a tool's parameters: {e}", param="tools") from e
    messages_in = [m.as_template_input() for m in body.messages]
    return Gateway.chat_tokens(pool, messages_in, tools), parser, grammar


def _text_prompt(pool: SessionPool, body: CompletionRequest) -> tuple[list[int], Grammar | None]:
    """The completion's prompt tokens and response_format's grammar (runs on the gateway's
    prompt thread)."""
    grammar = _response_grammar(body.response_format)
    prompt = body.text_or_ids()
    if isinstance(prompt, str):
        return list(pool.tokenizer.encode(prompt)), grammar
    vocab = pool.model.args.vocab_size
    if not all(0 <= t < vocab for t in prompt):
        raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    return prompt, grammar


def _response_grammar(response_format: ResponseFormat | None) -> Grammar | None:
    try:
        return None if response_format is None else response_format.grammar()
    except ValueError as e:
        raise APIError(400, str(e), param="response_format") from e
