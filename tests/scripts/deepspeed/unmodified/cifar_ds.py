"""A CIFAR-style DeepSpeed script (the shape of DeepSpeedExamples' cifar10_deepspeed.py), unmodified:
`import deepspeed`, `get_accelerator()`, `model_engine.bfloat16_enabled()` before the first step,
`save_checkpoint` / `load_checkpoint` between the epochs. Runs under DeepSpeed and under
`trident launch --as-deepspeed` (tests/distributed/test_deepspeed_corpus.py, bench/deepspeed_scripts.py).

Prints one `RESULT {...} END` line on rank 0: the mean loss of every optimizer step over all ranks.
"""

import argparse
import os

import torch
import torch.nn as nn

import deepspeed
from deepspeed.accelerator import get_accelerator


parser = argparse.ArgumentParser(description="CIFAR")
parser.add_argument("--epochs", type=int, default=2, help="number of total epochs")
parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
parser.add_argument("--ckpt_dir", type=str, default=None, help="checkpoint after the first epoch, reload it")
parser = deepspeed.add_config_arguments(parser)


def make_net() -> nn.Module:
    """A small convolutional classifier of 8x8 RGB images into 10 classes."""
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 8, 3), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 2 * 2, 24), nn.Tanh(), nn.Linear(24, 10))


deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
args = parser.parse_args()
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
trainset = torch.utils.data.TensorDataset(torch.randn(64, 3, 8, 8, generator=g),
                                          torch.randint(0, 10, (64,), generator=g))
net = make_net()
parameters = filter(lambda p: p.requires_grad, net.parameters())
model_engine, optimizer, trainloader, _ = deepspeed.initialize(args=args, model=net, model_parameters=parameters,
                                                               training_data=trainset)
local_device = get_accelerator().device_name(model_engine.local_rank)
local_rank = model_engine.local_rank
target_dtype = None  # the cifar example picks the input dtype from the engine
if model_engine.bfloat16_enabled():
    target_dtype = torch.bfloat16
elif model_engine.fp16_enabled():
    target_dtype = torch.half

criterion = nn.CrossEntropyLoss()
world = deepspeed.comm.get_world_size()
micro_losses = []
for epoch in range(args.epochs):
    for i, data in enumerate(trainloader):
        inputs, labels = data[0].to(local_device), data[1].to(local_device)
        if target_dtype is not None:
            inputs = inputs.to(target_dtype)
        outputs = model_engine(inputs)
        loss = criterion(outputs, labels)
        model_engine.backward(loss)
        model_engine.step()
        mean = loss.detach().float().clone()
        deepspeed.comm.all_reduce(mean)
        micro_losses.append(mean.item() / world)
    if epoch == 0 and args.ckpt_dir:
        model_engine.save_checkpoint(args.ckpt_dir, tag="epoch1", client_state={"epoch": epoch})
        _, client = model_engine.load_checkpoint(args.ckpt_dir, tag="epoch1")
        assert client["epoch"] == 0, client
get_accelerator().synchronize()

gas = model_engine.gradient_accumulation_steps()
steps = [sum(micro_losses[i:i + gas]) / gas for i in range(0, len(micro_losses), gas)]
if deepspeed.comm.get_rank() == 0:
    print("RESULT", {"losses": steps, "world": world, "global_steps": model_engine.global_steps,
                     "accelerator": get_accelerator().device_name(), "bf16": model_engine.bfloat16_enabled(),
                     "saved": bool(args.ckpt_dir and os.path.isdir(os.path.join(args.ckpt_dir, "epoch1")))},
          "END", flush=True)
