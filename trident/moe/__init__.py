"""Mixture of experts with expert parallelism on the mesh's `ep` axis.

- `routing.py`: top-k gating, capacity and dropping in one global priority order, the
  load-balancing and z losses (pure tensor maths, no processes)
- `dispatch.py`: the autograd all-to-all pair that moves token rows to their experts and back
- `layer.py`: `MoE`, DeepSpeed's layer and argument names, returning (output, aux_loss, counts)
- `parallel.py`: cut a model built with every expert down to this ep rank's (`apply_expert_parallel`),
  tell expert parameters from dense ones, and report the routing (stats, monitor events, start-up line)
- `spec.py`: `MoESpec`, a model's MoE settings (the reference GPT's `GPTConfig.moe`)

See docs/moe.md for the semantics (capacity over the whole token set, priority order, losses).
"""

from trident.moe.layer import MoE, check_moe_args
from trident.moe.parallel import apply_expert_parallel, expert_stats, is_expert, moe_layers
from trident.moe.spec import MoESpec

__all__ = ["MoE", "MoESpec", "apply_expert_parallel", "check_moe_args", "expert_stats", "is_expert", "moe_layers"]
