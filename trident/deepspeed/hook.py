"""`import deepspeed` and every `from deepspeed.x import y`, resolved to trident.

A finder on `sys.meta_path` (put there when `trident` is imported; it costs nothing until a
`deepspeed...` import misses `sys.modules`) answers for the `deepspeed` package and its modules
in two cases:

- the importing code bound trident as DeepSpeed (`import trident as deepspeed`, then
  `from deepspeed.pipe import PipelineModule`): the frame that runs the import has `deepspeed`
  naming the trident package, so `deepspeed` there means trident, whatever else is installed;
- the switch is on: `trident.install_as_deepspeed()` (notebooks), or `trident launch
  --as-deepspeed` (every rank), and DeepSpeed itself is not installed; then an unmodified
  DeepSpeed script runs as it is.

Once `deepspeed` is trident in `sys.modules`, all of its submodules are too. Each DeepSpeed
module is the trident module that carries its names (`MODULES`); the module object is shared,
never loaded twice. A DeepSpeed module with no counterpart here is a `ModuleNotFoundError`
naming it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import FrameType, ModuleType

MODULES: dict[str, str] = {
    "deepspeed": "trident",
    "deepspeed.comm": "trident.comm",
    "deepspeed.pipe": "trident.pipe",
    "deepspeed.ops": "trident.ops",
    "deepspeed.utils": "trident.utils",
    "deepspeed.zero": "trident.zero",
    "deepspeed.checkpointing": "trident.checkpointing",
    "deepspeed.checkpoint": "trident.deepspeed.ds_checkpoint",
    "deepspeed.moe": "trident.moe",
    "deepspeed.accelerator": "trident.deepspeed.accelerator",
    "deepspeed.runtime": "trident.deepspeed.runtime",
    "deepspeed.profiling": "trident.profiling",
    "deepspeed.git_version_info": "trident.deepspeed.git_version_info",
}
"""DeepSpeed's module -> the trident module standing in for it; a module below one of these
(`deepspeed.runtime.pipe.module`) is the same path below its counterpart."""

_switched_on = False


def target_of(fullname: str) -> str:
    """The trident module standing in for DeepSpeed module `fullname` (raises NotInTridentModule, a ModuleNotFoundError)."""
    parts = fullname.split(".")
    for cut in range(len(parts), 0, -1):
        base = MODULES.get(".".join(parts[:cut]))
        if base is not None:
            target = ".".join([base, *parts[cut:]])
            if cut == len(parts) or importlib.util.find_spec(target) is not None:
                return target
            break
    from trident.deepspeed.errors import NotInTridentModule

    raise NotInTridentModule(
        f"No module named {fullname!r}: trident stands in for DeepSpeed here (import trident as deepspeed, "
        f"trident launch --as-deepspeed or trident.install_as_deepspeed()) and has no counterpart of it; "
        f"see README.md, \"Coming from DeepSpeed\", for what a DeepSpeed script can import", name=fullname)


class _Alias(importlib.abc.Loader):
    """Gives the import system an existing trident module under a DeepSpeed name."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._spec = None

    def create_module(self, spec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec  # the import system set the alias's spec: keep the module's own


class DeepSpeedFinder(importlib.abc.MetaPathFinder):
    """Resolves `deepspeed` imports to trident when the importing code means trident (see module doc)."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        if not self._means_trident():
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(target_of(fullname)))

    def _means_trident(self) -> bool:
        trident = sys.modules.get("trident")
        if trident is None:
            return False
        if sys.modules.get("deepspeed") is trident or _switched_on:
            return True
        frame = _importing_frame()
        return frame is not None and (frame.f_globals.get("deepspeed") is trident
                                      or frame.f_locals.get("deepspeed") is trident)


def _importing_frame() -> FrameType | None:
    """The first frame outside the import machinery and this module: the code running `import`."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen importlib")
                                 or frame.f_code.co_filename == __file__
                                 or frame.f_globals.get("__name__", "").startswith("importlib")):
        frame = frame.f_back
    return frame


_FINDER = DeepSpeedFinder()


def register_finder() -> None:
    """Put the finder first on `sys.meta_path` (once); `import trident` does this."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def deepspeed_installed() -> bool:
    """DeepSpeed itself is importable (looked up past this finder)."""
    if isinstance(sys.modules.get("deepspeed"), ModuleType) and sys.modules["deepspeed"] is not sys.modules.get(
            "trident"):
        return True
    return any(finder is not _FINDER and getattr(finder, "find_spec", None) is not None
               and finder.find_spec("deepspeed", None) is not None
               for finder in sys.meta_path if hasattr(finder, "find_spec"))


def install_as_deepspeed(force: bool = False) -> bool:
    """Make `import deepspeed` (and every `from deepspeed.x import y`) give trident in this process.

    Does nothing, with a warning, when DeepSpeed itself is installed (its own package then keeps
    its name) unless `force`. Returns whether the switch is on."""
    global _switched_on
    register_finder()
    if not force and deepspeed_installed():
        warnings.warn("trident.install_as_deepspeed(): DeepSpeed itself is installed, so `import deepspeed` keeps "
                      "importing it; pass force=True to use trident under its name anyway, or write "
                      "`import trident as deepspeed`", RuntimeWarning, stacklevel=2)
        return False
    _switched_on = True
    return True
