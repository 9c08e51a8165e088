"""Pythonic tool calls (Llama 3.2's pythonic template, Llama 4): `[get_weather(city="Paris")]`
read with `ast`, never run, with the real openai client against a scripted stand-in model
under a template written in that style (tests/templates/pythonic.jinja)."""

from __future__ import annotations

import json

import pytest

from mlx_speculate.server.tool_parser import ToolParser
from mlx_speculate.server.tools import PYTHONIC, call_grammar, parse_pythonic_calls, tool_format

from . import test_server_tools as served
from .test_server_tools import ASK, TIME, TOOLS, ask, names_and_arguments

# The scripted model under tests/templates/pythonic.jinja, shared with test_server_tools.
pythonic, tokenizer_path = served.pythonic, served.tokenizer_path

NAMES = {"get_weather", "get_time"}


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ('[get_weather(city="Paris")]', [("get_weather", {"city": "Paris"})]),
        (
            '[get_weather(city="Paris", days=-3, hourly=True), get_time()]',
            [("get_weather", {"city": "Paris", "days": -3, "hourly": True}), ("get_time", {})],
        ),
        (
            "<|python_start|>[get_time(zone={'a': [1, 2.5, None, null, true]})]<|python_end|>",
            [("get_time", {"zone": {"a": [1, 2.5, None, None, True]}})],
        ),
        ('get_time(zone="UTC")', [("get_time", {"zone": "UTC"})]),  # a lone call, no list
    ],
)
def test_pythonic_calls_parse(text, calls):
    parsed = parse_pythonic_calls(text, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls


@pytest.mark.parametrize(
    "text",
    [
        '[__import__("os").system("touch /tmp/pwned")]',  # parsed, never run: not a call of a tool
        '[get_time(zone=__import__("os").getcwd())]',  # an argument that is not a literal
        '[get_time("UTC")]',  # positional
        "[get_time(**{'zone': 'UTC'})]",
        '[launch(when="now")]',  # not offered
        '[get_time(zone="UTC"]',  # bad syntax
        "[]",
        "Paris is sunny.",
        "[get_time(zone=1 + 2)]",
        "[get_time(zone={1: 2})]",
    ],
)
def test_other_output_is_not_a_call(text):
    assert parse_pythonic_calls(text, NAMES) is None


def test_the_template_is_recognised(pythonic):
    _, _, tokenizer = pythonic
    assert tool_format(tokenizer) == PYTHONIC


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_pythonic_call_comes_back_parsed(pythonic, stream):
    running, model, _ = pythonic
    model.say('[get_weather(city="Paris"), get_time(zone="CET")]')
    content, calls, finish = ask(running, stream, tools=TOOLS)
    assert (content, finish) == (None, "tool_calls")
    assert names_and_arguments(calls) == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET"}),
    ]
    content, calls, _ = ask(running, stream, tools=TOOLS, parallel_tool_calls=False)
    assert names_and_arguments(calls) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "said", ["It is sunny.", '[get_weather(city="Pa', '[os.system("ls")]', "[1, 2]"]
)
def test_pythonic_other_output_is_content(pythonic, said, stream):
    running, model, _ = pythonic
    model.say(said)
    assert ask(running, stream, tools=TOOLS) == (said, [], "stop")


def test_required_pythonic_call_follows_the_grammar(pythonic):
    from mlx_speculate.grammar import ll_tokenizer

    running, model, tokenizer = pythonic
    # Tokenized as the grammar spells it (no SentencePiece dummy-prefix space in front).
    model.script = ll_tokenizer(tokenizer).tokenize_str('[get_weather(city="Paris")]')
    completion = running.client().chat.completions.create(
        model="scripted",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = [c.model_dump() for c in choice.message.tool_calls]
    assert names_and_arguments(calls) == [("get_weather", {"city": "Paris"})]


def test_pythonic_grammar_takes_exactly_calls_of_the_tools(tokenizer_path):
    import llguidance

    from mlx_speculate.grammar import ll_tokenizer
    from mlx_speculate.loading import load_tokenizer

    tables = ll_tokenizer(load_tokenizer(tokenizer_path))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    schemas["ping"] = {"type": "object", "additionalProperties": True}  # any keywords
    schemas["noop"] = {"type": "object"}  # strict: no properties, so no keywords

    def takes(text: str, parallel: bool = True) -> bool:
        matcher = llguidance.LLMatcher(tables, call_grammar(PYTHONIC, schemas, parallel).source)
        ids = tables.tokenize_str(text)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    good = [
        '[get_weather(city="Paris")]',
        "[get_time()]",
        '[get_time(zone="CET")]',
        '[ping(a=1, b={"x": [true, null]})]',
        "[noop()]",
    ]
    for text in good:
        assert takes(text) and parse_pythonic_calls(text, set(schemas)) is not None
    assert takes('[get_weather(city="Paris"), get_time()]')
    assert not takes('[get_weather(city="Paris"), get_time()]', parallel=False)
    refused = ["[get_weather()]", "[get_weather(city=3)]", '[launch(x="y")]', "Sure."]
    refused += ['[get_weather(city="Paris", unit="C")]', "[noop(a=1)]"]  # undeclared keywords
    for text in refused:
        assert not takes(text)
    with pytest.raises(ValueError, match="pythonic"):
        call_grammar(PYTHONIC, {"get-weather": {"type": "object"}}, True)


def test_parser_reads_pythonic_output_whole_however_it_streams():
    said = '[get_weather(city="Paris"), get_time()]'
    for eager in (False, True):  # whole calls, or calls in deltas (each one's first names it)
        parser = ToolParser(PYTHONIC, NAMES, eager=eager)
        calls: dict[int, list[str]] = {}
        for piece in [p for c in said for p in parser.feed(c)] + parser.end():
            calls.setdefault(piece.index, [piece.name, ""])[1] += piece.arguments
        assert [(name, json.loads(arguments)) for name, arguments in calls.values()] == [
            ("get_weather", {"city": "Paris"}),
            ("get_time", {}),
        ]


def test_parser_streams_pythonic_calls_argument_by_argument():
    said = '[get_weather(city="Paris", days=3), get_time(zone="CET")]'
    parser = ToolParser(PYTHONIC, NAMES, eager=True)
    arrived = [(n, p) for n in range(len(said)) for p in parser.feed(said[n])] + [
        (len(said), p) for p in parser.end()
    ]
    # (where in the output each delta went out, its name, its arguments)
    assert [(n, p.index, p.name, p.arguments) for n, p in arrived] == [
        (said.index(","), 0, "get_weather", ""),
        (said.index(","), 0, None, '{"city": "Paris"'),
        (said.index(")"), 0, None, ', "days": 3'),
        (said.index(")"), 0, None, "}"),
        (said.rindex(")"), 1, "get_time", ""),
        (said.rindex(")"), 1, None, '{"zone": "CET"'),
        (said.rindex(")"), 1, None, "}"),
    ]
    assert arrived[0][1].id.startswith("call_") and arrived[4][1].id != arrived[0][1].id


def test_streamed_pythonic_call_broken_midway_is_truncated(pythonic):
    """Whole, a call with a non-literal argument is content; streamed, the arguments that
    went out stay (a truncated call) and the text from the one that broke it is content."""
    running, model, _ = pythonic
    said = '[get_weather(city="Paris", days=1 + 2)]'
    model.say(said)
    assert ask(running, False, tools=TOOLS) == (said, [], "stop")
    content, calls, finish = ask(running, True, tools=TOOLS)
    assert (content, finish) == (" days=1 + 2)]", "tool_calls")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Paris"')
    ]


def test_client_stream_helpers_rebuild_pythonic_calls(pythonic):
    """openai's chat.completions.stream() and anthropic's messages.stream() put the calls
    together from their deltas (several per call)."""
    from .test_server_messages import WEATHER, client

    running, model, _ = pythonic
    model.say('[get_weather(city="Paris", days=3, hourly=True), get_time(zone="CET")]')
    with running.client().chat.completions.stream(
        model="scripted", messages=ASK, tools=TOOLS, temperature=0
    ) as stream:
        deltas = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        message = stream.get_final_completion().choices[0].message
    # Per call: its name (no arguments), then one per argument and its "}".
    assert [bool(d.arguments_delta) for d in deltas] == [False, *[True] * 4, False, True, True]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3, "hourly": True}),
        ("get_time", {"zone": "CET"}),
    ]
    time_tool = {"name": "get_time", "input_schema": TIME["function"]["parameters"]}
    args = {"model": "scripted", "max_tokens": 200, "messages": ASK, "tools": [WEATHER, time_tool]}
    with client(running, "unused").messages.stream(**args) as events:
        fragments = [e.partial_json for e in events if e.type == "input_json"]
        final = events.get_final_message()
    assert len(fragments) == 6
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "get_weather", {"city": "Paris", "days": 3, "hourly": True}),
        ("tool_use", "get_time", {"zone": "CET"}),
    ]
    assert final.stop_reason == "tool_use"
