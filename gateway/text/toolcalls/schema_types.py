"""A tool parameter's JSON types from its schema (`type`, `enum`, `anyOf`/`oneOf`/`allOf`, as vLLM's tool parsers
read them), and a value the model wrote as text turned into the first of those types it fits."""

from __future__ import annotations

import json
import math

_ENUM_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
               (dict, "object"))
# Tried in this order: a value that is "null" for a nullable parameter is null, not the string "null".
_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")


def schema_types(schema) -> set[str]:
    """Every type `schema` admits; {"string"} when it names none (an untyped parameter is text)."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    types.update(t for t in kinds if isinstance(t, str))
    for value in schema.get("enum") or []:
        types.add("null" if value is None else next(t for cls, t in _ENUM_TYPES if isinstance(value, cls)))
    if "const" in schema:
        types.update(schema_types({"enum": [schema["const"]]}))
    for key in ("anyOf", "oneOf", "allOf"):
        for choice in schema.get(key) or []:
            types |= schema_types(choice)
    return types or {"string"}


def is_text(schema) -> bool:
    """Whether a value of `schema` is always a string (it can stream as it is written)."""
    return schema_types(schema) == {"string"}


def coerce(value: str, schema):
    """`value` as the first of the schema's types it fits; text the schema does not allow stays text (as vLLM)."""
    types, v = schema_types(schema), value.strip()
    for kind in _PRIORITY:
        if kind not in types:
            continue
        if kind == "null" and v.lower() == "null":
            return None
        if kind == "string":
            return value
        if kind == "integer":
            try:
                return int(v)
            except ValueError:
                continue
        if kind == "number":
            try:
                f = float(v)
            except ValueError:
                continue
            if math.isfinite(f):
                return int(f) if f.is_integer() else f
            continue
        if kind == "boolean" and v.lower() in ("true", "false"):
            return v.lower() == "true"
        if kind in ("object", "array"):
            try:
                parsed = json.loads(v)
            except ValueError:
                continue
            if isinstance(parsed, dict if kind == "object" else list):
                return parsed
    return value
