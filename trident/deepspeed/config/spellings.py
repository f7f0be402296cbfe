"""Spellings DeepSpeed accepts that trident's strict schema would not, read as DeepSpeed reads them.

Runs first in the dialect's translation (before `rules`):

  - `communication_data_type: "bfp16"` (Megatron-DeepSpeed's configs write bf16 so) is `"bf16"`;
  - an integer setting written as a whole float (`"steps_per_print": 100000.0`, `"stage": 2.0`)
    is that integer: DeepSpeed reads top-level scalars untyped and its pydantic sections coerce;
  - `steps_per_print: Infinity` (accelerate writes `float("inf")` into every config it hands
    DeepSpeed) is "never print", trident's null;
  - `tensor_parallel.autotp_size: N` (DeepSpeed AutoTP) is `tensor_parallel.size: N` with the plan
    `"auto"` (the model's own tensor-parallel plan, else the preset of its model type);
  - a top-level section trident does not know that is switched on (`"transformer_engine": {"enabled": true}`)
    is an error naming it: the run would otherwise train without what the user asked for. An
    unknown key that switches nothing on stays a note (the loader's), as DeepSpeed ignores it.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel

from trident.config.errors import ConfigIssue, join_path, section_type
from trident.config.notes import Note, is_comment_key
from trident.config.schema import TridentConfig

COMM_DTYPE_SPELLINGS = {"bfp16": "bf16"}
"""DeepSpeed's other spelling of a communication dtype, lower-cased, -> trident's name. (Other
names, such as "float16", DeepSpeed refuses too, and so does the schema.)"""


def translate(data: dict, known_top_level: frozenset[str]) -> tuple[dict, list[Note], list[ConfigIssue]]:
    """The config with DeepSpeed's spellings read into trident's; `known_top_level` holds the
    top-level keys the dialect's rules handle (not unknown, even when not in trident's schema)."""
    notes: list[Note] = []
    issues: list[ConfigIssue] = []
    data = dict(data)
    _comm_dtype(data, notes)
    _autotp(data, notes, issues)
    _never_print(data, notes)
    data = _integral_floats(data, TridentConfig)
    issues += switched_on_unknown_sections(data, known_top_level)
    return data, notes, issues


def _comm_dtype(data: dict, notes: list[Note]) -> None:
    value = data.get("communication_data_type")
    if isinstance(value, str) and value.lower() in COMM_DTYPE_SPELLINGS:
        data["communication_data_type"] = COMM_DTYPE_SPELLINGS[value.lower()]
        notes.append(Note("communication_data_type", "renamed",
                          f"{value!r} read as {COMM_DTYPE_SPELLINGS[value.lower()]!r}"))


def _never_print(data: dict, notes: list[Note]) -> None:
    """DeepSpeed prints when `step % steps_per_print == 0`: an infinite period never prints."""
    value = data.get("steps_per_print")
    if isinstance(value, float) and value == float("inf"):
        data["steps_per_print"] = None
        notes.append(Note("steps_per_print", "renamed", "inf read as null (never print)"))


def _autotp(data: dict, notes: list[Note], issues: list[ConfigIssue]) -> None:
    """DeepSpeed AutoTP's size -> trident's tensor_parallel.size with plan "auto"."""
    tp = data.get("tensor_parallel")
    if not isinstance(tp, dict) or "autotp_size" not in tp:
        return
    tp = dict(tp)
    size = tp.pop("autotp_size")
    path = "tensor_parallel.autotp_size"
    if isinstance(size, float) and size.is_integer():
        size = int(size)
    if size is None or (isinstance(size, int) and not isinstance(size, bool) and size in (0, 1)):
        notes.append(Note(path, "ignored", "1 = no tensor parallelism"))
    elif not isinstance(size, int) or isinstance(size, bool) or size < 0:
        issues.append(ConfigIssue(path, f"expected a positive integer (DeepSpeed AutoTP's tensor-parallel size), "
                                        f"got {size!r}"))
    elif tp.get("size", size) != size:
        issues.append(ConfigIssue(path, f"{size} disagrees with tensor_parallel.size={tp['size']}; both name the "
                                        "tensor-parallel size: keep one"))
    else:
        tp["size"] = size
        tp.setdefault("plan", "auto")
        notes.append(Note(path, "renamed", f"DeepSpeed AutoTP read as tensor_parallel.size={size}, "
                                           f"plan={tp['plan']!r}"))
    data["tensor_parallel"] = tp


def _takes_int_not_float(annotation: Any) -> bool:
    """A field typed int (or int | None, an Annotated int...) that has no float branch."""
    found: set[type] = set()

    def walk(a: Any) -> None:
        origin = typing.get_origin(a)
        if origin is typing.Annotated:
            walk(typing.get_args(a)[0])
        elif origin in (typing.Union, types.UnionType):
            for arg in typing.get_args(a):
                walk(arg)
        elif isinstance(a, type):
            found.add(a)

    walk(annotation)
    return int in found and float not in found


def _integral_floats(data: dict, model: type[BaseModel]) -> dict:
    """`data` with whole floats turned into ints where the schema field takes an integer."""
    out = dict(data)
    for key, value in data.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            continue
        sub = section_type(field.annotation)
        if sub is not None and isinstance(value, dict):
            out[key] = _integral_floats(value, sub)
        elif isinstance(value, float) and value.is_integer() and _takes_int_not_float(field.annotation):
            out[key] = int(value)
    return out


def _switched_on(value: Any) -> str | None:
    """The path (relative, "" for the section itself) of an `enabled: true` inside `value`."""
    if not isinstance(value, dict):
        return None
    if value.get("enabled") not in (False, None) and not isinstance(value.get("enabled"), str):
        return "enabled"
    for key, sub in value.items():
        inner = _switched_on(sub)
        if inner is not None:
            return f"{key}.{inner}"
    return None


def switched_on_unknown_sections(data: dict, known_top_level: frozenset[str]) -> list[ConfigIssue]:
    """An error for each top-level section trident does not know whose `enabled` is true."""
    issues = []
    for key, value in data.items():
        key = str(key)
        if key in TridentConfig.model_fields or key in known_top_level or is_comment_key(key):
            continue
        where = _switched_on(value)
        if where is not None:
            issues.append(ConfigIssue(key, (
                f"the section is switched on (`{join_path(key, where)}: {str(_at(value, where)).lower()}`) but "
                f"trident does not know `{key}`: the run would train without it. Remove the section or set "
                "its `enabled` to false (an unknown key that switches nothing on is only noted, as "
                "DeepSpeed ignores it)")))
    return issues


def _at(value: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        value = value[part]
    return value
