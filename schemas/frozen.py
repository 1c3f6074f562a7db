"""The base of every frozen contract: validated at construction (pydantic, frozen, unknown fields
rejected), so a bad value fails where it is written, not deep inside a Ray worker."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
