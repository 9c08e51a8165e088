"""The FastAPI app: OpenAI's routes over the generation worker.

The event loop only validates, tokenizes and relays: every MLX call happens on the worker's
thread. Each generation request watches its connection, so a client that goes away cancels its
generation, streamed or not.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..chat import apply_chat_template
from .errors import APIError, BodyLimit, install
from .metrics import Metrics
from .records import Failed, Generation, Job
from .responses import Completion
from .schemas import ChatCompletionRequest, CompletionRequest, Speculative
from .sessions import NONE, SessionPool
from .worker import NotReady, QueueFull, Worker

MAX_BODY = 8 * 1024 * 1024
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
        worker.close()

    app = FastAPI(title="mlx_speculate", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body)
    install(app, metrics)
    started = int(time.time())

    def authorized(credentials: Credentials) -> None:
        if api_key is None:
            return
        given = "" if credentials is None else credentials.credentials
        if not secrets.compare_digest(given.encode(), api_key.encode()):
            message = "missing API key" if credentials is None else "incorrect API key"
            raise APIError(401, message, code="invalid_api_key")

    def loaded() -> SessionPool:
        if worker.pool is None:
            message = worker.load_error or "the model is still loading"
            raise APIError(503, message, type_="server_error", code="model_not_ready")
        return worker.pool

    def served(model: str) -> SessionPool:
        pool = loaded()
        if model != model_id:
            raise APIError(
                404,
                f"model {model!r} is not served here (this server serves {model_id!r})",
                param="model",
                code="model_not_found",
            )
        return pool

    @app.get("/health")
    async def health() -> JSONResponse:
        if worker.pool is not None:
            return JSONResponse({"status": "ok"})
        status = "failed" if worker.load_error else "loading"
        return JSONResponse({"status": status, "error": worker.load_error}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict:
        pool = loaded()
        model = {"id": model_id, "object": "model", "created": started, "owned_by": "local"}
        model["speculative_methods"] = list(pool.methods)  # extension: what requests can ask
        return {"object": "list", "data": [model]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        pool = served(body.model)
        messages = [m.as_template_input() for m in body.messages]
        try:
            tokens = apply_chat_template(pool.tokenizer, messages)
        except (TemplateError, ValueError, TypeError) as e:
            message = f"the chat template refused the messages: {e}"
            raise APIError(400, message, param="messages") from e
        return await _serve(request, body, tokens, pool, chat=True)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        pool = served(body.model)
        prompt = body.text_or_ids()
        if isinstance(prompt, str):
            tokens = list(pool.tokenizer.encode(prompt))
        else:
            vocab = pool.model.args.vocab_size
            if not all(0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            tokens = prompt
        return await _serve(request, body, tokens, pool, chat=False)

    async def _serve(
        request: Request,
        body: ChatCompletionRequest | CompletionRequest,
        tokens: list[int],
        pool: SessionPool,
        *,
        chat: bool,
    ) -> Response:
        where = "messages" if chat else "prompt"
        if not tokens:
            raise APIError(400, "the prompt is empty", param=where)
        if len(tokens) > pool.max_context:
            raise APIError(
                400,
                f"the prompt has {len(tokens)} tokens, more than the model's context of "
                f"{pool.max_context}",
                param=where,
                code="context_length_exceeded",
            )
        method, draft = _speculation(body.speculative, pool)
        try:
            sampling = body.sampling()
        except ValueError as e:  # pydantic checked the ranges; this is the sampler's word
            raise APIError(400, str(e), code="invalid_value") from e
        generation = Generation(
            tokens=tokens,
            sampling=sampling,
            max_tokens=body.token_limit() or pool.max_context,
            stop=body.stops(),
            method=method,
            num_draft_tokens=draft,
            top_logprobs=body.top_count(),
        )
        try:
            job = worker.submit(generation)
        except QueueFull as e:
            raise APIError(
                429,
                f"the server is busy: {e}; retry later",
                type_="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from e
        except NotReady as e:
            raise APIError(503, str(e), type_="server_error", code="model_not_ready") from e
        completion = Completion(
            chat, model_id, body.top_count() is not None, body.stream and body.include_usage
        )
        endpoint = request.scope["route"].path
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job))

        def done() -> None:
            watcher.cancel()
            job.cancel()  # a no-op once it finished; otherwise nobody is left to read it
            metrics.requests.labels(endpoint, completion.outcome).inc()

        if body.stream:

            async def events():
                try:
                    async for chunk in completion.stream(job):
                        yield chunk
                finally:
                    done()

            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
        try:
            result, end = await completion.collect(job)
        finally:
            done()
        if isinstance(end, Failed):
            raise APIError(500, end.message, type_="server_error")
        if result is None:
            raise APIError(503, "the generation was cancelled", type_="server_error")
        return JSONResponse(result)

    return app


def _speculation(options: Speculative | None, pool: SessionPool) -> tuple[str, int | None]:
    """The method and fixed draft length a request asks for (None: adaptive)."""
    method = pool.default if options is None or options.method is None else options.method
    if method not in pool.methods:
        raise APIError(
            400,
            f"speculative method {method!r} is not served (served: {', '.join(pool.methods)})",
            param="speculative.method",
        )
    draft = None if options is None else options.num_draft_tokens
    if draft is not None:
        if method == NONE:
            raise APIError(
                400,
                "num_draft_tokens needs a speculative method",
                param="speculative.num_draft_tokens",
            )
        if draft > pool.max_draft[method]:
            raise APIError(
                400,
                f"num_draft_tokens must be <= {pool.max_draft[method]} for {method} here",
                param="speculative.num_draft_tokens",
            )
    return method, draft


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    """Cancels `job` when the client disconnects (the body is read: the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()
