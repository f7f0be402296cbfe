"""Process-group start-up, collectives over explicit groups, point-to-point, and their logger.

At this package's top level the collectives carry `deepspeed.comm`'s names and signatures
(re-exported from `trident.deepspeed.comm`, on this layer: `group=None` means every rank,
`all_gather` takes a list, ranks are global), so `import trident as deepspeed;
deepspeed.comm.all_reduce(t)` works. trident's own code calls `trident.comm.collectives` and
`trident.comm.p2p`, where the group is always named.
"""

from trident.comm.backend import DistEnv, default_device
from trident.comm.collectives import Handle, all_gather_list, all_to_all, gather, premul_sum, reduce_scatter, scatter
from trident.deepspeed.comm import (ReduceOp, all_gather, all_gather_into_tensor, all_reduce, all_to_all_single,
                                    allgather_fn, barrier, broadcast, comms_logger, configure, destroy_process_group,
                                    get_backend, get_global_rank, get_local_rank, get_rank, get_world_size,
                                    inference_all_reduce, init_distributed, irecv, is_available, is_initialized,
                                    isend, log_summary, new_group, recv, reduce, reduce_scatter_fn,
                                    reduce_scatter_tensor, send)
from trident.comm.logger import CommsLogger, OpStats
from trident.comm.p2p import P2POp, exchange

__all__ = [
    "CommsLogger", "DistEnv", "Handle", "OpStats", "P2POp", "ReduceOp", "all_gather", "all_gather_into_tensor",
    "all_gather_list", "all_reduce", "all_to_all", "all_to_all_single", "allgather_fn", "barrier", "broadcast",
    "comms_logger", "configure", "default_device", "destroy_process_group", "exchange", "gather", "get_backend",
    "get_global_rank", "get_local_rank", "get_rank", "get_world_size", "inference_all_reduce", "init_distributed",
    "irecv", "is_available", "is_initialized", "isend", "log_summary", "new_group", "premul_sum", "recv", "reduce",
    "reduce_scatter", "reduce_scatter_fn", "reduce_scatter_tensor", "scatter", "send",
]
