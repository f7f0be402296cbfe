"""`trident.zero.Init` and transformers' weight initialisation.

A transformers model initialises its weights in `post_init()`, at the end of the outermost
`__init__` (`PreTrainedModel._initialize_weights(module)` on every module, then
`tie_weights`). Under `zero.Init` every submodule has been partitioned by then, so the
initialisers would write into empty tensors: the model would silently keep torch's default
init (and an embedding with a `padding_idx` would fail to index its empty weight).
`patch_transformers` makes `_initialize_weights` gather the module's parameters (and its
direct children's, which some `_init_weights` touch, e.g. GPT-2's `c_proj`) whole for the
call and partition them again afterwards: at most one module's parameters are whole at a
time. Every rank runs the initialiser with the same random state (as `Init` requires), so
the result equals the model built without `Init`; rank 0's values are broadcast anyway, so
the shards always agree.

The patch registers itself with `trident.zero.init.register_init_hook` when this module is
imported (`trident.hf` imports it, and `import trident` imports that): `zero` knows no
transformers.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable

from trident.zero.init import GatheredParameters, register_init_hook


def patch_transformers() -> Callable[[], None] | None:
    """Patch transformers (if it is imported) for `zero.Init`; returns the undo function, or None."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:  # a transformers without it: nothing to patch
        return None
    original = PreTrainedModel.__dict__.get("_initialize_weights")
    if original is None or getattr(original, "_trident_wrapped", False):
        return None

    @functools.wraps(original)
    def _initialize_weights(self, module, is_custom_code: bool = False):
        if getattr(module, "_is_hf_initialized", False):
            return original(self, module, is_custom_code)
        params = partitioned_params(module, PreTrainedModel)
        if not params:
            return original(self, module, is_custom_code)
        with GatheredParameters(params, modifier_rank=0):
            return original(self, module, is_custom_code)

    _initialize_weights._trident_wrapped = True
    PreTrainedModel._initialize_weights = _initialize_weights

    def undo() -> None:
        PreTrainedModel._initialize_weights = original
    return undo


def partitioned_params(module, pretrained_cls) -> list:
    """`module`'s own `Init`-partitioned parameters and its direct children's (not those of a
    child that is a model of its own: it initialises itself)."""
    params = list(module.parameters(recurse=False))
    for child in module.children():
        if not isinstance(child, pretrained_cls):
            params.extend(child.parameters(recurse=False))
    seen, out = set(), []
    for p in params:
        if hasattr(p, "_trident_shard") and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


register_init_hook(patch_transformers)
