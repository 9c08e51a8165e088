"""Tool calling on the OpenAI routes, with the real openai client against a real server: a
scripted stand-in model (tests/scripted.py) says given text under a Hermes / Qwen2.5-style
template and a Llama 3.1-style one (tests/templates), and its calls come back parsed, whole
and streamed; tool results continue the conversation (reusing its prefix cache); tool_choice
behaves as OpenAI documents; malformed calls come back as content."""

from __future__ import annotations

import json

import pytest

from mlx_speculate.chat import apply_chat_template
from mlx_speculate.server.schemas import Message
from mlx_speculate.server.tool_parser import ToolParser

from .helpers import MODELS
from .scripted import scripted
from .serving import serve

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def hermes_call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def tokenizer_path():
    return MODELS / "stories260K-llama"


@pytest.fixture(scope="module")
def hermes(tokenizer_path):
    model, tokenizer = scripted(tokenizer_path, "hermes")
    with serve(model, tokenizer, model_id="scripted") as running:
        yield running, model, tokenizer


@pytest.fixture(scope="module")
def llama(tokenizer_path):
    model, tokenizer = scripted(tokenizer_path, "llama31")
    with serve(model, tokenizer, model_id="scripted") as running:
        yield running, model, tokenizer


@pytest.fixture(scope="module")
def pythonic(tokenizer_path):
    model, tokenizer = scripted(tokenizer_path, "pythonic")
    with serve(model, tokenizer, model_id="scripted") as running:
        yield running, model, tokenizer


def ask(running, stream: bool = False, messages=ASK, **kwargs):
    """The assistant message (content, tool calls as dicts) and the finish reason, whole or
    put together from the stream's deltas (which must follow OpenAI's protocol)."""
    client = running.client()
    args = dict(model="scripted", messages=messages, temperature=0, **{"max_tokens": 200, **kwargs})
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        calls = [c.model_dump() for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finishes = [], {}, []
    for chunk in client.chat.completions.create(**args, stream=True):
        delta = chunk.choices[0].delta
        finishes.append(chunk.choices[0].finish_reason)
        content.append(delta.content or "")
        for call in delta.tool_calls or []:
            if call.index not in calls:  # the first delta of a call names it
                assert call.id and call.function.name and call.type == "function"
                calls[call.index] = {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": ""},
                }
            calls[call.index]["function"]["arguments"] += call.function.arguments or ""
    assert set(finishes[:-1]) == {None} and finishes[-1] is not None
    assert sorted(calls) == list(range(len(calls)))
    return "".join(content) or None, [calls[i] for i in sorted(calls)], finishes[-1]


def template_tokens(tokenizer, messages: list[dict], tools=None) -> list[int]:
    """The prompt the server makes of OpenAI-shaped `messages`."""
    converted = [Message.model_validate(m).as_template_input() for m in messages]
    return apply_chat_template(tokenizer, converted, tools=tools)


def names_and_arguments(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_hermes_call_comes_back_parsed(hermes, stream):
    running, model, _ = hermes
    model.say(hermes_call("get_weather", {"city": "Paris"}))
    content, calls, finish = ask(running, stream, tools=TOOLS)
    assert content is None and finish == "tool_calls"
    assert names_and_arguments(calls) == [("get_weather", {"city": "Paris"})]
    assert calls[0]["id"].startswith("call_")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_text_around_parallel_calls(hermes, stream):
    running, model, _ = hermes
    first = hermes_call("get_weather", {"city": "Paris"})
    second = hermes_call("get_time", {"zone": "CET"})
    model.say(f"Let me look.\n{first}\n{second}")
    content, calls, finish = ask(running, stream, tools=TOOLS)
    assert content.strip() == "Let me look." and finish == "tool_calls"
    assert names_and_arguments(calls) == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert len({c["id"] for c in calls}) == 2
    content, calls, _ = ask(running, stream, tools=TOOLS, parallel_tool_calls=False)
    assert names_and_arguments(calls) == [("get_weather", {"city": "Paris"})]


BAD_JSON = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
UNCLOSED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
MALFORMED = {  # a call that is not one, and whether that shows before its first delta
    "bad-json": (BAD_JSON, False),
    "unknown-tool": (hermes_call("launch_rocket", {"when": "now"}), True),
    "no-name": ('<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>', True),
    "list-arguments": (
        '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',
        True,
    ),
    "unclosed": (UNCLOSED, False),
}


@pytest.mark.parametrize(
    ("said", "stream"),
    [
        pytest.param(said, stream, id=f"{name}-{'streamed' if stream else 'whole'}")
        for name, (said, early) in MALFORMED.items()
        for stream in ([False, True] if early else [False])
    ],
)
def test_malformed_calls_degrade_to_content(hermes, said, stream):
    running, model, _ = hermes
    model.say(said)
    content, calls, finish = ask(running, stream, tools=TOOLS)
    assert (content, calls, finish) == (said, [], "stop")


@pytest.mark.parametrize(
    ("said", "arguments", "content"),
    [(BAD_JSON, '{"city": ', "}\n</tool_call>"), (UNCLOSED, '{"city": "Pa', None)],
    ids=["bad-json", "unclosed"],
)
def test_streamed_call_broken_midway_is_truncated(hermes, said, arguments, content):
    """A call that breaks after its first delta went out (streamed only; whole, it is content):
    its arguments stop at the last character that kept them valid JSON, the rest is content."""
    running, model, _ = hermes
    model.say(said)
    got, calls, finish = ask(running, True, tools=TOOLS)
    assert (got, finish) == (content, "tool_calls")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", arguments)
    ]


def test_a_call_cut_by_max_tokens_is_truncated_whole_or_streamed(hermes):
    """max_tokens cuts a call in its arguments: whole as streamed, the call comes back with
    the arguments written so far and finish_reason "length", as OpenAI returns one; the text
    before it stays content."""
    running, model, tokenizer = hermes
    call = hermes_call("get_weather", {"city": "Paris"})
    model.say(f"Let me look.\n{call}")
    cut = call.index("Par") + 2
    max_tokens = len(tokenizer.encode(f"Let me look.\n{call[:cut]}", add_special_tokens=False))
    answers = [ask(running, stream, tools=TOOLS, max_tokens=max_tokens) for stream in (0, 1)]
    for content, calls, finish in answers:
        assert (content.strip(), finish) == ("Let me look.", "length")
        [(name, arguments)] = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        assert name == "get_weather" and arguments.startswith('{"city": "P')
        assert '{"city": "Paris"}'.startswith(arguments) and arguments != '{"city": "Paris"}'
    assert answers[0][1][0]["function"] == answers[1][1][0]["function"]


def test_streamed_call_arrives_in_fragments(hermes):
    """The arguments stream as the model writes them: many deltas, not one at the end."""
    running, model, _ = hermes
    arguments = {"city": "Paris", "note": "a long note to stretch the arguments out a little"}
    model.say(hermes_call("get_weather", arguments))
    stream = running.client().chat.completions.create(
        model="scripted", messages=ASK, tools=TOOLS, temperature=0, stream=True
    )
    deltas = [
        call
        for chunk in stream
        for call in chunk.choices[0].delta.tool_calls or []
    ]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert len(deltas) > 10
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == arguments


def test_openai_stream_helper_rebuilds_the_call(hermes):
    """The openai client's own stream accumulator puts the call together from the deltas."""
    running, model, _ = hermes
    model.say(f"Looking.\n{hermes_call('get_weather', {'city': 'Paris'})}")
    with running.client().chat.completions.stream(
        model="scripted", messages=ASK, tools=TOOLS, temperature=0
    ) as stream:
        for _ in stream:
            pass
        message = stream.get_final_completion().choices[0].message
    assert message.content == "Looking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_tool_choice_none_hides_the_tools(hermes):
    running, model, tokenizer = hermes
    said = hermes_call("get_weather", {"city": "Paris"})
    model.say(said)
    completion = running.client().chat.completions.create(
        model="scripted", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0
    )
    choice = completion.choices[0]
    assert (choice.message.content, choice.message.tool_calls) == (said, None)
    assert choice.finish_reason == "stop"
    # The prompt is the template's without tools.
    assert completion.usage.prompt_tokens == len(apply_chat_template(tokenizer, ASK))
    with_tools = apply_chat_template(tokenizer, ASK, tools=TOOLS)
    auto = running.client().chat.completions.create(
        model="scripted", messages=ASK, tools=TOOLS, tool_choice="auto", temperature=0
    )
    assert auto.usage.prompt_tokens == len(with_tools) > completion.usage.prompt_tokens
    assert auto.choices[0].finish_reason == "tool_calls"


def test_plain_answers_with_tools_offered(hermes):
    running, model, _ = hermes
    model.say("Paris is sunny < 30 degrees <tool")  # a partial tag at the end is content
    for stream in (False, True):
        content, calls, finish = ask(running, stream, tools=TOOLS)
        assert (content, calls, finish) == ("Paris is sunny < 30 degrees <tool", [], "stop")


@pytest.mark.parametrize("method", ["none", "prompt_lookup"])
def test_tool_loop_continues_and_reuses_the_cache(hermes, method):
    """Three rounds of call and result, each re-sending the whole conversation: the model sees
    the results through the template, and each turn reuses the last one's cache."""
    running, model, tokenizer = hermes
    messages = list(ASK)
    cities = ["Paris", "Lyon", "Nice"]
    previous = 0
    for i, city in enumerate(cities):
        model.say(hermes_call("get_weather", {"city": city}))
        completion = running.client().chat.completions.create(
            model="scripted",
            messages=messages,
            tools=TOOLS,
            temperature=0,
            extra_body={"speculative": {"method": method}},
        )
        message = completion.choices[0].message
        assert names_and_arguments([c.model_dump() for c in message.tool_calls]) == [
            ("get_weather", {"city": city})
        ]
        usage = completion.usage
        if i > 0:  # the whole last prompt, at least, came from the cache
            assert usage.prompt_tokens_details.cached_tokens >= previous
        previous = usage.prompt_tokens
        messages += [
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": f"sunny {i}"},
        ]
    prompt = template_tokens(tokenizer, messages, TOOLS)
    assert "<tool_response>\nsunny 2\n</tool_response>" in tokenizer.decode(prompt)
    model.say("It is sunny in all three.")
    content, calls, finish = ask(running, messages=messages, tools=TOOLS)
    assert (content, calls, finish) == ("It is sunny in all three.", [], "stop")


def test_lookup_drafts_a_repeated_call(hermes):
    """A call the conversation already holds is drafted by prompt lookup, and the output is
    the same as plain decoding's."""
    running, model, _ = hermes
    call = hermes_call("get_weather", {"city": "Paris"})
    model.say(call)
    messages = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "timeout; try again"},
    ]
    spec = {"method": "prompt_lookup", "num_draft_tokens": 8}
    completion = running.client().chat.completions.create(
        model="scripted",
        messages=messages,
        tools=TOOLS,
        temperature=0,
        extra_body={"speculative": spec},
    )
    assert completion.choices[0].finish_reason == "tool_calls"
    assert completion.usage.speculative["tokens_per_target_forward"] > 3


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "said",
    [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '  {"name": "get_weather", "arguments": {"city": "Paris"}}',
        '```json\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n```',
    ],
    ids=["json", "python-tag", "arguments", "fenced"],
)
def test_llama_json_call_comes_back_parsed(llama, said, stream):
    running, model, _ = llama
    model.say(said)
    content, calls, finish = ask(running, stream, tools=TOOLS)
    assert (content, finish) == (None, "tool_calls")
    assert names_and_arguments(calls) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "said",
    [
        "It is sunny in Paris.",
        '{"name": "get_weather", "parameters": {"city": "Paris"}',  # cut short
        '{"city": "Paris"}',  # JSON, but no call
    ],
)
def test_llama_other_output_is_content(llama, said, stream):
    running, model, _ = llama
    model.say(said)
    if stream and said.startswith('{"name"'):  # streamed, the call went out: it is cut short
        calls = [("get_weather", '{"city": "Paris"}')]
        content, got, finish = ask(running, stream, tools=TOOLS)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == calls
        assert (content, finish) == (None, "tool_calls")
        return
    assert ask(running, stream, tools=TOOLS) == (said, [], "stop")


@pytest.mark.parametrize(
    ("served", "said", "rendered"),
    [
        (
            "llama",
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            "<|start_header_id|>ipython<|end_header_id|>\n\nsunny, 24 C<|eot_id|>",
        ),
        ("pythonic", '[get_weather(city="Paris")]', '[get_weather(city="Paris")]<|eot_id|>'),
    ],
)
def test_whole_output_call_then_result_continues(request, served, said, rendered):
    """In the formats whose whole output is the call (Llama 3.1 JSON, pythonic), the call and
    its result go back through the template and the conversation goes on from the cache."""
    running, model, tokenizer = request.getfixturevalue(served)
    model.say(said)
    first = running.client().chat.completions.create(
        model="scripted", messages=ASK, tools=TOOLS, temperature=0
    )
    message = first.choices[0].message
    messages = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny, 24 C"},
    ]
    model.say("Sunny, 24 C.")
    second = running.client().chat.completions.create(
        model="scripted", messages=messages, tools=TOOLS, temperature=0
    )
    assert second.choices[0].message.content == "Sunny, 24 C."
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert rendered in tokenizer.decode(template_tokens(tokenizer, messages, TOOLS))


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tool_choice": "auto"}, "tool_choice"),  # no tools
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, None),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{oops"},
                            }
                        ],
                    }
                ]
            },
            None,
        ),
        ({"messages": [{"role": "tool", "content": "24 C"}]}, None),  # no tool_call_id
    ],
)
def test_bad_tool_requests_are_400(hermes, change, param):
    import httpx

    running, _, _ = hermes
    body = {"model": "scripted", "messages": ASK, **change}
    response = httpx.post(f"{running.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(
    ("format_", "said"),
    [
        ("hermes", f"Let me look.\n{hermes_call('get_weather', {'city': 'Paris'})}\nDone <tool"),
        ("hermes", f"{hermes_call('get_time', {})}\n{hermes_call('launch', {})}"),
        ("json", '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_time"}'),
        ("json", '[{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}]'),
        ("json", "  plain text"),
    ],
)
def test_parser_splits_the_same_whatever_the_chunks(format_, said):
    """Streamed a character at a time, the output parses as it does in one piece, and as it
    does when each call is only read whole."""

    def parse(chunks: list[str], eager: bool) -> list:
        parser = ToolParser(format_, {"get_weather", "get_time"}, eager=eager)
        pieces = [p for chunk in chunks for p in parser.feed(chunk)] + parser.end()
        merged: list = []
        for piece in pieces:
            if isinstance(piece, str) and merged and isinstance(merged[-1], str):
                merged[-1] += piece
            elif isinstance(piece, str):
                merged.append(piece)
            elif piece.name is not None:  # a call begins
                merged.append([piece.index, piece.name, piece.arguments])
            else:  # more of the last call's arguments
                assert merged[-1][0] == piece.index
                merged[-1][2] += piece.arguments
        return [p if isinstance(p, str) else (p[1], json.loads(p[2])) for p in merged]

    whole = parse([said], eager=False)
    for eager in (False, True):
        assert parse(list(said), eager) == whole
    assert any(isinstance(p, tuple) for p in whole) != (said.strip() == "plain text")


@pytest.mark.parametrize("format_", ["hermes", "json"])
def test_call_grammar_takes_exactly_calls_of_the_tools(tokenizer_path, format_):
    """The grammar of a required call accepts well-formed calls of the offered tools in the
    format's layout, one or (hermes, parallel) several, and nothing else."""
    import llguidance

    from mlx_speculate.grammar import ll_tokenizer
    from mlx_speculate.loading import load_tokenizer
    from mlx_speculate.server.tools import call_grammar

    tokenizer = load_tokenizer(tokenizer_path)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

    def takes(text: str, parallel: bool = True) -> bool:
        grammar = call_grammar(format_, schemas, parallel)
        tables = ll_tokenizer(tokenizer)
        matcher = llguidance.LLMatcher(tables, grammar.source)
        ids = tables.tokenize_str(text)  # no SentencePiece dummy-prefix space
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    def call(name: str, arguments: dict) -> str:
        if format_ == "hermes":
            return hermes_call(name, arguments)
        return json.dumps({"name": name, "parameters": arguments})

    paris = call("get_weather", {"city": "Paris"})
    assert takes(paris) and takes(call("get_time", {"zone": "CET"}))
    assert not takes(call("get_weather", {"city": 3}))  # against the schema
    assert not takes(call("get_weather", {}))  # "city" is required
    assert not takes(call("launch", {}))  # not a tool
    assert not takes(f"Sure. {paris}")
    two = f"{paris}\n{call('get_time', {})}"
    assert takes(two) == (format_ == "hermes")
    assert not takes(two, parallel=False)
