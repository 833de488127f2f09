"""Typed API objects: one frozen dataclass is both the CRD's OpenAPI schema and the parser.

A field is declared once, with `api_field(default, doc, ...)`. From that declaration
`openapi_schema(cls)` builds the structural schema the CRD carries (types, enums, bounds,
required fields, defaults, descriptions) and `parse(cls, data)` turns a custom resource's JSON
into the frozen object, applying the same defaults the API server applies. Field names are
snake_case in Python and camelCase on the wire.

Supported field types: bool, int, float, str, `X | None`, `list[T]`, `dict[str, T]`, nested
dataclasses, and the two markers below for Kubernetes-native values.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any


class Quantity(str):
    """A Kubernetes resource quantity ("500m", "16Gi", 2): an int or a string on the wire."""


class FreeForm(dict):
    """A Kubernetes object tandem passes through unread (e.g. `affinity`); its own schema is the
    API server's business, so the CRD keeps its fields unpruned."""


class SpecError(ValueError):
    """A value that can never work. `path` is the dotted field path, e.g. `spec.prefill.replicas`."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path


def api_field(default: Any = dataclasses.MISSING, doc: str = "", *, enum: tuple | None = None,
              minimum: float | None = None, maximum: float | None = None, pattern: str | None = None,
              fmt: str | None = None, name: str | None = None):
    """A dataclass field with its API documentation and constraints. Mutable defaults (lists,
    dicts, dataclasses) are copied per instance. A field without a default is required."""
    meta = {"doc": doc, "enum": enum, "minimum": minimum, "maximum": maximum, "pattern": pattern,
            "format": fmt, "name": name}
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=meta)
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: _copy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _copy(value):
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, dict):
        return type(value)({k: _copy(v) for k, v in value.items()})
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value)
    return value


def wire_name(f: dataclasses.Field) -> str:
    if f.metadata.get("name"):
        return f.metadata["name"]
    head, *rest = f.name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _fields(cls) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def _optional(tp) -> tuple[Any, bool]:
    """(inner type, nullable) for `X | None`."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported union {tp}")
        return args[0], True
    return tp, False


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


# ---------------------------------------------------------------------------------------------
# OpenAPI


def openapi_schema(cls) -> dict:
    """The structural OpenAPI v3 schema of a dataclass (an object with its fields)."""
    props, required = {}, []
    for f, tp in _fields(cls):
        props[wire_name(f)] = _field_schema(f, tp)
        if _default(f) is dataclasses.MISSING:
            required.append(wire_name(f))
    schema: dict = {"type": "object"}
    if cls.__doc__:
        schema["description"] = _squash(cls.__doc__)
    schema["properties"] = props
    if required:
        schema["required"] = required
    return schema


def _field_schema(f: dataclasses.Field, tp) -> dict:
    schema = _type_schema(tp)
    meta = f.metadata
    if meta.get("doc"):
        schema["description"] = meta["doc"]
    for key in ("enum", "minimum", "maximum", "pattern", "format"):
        if meta.get(key) is not None:
            schema[key] = list(meta[key]) if key == "enum" else meta[key]
    default = _default(f)
    if dataclasses.is_dataclass(default):
        # The API server applies defaults top-down: `{}` here, then each nested field's own default.
        schema["default"] = {}
    elif default is not dataclasses.MISSING and default is not None:
        schema["default"] = to_wire(default)
    if _optional(tp)[1]:
        schema["nullable"] = True
    return schema


def _type_schema(tp) -> dict:
    tp, _ = _optional(tp)
    origin = typing.get_origin(tp)
    if tp is Quantity:
        return {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}
    if tp is FreeForm:
        return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    if origin is list:
        return {"type": "array", "items": _type_schema(typing.get_args(tp)[0])}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(typing.get_args(tp)[1])}
    if dataclasses.is_dataclass(tp):
        return openapi_schema(tp)
    raise TypeError(f"no OpenAPI mapping for {tp!r}")


def _squash(doc: str) -> str:
    return " ".join(doc.split())


# ---------------------------------------------------------------------------------------------
# Parsing and serialising


def parse(cls, data: Any, path: str = "spec"):
    """Build `cls` from wire JSON, filling defaults. Raises SpecError naming the field on a wrong
    type, an unknown field, a missing required field, or a value outside its enum or bounds."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(path, f"expected an object, got {type(data).__name__}")
    known = {wire_name(f): (f, tp) for f, tp in _fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise SpecError(f"{path}.{unknown[0]}", f"unknown field (known: {', '.join(sorted(known))})")
    values = {}
    for key, (f, tp) in known.items():
        where = f"{path}.{key}"
        if key in data and data[key] is not None:
            values[f.name] = _parse_value(tp, data[key], where, f.metadata)
        elif _default(f) is dataclasses.MISSING:
            raise SpecError(where, "required")
        else:
            values[f.name] = _default(f)
    return cls(**values)


def _parse_value(tp, value, path: str, meta: typing.Mapping = types.MappingProxyType({})):
    tp, _ = _optional(tp)
    origin = typing.get_origin(tp)
    if tp is Quantity:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise SpecError(path, f"expected a quantity (int or string), got {value!r}")
        return value  # kept as written: 1 and "1" are both valid and the API server stores either
    if tp is FreeForm:
        if not isinstance(value, dict):
            raise SpecError(path, f"expected an object, got {value!r}")
        return FreeForm(value)
    if dataclasses.is_dataclass(tp):
        return parse(tp, value, path)
    if origin is list:
        if not isinstance(value, list):
            raise SpecError(path, f"expected a list, got {value!r}")
        item = typing.get_args(tp)[0]
        return [_parse_value(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise SpecError(path, f"expected an object, got {value!r}")
        item = typing.get_args(tp)[1]
        return {str(k): _parse_value(item, v, f"{path}.{k}") for k, v in value.items()}
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str)}[tp]
    if not ok(value):
        raise SpecError(path, f"expected {tp.__name__}, got {value!r}")
    value = float(value) if tp is float else value
    if meta.get("enum") is not None and value not in meta["enum"]:
        raise SpecError(path, f"{value!r} is not one of {list(meta['enum'])}")
    if meta.get("pattern") is not None and not re.search(meta["pattern"], value):
        raise SpecError(path, f"{value!r} does not match {meta['pattern']}")
    if meta.get("minimum") is not None and value < meta["minimum"]:
        raise SpecError(path, f"{value} is below the minimum {meta['minimum']}")
    if meta.get("maximum") is not None and value > meta["maximum"]:
        raise SpecError(path, f"{value} is above the maximum {meta['maximum']}")
    return value


def to_wire(value):
    """Dataclasses to camelCase JSON; None-valued fields are left out."""
    if dataclasses.is_dataclass(value):
        return {wire_name(f): to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)
                if getattr(value, f.name) is not None}
    if isinstance(value, list):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    if isinstance(value, Quantity):
        return str(value)  # a plain str: YAML's safe dumper refuses str subclasses
    return value
