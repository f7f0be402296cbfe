"""JSON (or a dict) -> `TridentConfig`, with every problem reported at once.

The steps, each adding to one list of issues:

  1. read the file (a syntax error names the file, line and column), and let the registered
     dialect (`trident.config.dialect`: DeepSpeed's) translate it into trident's sections;
  2. walk the keys against the schema: the dialect's aliases are renamed (deprecated ones warned
     once), its keys trident lacks get a specific message, other unknown keys a "did you mean";
  3. let pydantic check types and ranges, translated into JSON paths and plain messages;
  4. check `optimizer` and `scheduler` type and params with the rules their owner registered
     (`register_section_rules`), and fill in their defaults so the resolved config shows what
     will actually run.

Any issue raises one `ConfigError` listing them all.

Why a registry: trident.optim validates its own `params` with this module's helpers, so config
must not import optim back. trident.optim registers its rules when imported, and `import
trident` (which runs before any `trident.config` import) imports trident.optim, so the rules are
in place whenever a config is loaded; a missing registration is an error, never a silent skip.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Collection, NamedTuple, TypeVar

from pydantic import BaseModel, ValidationError

from trident.config.dialect import registered_dialect
from trident.config.errors import (ROOT, ConfigError, ConfigIssue, describe_value, issues_from_validation_error,
                                   join_path, section_type, unknown_name_message)
from trident.config.notes import Note, is_comment_key
from trident.config.schema import TridentConfig

M = TypeVar("M", bound=BaseModel)

_warned_aliases: set[str] = set()

# Sections whose `type` names an implementation elsewhere; its owner checks `params` (see above).
TYPED_SECTIONS = ("optimizer", "scheduler")


class SectionRules(NamedTuple):
    """What the owner of a typed section supplies: `check(type, params)` returns every problem
    at JSON paths under the section's key; `resolve(section)` returns the parsed section with
    its canonical type and every param filled in."""

    check: Callable[[Any, dict], list[ConfigIssue]]
    resolve: Callable[[Any], Any]


_section_rules: dict[str, SectionRules] = {}


def register_section_rules(key: str, check: Callable[[Any, dict], list[ConfigIssue]],
                           resolve: Callable[[Any], Any]) -> None:
    """Make `load_config` check and resolve section `key` (one of TYPED_SECTIONS) with these."""
    if key not in TYPED_SECTIONS:
        raise ValueError(f"register_section_rules: '{key}' is not one of {', '.join(TYPED_SECTIONS)}")
    _section_rules[key] = SectionRules(check, resolve)


def _rules(key: str) -> SectionRules:
    rules = _section_rules.get(key)
    if rules is None:
        raise RuntimeError(f"no rules are registered for the `{key}` section; `import trident` (which "
                           "imports trident.optim, their owner) before loading a config")
    return rules


def load_config(source: str | os.PathLike | dict | TridentConfig, strict: bool = False) -> TridentConfig:
    """Parse a config from a JSON file path, a dict or an already parsed config.

    DeepSpeed's dialect is read as DeepSpeed reads it (the registered dialect,
    `trident.deepspeed.config`): legacy names renamed, keys with no effect here ignored; unknown
    top-level keys and comment keys are accepted with a note. `strict=True` (or `"strict": true` in the config) makes those unknown keys errors.
    Raises `ConfigError` listing every problem found (not just the first).
    """
    if isinstance(source, TridentConfig):
        return source
    if isinstance(source, dict):
        data = copy.deepcopy(source)
    elif isinstance(source, (str, os.PathLike)):
        data = read_json(source)
    else:
        raise TypeError(f"load_config takes a JSON file path, a dict or a TridentConfig, got {type(source).__name__}")
    issues: list[ConfigIssue] = []
    flag = data.pop("strict", False)
    if not isinstance(flag, bool):
        issues.append(ConfigIssue("strict", f"expected true or false, got {describe_value(flag)}"))
    strict = strict or flag is True
    data, notes, dialect_issues = registered_dialect().translate(data)
    issues += dialect_issues
    cfg, schema_issues = validate_section(TridentConfig, data, "", notes=notes, strict=strict)
    issues += schema_issues + _typed_section_issues(data)
    if cfg is not None and not issues:
        issues += _preset_issues(cfg)
    if issues:
        raise ConfigError(sorted(issues, key=lambda i: i.path))
    cfg = _resolve_typed_sections(cfg)
    cfg._notes = tuple(notes)
    return cfg


def read_json(path: str | os.PathLike) -> dict:
    """Read a JSON object from a file; unreadable files and syntax errors raise `ConfigError`."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise ConfigError([ConfigIssue(name, f"cannot read the config file ({reason}); check the path")]) from None
    duplicates: list[str] = []
    try:
        data = json.loads(text, object_pairs_hook=lambda pairs: _no_duplicates(pairs, duplicates))
    except json.JSONDecodeError as err:
        raise ConfigError([ConfigIssue(name, (
            f"invalid JSON at line {err.lineno}, column {err.colno}: {err.msg}; fix the syntax "
            "(JSON allows no comments, no trailing commas, and strings need double quotes)"))]) from None
    issues = [ConfigIssue(name, f"key '{k}' appears twice in one JSON object; keep one") for k in duplicates]
    if not isinstance(data, dict):
        issues.append(ConfigIssue(name, f"expected a JSON object {{...}} at the top, got {describe_value(data)}"))
    if issues:
        raise ConfigError(issues)
    return data


def _no_duplicates(pairs: list[tuple[str, Any]], duplicates: list[str]) -> dict:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            duplicates.append(key)
        out[key] = value
    return out


def validate_section(model: type[M], data: Any, path: str, notes: list | None = None,
                     strict: bool = False) -> tuple[M | None, list[ConfigIssue]]:
    """Validate `data` against a section class; issues carry JSON paths under `path`.

    Used for the whole config (path "") and by trident.optim for `optimizer.params` and
    `scheduler.params`. Returns (None, issues) when anything is wrong. With `notes` (a list),
    comment keys and unknown top-level keys with no close match are accepted and recorded there
    (DeepSpeed ignores them) unless `strict`.
    """
    if not isinstance(data, dict):
        return None, [ConfigIssue(path or ROOT, f"expected an object {{...}}, got {describe_value(data)}")]
    issues: list[ConfigIssue] = []
    cleaned = _check_keys(data, model, path, issues, notes, strict)
    try:
        obj = model.model_validate(cleaned)
    except ValidationError as err:
        return None, issues + issues_from_validation_error(err, model, cleaned, path)
    return (None, issues) if issues else (obj, [])


def _check_keys(data: dict, model: type[BaseModel], path: str, issues: list[ConfigIssue],
                notes: list | None = None, strict: bool = False) -> dict:
    """`data` with aliases renamed and unknown keys dropped (each reported); sections recursed."""
    out: dict[str, Any] = {}
    fields = model.model_fields
    dialect = registered_dialect()
    unimplemented, template = dialect.unimplemented.get(path, (frozenset(), ""))
    for key, value in data.items():
        key = str(key)
        full = join_path(path, key)
        if full in dialect.aliases:
            new = dialect.aliases[full]
            if new in data:
                issues.append(ConfigIssue(full, f"`{full}` is the old name of `{join_path(path, new)}` and both "
                                                "are given; keep only the new one"))
                continue
            if full not in dialect.synonyms:
                warn_deprecated(full, join_path(path, new), stacklevel=4)
            key, full = new, join_path(path, new)
        if key not in fields:
            if key in unimplemented:
                issues.append(ConfigIssue(full, template.format(path=full)))
            elif notes is not None and _tolerated(key, path, fields):
                if strict:
                    issues.append(ConfigIssue(full, "unknown key, an error because \"strict\" is true; remove it "
                                                    "(without strict it would be ignored with a warning, as "
                                                    "DeepSpeed ignores it)"))
                else:
                    notes.append(Note(full, "unknown", "comment" if is_comment_key(key) else "unknown"))
            else:
                issues.append(ConfigIssue(full, unknown_name_message("key", key, fields)))
            continue
        sub = section_type(fields[key].annotation)
        out[key] = _check_keys(value, sub, full, issues, notes, strict) \
            if sub is not None and isinstance(value, dict) else value
    return out


TYPO_CUTOFF = 0.75
"""An unknown top-level key at least this similar to a known one (difflib's ratio), or a known
key cut short or lengthened, is a typo and an error; otherwise it is taken for a project's own
key and ignored, as DeepSpeed does."""


def _tolerated(key: str, path: str, fields: dict) -> bool:
    """Comment keys anywhere, and top-level keys that are not near-misses of a known key (inside a
    section DeepSpeed, like trident, rejects unknown keys)."""
    if is_comment_key(key):
        return True
    if path != "":
        return False
    low = key.lower()
    if any(low == f.lower() or (len(low) >= 5 and (f.startswith(low) or low.startswith(f))) for f in fields):
        return False  # a different case, or a truncated or extended known key
    return not difflib.get_close_matches(key, list(fields), n=1, cutoff=TYPO_CUTOFF)


def warn_deprecated(old: str, new: str, stacklevel: int) -> None:
    """Warn once per process that config key `old` is deprecated in favour of `new` (the loader's
    renamed aliases and a dialect's legacy names share the one set of keys already warned about).
    `stacklevel` counts from the caller of this function."""
    if old not in _warned_aliases:
        _warned_aliases.add(old)
        warnings.warn(f"config key `{old}` is deprecated; write `{new}` instead", FutureWarning,
                      stacklevel=stacklevel + 1)


def _typed_section_issues(data: dict) -> list[ConfigIssue]:
    """Type and params of the optimizer and scheduler sections, if they are well-formed objects."""
    issues = []
    for key in TYPED_SECTIONS:
        section = data.get(key)
        if isinstance(section, dict) and isinstance(section.get("type"), str) \
                and isinstance(section.get("params", {}), dict):
            issues += _rules(key).check(section["type"], section.get("params", {}))
    return issues


def _resolve_typed_sections(cfg: TridentConfig) -> TridentConfig:
    update = {key: _rules(key).resolve(section) for key in TYPED_SECTIONS
              if (section := getattr(cfg, key)) is not None}
    return cfg.model_copy(update=update) if update else cfg


_model_presets: Callable[[], Collection[str]] | None = None


def register_model_presets(names: Callable[[], Collection[str]]) -> None:
    """Make `load_config` check `model.preset` against `names()`, called only when a config sets
    one. The models are above config, so they are registered from above (`import trident` does)."""
    global _model_presets
    _model_presets = names


def _preset_issues(cfg: TridentConfig) -> list[ConfigIssue]:
    """`model.preset` names one of the registered presets (trident.models.gpt.GPT_PRESETS)."""
    if cfg.model.preset is None:
        return []
    if _model_presets is None:
        raise RuntimeError("no model presets are registered to check `model.preset` against; `import trident` "
                           "before loading a config")
    presets = _model_presets()
    if cfg.model.preset in presets:
        return []
    return [ConfigIssue("model.preset", unknown_name_message("preset", cfg.model.preset, presets, name_word=True))]
