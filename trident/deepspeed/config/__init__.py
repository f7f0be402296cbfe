"""DeepSpeed's config dialect (with the Hugging Face Trainer's `"auto"` values), read into
trident's own sections. Layer 0: it imports `trident.config`, never the other way.

Importing this package registers the dialect with `trident.config.dialect`, which is how
`load_config` / `trident.initialize` read a DeepSpeed config: `rules` (legacy names renamed,
keys with no effect dropped with a note, missing features refused) and `hf_auto` (an `"auto"`
left unfilled is an error naming what fills it) translate the raw config before the schema
sees it; `keys` names the aliases and unimplemented keys the schema walk meets. `import
trident` imports this package before anything can load a config.
"""

from __future__ import annotations

from trident.config.dialect import Dialect, register_dialect
from trident.config.errors import ConfigIssue
from trident.config.notes import Note, unknown_line
from trident.deepspeed.config import hf_auto, keys, rules, spellings
from trident.deepspeed.config.arguments import add_config_arguments
from trident.deepspeed.config.hf_auto import auto_paths, fill_auto, fill_from_run
from trident.deepspeed.config.rules import ignored_line, startup_lines


def translate(data: dict) -> tuple[dict, list[Note], list[ConfigIssue]]:
    """A raw DeepSpeed-dialect config -> (trident's sections, notes, issues): DeepSpeed's
    spellings (`spellings`: "bfp16", whole floats as integers, AutoTP's size), its rules,
    then every `"auto"` still unfilled reported (batch sizes aside: the schema reads those)."""
    data, spelled, early = spellings.translate(data, rules.top_level_keys())
    data, notes, issues = rules.translate(data)
    notes = spelled + notes
    return data, notes, early + issues + hf_auto.leftover_auto_issues(data, notes)


DEEPSPEED = Dialect(translate=translate, aliases=keys.DEPRECATED_ALIASES, synonyms=keys.SYNONYMS,
                    unimplemented=keys.UNIMPLEMENTED_KEYS, fill_auto=fill_auto, auto_paths=auto_paths)

register_dialect(DEEPSPEED)

__all__ = ["DEEPSPEED", "add_config_arguments", "auto_paths", "fill_auto", "fill_from_run", "ignored_line",
           "startup_lines", "translate", "unknown_line"]
