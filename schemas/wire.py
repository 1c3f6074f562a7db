"""Scalar types of request fields that accept exactly what their JSON Schema says.

Pydantic's lax mode would coerce `true` to 1, `"5"` to 5 and `"yes"` to True, and lets Python's JSON
parser's `NaN`/`Infinity` (and `1e400`, which parses to infinity) through to a float; the OpenAPI
document calls these fields integer, number and boolean, so anything else is a 422. One narrowing:
an integral float such as `2.0` is not an integer here (JSON Schema would allow it; clients send `2`).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AllowInfNan, Strict

JsonInt = Annotated[int, Strict()]  # no bool, str or float
JsonFloat = Annotated[float, Strict(), AllowInfNan(False)]  # int or float, finite; no bool or str
JsonBool = Annotated[bool, Strict()]  # true or false only
