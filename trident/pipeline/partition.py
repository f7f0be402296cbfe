"""Which layers go to which stage: pure arithmetic on per-layer weights.

A partition of n layers into p parts is the list of p + 1 boundaries `[0, b1, ..., n]`;
part i holds layers `b_i .. b_{i+1} - 1`, and every part holds at least one layer.

Methods (the `partition_method` of `PipelineModule` and of the config's `pipeline` section):

    "parameters"   balance the trainable parameter count of each part
    "uniform"      balance the number of layers (the first n % p parts get one more)
    "type:REGEX"   balance the number of layers whose class name matches REGEX
                   (case-insensitive search), e.g. "type:Block" for transformer blocks

Balancing minimises the heaviest part and, among partitions that achieve it, the sum of
squared part weights (the most even spread); remaining ties give earlier parts more layers, as
"uniform" does. It is exact dynamic programming, O(p n^2) in time.
"""

from __future__ import annotations

import re
from typing import Sequence

METHODS = ("parameters", "uniform", "type:REGEX")


def partition_uniform(num_layers: int, num_parts: int) -> list[int]:
    """Boundaries of `num_parts` runs of layers whose lengths differ by at most one."""
    _check_counts(num_layers, num_parts)
    size, extra = divmod(num_layers, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + size + (part < extra))
    return bounds


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries minimising the heaviest part, then the spread (see the module docstring)."""
    n = len(weights)
    _check_counts(n, num_parts)
    if any(w < 0 for w in weights):
        raise ValueError(f"layer weights must be >= 0, got {list(weights)}")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = (float("inf"), float("inf"))
    # best[k][i]: (heaviest part, sum of squares) splitting the first i layers into k parts
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(i - 1, k - 2, -1):  # latest cut first: ties keep earlier parts larger
                prev = best[k - 1][j]
                if prev == inf:
                    continue
                part = prefix[i] - prefix[j]
                cand = (max(prev[0], part), prev[1] + part * part)
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    bounds = [n]
    for k in range(num_parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def layer_type_name(layer: object) -> str:
    """The class name a "type:REGEX" partition matches: a spec's class, a module's, a function's name."""
    typename = getattr(layer, "typename", None)
    if typename is not None:
        return typename.__name__
    if isinstance(layer, type):
        return layer.__name__
    return getattr(layer, "__name__", None) or type(layer).__name__


def partition_layers(method: str, num_parts: int, names: Sequence[str],
                     param_counts: Sequence[int] | None = None) -> list[int]:
    """Boundaries for `method` over layers with class names `names` (and parameter counts).

    `param_counts` is needed by "parameters" only.
    """
    if method == "uniform":
        return partition_uniform(len(names), num_parts)
    if method == "parameters":
        if param_counts is None:
            raise ValueError('partition_method "parameters" needs the parameter count of every layer')
        if not any(param_counts):
            raise ValueError('partition_method "parameters" cannot balance layers that have no parameters; '
                             'use "uniform" or "type:REGEX"')
        return partition_balanced(param_counts, num_parts)
    if method.startswith("type:"):
        pattern = method[len("type:"):]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as err:
            raise ValueError(f'partition_method "{method}": {pattern!r} is not a valid regular expression '
                             f'({err}); write e.g. "type:Block"') from None
        weights = [1 if regex.search(name) else 0 for name in names]
        if not any(weights):
            raise ValueError(f'partition_method "{method}" matches none of the layer classes '
                             f'{sorted(set(names))}; pick a pattern that matches the layers to balance')
        return partition_balanced(weights, num_parts)
    raise ValueError(f"partition_method {method!r} is unknown; use one of {', '.join(METHODS)}")


def _check_counts(num_layers: int, num_parts: int) -> None:
    if isinstance(num_parts, bool) or not isinstance(num_parts, int) or num_parts < 1:
        raise ValueError(f"the number of parts must be a positive integer, got {num_parts!r}")
    if num_layers < num_parts:
        raise ValueError(f"cannot split {num_layers} layers into {num_parts} pipeline parts: every stage "
                         f"(and virtual stage) needs at least one layer; use fewer stages or more layers")
