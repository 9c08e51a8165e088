"""JSON schemas before they are compiled (json_schema.py): strict objects, schemas moved under
another root, the finite-instance check, and what a grammar that cannot go on mid-generation
raises through the Python API."""

from __future__ import annotations

import jsonschema
import pytest
from pydantic import BaseModel

from mlx_speculate.generation import stream_generate
from mlx_speculate.grammar import Grammar, GrammarError
from mlx_speculate.grammar.json_schema import check_finite, rooted, strict_objects

from .helpers import MODELS
from .test_server_structured import ENDLESS


class Node(BaseModel):  # recursive, and finite: the children may be none
    name: str
    children: list[Node] = []


class Pair(BaseModel):
    left: Node
    right: Node | None = None


def test_strict_closes_every_object_that_says_nothing():
    schema = Pair.model_json_schema()
    closed = strict_objects(schema)
    assert closed is not schema and "additionalProperties" not in schema  # a copy
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["Node"]["additionalProperties"] is False
    jsonschema.validate({"left": {"name": "a", "children": [{"name": "b"}]}}, closed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"left": {"name": "a", "extra": 1}}, closed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"left": {"name": "a"}, "extra": 1}, closed)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "additionalProperties": True},
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"type": "object", "unevaluatedProperties": False},
        {"type": "object", "allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
        {"type": "object", "$ref": "#/$defs/x", "$defs": {"x": {"type": "object"}}},
        {"type": "string"},
        {"enum": [{"type": "object"}]},  # a literal that looks like a schema is left alone
    ],
)
def test_strict_keeps_what_a_schema_says_or_combines(schema):
    closed = strict_objects(schema)
    assert {k: v for k, v in closed.items() if k != "$defs"} == {
        k: v for k, v in schema.items() if k != "$defs"
    }


def test_rooted_moves_local_references():
    schema = {
        "type": "object",
        "properties": {"me": {"$ref": "#"}, "loc": {"$ref": "#/$defs/Loc"}},
        "$defs": {"Loc": {"enum": [{"$ref": "#/not/a/ref"}]}},
    }
    moved = rooted(schema, "tool0")
    assert moved["properties"]["me"] == {"$ref": "#/$defs/tool0"}
    assert moved["properties"]["loc"] == {"$ref": "#/$defs/tool0/$defs/Loc"}
    assert moved["$defs"]["Loc"] == schema["$defs"]["Loc"]  # literals are not schemas
    whole = {"$defs": {"tool0": moved}, "$ref": "#/$defs/tool0"}
    jsonschema.validate({"me": {"loc": {"$ref": "#/not/a/ref"}}}, whole)


@pytest.mark.parametrize(
    "schema",
    [
        Node.model_json_schema(),
        Pair.model_json_schema(),
        {"type": "array", "items": {"$ref": "#"}},  # [] ends it
        {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#"}, "minItems": 1}]},
        {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        {"$ref": "#/$defs/missing"},  # the compiler's to refuse
    ],
)
def test_finite_schemas_pass(schema):
    check_finite(schema)


@pytest.mark.parametrize("name", sorted(ENDLESS))
def test_endless_schemas_are_one_line_value_errors(name):
    with pytest.raises(ValueError, match="no finite instance") as refused:
        Grammar.json_schema(ENDLESS[name])
    assert "\n" not in str(refused.value)


def test_a_grammar_that_cannot_go_on_is_a_one_line_value_error(monkeypatch):
    """Past every up-front check (here: turned off), a grammar the engine cannot follow ends
    the generation with a GrammarError (a ValueError) of one line, not the engine's dump."""
    import mlx_speculate.grammar

    from .serving import load_cached

    model, tokenizer = load_cached(MODELS / "stories260K-llama")
    monkeypatch.setattr(mlx_speculate.grammar, "check_finite", lambda schema: None)
    grammar = Grammar.json_schema(ENDLESS["required-ref"])
    with pytest.raises(GrammarError) as failed:
        for _ in stream_generate(model, tokenizer, "Once", max_tokens=20, grammar=grammar):
            pass
    assert isinstance(failed.value, ValueError)
    assert "\n" not in str(failed.value) and "<state>" not in str(failed.value)
