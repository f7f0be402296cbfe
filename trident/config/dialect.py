"""The seam between trident's config and a foreign dialect read into it (DeepSpeed's).

`trident.config` knows only trident's own sections. A config written in DeepSpeed's dialect
(legacy names, keys with no effect here, features trident lacks, Hugging Face's `"auto"`
values) is translated before the schema sees it, by the `Dialect` that
`trident.deepspeed.config` registers here when imported. `import trident` imports it, and every
`trident.config` import runs `import trident` first, so the dialect is in place whenever a
config is loaded; a missing registration is an error, never a silent skip (as with the
optimizer and scheduler rules, `loader.register_section_rules`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from trident.config.errors import ConfigIssue
from trident.config.notes import Note


@dataclass(frozen=True)
class Dialect:
    """What a dialect supplies to the loader (and to the public `trident.config.fill_auto`)."""

    translate: Callable[[dict], tuple[dict, list[Note], list[ConfigIssue]]]
    """Raw config -> (the config in trident's sections, notes, issues); run before the schema."""
    aliases: Mapping[str, str]
    """JSON path -> the current key name in the same section; the loader renames while it walks."""
    synonyms: frozenset[str]
    """Aliases renamed without a deprecation warning (current spellings, not old ones)."""
    unimplemented: Mapping[str, tuple[frozenset[str], str]]
    """Section path -> (the dialect's keys trident lacks, a message template with `{path}`)."""
    fill_auto: Callable[..., dict]
    """`fill_auto(config, training_args, model=None, num_training_steps=None)`: placeholders filled."""
    auto_paths: Callable[..., list[str]]
    """`auto_paths(config, path="")`: the JSON paths whose value is a placeholder still to fill."""


_registered: Dialect | None = None


def register_dialect(dialect: Dialect) -> None:
    """Make `load_config` read configs through `dialect` (the last registration holds)."""
    global _registered
    _registered = dialect


def registered_dialect() -> Dialect:
    if _registered is None:
        raise RuntimeError("no config dialect is registered; `import trident` (which imports "
                           "trident.deepspeed.config, the DeepSpeed dialect) before loading a config")
    return _registered
