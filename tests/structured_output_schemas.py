"""42 JSON schemas of varied shapes for the structured-output tests and benchmark: nested
objects, arrays with bounds, enums, anyOf, string formats and patterns, integer ranges.
Strings and arrays are bounded so that a small model's outputs end within a few dozen
tokens."""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SHORT = {"type": "string", "maxLength": 8}


def obj(properties: dict[str, Any], required: list[str] | None = None,
        **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False, **extra}


SCHEMAS: list[dict[str, Any]] = [
    # scalars at the top level
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "integer", "minimum": 10, "maximum": 99},
    {"type": "number", "enum": [0.5, 1.5, 2.5]},
    {"type": "boolean"},
    {"type": "null"},
    {"type": "string", "maxLength": 10},
    {"enum": ["red", "green", "blue"]},
    {"const": "fixed"},
    # flat objects
    obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"ok": {"type": "boolean"}}),
    obj({"id": {"type": "integer", "minimum": 1, "maximum": 999},
         "score": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}}),
    obj({"color": {"enum": ["red", "green", "blue"]}, "shade": {"enum": [1, 2, 3]}}),
    obj({"title": NAME, "note": SHORT}, required=["title"]),
    obj({"a": {"type": "null"}, "b": {"const": 7}}),
    obj({"count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}}),
    obj({"tag": {"type": "string", "pattern": "^[a-z]{2,5}$"}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
    obj({"day": {"type": "string", "format": "date"}}),
    obj({"at": {"type": "string", "format": "date-time"}}),
    obj({"mail": {"type": "string", "format": "email", "maxLength": 30}}),
    obj({"uid": {"type": "string", "format": "uuid"}}),
    obj({"when": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}}),
    # arrays with bounds
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "minItems": 2, "maxItems": 4},
    {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 3, "maxItems": 3},
    obj({"tags": {"type": "array", "items": SHORT, "maxItems": 2}}),
    obj({"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 1, "maxItems": 2}}}),
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9},
                                      {"type": "boolean"}], "items": False},
    # nested objects
    obj({"user": obj({"name": NAME, "admin": {"type": "boolean"}})}),
    obj({"a": obj({"b": obj({"c": {"type": "integer", "minimum": 0, "maximum": 9}})})}),
    obj({"point": obj({"x": {"type": "integer", "minimum": -9, "maximum": 9},
                       "y": {"type": "integer", "minimum": -9, "maximum": 9}}),
         "label": SHORT}),
    obj({"people": {"type": "array", "minItems": 1, "maxItems": 2,
                    "items": obj({"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                        "maximum": 99}})}}),
    obj({"meta": obj({"version": {"type": "integer", "minimum": 1, "maximum": 3},
                      "flags": {"type": "array", "items": {"type": "boolean"},
                                "maxItems": 2}})}),
    # anyOf / oneOf / refs
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]},
    obj({"value": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]}}),
    obj({"shape": {"anyOf": [obj({"kind": {"const": "circle"}, "r": {"type": "integer",
                                                                       "minimum": 1,
                                                                       "maximum": 9}}),
                             obj({"kind": {"const": "square"}, "side": {
                                 "type": "integer", "minimum": 1, "maximum": 9}})]}}),
    {"oneOf": [{"type": "string", "enum": ["x", "y"]}, {"type": "integer", "minimum": 100,
                                                       "maximum": 200}]},
    {"$defs": {"item": obj({"n": {"type": "integer", "minimum": 0, "maximum": 5}})},
     **obj({"first": {"$ref": "#/$defs/item"}, "second": {"$ref": "#/$defs/item"}})},
    obj({"maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    # open objects and optional properties
    {"type": "object", "maxProperties": 0},
    obj({"x": {"type": "integer", "minimum": 0, "maximum": 3},
         "y": {"type": "integer", "minimum": 0, "maximum": 3}}, required=["y"]),
    {"type": "object", "properties": {"k": SHORT}, "required": ["k"],
     "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
     "maxProperties": 2},
]
