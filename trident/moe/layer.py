"""`MoE`: a mixture-of-experts layer with DeepSpeed's `deepspeed.moe.layer.MoE` arguments.

    x [.., hidden] -> router (gate.wg, fp32) -> top-k with capacity (trident.moe.routing)
      -> dispatch all-to-all over ep -> local experts -> combine all-to-all -> weighted sum

Returns `(output, aux_loss, expert_counts)` as DeepSpeed does: `aux_loss` = aux_loss_coef x
load-balancing loss + z_loss_coef x router z-loss (add it to the training loss), and
`expert_counts` this rank's choices per expert before dropping (a CPU long tensor).

Experts are built whole and then cut: `expert` is copied `num_experts` times and every copy's
`reset_parameters()` is called in global expert order, so every rank draws the same numbers
and expert e has the same initial weights whatever the ep size (and differs from expert e').
A rank keeps experts [ep_rank x E/ep, (ep_rank + 1) x E/ep), stored under their *global*
index (`experts.3.fc.weight` is expert 3 on any layout), which is what lets a checkpoint
written at one ep size load at another. Their parameters are marked `expert_parallel = True`:
the mesh then reduces their gradients over dp x cp only (`ParallelMesh.gradient_axes`).
"""

from __future__ import annotations

import copy
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from trident.comm.logger import CommsLogger
import trident.moe.routing as routing
from trident.moe.dispatch import all_to_all_rows, gather_counts
from trident.parallel.mesh import DENSE_GRADIENT_AXES
from trident.parallel.rng import unit_seed

JITTER_EPS = 1e-2  # DeepSpeed's 'Jitter' policy: inputs to the router times U(1 - eps, 1 + eps)


def _reset(module: nn.Module) -> None:
    """Draw fresh initial values for every layer of `module` that knows how (nn.Linear etc.)."""
    for m in module.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()


class Router(nn.Module):
    """DeepSpeed's TopKGate weights: one linear map hidden -> experts, no bias, run in fp32."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.wg = nn.Linear(hidden_size, num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.float(), self.wg.weight.float())


class Experts(nn.ModuleDict):
    """This rank's experts, keyed by global expert index (`experts.<e>.*`); `expert(e)` by index."""

    def __init__(self, experts: dict[int, nn.Module]) -> None:
        super().__init__({str(e): m for e, m in sorted(experts.items())})
        self.first = min(experts)
        for p in self.parameters():
            p.expert_parallel = True

    def expert(self, e: int) -> nn.Module:
        return self[str(e)]


class MoE(nn.Module):
    """Mixture of experts over the `ep` axis of `mesh` (DeepSpeed's argument names).

    `ep_size` must equal mesh.ep_size when a mesh is given; without one it must be 1 (the
    layer then holds every expert). `drop_tokens=False` is dropless: every choice is kept and
    expert batches have whatever size the router gives them. `noisy_gate_policy='Jitter'`
    multiplies the router's input by U(1 - 0.01, 1 + 0.01) in training, drawn for the whole
    token set from a stream seeded with (`seed`, `name`), so every layout draws the same noise.
    `use_rts` and `use_tutel` are DeepSpeed options trident does not have (must be False).
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Literal["Jitter"] | None = None,
                 drop_tokens: bool = True, use_rts: bool = False, use_tutel: bool = False, *,
                 mesh=None, aux_loss_coef: float = 1.0, z_loss_coef: float = 0.0, seed: int = 0,
                 name: str = "moe", logger: CommsLogger | None = None) -> None:
        super().__init__()
        check_moe_args(num_experts, ep_size, k, capacity_factor, eval_capacity_factor, min_capacity,
                       noisy_gate_policy, use_rts, use_tutel)
        if mesh is not None and mesh.ep_size != ep_size:
            raise ValueError(f"MoE: ep_size={ep_size} but the mesh has ep={mesh.ep_size}; pass ep_size=mesh.ep_size")
        if mesh is None and ep_size != 1:
            raise ValueError(f"MoE: ep_size={ep_size} needs mesh=<ParallelMesh with ep={ep_size}> (trident keeps no "
                             "global process groups)")
        self.hidden_size, self.num_experts, self.k = hidden_size, num_experts, k
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity, self.drop_tokens = min_capacity, drop_tokens
        self.noisy_gate_policy, self.aux_loss_coef, self.z_loss_coef = noisy_gate_policy, aux_loss_coef, z_loss_coef
        self.gate = Router(hidden_size, num_experts)
        copies = {}
        for e in range(num_experts):
            copies[e] = copy.deepcopy(expert)
            _reset(copies[e])
        self.experts = Experts(copies)
        self.mlp = self.coefficient = None
        if use_residual:  # PR-MoE: a dense expert beside the routed ones, mixed per token
            self.mlp = copy.deepcopy(expert)
            self.coefficient = nn.Linear(hidden_size, 2)
        self._noise = torch.Generator().manual_seed(unit_seed(seed, name, 0)) if noisy_gate_policy else None
        self.ep_size, self.ep_group, self.token_group, self.logger = 1, None, None, logger
        self.last_routing: routing.Routing | None = None
        if mesh is not None:
            self.shard(mesh, logger)

    # -- expert parallelism ----------------------------------------------------------------

    def shard(self, mesh, logger: CommsLogger | None = None) -> None:
        """Keep this ep rank's experts and route over `mesh` from now on (before the optimizer)."""
        ep = mesh.ep_size
        if self.num_experts % ep:
            raise ValueError(f"MoE: num_experts={self.num_experts} is not divisible by expert_parallel.size={ep}; "
                             f"each ep rank holds num_experts / ep experts, so choose a multiple of {ep}")
        if len(self.experts) != self.num_experts:
            raise ValueError("MoE.shard: the layer is already expert-parallel")
        per = self.num_experts // ep
        first = mesh.ep_rank * per
        self.experts = Experts({e: self.experts.expert(e) for e in range(first, first + per)})
        self.ep_size = ep
        self.ep_group = mesh.ep_group
        self.token_group = mesh.group(*DENSE_GRADIENT_AXES)
        self.logger = logger if logger is not None else self.logger

    # -- forward ---------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        if used_token is not None:
            raise ValueError("MoE: used_token is not supported; mask tokens in the loss instead")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_size)
        me = dist.get_rank(self.token_group) if self.token_group is not None else 0
        group_size = dist.get_world_size(self.token_group) if self.token_group is not None else 1
        router_in = x
        if self._noise is not None and self.training:
            noise = torch.empty(group_size * x.shape[0], x.shape[1]).uniform_(
                1.0 - JITTER_EPS, 1.0 + JITTER_EPS, generator=self._noise)
            router_in = x * noise[me * x.shape[0]:(me + 1) * x.shape[0]].to(x)
        logits = self.gate(router_in)
        gates, indices = routing.top_k(logits, self.k)
        local = routing.choice_counts(indices, self.num_experts)
        counts = gather_counts(local, self.token_group)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        cap = (routing.capacity(group_size * x.shape[0], self.num_experts, self.k, factor, self.min_capacity)
               if self.drop_tokens else None)
        r = routing.route(logits, gates, indices, counts, me, cap)
        self.last_routing = r
        out = self._experts_forward(x, r, me)
        if self.mlp is not None:
            coef = torch.softmax(self.coefficient(x), dim=-1)
            out = out * coef[:, 0:1] + self.mlp(x) * coef[:, 1:2]
        aux = self.aux_loss_coef * r.l_aux + self.z_loss_coef * r.l_z
        return out.reshape(shape), aux, local.sum(0).cpu()

    def _experts_forward(self, x: torch.Tensor, r: routing.Routing, me: int) -> torch.Tensor:
        """Dispatch the kept assignments, run the local experts, combine (see trident.moe.dispatch)."""
        ep, per = self.ep_size, len(self.experts)
        first = self.experts.first
        base = me - (me % ep)  # token-group index of ep rank 0 of this rank's ep group
        rows = x.index_select(0, r.tokens)
        mine = r.kept[base:base + ep, first:first + per]                  # [ep sources, local experts]
        send = r.kept[me].view(ep, per).sum(1).tolist()
        recv = mine.sum(1).tolist()
        received = all_to_all_rows(rows, send, recv, self.ep_group, self.logger)
        pieces = received.split(mine.reshape(-1).tolist())
        outputs = []
        for local in range(per):
            batch = torch.cat([pieces[s * per + local] for s in range(ep)]) if ep > 1 else pieces[local]
            outputs.append(self.experts.expert(first + local)(batch).split(mine[:, local].tolist()))
        back_rows = torch.cat([outputs[local][s] for s in range(ep) for local in range(per)])
        back = all_to_all_rows(back_rows, recv, send, self.ep_group, self.logger)
        weighted = back * r.weights.to(back.dtype).unsqueeze(1)
        return torch.zeros_like(x).index_add(0, r.tokens, weighted)

    # -- statistics ------------------------------------------------------------------------

    def load_stats(self) -> dict[str, object]:
        """The last forward's routing over the whole token set: choices per expert (before
        dropping), kept assignments per expert, and the dropped share of all choices."""
        r = self.last_routing
        if r is None:
            return {}
        chosen = r.counts.sum((0, 1))
        kept = r.kept.sum(0)
        total = int(chosen.sum())
        return {"chosen": chosen.tolist(), "kept": kept.tolist(),
                "dropped_share": (total - int(kept.sum())) / max(total, 1)}


def check_moe_args(num_experts: int, ep_size: int, k: int, capacity_factor: float, eval_capacity_factor: float,
                   min_capacity: int, noisy_gate_policy=None, use_rts: bool = False, use_tutel: bool = False) -> None:
    """One clear error per bad argument."""
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"MoE: num_experts must be a positive integer, got {num_experts!r}")
    if not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"MoE: ep_size must be a positive integer, got {ep_size!r}")
    if num_experts % ep_size:
        raise ValueError(f"MoE: num_experts={num_experts} is not divisible by ep_size={ep_size}; each ep rank holds "
                         f"num_experts / ep_size experts, so choose a multiple of {ep_size}")
    if not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ValueError(f"MoE: k={k!r} must be an integer in [1, num_experts={num_experts}]: each token picks k "
                         "distinct experts")
    for key, value in (("capacity_factor", capacity_factor), ("eval_capacity_factor", eval_capacity_factor)):
        if not value > 0:
            raise ValueError(f"MoE: {key}={value!r} must be > 0 (slots per expert = ceil(tokens / experts x "
                             f"{key} x k)); use drop_tokens=False to keep every token")
    if not isinstance(min_capacity, int) or min_capacity < 0:
        raise ValueError(f"MoE: min_capacity must be a non-negative integer, got {min_capacity!r}")
    if noisy_gate_policy not in (None, "Jitter"):
        raise ValueError(f"MoE: noisy_gate_policy={noisy_gate_policy!r}: trident has None and 'Jitter' "
                         "(DeepSpeed's 'RSample' is not implemented)")
    if use_rts or use_tutel:
        raise ValueError("MoE: use_rts and use_tutel are DeepSpeed options trident does not implement; set them "
                         "to False (trident's priority order is deterministic, see trident.moe.routing)")
