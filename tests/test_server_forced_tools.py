"""Enforced tool calls (OpenAI's tool_choice "required" or named, Anthropic's "any" or "tool")
with the real openai and anthropic clients against a real server, the scripted stand-in model
under the Hermes, Llama 3.1 (JSON) and pythonic test templates: arguments are held to their
schema strictly (no invented keys unless the schema allows them), schemas with `$defs` and
`$ref` (pydantic's nested models) are enforced as written, a named tool is one call, and a
call cut by max_tokens is a truncated call (finish_reason "length"), whole as streamed, never
content."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from mlx_speculate.grammar import ll_tokenizer

from . import test_server_tools as served
from .test_server_tools import ASK, TIME, ask, hermes_call, names_and_arguments

# The scripted servers of test_server_tools (one per template), shared with it.
hermes, llama, pythonic = served.hermes, served.llama, served.pythonic
tokenizer_path = served.tokenizer_path


class Place(BaseModel):
    city: str
    country: str


class Trip(BaseModel):
    origin: Place
    destination: Place
    days: int


def function(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# Ordinary schemas: nothing says whether other keys may come (JSON Schema's default: they may).
WEATHER = function(
    "get_weather",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "where": {
                "type": "object",
                "properties": {"country": {"type": "string"}},
                "required": ["country"],
            },
        },
        "required": ["city"],
    },
)
TRIP = function("plan_trip", Trip.model_json_schema())  # $defs/Place, two $refs to it
NOTES = function("take_note", {"type": "object", "additionalProperties": True})
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def call_text(format_: str, name: str, arguments: dict) -> str:
    """A call of `name` as the grammar of `format_` spells it."""
    if format_ == "hermes":
        return hermes_call(name, arguments)
    if format_ == "llama":
        return json.dumps({"name": name, "parameters": arguments})
    keywords = ", ".join(f"{k}={json.dumps(v)}" for k, v in arguments.items())
    return f"[{name}({keywords})]"


def write(running, model, tokenizer, format_: str, name: str, arguments: dict) -> None:
    """The scripted model writes a call of `name` in `format_`, tokenized as the grammar
    spells it (no SentencePiece dummy-prefix space in front)."""
    model.script = ll_tokenizer(tokenizer).tokenize_str(call_text(format_, name, arguments))


FORMATS = ["hermes", "llama", "pythonic"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("format_", FORMATS)
def test_enforced_arguments_take_no_undeclared_keys(request, format_, choice, stream):
    """The model tries keys its schema does not declare, at the top and inside a nested
    object: the grammar ends each object where its declared keys end, and the call is one
    that validates."""
    running, model, tokenizer = request.getfixturevalue(format_)
    said = {"city": "Paris", "where": {"country": "FR", "zip": "75"}, "unit_map": "C"}
    if format_ == "pythonic":  # keywords are the arguments: the extra one is at the top
        said = {"city": "Paris", "unit_map": "C"}
    write(running, model, tokenizer, format_, "get_weather", said)
    # Off its script the stand-in takes the allowed token of lowest id, which in the pythonic
    # layout is `, ` and one more call, without end: one call there.
    content, calls, finish = ask(
        running,
        stream,
        tools=[WEATHER, TIME],
        tool_choice=NAMED if choice == "named" else choice,
        parallel_tool_calls=format_ != "pythonic",
    )
    assert (content, finish) == (None, "tool_calls")
    [(name, arguments)] = names_and_arguments(calls)
    assert name == "get_weather" and arguments["city"] == "Paris"
    assert "unit_map" not in arguments and arguments.get("where", {}).get("zip") is None
    schema = {**WEATHER["function"]["parameters"], "additionalProperties": False}
    jsonschema.validate(arguments, schema)


@pytest.mark.parametrize("format_", FORMATS)
def test_a_schema_that_allows_other_keys_keeps_them(request, format_):
    running, model, tokenizer = request.getfixturevalue(format_)
    write(running, model, tokenizer, format_, "take_note", {"text": "hi", "tag": "x"})
    _, calls, finish = ask(running, tools=[NOTES], tool_choice="required")
    assert finish == "tool_calls"
    assert names_and_arguments(calls) == [("take_note", {"text": "hi", "tag": "x"})]


TRIP_ARGUMENTS = {
    "origin": {"city": "Paris", "country": "FR"},
    "destination": {"city": "Rome", "country": "IT"},
    "days": 3,
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("format_", FORMATS)
def test_schemas_with_defs_and_refs_are_enforced(request, format_, choice, stream):
    """Pydantic's nested models (`$defs` and `$ref`) are enforced as written, next to a tool
    without them."""
    running, model, tokenizer = request.getfixturevalue(format_)
    write(running, model, tokenizer, format_, "plan_trip", TRIP_ARGUMENTS)
    tool_choice = {"type": "function", "function": {"name": "plan_trip"}}
    content, calls, finish = ask(
        running,
        stream,
        tools=[WEATHER, TRIP],
        tool_choice=tool_choice if choice == "named" else choice,
    )
    assert (content, finish) == (None, "tool_calls")
    assert names_and_arguments(calls) == [("plan_trip", TRIP_ARGUMENTS)]
    Trip.model_validate(TRIP_ARGUMENTS)


def anthropic_client(running) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=running.url, api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "plan_trip"}])
def test_anthropic_enforced_tool_with_defs(hermes, choice):
    running, model, tokenizer = hermes
    write(running, model, tokenizer, "hermes", "plan_trip", TRIP_ARGUMENTS)
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
        for t in (WEATHER, TRIP)
    ]
    message = anthropic_client(running).messages.create(
        model="scripted", max_tokens=200, messages=ASK, tools=tools, tool_choice=choice
    )
    uses = [b for b in message.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("plan_trip", TRIP_ARGUMENTS)]
    assert message.stop_reason == "tool_use"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("format_", ["hermes", "pythonic"])  # the formats with several calls
def test_a_named_tool_is_one_call(request, format_, stream):
    """The model goes on to a second call: under a named tool_choice the grammar ends after
    the first (whatever parallel_tool_calls says), and nothing of the second comes back."""
    running, model, tokenizer = request.getfixturevalue(format_)
    tokenize = ll_tokenizer(tokenizer).tokenize_str
    if format_ == "hermes":
        once = hermes_call("get_weather", {"city": "Paris"})
        twice = f"{once}\n{hermes_call('get_weather', {'city': 'Rome'})}"
    else:
        once = '[get_weather(city="Paris")]'
        twice = '[get_weather(city="Paris"), get_weather(city="Rome")]'
    model.script = tokenize(twice)
    # The second: room for the first call and its EOS, not for the second call.
    for max_tokens in (200, len(tokenize(once)) + 3):
        content, calls, finish = ask(
            running, stream, tools=[WEATHER, TIME], tool_choice=NAMED, max_tokens=max_tokens
        )
        assert (content, finish) == (None, "tool_calls"), max_tokens
        assert names_and_arguments(calls) == [("get_weather", {"city": "Paris"})]
    # "required" with parallel calls allowed keeps both.
    _, calls, _ = ask(running, stream, tools=[WEATHER, TIME], tool_choice="required")
    assert names_and_arguments(calls) == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]


def test_anthropic_named_tool_is_one_call(hermes):
    running, model, tokenizer = hermes
    twice = "\n".join(hermes_call("get_weather", {"city": c}) for c in ("Paris", "Rome"))
    model.script = ll_tokenizer(tokenizer).tokenize_str(twice)
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    message = anthropic_client(running).messages.create(
        model="scripted",
        max_tokens=200,
        messages=ASK,
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    uses = [b for b in message.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("get_weather", {"city": "Paris"})]
    assert [b.type for b in message.content] == ["tool_use"]


def test_an_endless_tool_schema_is_400(hermes):
    """A tool whose arguments could never end (a required property that refers back to its
    own object) is refused before generation, on both APIs."""
    running, _, _ = hermes
    node = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
    with pytest.raises(openai.BadRequestError) as refused:
        ask(running, tools=[function("loop", node)], tool_choice="required")
    error = refused.value.response.json()["error"]
    assert error["param"] == "tools" and "no finite instance" in error["message"]
    with pytest.raises(anthropic.BadRequestError) as bad:
        anthropic_client(running).messages.create(
            model="scripted",
            max_tokens=20,
            messages=ASK,
            tools=[{"name": "loop", "input_schema": node}],
            tool_choice={"type": "any"},
        )
    assert "no finite instance" in bad.value.response.json()["error"]["message"]


# A call long enough that max_tokens can cut it inside its last argument.
LONG = {"city": "Paris", "note": "pack an umbrella and a warm coat for the evening walk"}
WEATHER_NOTE = function(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "note": {"type": "string"}},
        "required": ["city", "note"],
    },
)


def cut_inside(model, tokenizer, format_: str) -> int:
    """Scripts a call of get_weather with LONG; max_tokens that ends the output in its note
    (the tokens of the output up to the note's "warm")."""
    write(None, model, tokenizer, format_, "get_weather", LONG)
    text = call_text(format_, "get_weather", LONG)
    return len(ll_tokenizer(tokenizer).tokenize_str(text[: text.index("warm")]))


@pytest.mark.parametrize("format_", FORMATS)
def test_a_forced_call_cut_by_max_tokens_is_a_truncated_call(request, format_):
    """OpenAI's way, whole as streamed: the call with the arguments written so far (not JSON
    yet), finish_reason "length", and no half call as content."""
    running, model, tokenizer = request.getfixturevalue(format_)
    max_tokens = cut_inside(model, tokenizer, format_)
    tools = [WEATHER_NOTE, TIME]
    answers = [
        ask(running, stream, tools=tools, tool_choice="required", max_tokens=max_tokens)
        for stream in (False, True)
    ]
    (content, calls, finish), streamed = answers
    assert (content, finish) == (None, "length")
    [call] = calls
    arguments = call["function"]["arguments"]
    assert call["function"]["name"] == "get_weather" and '"city": "Paris"' in arguments
    assert json.dumps(LONG).startswith(arguments) and arguments != json.dumps(LONG)
    if format_ != "pythonic":  # JSON arguments go out as written; pythonic ones, each whole
        assert '"note": "pack' in arguments
    assert streamed[0] is None and [c["function"] for c in streamed[1]] == [call["function"]]
    assert streamed[2] == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("format_", FORMATS)
def test_a_forced_call_cut_before_its_name_is_nothing(request, format_, stream):
    """Cut before the call is named there is no call to return, and its opening is no
    content: the output holds nothing but finish_reason "length"."""
    running, model, tokenizer = request.getfixturevalue(format_)
    write(running, model, tokenizer, format_, "get_weather", LONG)
    content, calls, finish = ask(
        running, stream, tools=[WEATHER_NOTE], tool_choice="required", max_tokens=3
    )
    assert (content or None, calls, finish) == (None, [], "length")


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_forced_call_cut_by_max_tokens(hermes, choice):
    """Anthropic's way, whole as the client builds it from the stream: a last tool_use block
    whose input holds the arguments that were complete, stop_reason "max_tokens"."""
    running, model, tokenizer = hermes
    max_tokens = cut_inside(model, tokenizer, "hermes")
    tools = [{"name": "get_weather", "input_schema": WEATHER_NOTE["function"]["parameters"]}]
    args = dict(model="scripted", max_tokens=max_tokens, messages=ASK, tools=tools)
    whole = anthropic_client(running).messages.create(**args, tool_choice=choice)
    with anthropic_client(running).messages.stream(**args, tool_choice=choice) as events:
        streamed = events.get_final_message()
    for message in (whole, streamed):
        assert message.stop_reason == "max_tokens"
        assert [(b.type, b.name, b.input) for b in message.content] == [
            ("tool_use", "get_weather", {"city": "Paris"})
        ]
