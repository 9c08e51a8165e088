"""Schema fuzzing of the server's own OpenAPI document (schemathesis): requests generated from
it, valid and not, to every route of a served tiny model; no answer is a server error, and every
answer, every stream event and every error body parses as the openai or anthropic SDK's type for
it. Bounded examples per route keep it short; a tiny context keeps each generation short."""

from __future__ import annotations

import json

import anthropic.types
import httpx
import openai.types
import openai.types.chat
import pydantic
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from .helpers import MODELS, tiny_model
from .serving import load_cached, serve
from .test_server_hardening import assert_idle

EXAMPLES = 10  # per route and mode
MODEL = "stories"  # the served model's id
CONTEXT = 48  # the served model's context: no generation runs long
USER = [{"role": "user", "content": "Once upon a time"}]
CORES = {
    "/v1/chat/completions": {"messages": USER},
    "/v1/completions": {"prompt": "Once upon a time"},
    "/v1/messages": {"messages": USER},
    "/v1/messages/count_tokens": {"messages": USER},
}

Anthropic = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
OpenAIError = pydantic.TypeAdapter(dict[str, openai.types.ErrorObject])
AnthropicError = pydantic.TypeAdapter(anthropic.types.ErrorResponse)


@pytest.fixture(scope="module")
def running():
    _, tokenizer = load_cached(MODELS / "stories260K-llama")
    model = tiny_model("llama", 0, vocab_size=512, max_position_embeddings=CONTEXT)
    with serve(model, tokenizer, max_batch=4, max_sessions=2) as served:
        yield served


def events(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each event of a server-sent event stream."""
    found = []
    for block in text.split("\n\n"):
        lines = block.strip("\n").split("\n")
        if block.strip():
            name = next((x.removeprefix("event: ") for x in lines if x.startswith("event: ")), None)
            data = [x.removeprefix("data: ") for x in lines if x.startswith("data: ")]
            assert len(data) == 1, block
            found.append((name, data[0]))
    return found


def completion_chunk(data: str) -> None:
    """A /v1/completions stream event as the SDK's `Completion`: its chunks carry
    `finish_reason: null` until the last, as OpenAI's own do, which the type's literal does
    not admit (the SDK builds stream chunks without validating them), so null reads as set."""
    chunk = json.loads(data)
    for choice in chunk["choices"]:
        assert choice["finish_reason"] in (None, "stop", "length"), choice
        choice["finish_reason"] = choice["finish_reason"] or "length"
    openai.types.Completion.model_validate(chunk)


def check(path: str, status: int, content_type: str, text: str) -> None:
    """`text` parses as the SDK's type for what `path` answered."""
    assert status < 500, text
    anthropic_route = path.startswith("/v1/messages")
    if status >= 400:
        if path.startswith("/v1/"):
            if anthropic_route:
                AnthropicError.validate_json(text)
            else:
                OpenAIError.validate_json(text)
        return
    if content_type.startswith("text/event-stream"):
        for name, data in events(text):
            if anthropic_route:  # the SDK skips pings and raises an error event's error
                if name == "ping":
                    assert json.loads(data) == {"type": "ping"}
                    continue
                event = (AnthropicError if name == "error" else Anthropic).validate_json(data)
                assert event.type == name
            elif data != "[DONE]":
                if "error" in json.loads(data):
                    OpenAIError.validate_json(data)
                elif path == "/v1/chat/completions":
                    openai.types.chat.ChatCompletionChunk.model_validate_json(data)
                else:
                    completion_chunk(data)
        return
    parse = {
        "/v1/chat/completions": openai.types.chat.ChatCompletion.model_validate_json,
        "/v1/completions": openai.types.Completion.model_validate_json,
        "/v1/messages": anthropic.types.Message.model_validate_json,
        "/v1/messages/count_tokens": anthropic.types.MessageTokensCount.model_validate_json,
    }
    if path in parse:
        parse[path](text)
    elif path == "/v1/models":
        for model in json.loads(text)["data"]:
            openai.types.Model.model_validate(model)


def operations(url: str) -> list:
    document = httpx.get(f"{url}/openapi.json").json()
    schema = schemathesis.openapi.from_dict(document)
    return [result.ok() for result in schema.get_all_operations()]


def fuzz(operation, mode: GenerationMode, url: str, streamed: bool = False) -> set[str]:
    """`EXAMPLES` requests to `operation` generated in `mode` (`streamed`: with a valid core
    that asks for a stream), each answer checked; the content types of its 200s."""
    answered = set()

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,  # the same requests every run: a failure here reproduces
        suppress_health_check=list(HealthCheck),
    )
    def answers(case) -> None:
        if mode == GenerationMode.POSITIVE and isinstance(case.body, dict):
            # A served model and a plain prompt (else almost every request is a 404 for its
            # model or a 400 for its messages); every other field stays as generated.
            case.body.update({"model": MODEL, **CORES.get(operation.path, {})})
            if streamed:
                case.body["stream"] = True
        response = case.call(base_url=url, timeout=60)
        content_type = response.headers.get("content-type", [""])
        content_type = content_type[0] if isinstance(content_type, list) else content_type
        check(operation.path, response.status_code, content_type, response.text)
        if response.status_code == 200:
            answered.add(content_type.split(";")[0])

    answers()
    return answered


@pytest.mark.parametrize(
    "mode, streamed",
    [
        (GenerationMode.POSITIVE, False),
        (GenerationMode.POSITIVE, True),
        (GenerationMode.NEGATIVE, False),
    ],
    ids=["positive", "streamed", "negative"],
)
def test_every_route_answers_what_the_sdks_parse(running, mode, streamed):
    answered = {}
    for operation in operations(running.url):
        if (mode == GenerationMode.NEGATIVE or streamed) and operation.method.upper() != "POST":
            continue  # nothing to send wrong or to stream (their only inputs: path and method)
        answered[operation.path] = fuzz(operation, mode, running.url, streamed)
    generating = ["/v1/chat/completions", "/v1/completions", "/v1/messages"]
    assert set(generating) <= set(answered)
    if mode == GenerationMode.POSITIVE:  # the answers parsed include real generations
        kind = "text/event-stream" if streamed else "application/json"
        assert all(kind in answered[path] for path in generating), answered
    assert_idle(running, 2)
