"""The JSON prefix check that gates streamed tool-call arguments: it takes every prefix of
valid JSON, and stops at the first character of invalid JSON that no value could continue."""

from __future__ import annotations

import json
import random

import pytest

from mlx_speculate.server.json_prefix import JsonPrefix, complete_part


def taken(text: str) -> tuple[int, bool]:
    """How many characters of `text` the check took, and whether the value was then whole."""
    check = JsonPrefix()
    for i, c in enumerate(text):
        if not check.push(c):
            return i, check.done
    return len(text), check.done


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["object", "array", "string", "number", "literal"]
    kind = rng.choice(kinds if depth < 3 else kinds[2:])
    if kind == "object":
        n = rng.randrange(4)
        return {f"k{rng.randrange(9)}é\n": random_value(rng, depth + 1) for _ in range(n)}
    if kind == "array":
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == "string":
        return "".join(rng.choice('ab"\\/\t\u00e9\u2028 ') for _ in range(rng.randrange(6)))
    if kind == "number":
        return rng.choice([0, -1, 12, 3.5, -0.25e-7, 1e21])
    return rng.choice([True, False, None])


def test_valid_json_is_taken_whole():
    rng = random.Random(0)
    for _ in range(300):
        value = {"a": random_value(rng)}
        texts = [json.dumps(value), json.dumps(value, indent=2)]
        for text in [*texts, json.dumps(value, ensure_ascii=False)]:
            assert taken(text) == (len(text), True), text


@pytest.mark.parametrize(
    ("text", "at"),
    [
        ('{"a":}', 5),
        ('{"a" 1}', 5),
        ("{,}", 1),
        ("[1,]", 3),
        ('{"a": 01}', 7),
        ('{"a": tru}', 9),
        ('{"a": "x\\q"}', 9),
        ('{"a": "\\u12g4"}', 11),
        ('{"a": [1}', 8),
        ('{"a": "line\nbreak"}', 11),
        ('{"a": 1}}', 8),
        ("{1: 2}", 1),
    ],
)
def test_invalid_json_stops_at_the_first_bad_character(text, at):
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    assert taken(text)[0] == at


def test_unfinished_json_is_taken_but_not_whole():
    text = '{"city": "Pa'
    assert taken(text) == (len(text), False)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("{", {}),
        ('{"city": "Par', {}),  # an unfinished string is dropped
        ('{"city": "Paris", "da', {"city": "Paris"}),  # and a key without its value
        ('{"city": "Paris", "days": 1', {"city": "Paris"}),  # 1 may yet be 12
        ('{"city": "Paris", "days": 12,', {"city": "Paris", "days": 12}),
        ('{"a": {"b": [1, 2,', {"a": {"b": [1, 2]}}),
        ('{"a": tr', {}),
        ('{"a": true ', {"a": True}),
        ('{"a": ["x", {"y": null}, ', {"a": ["x", {"y": None}]}),
        ('{"a": "x\\', {}),  # inside an escape
        ('{"a": {}', {"a": {}}),
        ('{"a": 1}', {"a": 1}),
    ],
)
def test_complete_part_closes_what_is_whole(text, value):
    assert complete_part(text) == value


def test_complete_part_of_every_prefix():
    """Every prefix of an object's or array's text has a complete part (the whole text: the
    value itself), which only grows as the text does."""
    rng = random.Random(1)
    for _ in range(100):
        value = {"k": [random_value(rng) for _ in range(3)], "v": random_value(rng)}
        text = json.dumps(value)
        parts = [json.dumps(complete_part(text[:n])) for n in range(1, len(text) + 1)]
        assert json.loads(parts[-1]) == value
        lengths = [len(p) for p in parts]
        assert lengths == sorted(lengths)


@pytest.mark.parametrize("text", ["", '"abc', "x", '{"a" 1', "[1] 2"])
def test_complete_part_refuses_what_is_no_container_prefix(text):
    with pytest.raises(ValueError):
        complete_part(text)
