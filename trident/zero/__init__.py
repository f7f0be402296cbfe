"""ZeRO: partitioned optimizer states (stage 1), gradients (stage 2) and parameters (stage 3).

Where things are: shard arithmetic in `partition`, stage 1's gradient path in `stage1`, the
reduce-scatter during backward (stages 2-3) in `stage2`, stage 3's gather/release hooks in
`stage3`, the sharded optimizer step and parameter sync in `optimizer`, `Init` and
`GatheredParameters` in `init`, ZeRO++'s switches in `zeropp`, `TiledLinear` in `tiled_linear`.
"""

from trident.zero.init import GatheredParameters, Init
from trident.zero.optimizer import ZeroOptimizer
from trident.zero.tiled_linear import TiledLinear

__all__ = ["GatheredParameters", "Init", "TiledLinear", "ZeroOptimizer"]
