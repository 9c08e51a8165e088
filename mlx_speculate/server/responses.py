"""OpenAI response bodies and stream chunks, for chat and text completions.

Streaming follows OpenAI's protocol: one id for every chunk; in a chat, the role only in the
first chunk; exactly one chunk with a `finish_reason`; with `stream_options.include_usage`, a
last chunk with `choices: []` and the usage (and `usage: null` in the others); then
`data: [DONE]`. Tool calls stream as OpenAI's `tool_calls` deltas as the model writes them:
the first names the call (index, id, type, name), the later ones carry fragments of its
arguments (tool_parser.py says when and how); `finish_reason` is then "tool_calls", or
"length" when max_tokens cut a call short (whole, it then holds the arguments written so
far, as streamed: `Tools.whole`). Usage
carries the prompt-cache hits (`prompt_tokens_details.cached_tokens`) and, as an extension,
what speculation did (`usage.speculative`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from .records import Delta, Failed, Finished, Job, TokenLogprob, Usage
from .tool_parser import CallDelta, Piece, Tools

DONE = "data: [DONE]\n\n"


def usage_body(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    stats = usage.stats
    body["speculative"] = {
        "method": usage.method,
        "drafted_tokens": stats.drafted if stats else 0,
        "accepted_tokens": stats.accepted if stats else 0,
        "acceptance_rate": stats.acceptance_rate if stats else 0.0,
        "target_forwards": stats.target_forwards if stats else 0,
        "tokens_per_target_forward": stats.tokens_per_forward if stats else 0.0,
        # under a grammar: tokens it forced, emitted without being sampled
        "fast_forwarded_tokens": stats.fast_forwarded if stats else 0,
    }
    return body


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": _bytes(e.token),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": _bytes(t)} for t, lp in e.top
                ],
            }
            for e in entries
        ]
    }


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """The legacy format; `offset` is where the first token's text starts in the output."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }


class Completion:
    """One request's response in the shape of its endpoint: `chat` (chat.completion) or a text
    completion; whole (`collect`) or streamed (`stream`)."""

    def __init__(
        self,
        chat: bool,
        model: str,
        logprobs: bool,
        include_usage: bool = False,
        tools: Tools | None = None,
    ):
        self.chat = chat
        self.model = model
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.outcome = "cancelled"  # then the finish reason, or "error"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.tools = tools
        self.called = False  # whether the output held a tool call

    def _finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.called and reason == "stop" else reason

    def _envelope(self, object_: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _logprobs(self, entries: Sequence[TokenLogprob], offset: int = 0) -> Any:
        if not self.logprobs:
            return None
        return chat_logprobs(entries) if self.chat else completion_logprobs(entries, offset)

    async def collect(self, job: Job) -> tuple[dict[str, Any] | None, Finished | Failed]:
        """The whole response (None when the job failed or was cancelled) and how it ended."""
        text, entries = [], []
        async for event in job.events():
            if isinstance(event, Delta):
                text.append(event.text)
                if event.logprob is not None:
                    entries.append(event.logprob)
            elif isinstance(event, Failed) or event.reason == "cancelled":
                self.outcome = "error" if isinstance(event, Failed) else "cancelled"
                return None, event
            else:
                content, calls = "".join(text), []
                if self.tools is not None:
                    cut = event.reason == "length"
                    pieces, self.called = self.tools.whole(content, cut=cut)
                    content = "".join(p for p in pieces if isinstance(p, str))
                    calls = [_call_body(p) for p in pieces if isinstance(p, CallDelta)]
                self.outcome = reason = self._finish_reason(event.reason)
                choice: dict[str, Any] = {"index": 0}
                if self.chat:
                    choice["message"] = {"role": "assistant", "content": content}
                    if calls:
                        choice["message"]["content"] = content or None
                        choice["message"]["tool_calls"] = calls
                else:
                    choice["text"] = content
                choice["logprobs"] = self._logprobs(entries)
                choice["finish_reason"] = reason
                body = self._envelope(
                    "chat.completion" if self.chat else "text_completion", [choice]
                )
                body["usage"] = usage_body(event.usage)
                return body, event
        raise RuntimeError("the job's events ended without a finish")

    def _chunk(self, delta: dict[str, Any] | str, logprobs: Any, finish: str | None) -> str:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        body = self._envelope(self.chunk_object, [choice])
        if self.include_usage:
            body["usage"] = None
        return _sse(body)

    async def stream(self, job: Job) -> AsyncIterator[str]:
        """Server-sent events; a generation that fails midway ends with an error event (the
        status line has long been sent), which OpenAI's clients raise as an APIError."""
        if self.chat:
            yield self._chunk({"role": "assistant", "content": ""}, None, None)
        parser = None if self.tools is None else self.tools.parser(eager=True)
        offset = 0
        async for event in job.events():
            if isinstance(event, Delta):
                if not event.text and event.logprob is None:
                    continue
                entries = [] if event.logprob is None else [event.logprob]
                if parser is None:
                    delta = {"content": event.text} if self.chat else event.text
                    yield self._chunk(delta, self._logprobs(entries, offset), None)
                    offset += sum(len(e.token) for e in entries)
                    continue
                for chunk in self._piece_chunks(parser.feed(event.text), entries):
                    yield chunk
            elif isinstance(event, Failed):
                self.outcome = "error"
                yield _sse(error_body(event.message, event.type, code=event.code))
            elif event.reason == "cancelled":  # by the server shutting down, if anyone reads
                message = "the server is shutting down; the generation was cancelled"
                yield _sse(error_body(message, "server_error", None, "server_shutdown"))
            else:
                if parser is not None:
                    for chunk in self._piece_chunks(parser.end(), []):
                        yield chunk
                    self.called = parser.called
                self.outcome = reason = self._finish_reason(event.reason)
                yield self._chunk({} if self.chat else "", None, reason)
                if self.include_usage:
                    usage = self._envelope(self.chunk_object, [])
                    usage["usage"] = usage_body(event.usage)
                    yield _sse(usage)
        yield DONE

    def _piece_chunks(self, pieces: list[Piece], entries: list[TokenLogprob]) -> list[str]:
        """A chat's content and call deltas, in order; the token's log-probabilities go with
        its content, or alone when it made none."""
        chunks, text = [], "".join(p for p in pieces if isinstance(p, str))
        if text or entries:
            chunks.append(self._chunk({"content": text}, self._logprobs(entries), None))
        for piece in pieces:
            if isinstance(piece, CallDelta):
                call: dict[str, Any] = {"index": piece.index}
                if piece.name is not None:
                    call |= {"id": piece.id, "type": "function"}
                    call["function"] = {"name": piece.name, "arguments": piece.arguments}
                elif piece.arguments:
                    call["function"] = {"arguments": piece.arguments}
                else:
                    continue
                chunks.append(self._chunk({"tool_calls": [call]}, None, None))
        return chunks


def _call_body(call: CallDelta) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code=None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
