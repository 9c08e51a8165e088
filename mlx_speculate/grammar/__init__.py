"""Grammars for structured output: JSON schemas, any JSON object, Lark grammars.

    stream_generate(model, tokenizer, prompt, grammar=Grammar.json_schema(schema))

The engine is llguidance (guidance-ai), chosen over xgrammar for this loop because:
- it runs on the host, cheaply enough to mask every step, with no tensor library underneath,
  so it needs nothing from MLX: a mask is a bitmask we unpack into an MLX array (xgrammar's
  Python side is written around torch tensors for its masks and kernels);
- it has what speculation needs on one matcher: `consume_token` / `rollback(n)` to walk a
  draft and come back, and `compute_ff_tokens` for the tokens the grammar forces;
- it reads Hugging Face `tokenizers` pipelines directly (`llguidance.hf`), and the JSON
  schema support covers nested objects, enums, arrays, numbers with bounds, string lengths.

A `Grammar` is the compiled grammar text, independent of any tokenizer; the per-tokenizer
tables (`ll_tokenizer`, about a second for a 50k vocabulary) are built once per tokenizer.
JSON comes out in `json.dumps`' default layout (", " and ": ", no other whitespace): models
see that layout most, and free whitespace lets a small model wander into endless newlines.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import Any

import llguidance

from .json_schema import check_finite, strict_objects

# llguidance's JSON options: json.dumps' separators and no free whitespace.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A generation's grammar could not go on (its engine refused a token or allowed none),
    found mid-generation: a grammar that compiled and still has no way forward there. The
    message is one line, without the engine's state dump."""


@dataclass(frozen=True)
class Grammar:
    """A grammar the output must follow; build one with the constructors below."""

    source: str  # llguidance's grammar (its JSON form), checked valid
    description: str  # what it was built from, for messages

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, *, strict: bool = False) -> Grammar:
        """Output is one JSON value valid against `schema` (a dict or its JSON text). With
        `strict`, objects take only the properties they declare unless their schema allows
        others (`additionalProperties`), as xgrammar's strict mode (json_schema.py says why).
        A schema with no finite instance (a `$ref` that only recurses) is a ValueError."""
        schema = checked_schema(schema, strict=strict)
        try:
            source = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)
        except (ValueError, TypeError) as e:
            raise ValueError(f"the JSON schema cannot be compiled: {first_line(str(e))}") from None
        return cls._checked(source, "JSON schema")

    @classmethod
    def json_object(cls) -> Grammar:
        """Output is one JSON object (any keys and values)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def lark(cls, source: str) -> Grammar:
        """Output follows a Lark grammar in llguidance's dialect (its rule `start`; `%json {...}`
        embeds a JSON schema, /regex/ terminals, `%ignore` as in Lark)."""
        if not isinstance(source, str):
            raise TypeError(f"a Lark grammar is a str, got {type(source).__name__}")
        return cls._checked(llguidance.LLMatcher.grammar_from_lark(source), "Lark grammar")

    @classmethod
    def _checked(cls, source: str, description: str) -> Grammar:
        error = llguidance.LLMatcher.validate_grammar(source)
        if error:
            raise ValueError(f"the {description} is invalid: {first_line(error)}")
        return cls(source, description)


def checked_schema(schema: dict[str, Any] | str, *, strict: bool = False) -> dict[str, Any]:
    """`schema` (a dict or its JSON text) as a dict, made strict if asked; a ValueError when
    it is not an object or has no finite instance."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
    if strict:
        schema = strict_objects(schema)
    check_finite(schema)
    return schema


def first_line(message: str) -> str:
    """The first line of an llguidance message (later lines quote the grammar or dump the
    parser's state)."""
    return message.strip().splitlines()[0] if message.strip() else "unknown error"


_TOKENIZERS: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer) -> llguidance.LLTokenizer:
    """llguidance's tables for `tokenizer`, built once per tokenizer object.

    Takes what `load` returns (mlx-lm's wrapper of a fast Hugging Face tokenizer), a fast
    tokenizer itself, or any object with llguidance's plain protocol (`tokens`: bytes per id,
    `eos_token_id`, `bos_token_id`, and calling it encodes). Every id in the tokenizer's
    `eos_token_ids` ends the grammar's output.
    """
    cached = _TOKENIZERS.get(tokenizer)
    if cached is not None:
        return cached
    eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    if hasattr(inner, "tokens") and hasattr(inner, "eos_token_id"):
        built = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(inner), eos_token=eos or inner.eos_token_id
        )
    else:
        from llguidance.hf import from_tokenizer  # imports transformers: only needed here

        try:
            built = from_tokenizer(inner, eos_token=eos or None)
        except ValueError as e:
            message = f"grammars need a fast Hugging Face tokenizer: {first_line(str(e))}"
            raise ValueError(message) from e
    _TOKENIZERS[tokenizer] = built
    return built
