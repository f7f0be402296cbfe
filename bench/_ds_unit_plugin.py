"""pytest plugin (`-p _ds_unit_plugin`, bench/ on the path) for DeepSpeed's own tests/unit, harness unmodified.

With TRIDENT_DS_SWITCH=1 it turns trident's switch on before collection; always it deselects
tests that need more than 2 ranks (a class `world_size` above 2, or a list with one)."""

import os

if os.environ.get("TRIDENT_DS_SWITCH") == "1":
    import trident

    trident.install_as_deepspeed()


def _world(item) -> int:
    size = getattr(getattr(item, "cls", None), "world_size", 1)
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "world_size" in callspec.params:
        size = callspec.params["world_size"]
    return max(size) if isinstance(size, (list, tuple)) else int(size)


def pytest_collection_modifyitems(config, items):
    kept = [i for i in items if _world(i) <= 2]
    dropped = [i for i in items if _world(i) > 2]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
