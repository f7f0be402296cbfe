"""Keys the loader accepted without using them, kept on the parsed config (`cfg._notes`).

A note is "unknown" (a top-level key with no close match, or a comment key: accepted as
DeepSpeed accepts them, an error under `strict`) or "ignored" (a key a registered dialect knows
and drops because it changes nothing here, with the reason). `trident.initialize` and
`trident config check` print them in at most two start-up lines.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Note:
    """A key the loader accepted without using: `kind` is "ignored" (a known key of a dialect,
    with no effect here) or "unknown" (no such key anywhere; DeepSpeed ignores it too)."""

    path: str
    kind: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path} ({self.reason})"


def is_comment_key(key: str) -> bool:
    """`_comment`, `_note`, `comment`: documentation inside a JSON file, as DeepSpeed configs write it."""
    return key.startswith("_") or key.lower() in ("comment", "comments")


def unknown_line(notes: list[Note]) -> str | None:
    """One line naming the unknown and comment keys (a warning: they may be typos of nothing)."""
    unknown = [n for n in notes if n.kind == "unknown"]
    if not unknown:
        return None
    return (f"config: {len(unknown)} unknown key(s) ignored, as DeepSpeed ignores them (\"strict\": true makes "
            "them errors): " + ", ".join(n.path for n in unknown))
