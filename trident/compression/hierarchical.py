"""ZeRO++ qgZ: a reduce-scatter of quantized gradients in two all-to-all hops, inside the node
first, then across nodes.

The data-parallel group of N = nodes x L ranks is numbered node by node: rank r sits on node
r // L at local index r % L. A bucket arrives as [N, W] rows, row r holding this rank's
contribution to rank r's shard. Rank r must end with the sum of row r over all N ranks.

1. Inside the node: the rows meant for local index j on every node ({n L + j}) go to local
   peer j, quantized (int4 blocks, one scale per block). Each rank now holds, from each of its
   L peers, the rows of the ranks that share its local index, and adds them: [nodes, W]
   partial sums, one per node.
2. Across nodes: among the ranks with the same local index (one per node), partial n goes to
   node n, quantized again; each rank adds what the nodes sent: the sum of its row.

Only step 2 crosses nodes, and it carries one int4 row per node instead of the N fp16/bf16
rows a flat reduce-scatter sends: the ZeRO++ paper's cut of cross-node gradient bytes. The
sums are taken in fp32 on dequantized values. Each hop's error is at most half a quantization
step of its block (`trident.compression.quantize`); the test bounds the total from the inputs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trident.comm import collectives
from trident.comm.logger import CommsLogger
from trident.compression.quantize import GRADIENTS, BlockQuantizer


class HierarchicalReduceScatter:
    """Quantized two-hop reduce-scatter over `intra` (the L ranks of this node, group rank =
    local index) and `inter` (the ranks with this local index on every node, group rank =
    node). Either may be None when its size is 1."""

    def __init__(self, intra: dist.ProcessGroup | None, inter: dist.ProcessGroup | None, local: int, nodes: int,
                 logger: CommsLogger | None = None, quantizer: BlockQuantizer = GRADIENTS) -> None:
        self.intra, self.inter, self.local, self.nodes = intra, inter, local, nodes
        self.logger, self.quantizer = logger, quantizer

    def launch(self, out: torch.Tensor, rows: torch.Tensor) -> "_TwoHops":
        """Start reducing `rows` ([nodes x local, W]) into `out` ([W]); `.wait()` finishes."""
        width = rows.shape[1]
        if rows.shape[0] != self.nodes * self.local:
            raise ValueError(f"qgZ expects {self.nodes} x {self.local} rows, got {rows.shape[0]}")
        hop = _TwoHops(self, out, width)
        if self.local == 1:
            hop.partials = rows.float()
            return hop
        # rows meant for local peer j, for every node, side by side: [local, nodes, W]
        by_peer = rows.view(self.nodes, self.local, width).transpose(0, 1).reshape(-1, width)
        send = self.quantizer.quantize(by_peer)
        hop.received = torch.empty_like(send)
        hop.handle = collectives.all_to_all(hop.received, send, group=self.intra, async_op=True,
                                            logger=self.logger)
        hop.sent = send
        return hop


class _TwoHops:
    """A qgZ reduction in flight: the intra-node hop is asynchronous, `wait` runs the rest."""

    def __init__(self, owner: HierarchicalReduceScatter, out: torch.Tensor, width: int) -> None:
        self.owner, self.out, self.width = owner, out, width
        self.handle = self.received = self.sent = self.partials = None
        self.done = False

    def wait(self) -> bool:
        if self.done:
            return True
        o, q, w = self.owner, self.owner.quantizer, self.width
        if self.handle is not None:
            self.handle.wait()
            peers = q.dequantize(self.received, w).view(o.local, o.nodes, w)
            self.partials = peers.sum(dim=0)  # [nodes, W]: this node's sum of each node's row
            self.received = self.sent = None
        if o.nodes == 1:
            self.out.copy_(self.partials.view(-1))
        else:
            send = q.quantize(self.partials)
            received = torch.empty_like(send)
            collectives.all_to_all(received, send, group=o.inter, logger=o.logger)
            self.out.copy_(q.dequantize(received, w).sum(dim=0))
        self.partials, self.done = None, True
        return True
