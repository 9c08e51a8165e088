"""Structured output through the server: `response_format` (json_object, json_schema) on the
stories models with every chain method, whole and streamed, greedy and sampled, always parses
and validates, and greedy equals `stream_generate(grammar=...)`; a required or named tool call
(OpenAI's tool_choice, Anthropic's "any" / "tool") from SmolLM2 under the Hermes-style test
template is always a well-formed call whose arguments validate."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from mlx_speculate.convert import convert
from mlx_speculate.drafters import DraftModelSpec, EagleGrowth, EagleSpec
from mlx_speculate.generation import stream_generate
from mlx_speculate.grammar import Grammar
from mlx_speculate.loading import load

from .helpers import MODELS, random_eagle_head
from .scripted import TEMPLATES
from .serving import load_cached, serve

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "pet": {
                "type": "object",
                "properties": {
                    "kind": {"enum": ["dog", "cat", "bird"]},
                    "age": {"type": "integer", "minimum": 0, "maximum": 20},
                },
                "required": ["kind", "age"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "pet"],
        "additionalProperties": False,
    },
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -10, "maximum": 10},
        "minItems": 1,
        "maxItems": 4,
    },
    "enum": {"enum": ["happy", "sad", "angry"]},
    "flags": {
        "type": "object",
        "properties": {
            "done": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["done", "tags"],
        "additionalProperties": False,
    },
}
METHODS = ["none", "prompt_lookup", "draft_model"]
PROMPT = [{"role": "user", "content": "Lily and Tom went to the park. They saw a big dog."}]


@pytest.fixture(scope="module")
def stories():
    return load_cached(MODELS / "stories260K-llama")


@pytest.fixture(scope="module")
def server(stories):
    draft, draft_tokenizer = load_cached(MODELS / "llama2xs281K-llama")
    with serve(*stories, DraftModelSpec(model=draft, tokenizer=draft_tokenizer)) as running:
        yield running


def response_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


def chat(running, stream: bool, **kwargs) -> tuple[str, str]:
    args = dict(model="stories", messages=PROMPT, max_tokens=120, **kwargs)
    client = running.client()
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        return choice.message.content, choice.finish_reason
    chunks = list(client.chat.completions.create(**args, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    return text, chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_answer_validates(server, name):
    for i, method in enumerate(METHODS):
        for temperature in (0.0, 0.8):
            text, finish = chat(
                server,
                stream=i % 2 == 1,
                temperature=temperature,
                seed=i,
                response_format=response_format(name),
                extra_body={"speculative": {"method": method}},
            )
            assert finish == "stop", (method, temperature, text)
            jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_object(server):
    for stream in (False, True):
        text, finish = chat(
            server, stream, temperature=0.8, seed=5, response_format={"type": "json_object"}
        )
        if finish == "stop":  # a free object may run past max_tokens; then it is cut short
            assert isinstance(json.loads(text), dict)
        else:
            assert text.startswith("{")


def constrained_generate(model, tokenizer) -> str:
    """`stream_generate`'s greedy answer under the "nested" schema, on the chat's text."""
    tokens = list(tokenizer.encode(PROMPT[0]["content"]))
    grammar = Grammar.json_schema(SCHEMAS["nested"])
    return "".join(
        r.text for r in stream_generate(model, tokenizer, tokens, max_tokens=120, grammar=grammar)
    )


def nested_greedy(running, speculative: dict):
    return running.client().chat.completions.create(
        model="stories",
        messages=PROMPT,
        max_tokens=120,
        temperature=0,
        response_format=response_format("nested"),
        extra_body={"speculative": speculative},
    )


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_constrained_generate(server, stories, method):
    speculative = {"method": method}
    if method != "none":
        speculative["num_draft_tokens"] = 3
    completion = nested_greedy(server, speculative)
    assert completion.choices[0].message.content == constrained_generate(*stories)
    usage = completion.usage.speculative
    assert usage["fast_forwarded_tokens"] > 0  # `{"name": "` at least is forced


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}, None),
        ({"type": "xml"}, "response_format.type"),
    ],
)
def test_bad_response_format_is_400(server, response_format, param):
    body = {"model": "stories", "messages": PROMPT, "response_format": response_format}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == (param or "response_format")


def test_tree_methods_work_under_a_grammar(stories):
    """EAGLE drafts trees; under response_format the grammar cuts them, and the answer is
    what constrained greedy decoding says."""
    model, tokenizer = stories
    config = json.loads((MODELS / "stories260K-llama" / "config.json").read_text())
    head = random_eagle_head(config, 1, seed=3)
    spec = EagleSpec(heads=head, tree=EagleGrowth(16, 4, 4), num_draft_tokens=15)
    with serve(model, tokenizer, spec) as running:
        completion = nested_greedy(running, {"method": "eagle"})
        choice = completion.choices[0]
        want = constrained_generate(model, tokenizer)
        assert (choice.message.content, choice.finish_reason) == (want, "stop")
        assert completion.usage.speculative["method"] == "eagle"
        assert completion.usage.speculative["fast_forwarded_tokens"] > 0


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "London", "Tokyo"]},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Adds two numbers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 1000},
                "b": {"type": "integer", "minimum": 0, "maximum": 1000},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, smollm2_file):
    """SmolLM2 (its 4-bit GGUF tensors, as the default model) under the Hermes-style test
    template: a real small model that was never asked to follow it."""
    folder = convert(smollm2_file, tmp_path_factory.mktemp("smollm2") / "q4", quantize=True)
    model, own = load(folder)
    _, tokenizer = load(folder)
    tokenizer.chat_template = (TEMPLATES / "hermes.jinja").read_text()
    with serve(model, tokenizer, model_id="smollm2") as tools_server:
        with serve(model, own, model_id="smollm2") as plain_server:
            yield tools_server, plain_server


def assert_valid_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


ASK = [{"role": "user", "content": "Tell me a joke about cats."}]  # asks for no tool
NAMED = {"type": "function", "function": {"name": "add"}}
REQUIRED = [("none", 0.0, "required")] + [
    pytest.param(method, temperature, choice, marks=pytest.mark.slow)
    for method in ("none", "prompt_lookup")
    for temperature in (0.0, 0.8)
    for choice in ("required", "named")
    if (method, temperature, choice) != ("none", 0.0, "required")
]


@pytest.mark.parametrize(("method", "temperature", "choice"), REQUIRED)
def test_required_and_named_calls_are_well_formed(smollm2, method, temperature, choice):
    running, _ = smollm2
    completion = running.client(timeout=600).chat.completions.create(
        model="smollm2",
        messages=ASK,
        tools=[WEATHER, ADD],
        tool_choice=NAMED if choice == "named" else "required",
        parallel_tool_calls=False,  # one call: a small model may go on calling to max_tokens
        max_tokens=80,
        temperature=temperature,
        seed=1,
        extra_body={"speculative": {"method": method}},
    )
    choice_ = completion.choices[0]
    assert choice_.finish_reason == "tool_calls" and len(choice_.message.tool_calls) == 1
    assert_valid_calls(choice_.message.tool_calls, {"add"} if choice == "named" else set(SCHEMA_OF))
    assert completion.usage.speculative["fast_forwarded_tokens"] > 0


def test_named_call_with_an_ordinary_schema_is_one_call(smollm2):
    """Schemas as users write them (nothing says whether other keys may come): SmolLM2 once
    invented keys here until max_tokens, then called the tool a second time. Enforced
    arguments are strict and a named tool is one call, so it ends with one valid call."""
    running, _ = smollm2
    ordinary = json.loads(json.dumps(WEATHER))
    del ordinary["function"]["parameters"]["additionalProperties"]
    ordinary["function"]["parameters"]["properties"]["unit"] = {"type": "string"}
    completion = running.client(timeout=600).chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[ordinary],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    strict = {**ordinary["function"]["parameters"], "additionalProperties": False}
    jsonschema.validate(json.loads(call.function.arguments), strict)


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        pytest.param({"type": "any", "disable_parallel_tool_use": True}, marks=pytest.mark.slow),
    ],
    ids=["tool", "any"],
)
def test_anthropic_any_and_named_tool_are_well_formed(smollm2, choice):
    running, _ = smollm2
    client = anthropic.Anthropic(base_url=running.url, api_key="unused", max_retries=0, timeout=600)
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
        for t in (WEATHER, ADD)
    ]
    message = client.messages.create(
        model="smollm2",
        max_tokens=80,
        messages=[{"role": "user", "content": "Hello!"}],
        tools=tools,
        tool_choice=choice,
    )
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len(uses) == 1 and message.stop_reason == "tool_use"
    assert choice["type"] == "any" or uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, SCHEMA_OF[uses[0].name])


def test_a_template_without_tools_is_400(smollm2):
    _, plain = smollm2
    with pytest.raises(openai.BadRequestError) as refused:
        plain.client().chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER]
        )
    assert refused.value.status_code == 400
    error = refused.value.response.json()["error"]
    assert error["param"] == "tools" and "does not take tools" in error["message"]


NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}
ENDLESS = {  # schemas whose every instance would be infinite
    "required-ref": {"$defs": {"node": NODE}, "$ref": "#/$defs/node"},
    "root-ref": {"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]},
    "array": {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    "mutual": {
        "$defs": {
            "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
            "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 2},
        },
        "$ref": "#/$defs/a",
    },
    "every-option": {
        "anyOf": [
            {"type": "string", "minLength": 3, "maxLength": 1},
            {"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1},
        ]
    },
    "optional-endless": {  # the model may take the optional key, then never end
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/node"}},
        "$defs": {"node": NODE},
    },
}


@pytest.mark.parametrize("name", sorted(ENDLESS))
def test_endless_schemas_are_400_up_front(server, name):
    schema = ENDLESS[name]
    with pytest.raises(openai.BadRequestError) as refused:
        server.client().chat.completions.create(
            model="stories",
            messages=PROMPT,
            max_tokens=20,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    error = refused.value.response.json()["error"]
    assert error["param"] == "response_format" and "no finite instance" in error["message"]
    assert "\n" not in error["message"]


def test_a_grammar_that_fails_midway_is_a_clean_error(server, monkeypatch):
    """A grammar that compiles and then cannot go on (here: the up-front check turned off, so
    an endless schema reaches generation) ends the request with a one-line 400, or a streamed
    error event, never a 500 with the engine's state dump."""
    import mlx_speculate.grammar

    monkeypatch.setattr(mlx_speculate.grammar, "check_finite", lambda schema: None)
    args = dict(
        model="stories",
        messages=PROMPT,
        max_tokens=20,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": ENDLESS["required-ref"]},
        },
    )
    labels = {"endpoint": "/v1/chat/completions", "outcome": "400"}
    before = server.metric("mlx_speculate_requests_total", **labels)
    with pytest.raises(openai.BadRequestError) as refused:
        server.client().chat.completions.create(**args)
    error = refused.value.response.json()["error"]
    assert error["code"] == "grammar_error" and error["type"] == "invalid_request_error"
    assert "\n" not in error["message"] and "<state>" not in error["message"]
    assert server.metric("mlx_speculate_requests_total", **labels) == before + 1
    with pytest.raises(openai.APIError) as failed:
        for _ in server.client().chat.completions.create(**args, stream=True):
            pass
    assert "cannot follow the requested format" in str(failed.value)
    assert "<state>" not in str(failed.value)
    # Anthropic's route: a 400 of its own shape.
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model="stories",
            max_tokens=20,
            messages=[{"role": "user", "content": "Hi"}],
            extra_body={
                "output_config": {
                    "format": {"type": "json_schema", "schema": ENDLESS["required-ref"]}
                }
            },
        )
    assert bad.value.response.json()["error"]["type"] == "invalid_request_error"


def test_text_completions_follow_response_format(server):
    """/v1/completions takes response_format as chat does (it was silently ignored)."""
    for stream in (False, True):
        args = dict(
            model="stories",
            prompt="Lily and Tom went to the park.",
            max_tokens=120,
            temperature=0.8,
            seed=3,
            extra_body={"response_format": response_format("nested")},
        )
        if stream:
            chunks = list(server.client().completions.create(**args, stream=True))
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            choice = server.client().completions.create(**args).choices[0]
            text, finish = choice.text, choice.finish_reason
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMAS["nested"])
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}
    with pytest.raises(openai.BadRequestError) as refused:
        server.client().completions.create(
            model="stories", prompt="Hi", extra_body={"response_format": bad}
        )
    assert refused.value.response.json()["error"]["param"] == "response_format"


def test_a_strict_response_format_takes_only_declared_keys(server):
    """`strict: true` holds the schema's objects to the properties they declare, as OpenAI's
    strict mode does; a schema that says nothing lets the model add keys otherwise."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}}
    closed = {**schema, "additionalProperties": False}
    for seed in range(3):
        text, finish = chat(
            server,
            False,
            temperature=0.8,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema, "strict": True},
            },
        )
        assert finish == "stop", text  # a name of 8 characters at most, then nothing more
        jsonschema.validate(json.loads(text), closed)
