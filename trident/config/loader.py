"""JSON (or a dict) -> `TridentConfig`, with every problem reported at once.

The steps, each adding to one list of issues:

  1. read the file (a syntax error names the file, line and column);
  2. walk the keys against the schema: deprecated aliases are renamed (warned once), real
     DeepSpeed keys trident lacks get a specific message, other unknown keys a "did you mean";
  3. let pydantic check types and ranges, translated into JSON paths and plain messages;
  4. check `optimizer` and `scheduler` type and params with trident.optim's own rules, and fill
     in their defaults so the resolved config shows what will actually run.

Any issue raises one `ConfigError` listing them all.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from trident.config.errors import (ROOT, ConfigError, ConfigIssue, describe_value, issues_from_validation_error,
                                   join_path, section_type, unknown_name_message)
from trident.config.schema import DEPRECATED_ALIASES, SYNONYMS, UNIMPLEMENTED_KEYS, TridentConfig

M = TypeVar("M", bound=BaseModel)

_warned_aliases: set[str] = set()


def load_config(source: str | os.PathLike | dict | TridentConfig) -> TridentConfig:
    """Parse a config from a JSON file path, a dict or an already parsed config.

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
    cfg, issues = validate_section(TridentConfig, data, "")
    issues += _optim_issues(data)
    if cfg is not None and not issues:
        issues += _preset_issues(cfg)
    if issues:
        raise ConfigError(sorted(issues, key=lambda i: i.path))
    return _resolve_optim(cfg)


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


def validate_section(model: type[M], data: Any, path: str) -> tuple[M | None, list[ConfigIssue]]:
    """Validate `data` against a section class; issues carry JSON paths under `path`.

    Used for the whole config (path "") and by trident.optim for `optimizer.params` and
    `scheduler.params`. Returns (None, issues) when anything is wrong.
    """
    if not isinstance(data, dict):
        return None, [ConfigIssue(path or ROOT, f"expected an object {{...}}, got {describe_value(data)}")]
    issues: list[ConfigIssue] = []
    cleaned = _check_keys(data, model, path, issues)
    try:
        obj = model.model_validate(cleaned)
    except ValidationError as err:
        return None, issues + issues_from_validation_error(err, model, cleaned, path)
    return (None, issues) if issues else (obj, [])


def _check_keys(data: dict, model: type[BaseModel], path: str, issues: list[ConfigIssue]) -> dict:
    """`data` with aliases renamed and unknown keys dropped (each reported); sections recursed."""
    out: dict[str, Any] = {}
    fields = model.model_fields
    unimplemented, template = UNIMPLEMENTED_KEYS.get(path, (frozenset(), ""))
    for key, value in data.items():
        key = str(key)
        full = join_path(path, key)
        if full in DEPRECATED_ALIASES:
            new = DEPRECATED_ALIASES[full]
            if new in data:
                issues.append(ConfigIssue(full, f"`{full}` is the old name of `{join_path(path, new)}` and both "
                                                "are given; keep only the new one"))
                continue
            if full not in SYNONYMS:
                _warn_alias(full, join_path(path, new))
            key, full = new, join_path(path, new)
        if key not in fields:
            if key in unimplemented:
                issues.append(ConfigIssue(full, template.format(path=full)))
            else:
                issues.append(ConfigIssue(full, unknown_name_message("key", key, fields)))
            continue
        sub = section_type(fields[key].annotation)
        out[key] = _check_keys(value, sub, full, issues) if sub is not None and isinstance(value, dict) else value
    return out


def _warn_alias(old: str, new: str) -> None:
    if old not in _warned_aliases:
        _warned_aliases.add(old)
        warnings.warn(f"config key `{old}` is deprecated; write `{new}` instead", FutureWarning, stacklevel=5)


def _optim_issues(data: dict) -> list[ConfigIssue]:
    """Type and params of the optimizer and scheduler sections, if they are well-formed objects."""
    # Imported here: trident.optim imports trident.config, so a top-level import would be circular.
    from trident.optim.factory import check_optimizer
    from trident.optim.schedulers import check_scheduler

    issues = []
    for key, check in (("optimizer", check_optimizer), ("scheduler", check_scheduler)):
        section = data.get(key)
        if isinstance(section, dict) and isinstance(section.get("type"), str) \
                and isinstance(section.get("params", {}), dict):
            issues += check(section["type"], section.get("params", {}))
    return issues


def _resolve_optim(cfg: TridentConfig) -> TridentConfig:
    from trident.optim.factory import resolve_optimizer_config
    from trident.optim.schedulers import resolve_scheduler_config

    update = {}
    if cfg.optimizer is not None:
        update["optimizer"] = resolve_optimizer_config(cfg.optimizer)
    if cfg.scheduler is not None:
        update["scheduler"] = resolve_scheduler_config(cfg.scheduler)
    return cfg.model_copy(update=update) if update else cfg


def _preset_issues(cfg: TridentConfig) -> list[ConfigIssue]:
    """`model.preset` names one of trident.models.gpt.GPT_PRESETS (imported only when set)."""
    if cfg.model.preset is None:
        return []
    from trident.models.gpt import GPT_PRESETS

    if cfg.model.preset in GPT_PRESETS:
        return []
    return [ConfigIssue("model.preset", unknown_name_message("preset", cfg.model.preset, GPT_PRESETS, name_word=True))]
