"""Anthropic's Messages API with the real anthropic client against a real server: text, the
streamed events in their documented order, stop sequences, tool_use blocks and tool results,
count_tokens, and Anthropic-shaped errors (missing max_tokens, wrong roles, bad key). The
model is the scripted stand-in under the Hermes-style test template (tests/scripted.py)."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from mlx_speculate.chat import apply_chat_template

from .helpers import MODELS
from .scripted import scripted
from .serving import serve, sse_lines
from .test_server_tools import hermes_call

KEY = "sesame"
HI = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city now",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
WEATHER_FUNCTION = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"],
    },
}


@pytest.fixture(scope="module")
def served():
    path = MODELS / "stories260K-llama"
    model, tokenizer = scripted(path, "hermes")
    with serve(model, tokenizer, model_id="scripted", api_key=KEY) as running:
        yield running, model, tokenizer


def client(running, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=running.url, api_key=key, max_retries=0, timeout=60)


# The client takes no sampling settings any more (the newest API dropped them); they go as body.
SAMPLING = ("temperature", "top_p", "top_k")


def create(running, **kwargs):
    extra = {k: kwargs.pop(k) for k in SAMPLING if k in kwargs}
    args = {"model": "scripted", "max_tokens": 100, "messages": HI, **kwargs}
    return client(running).messages.create(**args, extra_body=extra or None)


def test_text_message(served):
    running, model, tokenizer = served
    model.say("Hello there, friend.")
    message = create(running, temperature=0.0)
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == "scripted"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == "Hello there, friend."
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    usage = message.usage
    prompt = apply_chat_template(tokenizer, HI)
    assert usage.input_tokens + usage.cache_read_input_tokens == len(prompt)
    assert usage.output_tokens == len(model.script)
    again = create(running, temperature=0.0, system="Be brief.", top_k=5, top_p=0.9)
    assert again.content[0].text == "Hello there, friend."


def test_stop_sequences_and_max_tokens(served):
    running, model, _ = served
    model.say("one two three four")
    message = create(running, stop_sequences=["four", "three"])
    assert message.content[0].text == "one two "
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "three")
    short = create(running, max_tokens=2)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_stream_events_come_in_the_documented_order(served):
    running, model, _ = served
    model.say("Hello there, friend.")
    body = {"model": "scripted", "max_tokens": 100, "messages": HI, "stream": True}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    url = f"{running.url}/v1/messages"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_lines(response)
    names = [name for name, _ in events]
    assert all(data["type"] == name for name, data in events)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert events[2][1]["content_block"] == {"type": "text", "text": ""}
    text = "".join(data["delta"]["text"] for name, data in events[3:-3])
    assert text == "Hello there, friend."
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(model.script)
    with client(running).messages.stream(model="scripted", max_tokens=100, messages=HI) as stream:
        assert "".join(stream.text_stream) == "Hello there, friend."
        final = stream.get_final_message()
    whole = create(running)
    assert [b.text for b in final.content] == [b.text for b in whole.content]
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_use_blocks(served, stream):
    running, model, _ = served
    model.say(f"Let me look.\n{hermes_call('get_weather', {'city': 'Paris'})}")
    args = {"model": "scripted", "max_tokens": 200, "messages": HI, "tools": [WEATHER]}
    if stream:
        with client(running).messages.stream(**args) as events:
            kinds = [e.type for e in events]
            message = events.get_final_message()
        assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 2
    else:
        message = client(running).messages.create(**args)
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[0].text.strip() == "Let me look."
    use = message.content[1]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    assert use.id.startswith("toolu_") and message.stop_reason == "tool_use"


def test_tool_input_streams_in_fragments(served):
    """A tool_use block's input comes as many input_json_delta events as the model writes it;
    the client's accumulator rebuilds it (its partial snapshots parse all along)."""
    running, model, _ = served
    arguments = {"city": "Paris", "note": "a long note to stretch the input out a little"}
    model.say(hermes_call("get_weather", arguments))
    args = {"model": "scripted", "max_tokens": 200, "messages": HI, "tools": [WEATHER]}
    with client(running).messages.stream(**args) as events:
        fragments = [e.partial_json for e in events if e.type == "input_json"]
        message = events.get_final_message()
    assert len(fragments) > 10
    assert json.loads("".join(fragments)) == arguments
    assert [(b.type, b.input) for b in message.content] == [("tool_use", arguments)]
    assert message.stop_reason == "tool_use"


def test_tool_result_continues_with_the_cache(served):
    running, model, tokenizer = served
    model.say(hermes_call("get_weather", {"city": "Paris"}))
    first = create(running, tools=[WEATHER], max_tokens=200)
    use = first.content[0]
    messages = [
        *HI,
        {"role": "assistant", "content": [use.model_dump()]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 24 C"}],
        },
    ]
    model.say("Sunny, 24 C.")
    second = create(running, tools=[WEATHER], messages=messages)
    assert second.content[0].text == "Sunny, 24 C." and second.stop_reason == "end_turn"
    prompt_before = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= prompt_before
    template = [
        *HI,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": use.id, "content": "sunny, 24 C"},
    ]
    prompt = apply_chat_template(tokenizer, template, tools=[WEATHER_FUNCTION])
    count = client(running).messages.count_tokens(
        model="scripted", messages=messages, tools=[WEATHER]
    )
    assert count.input_tokens == len(prompt)
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == len(prompt)
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in tokenizer.decode(prompt)


def assert_anthropic_error(error: anthropic.APIStatusError, status: int, type_: str) -> None:
    assert error.status_code == status
    body = error.body
    assert body["type"] == "error" and body["error"]["type"] == type_
    assert body["error"]["message"] and "Traceback" not in body["error"]["message"]


@pytest.mark.parametrize(
    "change",
    [
        {"messages": [{"role": "system", "content": "Hi"}]},  # system goes in `system`
        {"messages": [{"role": "tool", "content": "Hi"}]},
        {"messages": []},
        {"messages": [*HI, {"role": "assistant", "content": "Once"}]},  # a prefill
        {"temperature": 1.5},  # Anthropic's range is [0, 1]
        {"max_tokens": 0},
        {"stop_sequences": [""]},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {
            "messages": [
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}
            ]
        },
        {"tool_choice": {"type": "tool", "name": "get_weather"}},  # no tools
        {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "launch"}},
    ],
)
def test_bad_input_is_an_anthropic_400(served, change):
    running, _, _ = served
    with pytest.raises(anthropic.BadRequestError) as refused:
        create(running, **change)
    assert_anthropic_error(refused.value, 400, "invalid_request_error")


def test_missing_max_tokens_bad_key_and_unknown_model(served):
    running, _, _ = served
    # The client will not send a request without max_tokens: a raw one.
    response = httpx.post(
        f"{running.url}/v1/messages",
        json={"model": "scripted", "messages": HI},
        headers={"x-api-key": KEY},
        timeout=30,
    )
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as refused:
        client(running, "wrong").messages.create(model="scripted", max_tokens=5, messages=HI)
    assert_anthropic_error(refused.value, 401, "authentication_error")
    keyless = httpx.post(
        f"{running.url}/v1/messages",
        json={"model": "scripted", "messages": HI, "max_tokens": 5},
        timeout=30,
    )
    assert keyless.status_code == 401
    assert keyless.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as refused:
        create(running, model="claude-opus-4")
    assert_anthropic_error(refused.value, 404, "not_found_error")
