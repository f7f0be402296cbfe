"""`deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`: DeepSpeed's host Adagrad, here torch's Adagrad with the same
arithmetic (weight decay added to the gradient, squared-gradient sum, no lr decay, zero initial sum)."""
import torch


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's signature and defaults; `amsgrad` is accepted and unused, as in DeepSpeed;
    `fp32_optimizer_states` keeps the state in fp32 for lower-precision parameters (torch keeps it in the
    parameter's dtype, so only fp32 parameters are accepted with it off)."""

    def __init__(self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False, fp32_optimizer_states=True):
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
        self.fp32_optimizer_states = fp32_optimizer_states
