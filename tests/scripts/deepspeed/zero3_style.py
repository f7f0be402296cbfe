"""A DeepSpeed ZeRO-3 script: the model built under `deepspeed.zero.Init`, one weight edited
under `deepspeed.zero.GatheredParameters`, trained, and gathered again to save; run by
tests/distributed/test_deepspeed_scripts.py with only the import changed.

    trident launch --nproc 2 zero3_style.py --deepspeed --deepspeed_config zero3_config.json

Prints one `RESULT` line: the mean loss of every optimizer step over all ranks and a checksum
of the whole (gathered) weights.
"""

import argparse
import os

import torch
import torch.nn as nn

import trident as deepspeed


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh())
        self.head = nn.Linear(24, 3)

    def forward(self, x):
        return self.head(self.body(x))


parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--save_dir", type=str, default=None)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

deepspeed.init_distributed()
torch.manual_seed(42)
with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config, remote_device="cpu", pin_memory=False):
    model = Model()
with deepspeed.zero.GatheredParameters(model.head.weight, modifier_rank=0):
    if deepspeed.comm.get_rank() == 0:
        with torch.no_grad():
            model.head.weight.mul_(0.5)  # a custom initialisation, made once and broadcast

engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
world, rank = deepspeed.comm.get_world_size(), deepspeed.comm.get_rank()
micro = engine.train_micro_batch_size_per_gpu()
gas = engine.gradient_accumulation_steps()
g = torch.Generator().manual_seed(3)
data_x = torch.randn(args.steps * engine.train_batch_size(), 10, generator=g)
data_y = torch.randn(data_x.shape[0], 3, generator=g)
losses = []
for step in range(args.steps):
    window = 0.0
    for m in range(gas):
        start = step * engine.train_batch_size() + (m * world + rank) * micro
        x, y = data_x[start:start + micro], data_y[start:start + micro]
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        deepspeed.comm.all_reduce(mean)
        window += mean.item() / world
    losses.append(window / gas)
    assert engine.was_step_applied()

params = list(engine.module.parameters())
with deepspeed.zero.GatheredParameters(params):
    checksum = sum(p.detach().double().sum().item() for p in params)
if args.save_dir:
    engine.save_16bit_model(args.save_dir)
if rank == 0:
    print("RESULT", {"losses": losses, "checksum": checksum, "stage": engine.zero_optimization_stage(),
                     "world": world}, "END", flush=True)
