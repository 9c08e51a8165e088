"""What every generation route shares, whichever API it speaks: the served model, prompts
through the chat template, the checks before queueing, the queue, cancellation when the client
goes away, and the request metric. A route brings its request body and a `Responder` that
writes the response in its API's shape, whole or streamed.

A prompt is prepared (chat template, tokenization, grammar compilation) on the gateway's own
thread (`prepare`): that work grows with the request (seconds for megabytes of text or
thousands of tools), and meanwhile the event loop keeps answering /health and relaying the
running streams. One thread, because a Hugging Face tokenizer is not safe to share between
threads; the tokenizers and llguidance release the GIL while they work.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError

from ..chat import apply_chat_template
from ..grammar import Grammar
from ..sampling import SamplingParams
from .errors import APIError
from .metrics import Metrics
from .records import Failed, Finished, Generation, Job
from .schemas import Speculative
from .sessions import NONE, SessionPool
from .worker import NotReady, QueueFull, Worker


class Body(Protocol):
    """What a generation request body tells the gateway."""

    stream: bool
    speculative: Speculative | None

    def sampling(self) -> SamplingParams: ...
    def stops(self) -> list[str]: ...
    def token_limit(self) -> int | None: ...
    def top_count(self) -> int | None: ...


class Responder(Protocol):
    outcome: str  # for the requests metric: a finish reason, "cancelled" or "error"

    async def collect(self, job: Job) -> tuple[dict[str, Any] | None, Finished | Failed]: ...
    def stream(self, job: Job) -> AsyncIterator[str]: ...


T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's status for a request its client closed (nobody reads it)
# A generation cancelled with its client still there: the server is stopping.
SHUTDOWN, SHUTDOWN_MESSAGE = "server_shutdown", "the server is shutting down; retry later"


class Gateway:
    def __init__(self, worker: Worker, model_id: str, metrics: Metrics):
        self.worker = worker
        self.model_id = model_id
        self.metrics = metrics
        self._prompts = ThreadPoolExecutor(1, thread_name_prefix="mlx-prompts")

    async def prepare(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on the prompt thread (see the module's docstring); what it raises
        (an APIError, say) comes back here."""
        loop = asyncio.get_running_loop()
        with self.worker.arriving():
            return await loop.run_in_executor(self._prompts, functools.partial(work, *args))

    def close(self) -> None:
        """Drops the prompts not yet started (the server is stopping)."""
        self._prompts.shutdown(wait=False, cancel_futures=True)

    def loaded(self) -> SessionPool:
        pool = self.worker.ready
        if pool is None:
            message = self.worker.load_error or "the model is still loading"
            raise APIError(503, message, type_="server_error", code="model_not_ready")
        return pool

    def served(self, model: str) -> SessionPool:
        pool = self.loaded()
        if model != self.model_id:
            raise APIError(
                404,
                f"model {model!r} is not served here (this server serves {self.model_id!r})",
                param="model",
                code="model_not_found",
            )
        return pool

    @staticmethod
    def chat_tokens(
        pool: SessionPool,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        try:
            return apply_chat_template(pool.tokenizer, messages, tools=tools)
        except (TemplateError, ValueError, TypeError) as e:
            message = f"the chat template refused the messages: {e}"
            raise APIError(400, message, param="messages") from e

    async def respond(
        self,
        request: Request,
        body: Body,
        tokens: list[int],
        pool: SessionPool,
        responder: Responder,
        *,
        where: str,
        grammar: Grammar | None = None,
    ) -> Response:
        """Queues the generation of `tokens` (the prompt, which `where` names in errors), under
        `grammar` if given, and answers with `responder`'s response, streamed if the body asks
        for it."""
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
        method, draft = speculation(body.speculative, pool)
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
            grammar=grammar,
        )
        try:
            job = self.worker.submit(generation)
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
        endpoint = request.scope["route"].path
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job))

        def done() -> bool:
            """Ends the watch; whether the client went away."""
            left = watcher.done() and not watcher.cancelled()
            watcher.cancel()
            job.cancel()  # a no-op once it finished; otherwise nobody is left to read it
            return left

        def count(outcome: str) -> None:
            self.metrics.requests.labels(endpoint, outcome).inc()

        if body.stream:  # counted once, by how it ended: its status line went out long ago

            async def events():
                try:
                    async for chunk in responder.stream(job):
                        yield chunk
                finally:
                    done()
                    count(responder.outcome)

            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
        try:
            result, end = await responder.collect(job)
        except BaseException:
            done()
            count(responder.outcome)
            raise
        left = done()
        # An error response is counted once, by its status (the error handler counts it).
        if isinstance(end, Failed):
            raise APIError(end.status, end.message, type_=end.type, code=end.code)
        if result is None and left:  # nobody reads the answer: counted as cancelled
            count("cancelled")
            return Response(status_code=CLIENT_CLOSED)
        if result is None:
            raise APIError(503, SHUTDOWN_MESSAGE, type_="server_error", code=SHUTDOWN)
        count(responder.outcome)
        return JSONResponse(result)


def speculation(options: Speculative | None, pool: SessionPool) -> tuple[str, int | None]:
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
