"""`deepspeed.ops.op_builder`: every `XBuilder` answers as a DeepSpeed build without compiled ops.

trident's kernels are torch code, so no builder is compatible and `load()` raises trident's
named error saying what to use instead (the `deepspeed.ops` optimizers run without a build)."""

from __future__ import annotations

from trident.deepspeed.engine.surface import NotInTrident


class OpBuilder:
    """One DeepSpeed op builder; `NAME` is the op's name as DeepSpeed spells it."""

    NAME = "op"

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.name}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        return False

    def load(self, verbose: bool = False):
        raise NotInTrident(
            f"deepspeed.ops.op_builder: {type(self).__name__}.load(): trident builds no compiled ops; "
            f"use the optimizers in deepspeed.ops (torch code, nothing to build)")

    def builder(self):
        return self.load()


def __getattr__(name: str):
    """`from deepspeed.ops.op_builder import AnyBuilder` gives a builder class named so."""
    if name.endswith("Builder") and name != "Builder":
        op = name[: -len("Builder")].lower() or "op"
        cls = type(name, (OpBuilder,), {"NAME": op, "__module__": __name__})
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
