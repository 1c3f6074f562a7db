"""The request models' base and the scalar types of their fields, which accept exactly what their JSON Schema says.

`Strict` is every request model's base: an unknown field is a 422 naming it, not silently dropped.

Pydantic's lax mode would coerce `true` to 1, `"5"` to 5 and `"yes"` to True, and lets Python's JSON
parser's `NaN`/`Infinity` (and `1e400`, which parses to infinity) through to a float; the OpenAPI
document calls these fields integer, number and boolean, so anything else is a 422. One narrowing:
an integral float such as `2.0` is not an integer here (JSON Schema would allow it; clients send `2`).
"""

from __future__ import annotations

from typing import Annotated, Any

import pydantic
from pydantic import AfterValidator, AllowInfNan, BaseModel, ConfigDict, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NullIsDefault(BaseModel):
    """OpenAI's rule for its request models: `null` for an optional field means its default (`temperature: null`
    is temperature 1). Clients send it (the openai SDK passes an explicit None through; a dumped assistant message
    carries `refusal: null`). A required field's null stays, and fails as before. Only the OpenAI-compatible
    request models (and the messages and tools they share with the native request) take it: response models keep
    a None that means "not measured"."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        optional = {name for field_name, field in cls.model_fields.items() if not field.is_required()
                    for name in (field_name, field.alias) if name}
        return {key: value for key, value in data.items() if value is not None or key not in optional}


JsonInt = Annotated[int, pydantic.Strict()]  # no bool, str or float
JsonFloat = Annotated[float, pydantic.Strict(), AllowInfNan(False)]  # int or float, finite; no bool or str
JsonBool = Annotated[bool, pydantic.Strict()]  # true or false only


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:  # a lone surrogate sent as a JSON escape ("\\ud800"): no tokenizer takes it
        raise ValueError(f"not valid Unicode text: a lone surrogate at character {error.start}") from None
    return text


# text a tokenizer can take: whatever JSON escapes spell, less lone surrogates
Utf8Str = Annotated[str, AfterValidator(_utf8)]
