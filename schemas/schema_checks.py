"""The cost limits of the JSON a client sends for the server to interpret: tool `parameters` schemas,
`response_format`'s schema, and a tool call's `arguments` in the history.

A JSON Schema is checked against the 2020-12 metaschema (jsonschema, pure Python: ~0.2 ms per subschema on an idle
core, ten times that on a loaded one) and compiled to a grammar (llguidance); both cost grows with the number of
subschemas and recursion with their depth. So, before any of that work (docs/SECURITY.md, "Cost"):

- each schema at most MAX_SCHEMA_CHARS characters as JSON (the request models check it: a size, cheap),
- each schema at most MAX_SCHEMA_DEPTH levels of JSON nesting (deeper, the metaschema check recursed past
  Python's limit: a 500),
- at most MAX_SUBSCHEMAS JSON objects across all the schemas of one request (8 tools of 4,000 `{}` each took
  12 s of metaschema checks); past this or the depth, the 400 comes from the count, before any check,
- the metaschema check stops at SCHEMA_CHECK_S seconds of its own work (`check_schemas`' deadline is read at each
  keyword of the metaschema, so a check past it ends there: the worker thread is freed, not left running).

Counting (`measure`) walks the JSON iteratively and stops at the first limit it passes, so a bomb costs the walk up
to the limit, not its size. serve/http/checks.py runs all of it on a worker thread after the request is
authenticated and charged (serve/http/exchange.py `Turns.begin`).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import attrs
from jsonschema import Draft202012Validator, validators

MAX_SCHEMA_CHARS = 65_536  # one schema (a function's parameters, response_format's schema), as JSON
MAX_SCHEMA_DEPTH = 32  # JSON nesting of one schema: {"properties": {"a": {...}}} is two levels per property
MAX_SUBSCHEMAS = 1_024  # JSON objects across every schema of one request
SCHEMA_CHECK_S = 2.0  # the metaschema check's own time, all schemas of one request together (1,000 subschemas:
# 0.7 s on an idle core, 1.2 s on a 2-core box at load 7)
MAX_ARGUMENTS_DEPTH = 64  # JSON nesting of a tool call's arguments in the history


class SchemaCheckError(ValueError):
    """A schema past a limit, or not a JSON Schema; `param` is its field's path."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class Shape:
    objects: int  # JSON objects (each a subschema, in a schema)
    depth: int  # the deepest nesting; 1 for a scalar or an empty container


def measure(value: Any, max_depth: int, max_objects: int) -> Shape:
    """The shape of parsed JSON, walked without recursion; it stops as soon as it is past `max_depth` or
    `max_objects` (the result then says so: depth max_depth + 1, or objects max_objects + 1)."""
    objects, deepest = 0, 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > max_depth:
            return Shape(objects, depth)
        if isinstance(item, dict):
            objects += 1
            if objects > max_objects:
                return Shape(objects, deepest)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return Shape(objects, deepest)


def schema_chars_error(schema: dict[str, Any]) -> str | None:
    """The size limit, as the request models check it (a ValueError's message, or None)."""
    chars = len(json.dumps(schema))
    return f"{chars} characters of JSON Schema; at most {MAX_SCHEMA_CHARS}" if chars > MAX_SCHEMA_CHARS else None


class _Deadline(threading.local):
    at = float("inf")


_deadline = _Deadline()


class CheckTimeout(Exception):
    pass


def _capped(keyword):
    def check(validator, value, instance, schema):
        if time.monotonic() > _deadline.at:
            raise CheckTimeout
        return keyword(validator, value, instance, schema)
    return check


def _evolve(self, **changes):
    """jsonschema's `evolve` less its switch to the class registered for a subschema's `$schema`: every part of the
    2020-12 metaschema names 2020-12, which would drop the deadline's keywords below the top level."""
    changes.setdefault("schema", self.schema)
    for field in attrs.fields(type(self)):
        if field.init and field.alias not in changes:
            changes[field.alias] = getattr(self, field.name)
    return type(self)(**changes)


# Draft 2020-12's metaschema validator with the deadline read at every keyword it applies, at every level
_CappedMeta = validators.extend(Draft202012Validator, {k: _capped(f) for k, f in
                                                        Draft202012Validator.VALIDATORS.items()})
_CappedMeta.evolve = _evolve


@dataclass(frozen=True)
class SchemaField:
    param: str  # its path in the request, e.g. tools[0].function.parameters
    schema: dict[str, Any]
    metaschema: bool  # checked against the metaschema here (else only its shape: the grammar compiler judges it)


def check_schemas(fields: list[SchemaField], budget_s: float = SCHEMA_CHECK_S) -> None:
    """Every field within the limits, then each `metaschema` one a valid JSON Schema, in at most `budget_s` of
    checking (SchemaCheckError naming the first field that fails, and the limit)."""
    objects = 0
    for field in fields:
        shape = measure(field.schema, MAX_SCHEMA_DEPTH, MAX_SUBSCHEMAS - objects)
        if shape.depth > MAX_SCHEMA_DEPTH:
            raise SchemaCheckError(field.param, f"the JSON Schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        objects += shape.objects
        if objects > MAX_SUBSCHEMAS:
            raise SchemaCheckError(field.param, f"more than {MAX_SUBSCHEMAS} subschemas (JSON objects) in the "
                                   "request's schemas together")
    _deadline.at = time.monotonic() + budget_s
    try:
        for field in fields:
            if not field.metaschema:
                continue
            meta = _CappedMeta(Draft202012Validator.META_SCHEMA, format_checker=Draft202012Validator.FORMAT_CHECKER)
            try:
                error = next(iter(meta.iter_errors(field.schema)), None)
            except CheckTimeout:
                raise SchemaCheckError(field.param, f"checking the JSON Schemas took over {budget_s:g} s; "
                                       "send smaller schemas") from None
            if error is not None:
                raise SchemaCheckError(field.param, f"not a valid JSON Schema: {error.message[:300]}")
    finally:
        _deadline.at = float("inf")


def arguments_depth_error(value: Any) -> str | None:
    """A tool call's parsed arguments past MAX_ARGUMENTS_DEPTH (a message), or None."""
    if measure(value, MAX_ARGUMENTS_DEPTH, 1 << 62).depth > MAX_ARGUMENTS_DEPTH:
        return f"the arguments nest deeper than {MAX_ARGUMENTS_DEPTH} levels"
    return None
