"""Anthropic's Messages API over the same gateway, worker, prefix cache and metrics as the
OpenAI routes: `POST /v1/messages` (whole or streamed) and `POST /v1/messages/count_tokens`.

A streamed message follows Anthropic's event sequence: `message_start`, a `ping`, then per
content block `content_block_start`, its `content_block_delta`s (`text_delta`, or a tool
call's `input_json_delta`s as the model writes its arguments: tool_parser.py) and
`content_block_stop`; then `message_delta` (stop reason, final usage) and `message_stop`. A
tool call cut short by max_tokens is a last `tool_use` block, whole or streamed, with stop
reason "max_tokens"; whole, its input holds what of the arguments was complete. A
generation that fails midway ends with an `error` event. Usage counts `input_tokens` past the
prefix cache and the cached ones as `cache_read_input_tokens`, as Anthropic's prompt caching.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from ..grammar import Grammar
from .errors import APIError, anthropic_error_body
from .gateway import Gateway
from .json_prefix import complete_part
from .messages_schemas import Conversation, MessagesRequest
from .records import Delta, Failed, Finished, Job, Usage
from .responses import usage_body
from .sessions import SessionPool
from .tool_parser import CallDelta, Piece, Tools
from .tools import call_grammar, tool_format


def install(app: FastAPI, gateway: Gateway, authorized: Callable[..., None]) -> None:
    @app.post("/v1/messages", dependencies=[Depends(authorized)])
    async def messages(body: MessagesRequest, request: Request) -> Response:
        pool = gateway.served(body.model)
        tokens, parser, grammar = await gateway.prepare(_prompt, pool, body)
        message = Message(gateway.model_id, len(tokens), parser)
        return await gateway.respond(
            request, body, tokens, pool, message, where="messages", grammar=grammar
        )

    @app.post("/v1/messages/count_tokens", dependencies=[Depends(authorized)])
    async def count_tokens(body: Conversation) -> dict[str, int]:
        pool = gateway.served(body.model)
        tokens, _, _ = await gateway.prepare(_prompt, pool, body)
        return {"input_tokens": len(tokens)}


def _parallel(body: Conversation) -> bool:
    """Whether the model may make several calls: not when told so, nor when tool_choice names
    the one tool to call (one call, as vLLM and llama.cpp read a named choice)."""
    if body.tool_choice is None:
        return True
    return not body.tool_choice.disable_parallel_tool_use and body.tool_mode != "tool"


def _prompt(
    pool: SessionPool, body: Conversation
) -> tuple[list[int], Tools | None, Grammar | None]:
    """The prompt's tokens, the parser of tool calls when the model may make them, and the
    grammar the output must follow: the calls' when one is required (tool_choice "any" or
    "tool"), or output_config.format's. Runs on the gateway's prompt thread."""
    try:
        messages = body.template_messages()
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from e
    grammar = _output_grammar(body)
    if body.tool_mode == "none":
        return Gateway.chat_tokens(pool, messages), None, grammar
    format_ = tool_format(pool.tokenizer)
    if format_ is None:
        raise APIError(400, "the model's chat template does not take tools", param="tools")
    tools = body.tools or []
    forced = body.tool_mode in ("any", "tool")
    parser = Tools(format_, frozenset(tool.name for tool in tools), _parallel(body), forced)
    if forced:
        if grammar is not None:
            raise APIError(
                400,
                "output_config.format and a required tool call cannot both shape the output",
                param="output_config",
            )
        schemas = {tool.name: tool.input_schema for tool in tools}
        if body.tool_mode == "tool":
            name = body.tool_choice.name
            schemas = {name: schemas[name]}
        try:
            grammar = call_grammar(format_, schemas, _parallel(body))
        except ValueError as e:
            raise APIError(400, f"a tool's input_schema: {e}", param="tools") from e
    return Gateway.chat_tokens(pool, messages, body.template_tools()), parser, grammar


def _output_grammar(body: Conversation) -> Grammar | None:
    """output_config.format's grammar, on the Messages route (count_tokens has none)."""
    config = body.output_config if isinstance(body, MessagesRequest) else None
    if config is None or config.format is None:
        return None
    try:
        return Grammar.json_schema(config.format.schema_)
    except ValueError as e:
        raise APIError(400, str(e), param="output_config") from e


def _tool_use(call: CallDelta) -> dict[str, Any]:
    """The block of the call `call` starts (with its input whole, when it is not streamed; of
    a call cut short, what of its input is whole, as Anthropic's client reads it)."""
    return {
        "type": "tool_use",
        "id": f"toolu_{call.id.removeprefix('call_')}",
        "name": call.name,
        "input": complete_part(call.arguments or "{}"),
    }


def _usage(usage: Usage | None) -> dict[str, Any]:
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": usage.completion_tokens,
        "speculative": usage_body(usage)["speculative"],  # the OpenAI routes' extension
    }


def _event(name: str, body: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


class Message:
    """One request's answer as an Anthropic message, whole (`collect`) or streamed (`stream`)."""

    def __init__(
        self,
        model: str,
        prompt_tokens: int,
        tools: Tools | None,
    ):
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.tools = tools
        self.id = f"msg_{uuid.uuid4().hex}"
        self.outcome = "cancelled"  # then the finish reason, or "error"
        self.called = False  # whether the output held a tool call

    def _stop(self, end: Finished) -> tuple[str, str | None]:
        """Anthropic's stop_reason and stop_sequence."""
        self.outcome = "tool_calls" if self.called and end.reason == "stop" else end.reason
        if self.outcome == "tool_calls":
            return "tool_use", None
        if end.reason == "length":
            return "max_tokens", None
        if end.stop_sequence is not None:
            return "stop_sequence", end.stop_sequence
        return "end_turn", None

    def _envelope(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
        }

    async def collect(self, job: Job) -> tuple[dict[str, Any] | None, Finished | Failed]:
        text = []
        async for event in job.events():
            if isinstance(event, Delta):
                text.append(event.text)
            elif isinstance(event, Failed) or event.reason == "cancelled":
                self.outcome = "error" if isinstance(event, Failed) else "cancelled"
                return None, event
            else:
                content: list[dict[str, Any]] = []
                pieces: list[Piece] = ["".join(text)] if text else []
                if self.tools is not None:
                    cut = event.reason == "length"
                    pieces, self.called = self.tools.whole("".join(text), cut=cut)
                for piece in pieces:
                    if isinstance(piece, CallDelta):
                        content.append(_tool_use(piece))
                    elif content and content[-1]["type"] == "text":
                        content[-1]["text"] += piece
                    else:
                        content.append({"type": "text", "text": piece})
                body = self._envelope(content)
                body["stop_reason"], body["stop_sequence"] = self._stop(event)
                body["usage"] = _usage(event.usage)
                return body, event
        raise RuntimeError("the job's events ended without a finish")

    async def stream(self, job: Job) -> AsyncIterator[str]:
        start = self._envelope([])
        start["usage"] = {"input_tokens": self.prompt_tokens, "output_tokens": 0}
        yield _event("message_start", {"type": "message_start", "message": start})
        yield _event("ping", {"type": "ping"})
        parser = None if self.tools is None else self.tools.parser(eager=True)
        blocks = 0
        open_block: str | None = None  # "text" or "tool_use": block `blocks - 1`, still open

        def close() -> list[str]:
            nonlocal open_block
            if open_block is None:
                return []
            open_block = None
            body = {"type": "content_block_stop", "index": blocks - 1}
            return [_event("content_block_stop", body)]

        def pieces_events(pieces: list[Piece]) -> list[str]:
            nonlocal blocks, open_block
            events = []
            for piece in pieces:
                if isinstance(piece, CallDelta) and piece.name is not None:
                    events += close()
                    events.append(_block_start(blocks, {**_tool_use(piece), "input": {}}))
                    blocks, open_block = blocks + 1, "tool_use"
                if isinstance(piece, CallDelta):
                    if piece.arguments:
                        delta = {"type": "input_json_delta", "partial_json": piece.arguments}
                        events.append(_block_delta(blocks - 1, delta))
                    continue
                if open_block != "text":
                    events += close()
                    events.append(_block_start(blocks, {"type": "text", "text": ""}))
                    blocks, open_block = blocks + 1, "text"
                events.append(_block_delta(blocks - 1, {"type": "text_delta", "text": piece}))
            return events

        async for event in job.events():
            if isinstance(event, Delta):
                if not event.text:
                    continue
                pieces = [event.text] if parser is None else parser.feed(event.text)
                for chunk in pieces_events(pieces):
                    yield chunk
            elif isinstance(event, Failed) or event.reason == "cancelled":
                self.outcome = "error" if isinstance(event, Failed) else "cancelled"
                message = (
                    event.message if isinstance(event, Failed) else "the generation was cancelled"
                )
                status = event.status if isinstance(event, Failed) else 503
                yield _event("error", anthropic_error_body(status, message))
            else:
                rest = [] if parser is None else parser.end()
                self.called = parser is not None and parser.called
                for chunk in [*pieces_events(rest), *close()]:
                    yield chunk
                reason, sequence = self._stop(event)
                delta = {"stop_reason": reason, "stop_sequence": sequence}
                body = {"type": "message_delta", "delta": delta, "usage": _usage(event.usage)}
                yield _event("message_delta", body)
                yield _event("message_stop", {"type": "message_stop"})


def _block_start(index: int, block: dict[str, Any]) -> str:
    body = {"type": "content_block_start", "index": index, "content_block": block}
    return _event("content_block_start", body)


def _block_delta(index: int, delta: dict[str, Any]) -> str:
    return _event(
        "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
    )
