"""Context parallelism: every sequence split over the `cp` mesh axis (ring attention, Ulysses).

    layout.py     which chunks of a sequence a cp rank holds (load-balanced zigzag), the loss
    ring.py       ring attention: key/value blocks around the ring, log-sum-exp merge, ring backward
    ulysses.py    all-to-all between sequence shards and head shards
    attention.py  `attention(q, k, v, causal=..., doc_ids=...)`, the one call a model makes
    apply.py      `apply_context_parallel`: what `trident.initialize` does for `context_parallel`
"""

from trident.context_parallel.apply import apply_context_parallel, shard_batch
from trident.context_parallel.attention import attention, bind, current, using
from trident.context_parallel.layout import METHODS, ContextParallel

__all__ = ["METHODS", "ContextParallel", "apply_context_parallel", "attention", "bind", "current", "shard_batch",
           "using"]
