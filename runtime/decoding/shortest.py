"""The fewest new tokens any output a constraint admits can have: a request whose `max_new_tokens` is below it
can never complete, and is refused before it runs instead of spending its budget on a cut document.

Two bounds, the larger wins:
- the grammar's forced start: the tokens it admits deterministically from its first state (llguidance's mask
  admits only their canonical spelling), and one more token if the grammar cannot end there; any kind;
- the shortest document (JSON schema, JSON object, choice): for a schema, its smallest instance in characters
  (required properties only, empty strings, `minItems` items, the shortest `enum`/`const`/`anyOf` branch, 0 or
  the nearest bound for numbers, a minimal value for the common string formats), written as the grammar writes
  JSON; used only when the grammar accepts it (a schema feature not modelled here, such as a `pattern`, leaves
  this bound out rather than guess), and counted in the fewest tokens the vocabulary can spell it with, not
  the tokenizer's own spelling, so that the count never overstates what the model could need.
"""
from __future__ import annotations

import json
import math

import llguidance

# the smallest value each common string format admits (checked by the grammar before use)
FORMAT_MINIMA = {"date": "2000-01-01", "time": "00:00:00Z", "date-time": "2000-01-01T00:00:00Z",
                 "email": "a@a.a", "uuid": "00000000-0000-0000-0000-000000000000"}
MAX_DEPTH = 32  # $ref chains and nesting beyond this: no document bound (recursive schemas)


class Unmodelled(Exception):
    """A schema feature the smallest-instance walk does not model: the document bound is left out."""


def shortest_tokens(spec, tokenizer, vocab_bytes, longest: int, above: int | None = None) -> int:
    """The fewest new tokens a complete output of `spec` (a ConstraintSpec) has, by the bounds above.
    `vocab_bytes`: every token's bytes (a set of them); `longest`: the longest token in bytes. `above`: only
    whether the count exceeds this matters, so a document of no more bytes than it (no more tokens, as every
    byte is a token of a byte-level vocabulary) is not checked."""
    grammar = spec.engine_grammar()
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    forced = list(matcher.compute_ff_tokens())
    matcher.consume_tokens(forced)
    bound = len(forced) + (0 if matcher.is_accepting() else 1)
    for text in _documents(spec):
        if above is not None and len(text.encode()) <= above:
            continue
        if _accepts(tokenizer, grammar, text):
            bound = max(bound, min_spelling(text.encode(), vocab_bytes, longest))
    return bound


def _documents(spec) -> list[str]:
    """The candidate shortest outputs of `spec` (empty where no document bound applies)."""
    if spec.kind == "choice":
        return [min(spec.value, key=len)]
    if spec.kind == "json_object":
        return ["{}"]
    if spec.kind != "json_schema":
        return []
    schema = json.loads(spec.value)
    try:
        return [json.dumps(smallest(schema, schema, 0), ensure_ascii=False)]  # json.dumps' separators: the grammar's
    except Unmodelled:
        return []


def _accepts(tokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    return bool(matcher.consume_tokens(tokenizer.tokenize_str(text))) and matcher.is_accepting()


def min_spelling(data: bytes, vocab_bytes, longest: int) -> int:
    """The fewest vocabulary tokens whose bytes concatenate to `data` (a shortest path over its positions)."""
    best = [0] + [math.inf] * len(data)
    for end in range(1, len(data) + 1):
        for start in range(max(0, end - longest), end):
            if best[start] + 1 < best[end] and data[start:end] in vocab_bytes:
                best[end] = best[start] + 1
    if best[-1] == math.inf:
        raise Unmodelled("the vocabulary cannot spell the document")
    return int(best[-1])


def smallest(schema, root: dict, depth: int):
    """The instance of `schema` that is shortest as JSON text (Unmodelled where that is not known)."""
    if depth > MAX_DEPTH:
        raise Unmodelled("nested too deep")
    if schema is True or schema == {}:
        return 0
    if not isinstance(schema, dict):
        raise Unmodelled(f"schema {schema!r}")
    if "$ref" in schema:
        return smallest(_resolve(schema["$ref"], root), root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return min(schema["enum"], key=lambda v: len(json.dumps(v, ensure_ascii=False)))
    if set(schema) & {"allOf", "not", "if", "patternProperties", "dependentRequired", "dependentSchemas"}:
        raise Unmodelled("combined schemas")
    branches = schema.get("anyOf") or schema.get("oneOf")
    if branches:
        found = []
        for branch in branches:
            try:
                found.append(smallest({**{k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}, **branch},
                                      root, depth + 1))
            except Unmodelled:
                continue
        if not found:
            raise Unmodelled("no branch modelled")
        return min(found, key=lambda v: len(json.dumps(v, ensure_ascii=False)))
    kinds = schema.get("type") or _implied_type(schema)
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    return min((_smallest_of(kind, schema, root, depth) for kind in kinds),
               key=lambda v: len(json.dumps(v, ensure_ascii=False)))


def _implied_type(schema: dict) -> list[str]:
    if "properties" in schema or "required" in schema:
        return ["object"]
    if "items" in schema or "prefixItems" in schema:
        return ["array"]
    return ["null", "integer", "boolean", "string", "array", "object"]


def _smallest_of(kind: str, schema: dict, root: dict, depth: int):
    if kind == "null":
        return None
    if kind == "boolean":
        return True
    if kind in ("integer", "number"):
        return _smallest_number(schema)
    if kind == "string":
        if "pattern" in schema:
            raise Unmodelled("a pattern")
        if "format" in schema:
            if schema["format"] not in FORMAT_MINIMA:
                raise Unmodelled(f"format {schema['format']}")
            return FORMAT_MINIMA[schema["format"]]
        return "a" * int(schema.get("minLength", 0))
    if kind == "array":
        prefix = [smallest(item, root, depth + 1) for item in schema.get("prefixItems", [])]
        rest = max(0, int(schema.get("minItems", 0)) - len(prefix))
        return prefix + ([smallest(schema.get("items", True), root, depth + 1)] * rest if rest else [])
    if kind == "object":
        properties, required = schema.get("properties", {}), schema.get("required", [])
        if any(name not in properties for name in required) or schema.get("minProperties", 0) > len(required):
            raise Unmodelled("required properties without their schema")
        # the grammar writes properties in the schema's order
        return {name: smallest(sub, root, depth + 1) for name, sub in properties.items() if name in required}
    raise Unmodelled(f"type {kind}")


def _smallest_number(schema: dict):
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    if (low is None or low < 0) and (high is None or high > 0):
        return 0
    if "multipleOf" in schema:
        raise Unmodelled("a multiple away from 0")
    value = low if low is not None and low >= 0 else high
    if value == schema.get("exclusiveMinimum") and value is not None and value >= 0:
        value = math.floor(value) + 1
    elif value == schema.get("exclusiveMaximum") and value is not None and value <= 0:
        value = math.ceil(value) - 1
    return int(value) if float(value).is_integer() else value


def _resolve(ref: str, root: dict):
    if not ref.startswith("#"):
        raise Unmodelled(f"an external $ref {ref}")
    node = root
    for part in ref.lstrip("#").strip("/").split("/") if ref not in ("#", "#/") else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            raise Unmodelled(f"$ref {ref}")
        node = node[part]
    return node
