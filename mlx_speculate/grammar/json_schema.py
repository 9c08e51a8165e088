"""JSON schemas as the grammar compiler gets them: strict objects, schemas moved under another
root, and the check that a schema has a finite instance.

- `strict_objects`: every object schema that says nothing of undeclared properties (neither
  `additionalProperties` nor `unevaluatedProperties`) gets `additionalProperties: false`, as
  xgrammar's strict mode and OpenAI's strict function calling read a schema. JSON Schema's
  default allows any other key, and under a grammar that lets a small model invent keys
  without end (`"unit_map": ..., "unit_map_map": ...`). Objects built from `allOf` or `$ref`
  are left as written: a sibling `additionalProperties: false` would refuse the properties
  the other schemas declare.
- `rooted`: the schema as it reads when stored at `#/$defs/<name>` of another document, its
  local `$ref`s rewritten to point there, so several schemas (each with its own `$defs`) can be
  parts of one grammar.
- `check_finite`: a ValueError for a schema with a `$ref` that can only recurse (a required
  property, a non-empty array or every alternative leading back to it): no JSON text is
  finite there, and the grammar engine finds out only mid-generation.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

Schema = dict[str, Any]
# Keywords whose value is one subschema, a list of them, or a map from names to them.
ONE = ("additionalProperties", "unevaluatedProperties", "items", "contains", "not")
ONE += ("propertyNames", "if", "then", "else", "additionalItems", "unevaluatedItems")
MANY = ("allOf", "anyOf", "oneOf", "prefixItems")
NAMED = ("properties", "patternProperties", "dependentSchemas", "$defs", "definitions")
DEFINITIONS = ("$defs", "definitions")


def subschemas(schema: Schema, *, definitions: bool = True) -> Iterator[Any]:
    """The schemas directly inside `schema` (dicts or booleans); literals (`enum`, `const`,
    `default`, `examples`) are not schemas and are never entered."""
    for key in ONE:
        if key in schema:
            yield schema[key]
    for key in MANY:
        if isinstance(schema.get(key), list):
            yield from schema[key]
    if isinstance(schema.get("items"), list):  # draft 4-2019's tuple form
        yield from schema["items"]
    for key in NAMED:
        if isinstance(schema.get(key), dict) and (definitions or key not in DEFINITIONS):
            yield from schema[key].values()


def _rewrite(schema: Any, change: Callable[[Schema], None]) -> None:
    """Applies `change` to `schema` and every schema inside it, in place."""
    if not isinstance(schema, dict):
        return
    change(schema)
    for inner in subschemas(schema):
        if not isinstance(inner, list):
            _rewrite(inner, change)


def _is_object(schema: Schema) -> bool:
    kind = schema.get("type")
    if isinstance(kind, list):
        return "object" in kind
    return kind == "object" or (kind is None and "properties" in schema)


def strict_objects(schema: Schema) -> Schema:
    """A copy of `schema` whose objects take only the properties they declare, unless they
    say otherwise (see the module's docstring)."""

    parts: set[int] = set()  # allOf's schemas (by id): each declares part of one object

    def find_parts(node: Schema) -> None:
        parts.update(id(part) for part in node.get("allOf", ()) if isinstance(part, dict))

    def close(node: Schema) -> None:
        open_ = "additionalProperties" in node or "unevaluatedProperties" in node
        combined = "$ref" in node or "allOf" in node or id(node) in parts
        if _is_object(node) and not open_ and not combined:
            node["additionalProperties"] = False

    result = copy.deepcopy(schema)
    _rewrite(result, find_parts)
    _rewrite(result, close)
    return result


def rooted(schema: Schema, name: str) -> Schema:
    """A copy of `schema` to be stored at `#/$defs/<name>` of another schema: each `$ref` to
    a JSON pointer in `schema` ("#", "#/$defs/X", "#/properties/a") points there instead."""
    base = f"#/$defs/{name}"

    def move(node: Schema) -> None:
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            node["$ref"] = base + ref[1:]

    result = copy.deepcopy(schema)
    _rewrite(result, move)
    return result


def _resolve(root: Schema, ref: str) -> Any:
    """The schema a local `$ref` points to; None when it points nowhere (or elsewhere)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def check_finite(schema: Schema) -> None:
    """A ValueError naming a `$ref` of `schema` that has no finite instance: every way
    through it leads back to itself (see the module's docstring). A least fixed point: a
    reference is finite once some instance of it is built from finite ones."""
    refs = _reachable_refs(schema)
    finite = dict.fromkeys(refs, False)
    changed = True
    while changed:
        changed = False
        for ref in refs:
            if not finite[ref] and _finite(_resolve(schema, ref), finite):
                finite[ref] = changed = True
    endless = [ref for ref in refs if not finite[ref]]
    if endless:
        raise ValueError(
            f"the JSON schema has no finite instance: {endless[0]!r} refers back to itself "
            "in every instance (a required property, a non-empty array or every anyOf "
            "alternative recurses)"
        )


def _reachable_refs(root: Schema) -> list[str]:
    """The local `$ref`s found from the root, following each to its target (definitions
    nobody refers to are not visited)."""
    found: list[str] = []
    stack = [root]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in found:
            target = _resolve(root, ref)
            if target is not None:
                found.append(ref)
                stack.append(target)
        stack.extend(
            inner for inner in subschemas(node, definitions=False) if not isinstance(inner, list)
        )
    return found


def _finite(node: Any, finite: dict[str, bool]) -> bool:
    """Whether `node` has an instance built only from references `finite` holds true; True
    where unsure (what this does not read, the compiler checks)."""
    if not isinstance(node, dict):
        return node is not False
    ref = node.get("$ref")
    if isinstance(ref, str) and not finite.get(ref, True):
        return False
    if not all(_finite(s, finite) for s in node.get("allOf", ()) if isinstance(s, dict)):
        return False
    for key in ("anyOf", "oneOf"):
        options = node.get(key)
        if isinstance(options, list) and options and not any(_finite(s, finite) for s in options):
            return False
    if "enum" in node or "const" in node:  # literal values, if any
        return node.get("enum") != []
    kinds = node.get("type")
    if kinds is None:
        return True  # any type: a null, say
    kinds = kinds if isinstance(kinds, list) else [kinds]
    return any(_finite_as(kind, node, finite) for kind in kinds)


# Bounds that leave no value of a type when the least exceeds the most.
BOUNDS = {
    "string": ("minLength", "maxLength"),
    "array": ("minItems", "maxItems"),
    "integer": ("minimum", "maximum"),
    "number": ("minimum", "maximum"),
}


def _finite_as(kind: str, node: Schema, finite: dict[str, bool]) -> bool:
    least, most = (node.get(bound) for bound in BOUNDS.get(kind, ("", "")))
    numbers = (int, float)
    if isinstance(least, numbers) and isinstance(most, numbers) and least > most:
        return False
    if kind == "object":
        properties = node.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        extra = node.get("additionalProperties", True)
        required = node.get("required")
        names = [n for n in required if isinstance(n, str)] if isinstance(required, list) else []
        return all(_finite(properties.get(name, extra), finite) for name in names)
    if kind == "array":
        least = node.get("minItems", 0)
        least = least if isinstance(least, int) else 0
        prefix = node.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        items = node.get("items", True)
        if isinstance(items, list):  # the tuple form: its items come first
            prefix, items = items, node.get("additionalItems", True)
        needed = prefix[:least] + ([items] if least > len(prefix) else [])
        return all(_finite(s, finite) for s in needed)
    return True
