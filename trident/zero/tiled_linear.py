"""TiledLinear: one linear layer built from out_splits x in_splits smaller ones (DeepSpeed's class).

Under ZeRO-3 each tile is a module of its own, so its weight is one unit, gathered just before
the tile runs and released just after (trident.zero.stage3): the layer's gathered parameters
never exceed one tile, however large the whole weight. Set `stage3_prefetch_bucket_size` to 0
(and `stage3_max_reuse_distance` to 0) for that bound to hold strictly; prefetching gathers the
next tiles early by design.

Maths: y[:, o] = sum over input tiles i of x[:, i] @ W[o, i].T, plus the bias of output tile
o, which lives on its last input tile. The same as `nn.Linear` up to the order of the sums.
Tile boundaries split the features as evenly as possible, the first tiles one feature larger.
"""

from __future__ import annotations

import torch


def _bounds(features: int, splits: int) -> list[int]:
    size, extra = divmod(features, splits)
    bounds = [0]
    for part in range(splits):
        bounds.append(bounds[-1] + size + (part < extra))
    return bounds


def _check_splits(name: str, splits: int, features_name: str, features: int) -> None:
    if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= features:
        raise ValueError(f"TiledLinear: {name}={splits!r} must be an integer in [1, {features_name}={features}]; "
                         f"each tile needs at least one feature, so use at most {features} {name}")


class TiledLinear(torch.nn.Module):
    """`nn.Linear(in_features, out_features, bias)` as a grid of `linear_cls` tiles:
    `linears[o][i]` maps input features in_parts[i]:in_parts[i+1] to output features
    out_parts[o]:out_parts[o+1]. With `input_is_already_split` forward takes a list of
    in_splits inputs; with `combine_out_splits=False` it returns the out_splits outputs as a
    list. `init_linear` (an nn.Linear of the same shape) is copied into the tiles."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls=torch.nn.Linear, init_linear: torch.nn.Module | None = None, **kwargs) -> None:
        super().__init__()
        _check_splits("in_splits", in_splits, "in_features", in_features)
        _check_splits("out_splits", out_splits, "out_features", out_features)
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split, self.combine_out_splits = input_is_already_split, combine_out_splits
        self.in_parts = _bounds(in_features, in_splits)
        self.out_parts = _bounds(out_features, out_splits)
        self.linears = torch.nn.ModuleList()
        for o in range(out_splits):
            row = torch.nn.ModuleList()
            for i in range(in_splits):
                row.append(linear_cls(self.in_parts[i + 1] - self.in_parts[i], self.out_parts[o + 1] - self.out_parts[o],
                                      bias=bias and i == in_splits - 1, **kwargs))
            self.linears.append(row)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_):
        if self.input_is_already_split:
            inputs = list(input_)
            if len(inputs) != self.in_splits:
                raise ValueError(f"TiledLinear: input_is_already_split is set but forward got {len(inputs)} "
                                 f"inputs for in_splits={self.in_splits}")
        elif self.in_splits > 1:
            sizes = [b - a for a, b in zip(self.in_parts, self.in_parts[1:])]
            inputs = list(torch.split(input_, sizes, dim=-1))
        else:
            inputs = [input_]
        outputs = []
        for row in self.linears:
            total = None
            for tile, x in zip(row, inputs):
                y = tile(x)
                total = y.clone() if total is None else total + y  # clone: the sum must not be a view
            outputs.append(total)
        return torch.cat(outputs, dim=-1) if self.combine_out_splits else outputs

    @torch.no_grad()
    def copy_params_from(self, other: torch.nn.Module) -> None:
        """Copy `other`'s weight (out_features x in_features) and bias into the tiles. Under
        ZeRO-3 this is collective (each tile is gathered, written by dp rank 0, re-sharded)."""
        from trident.zero.init import GatheredParameters

        shape = (self.out_features, self.in_features)
        if tuple(other.weight.shape) != shape:
            raise ValueError(f"TiledLinear.copy_params_from: weight of shape {tuple(other.weight.shape)}, expected {shape}")
        if self.use_bias != (getattr(other, "bias", None) is not None):
            raise ValueError(f"TiledLinear.copy_params_from: this layer has bias={self.use_bias}, the source "
                             f"{'has' if not self.use_bias else 'has no'} bias")
        with GatheredParameters([other.weight] + ([other.bias] if self.use_bias else [])):
            for o, row in enumerate(self.linears):
                r0, r1 = self.out_parts[o], self.out_parts[o + 1]
                for i, tile in enumerate(row):
                    c0, c1 = self.in_parts[i], self.in_parts[i + 1]
                    params = [tile.weight] + ([tile.bias] if tile.bias is not None else [])
                    with GatheredParameters(params, modifier_rank=0):
                        tile.weight.copy_(other.weight[r0:r1, c0:c1])
                        if tile.bias is not None:
                            tile.bias.copy_(other.bias[r0:r1])
