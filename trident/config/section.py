"""The base of every config section, and the value types several sections share.

`Section` makes a section strict (unknown keys rejected, JSON types enforced) and read-only;
`BatchSize` reads Hugging Face's `"auto"` as unset; `Count` takes element counts written as
whole floats (5e8), as DeepSpeed configs write them.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict


class Section(BaseModel):
    """Base of every config section: unknown keys rejected, JSON types enforced, read-only."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _auto_is_none(value: Any) -> Any:
    # Hugging Face's DeepSpeed integration writes "auto" for values it fills in itself.
    return None if value == "auto" else value


BatchSize = Annotated[int | None, BeforeValidator(_auto_is_none)]


def _integral_float_to_int(value: Any) -> Any:
    # DeepSpeed configs write element counts as 5e8; JSON makes those floats.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Count = Annotated[int, BeforeValidator(_integral_float_to_int)]
"""An element or byte count: an integer, also written as a whole float such as 5e8."""
