"""JSON schemas the structured-output tests and benchmark generate against: small, and
bounded (string lengths, item counts, number ranges) so that a 135M model at any
temperature finishes them within a few dozen tokens. (A unique module name, so test
files and benchmarks.structured_overhead can import it.)"""

from __future__ import annotations

_NAME = {"type": "string", "minLength": 1, "maxLength": 8}
_SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": _NAME}, "required": ["name"]},
    {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["age"],
    },
    {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["score"],
    },
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    {
        "type": "object",
        "properties": {"kind": {"const": "point"}, "x": _SMALL_INT},
        "required": ["kind", "x"],
    },
    {
        "type": "object",
        "properties": {"first": _NAME, "last": _NAME},
        "required": ["first", "last"],
    },
    {
        "type": "object",
        "properties": {"name": _NAME, "nick": _NAME, "age": _SMALL_INT},
        "required": ["name"],
    },  # optional fields
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": _SMALL_INT, "name": _NAME},
                "required": ["id", "name"],
            }
        },
        "required": ["user"],
    },
    {
        "type": "object",
        "properties": {
            "values": {"type": "array", "items": _SMALL_INT, "minItems": 1, "maxItems": 3}
        },
        "required": ["values"],
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b", "c"]}}
        },
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "people": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {"type": "object", "properties": {"name": _NAME}, "required": ["name"]},
            }
        },
        "required": ["people"],
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["code"],
    },
    {
        "type": "object",
        "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
        "required": ["phone"],
    },
    {
        "type": "object",
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": _SMALL_INT, "y": _SMALL_INT},
                "required": ["x", "y"],
            }
        },
        "properties": {"at": {"$ref": "#/$defs/point"}},
        "required": ["at"],
    },
    {
        "type": "object",
        "definitions": {"name": _NAME},
        "properties": {"a": {"$ref": "#/definitions/name"}, "b": {"$ref": "#/definitions/name"}},
        "required": ["a", "b"],
    },
    {"type": "object", "properties": {"id": {"anyOf": [_SMALL_INT, _NAME]}}, "required": ["id"]},
    {
        "type": "object",
        "properties": {"v": {"oneOf": [{"type": "boolean"}, {"type": "null"}]}},
        "required": ["v"],
    },
    {
        "type": "object",
        "properties": {"note": {"type": ["string", "null"], "maxLength": 6}},
        "required": ["note"],
    },
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 9}},
        "required": ["n"],
    },
    {
        "type": "object",
        "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 5}},
        "required": ["word"],
    },
    {
        "type": "object",
        "properties": {
            "pair": {"type": "array", "prefixItems": [_NAME, _SMALL_INT], "items": False}
        },
        "required": ["pair"],
    },
    {"type": "array", "items": _SMALL_INT, "minItems": 2, "maxItems": 3},
    {
        "type": "object",
        "properties": {
            "grid": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "array",
                    "maxItems": 2,
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                },
            }
        },
        "required": ["grid"],
    },
    {
        "type": "object",
        "properties": {"count": _SMALL_INT, "done": {"type": "boolean"}},
        "required": ["count", "done"],
    },
    {"type": "object", "properties": {"v": {"enum": [1, "two", None, True]}}, "required": ["v"]},
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {"type": "object", "properties": {"c": _SMALL_INT}, "required": ["c"]}
                },
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    {
        "type": "object",
        "properties": {"t": {"type": "integer", "minimum": -50, "maximum": -10}},
        "required": ["t"],
    },
    {
        "type": "object",
        "properties": {"say": {"enum": ['he said "hi"', "a\\b", "tab\there"]}},
        "required": ["say"],
    },
    {
        "type": "object",
        "properties": {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "ok": {"type": "boolean"},
        },
        "required": ["lat", "ok"],
    },
    {
        "type": "object",
        "properties": {
            "size": {"enum": ["S", "M", "L"]},
            "qty": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["size", "qty"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/item"}}
        },
        "required": ["items"],
        "$defs": {
            "item": {
                "type": "object",
                "properties": {"sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"}},
                "required": ["sku"],
            }
        },
    },
]
