"""A DeepSpeed pipeline-parallel script (the shape of DeepSpeedExamples' pipeline_parallelism/train.py),
run by tests/distributed/test_deepspeed_scripts.py with only the import changed.

    trident launch --nproc 2 pipe_style.py -p 2 --deepspeed_config pipe_config.json

Prints one `RESULT` line from the last stage: every step's loss and the stage's weight checksum.
"""

import argparse

import torch
import torch.nn as nn

import trident as deepspeed
from trident.pipe import LayerSpec, PipelineModule


def get_args():
    parser = argparse.ArgumentParser(description="pipeline")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-s", "--steps", type=int, default=6, help="quit after this many steps")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2, help="pipeline parallelism")
    parser.add_argument("--backend", type=str, default="gloo", help="distributed backend")
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def join_layers():
    return [LayerSpec(nn.Linear, 12, 32), nn.ReLU(), LayerSpec(nn.Linear, 32, 32), nn.ReLU(),
            LayerSpec(nn.Linear, 32, 32), nn.ReLU(), LayerSpec(nn.Linear, 32, 5)]


def train_pipe(args):
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(7)
    trainset = torch.utils.data.TensorDataset(torch.randn(128, 12, generator=g),
                                              torch.randint(0, 5, (128,), generator=g))
    net = PipelineModule(layers=join_layers(), loss_fn=nn.CrossEntropyLoss(),
                         num_stages=args.pipeline_parallel_size, partition_method="parameters",
                         activation_checkpoint_interval=0, seed_layers=True, base_seed=args.seed)
    engine, _, _, _ = deepspeed.initialize(args=args, model=net,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad],
                                           training_data=trainset)
    losses = [float(engine.train_batch()) for _ in range(args.steps)]
    local = [p.detach().double().sum() for p in engine.module.parameters()]
    checksum = torch.stack(local).sum() if local else torch.zeros((), dtype=torch.float64)
    deepspeed.comm.all_reduce(checksum)
    if deepspeed.comm.get_rank() == deepspeed.comm.get_world_size() - 1:
        print("RESULT", {"losses": losses, "checksum": checksum.item(), "stages": engine.num_stages,
                         "micro_batches": engine.gradient_accumulation_steps()}, "END", flush=True)


if __name__ == "__main__":
    args = get_args()
    deepspeed.init_distributed(dist_backend=args.backend)
    train_pipe(args)
