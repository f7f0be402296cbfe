"""Token-weighted loss (`data.loss_normalization`): a step's gradient is the sum of every counted
token's loss gradient divided by the step's global count, whatever the micro-batch split.

Each micro-batch's loss is the mean over its own counted tokens (labels other than -100). With
packed or bucketed rows those counts differ, and the mean of the micro-batches' means (over
accumulation steps and data-parallel ranks) is not the mean over the global batch's tokens: the
same batch trains differently when it is split differently. Here each micro-batch's backward
carries `mean x count` (its loss sum), and at the step the gradient is scaled by
`A / N`, where N is the window's count summed over the ranks the gradient is averaged over
(dp x cp x ep, A of them; cp ranks count the same sequences, which A's average undoes) and the
strategies' 1/A average is thereby replaced by 1/(true global count). The norm, the clip and the
update all use the scaled gradient; the factor is read on the host with the norm, in the step's
one sync. With equal counts everywhere this is the micro-batch mean, up to rounding.

The count comes from the model's family (`ModelAdapter.loss_tokens`: trident's GPT and
transformers causal LMs called with their labels), or from the caller
(`engine.backward(loss, num_tokens=n)`, for a loss of one's own). `engine.tokens_in_step` is
the global count of the last step (Megatron's `calculate_per_token_loss`; transformers' Trainer
passes the same count as `num_items_in_batch`).
"""

from __future__ import annotations

from typing import Any

import torch

from trident.comm import collectives

TOKENS, MICRO_BATCH = "tokens", "micro_batch"


def configured_mode(config) -> str:
    """`data.loss_normalization` as a run takes it. Unset: "tokens" when the data makes rows of
    different counted lengths (`data.packing`, `data.bucketing`), else "micro_batch"; under fp16
    "micro_batch" (its loss scale is set for mean losses, not sums) unless "tokens" is asked for.
    Labels with -100 from one's own data loop ask for "tokens" explicitly: the ranks must agree
    on it before they see their data."""
    mode = config.data.loss_normalization
    if mode is not None:
        return mode
    data = config.data
    return TOKENS if (data.packing or data.bucketing) and not config.fp16.enabled else MICRO_BATCH


class TokenWeighting:
    """One engine's token counts over an accumulation window, and the step's scaling factor."""

    def __init__(self, mode: str, adapter: Any, group, average_over: int, cp: int, explicit: bool = False) -> None:
        """`mode` as `configured_mode` resolved it; `explicit`: the config set it (an explicit
        "micro_batch" refuses `num_tokens`; an unset one lets a caller's counts weigh the window)."""
        self.mode, self.adapter, self.explicit = mode, adapter, explicit
        self.group, self.average_over, self.cp = group, average_over, cp
        self._pending: torch.Tensor | None = None  # the last forward's count
        self._tokens: torch.Tensor | None = None   # the window's count on this rank
        self._loss_sum: torch.Tensor | None = None
        self._unweighted = 0  # micro-batches of the window without a count
        self._totals: torch.Tensor | None = None  # the window's (count, loss sum) over the group, once reduced
        self.tokens_in_step: torch.Tensor | float | None = None

    @property
    def enabled(self) -> bool:
        """Whether the model's own counts weigh the loss ("tokens")."""
        return self.mode == TOKENS

    def count_forward(self, args: tuple, kwargs: dict) -> None:
        """Remember how many tokens the loss of this forward is a mean over, when its family says."""
        if self.enabled and self.adapter is not None:
            self._pending = self.adapter.loss_tokens(args, kwargs)

    def next_count(self) -> torch.Tensor | None:
        """The count the next backward weighs its loss by (the last forward's), or None."""
        return self._pending if self.enabled else None

    def weigh(self, loss: torch.Tensor, num_tokens: Any) -> torch.Tensor | None:
        """The count this micro-batch's loss is weighted by (a float64 tensor), or None when the
        window is averaged per micro-batch. Accumulates the window's count and loss sum."""
        n, self._pending = (num_tokens if num_tokens is not None else self._pending), None
        if num_tokens is not None and self.explicit and self.mode == MICRO_BATCH:
            raise ValueError("engine.backward(loss, num_tokens=...) weighs the loss by its token count, but "
                             "data.loss_normalization is \"micro_batch\"; set it to \"tokens\" or leave it unset")
        if n is None and self.mode == TOKENS:
            raise ValueError("data.loss_normalization is \"tokens\" (set, or chosen for packed / bucketed data), but "
                             "this micro-batch's loss comes with no token count: the model is not one whose labels "
                             "trident can count (trident's GPT or a transformers causal LM called with labels); pass "
                             "engine.backward(loss, num_tokens=n) with the number of tokens the loss is a mean over, "
                             "or set data.loss_normalization to \"micro_batch\"")
        if n is None:
            if self._tokens is not None:
                raise ValueError(self._mixed())
            self._unweighted += 1
            return None
        if self._unweighted:
            raise ValueError(self._mixed())
        n = torch.as_tensor(n, dtype=torch.float64, device=loss.device).reshape(())
        weighted = loss.detach().double() * n
        self._tokens = n if self._tokens is None else self._tokens + n
        self._loss_sum = weighted if self._loss_sum is None else self._loss_sum + weighted
        return n

    def _mixed(self) -> str:
        return ("a window mixes micro-batches with and without a token count (engine.backward(loss, "
                "num_tokens=...)); give every micro-batch of a window its count, or none")

    def close_window(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """At the window's end: (the gradient factor A / N, the global token mean of the loss) as
        device tensors, or None for a window averaged per micro-batch. Collective over the
        gradient group when the window was token-weighted (every rank's is)."""
        self._unweighted = 0
        totals = self._window_totals()
        self._tokens = self._loss_sum = self._totals = None
        return None if totals is None else self.factor_and_mean(totals[0], totals[1])

    def factor_now(self) -> torch.Tensor | None:
        """The factor the coming step will scale the gradients by (collective, once a window; the
        step reuses it), for tools that read the gradients between backward and step."""
        totals = self._window_totals()
        return None if totals is None else (self.average_over / totals[0]).reshape(1)

    def _window_totals(self) -> torch.Tensor | None:
        if self._tokens is None:
            return None
        if getattr(self, "_totals", None) is None:
            totals = torch.stack([self._tokens, self._loss_sum])
            if self.average_over > 1:
                collectives.all_reduce(totals, group=self.group)
            self._totals = totals
        return self._totals

    def factor_and_mean(self, tokens: torch.Tensor, loss_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From the count and loss sum over the gradient group (cp ranks counting their shared
        sequences each): the gradient factor and the global token mean; notes the step's count."""
        self.tokens_in_step = tokens / self.cp
        return (self.average_over / tokens).reshape(1), loss_sum / tokens
