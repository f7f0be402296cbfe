"""Cross-entropy over logits split by vocabulary, without building the full logits anywhere.

Rank i holds logits z[:, i*V/tp : (i+1)*V/tp]. With m = max_k z_k, S = sum_k exp(z_k - m),
t = z_target - m and, for label smoothing eps over the V real classes, Z = sum_k (z_k - m):

    loss = (1 - eps) * (log S - t) + eps * (log S - Z / V)

m is combined with one all-reduce (MAX) and S, t, Z with one all-reduce (SUM) of three
numbers per row: forward sends 4 floats per row, never the [rows, V] logits. The gradient is
local and needs no message: d loss / d z_k = softmax_k - (1 - eps) [k = target] - eps / V.

Vocabulary padding follows Megatron-LM: the vocabulary may be padded to a multiple of tp
(VocabParallelEmbedding, ColumnParallelLinear(pad_vocab=True)); pass the real `vocab_size`
and the pad columns (at the end of the padded vocabulary) are excluded from the softmax, the
smoothing term and the gradient. Rows whose target is `ignore_index` add nothing and are not
counted in the mean, as in torch's cross_entropy. Computed in fp32 whatever the logits' dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trident.comm import collectives
from trident.comm.logger import CommsLogger

_REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_size, ignore_index, eps, logger):
        local_vocab = logits.shape[-1]
        vocab_start = dist.get_rank(group) * local_vocab
        valid = max(0, min(local_vocab, vocab_size - vocab_start))  # real (unpadded) columns held here
        z = logits.reshape(-1, local_vocab).float()
        if valid < local_vocab:
            z = z.clone()
            z[:, valid:] = float("-inf")
        t = targets.reshape(-1)
        ignored = t == ignore_index

        many = dist.get_world_size(group) > 1
        row_max = z.max(dim=-1).values
        if many:
            collectives.all_reduce(row_max, collectives.ReduceOp.MAX, group=group, logger=logger)
        shifted = z - row_max.unsqueeze(-1)
        exp = shifted.exp()
        local_t = t - vocab_start
        mine = (local_t >= 0) & (local_t < valid) & ~ignored
        local_t = local_t.masked_fill(~mine, 0)
        sums = torch.stack([
            exp.sum(dim=-1),
            shifted.gather(1, local_t.unsqueeze(1)).squeeze(1) * mine,
            shifted[:, :valid].sum(dim=-1) if eps > 0 else torch.zeros_like(row_max),
        ])
        if many:
            collectives.all_reduce(sums, group=group, logger=logger)
        sum_exp, target_logit, sum_logits = sums.unbind(0)
        log_sum_exp = sum_exp.log()
        loss = (1.0 - eps) * (log_sum_exp - target_logit)
        if eps > 0:
            loss = loss + eps * (log_sum_exp - sum_logits / vocab_size)
        loss = loss.masked_fill(ignored, 0.0)

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_t, mine, ignored)
        ctx.eps, ctx.valid, ctx.vocab_size = eps, valid, vocab_size
        ctx.logits_shape, ctx.dtype = logits.shape, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, mine, ignored = ctx.saved_tensors
        grad = softmax  # saved only for this backward: safe to overwrite
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= (1.0 - ctx.eps) * mine
        if ctx.eps > 0:
            grad[:, :ctx.valid] -= ctx.eps / ctx.vocab_size
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.view(ctx.logits_shape).to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup, *,
                                 vocab_size: int | None = None, ignore_index: int = -100,
                                 label_smoothing: float = 0.0, reduction: str = "mean",
                                 logger: CommsLogger | None = None) -> torch.Tensor:
    """torch's cross_entropy(full_logits, targets) from this rank's vocabulary slice of the logits.

    logits: [..., V_padded / tp], this tp rank's columns (as ColumnParallelLinear with
    gather_output=False leaves them). targets: [...] class ids in [0, vocab_size) or
    `ignore_index`. vocab_size: the real vocabulary (default: V_padded, no padding).
    reduction: "mean" over non-ignored targets, "sum", or "none" (per position, 0 where ignored).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"vocab_parallel_cross_entropy: reduction={reduction!r} is not one of {_REDUCTIONS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"vocab_parallel_cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and targets "
                         f"{tuple(targets.shape)} must agree in every dim but the last")
    padded = logits.shape[-1] * dist.get_world_size(group)
    vocab_size = padded if vocab_size is None else vocab_size
    if not padded - logits.shape[-1] < vocab_size <= padded:
        raise ValueError(f"vocab_parallel_cross_entropy: vocab_size={vocab_size} does not fit the padded "
                         f"vocabulary of {padded} ({logits.shape[-1]} columns x tp={padded // logits.shape[-1]}); "
                         f"pass the unpadded vocabulary size of the model")
    _check_targets(targets, vocab_size, ignore_index)
    loss = _VocabParallelCrossEntropy.apply(logits, targets, group, vocab_size, ignore_index,
                                           float(label_smoothing), logger)
    if reduction == "none":
        return loss.view(targets.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (targets != ignore_index).sum()


def _check_targets(targets: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Targets outside [0, vocab_size) are an error. Checked on the device (`_assert_async`), so
    a step does not wait for it on a GPU (there it surfaces as a device assert, as in
    F.cross_entropy); on the CPU the first bad target is named."""
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))
    try:
        torch._assert_async(~bad.any(), "vocab_parallel_cross_entropy: a target is outside the vocabulary")
    except RuntimeError:
        first = targets[bad].flatten()[0].item()
        raise ValueError(f"vocab_parallel_cross_entropy: target {first} is outside [0, {vocab_size}) and is "
                         f"not ignore_index={ignore_index}") from None
