"""A Megatron-style DeepSpeed script, unmodified: it builds its own model-parallel unit (`mpu`: the
data- and model-parallel groups, Megatron's `get_*_parallel_*` functions) and passes it to
`deepspeed.initialize(mpu=...)`, steps a GPT-like model with gradient accumulation, and reads
the engine's DeepSpeed accessors (`gradient_clipping()`, `get_mom()`, `zero_optimization()`...).

Prints one `RESULT {...} END` line on rank 0: every optimizer step's mean loss.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn

import deepspeed
from deepspeed.utils import log_dist


class MPU:
    """Megatron's model-parallel unit with model-parallel size 1: every rank is one data-parallel replica."""

    def __init__(self):
        world, rank = dist.get_world_size(), dist.get_rank()
        self._mp = [dist.new_group([r]) for r in range(world)][rank]
        self._dp = dist.new_group(list(range(world)))

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_group(self):
        return self._mp

    def get_data_parallel_rank(self):
        return dist.get_rank(self._dp)

    def get_data_parallel_world_size(self):
        return dist.get_world_size(self._dp)

    def get_data_parallel_group(self):
        return self._dp

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_pipeline_model_parallel_world_size(self):
        return 1

    def get_pipeline_model_parallel_rank(self):
        return 0


class TinyGPT(nn.Module):
    def __init__(self, vocab=32, dim=32, seq=8):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.block = nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.0, batch_first=True)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, ids, labels):
        x = self.block(self.embed(ids) + self.pos)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=5)
args = deepspeed.add_config_arguments(parser).parse_args()
deepspeed.init_distributed(dist_backend="gloo")
mpu = MPU()
torch.manual_seed(1234)
model = TinyGPT()
engine, optimizer, _, scheduler = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                       mpu=mpu)
log_dist(f"clipping {engine.gradient_clipping()}, momentum {engine.get_mom()}, zero {engine.zero_optimization()}",
         ranks=[0])
data = torch.randint(0, 32, (args.steps * engine.train_batch_size(), 9), generator=torch.Generator().manual_seed(5))
micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
dp_rank, dp = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
losses = []
for step in range(args.steps):
    batch = data[step * engine.train_batch_size():(step + 1) * engine.train_batch_size()]
    total = torch.zeros(())
    for m in range(gas):  # this rank's micro-batches: rows dp_rank, dp_rank + dp, ... of the global batch
        rows = batch[dp_rank::dp][m * micro:(m + 1) * micro]
        loss = engine(rows[:, :-1], rows[:, 1:])
        engine.backward(loss)
        engine.step()
        total += loss.detach()
    dist.all_reduce(total, group=mpu.get_data_parallel_group())
    losses.append(total.item() / (gas * dp))
if dist.get_rank() == 0:
    print("RESULT", {"losses": losses, "world": dist.get_world_size(), "gas": gas, "mp": engine.mp_world_size,
                     "clipping": engine.gradient_clipping(), "zero": engine.zero_optimization()}, "END", flush=True)
