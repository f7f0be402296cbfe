"""A pipeline-parallel DeepSpeed script (the shape of DeepSpeedExamples' pipeline_parallelism/train.py),
unmodified: `from deepspeed.pipe import PipelineModule`, `set_random_seed`, `RepeatingLoader`, and
`train_batch()` over the loader `initialize(training_data=...)` builds (then over a RepeatingLoader
the script builds itself).

Prints one `RESULT {...} END` line from the last stage's first rank: every step's loss.
"""

import argparse

import torch
import torch.nn as nn

import deepspeed
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.utils import set_random_seed
from deepspeed.utils import RepeatingLoader


def parse_args(argv=None):
    """The example's flags: steps, pipeline size, backend, seed, and DeepSpeed's config flags."""
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser(description="pipeline parallelism"))
    for flags, kind, default in ((("--local_rank",), int, -1), (("-s", "--steps"), int, 6),
                                 (("-p", "--pipeline-parallel-size"), int, 2), (("--backend",), str, "gloo"),
                                 (("--seed",), int, 1138)):
        parser.add_argument(*flags, type=kind, default=default)
    return parser.parse_args(argv)


def layer_specs(width=24):
    """A 4-layer perceptron of 12 features into 5 classes, as specs each stage builds its part of."""
    sizes = [12, width, width, width, 5]
    specs = []
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:])):
        specs.append(LayerSpec(nn.Linear, n_in, n_out))
        if i < len(sizes) - 2:
            specs.append(nn.GELU())
    return specs


def train_pipe(args):
    set_random_seed(args.seed)
    g = torch.Generator().manual_seed(7)
    trainset = torch.utils.data.TensorDataset(torch.randn(96, 12, generator=g), torch.randint(0, 5, (96,), generator=g))
    net = PipelineModule(layers=layer_specs(), loss_fn=nn.CrossEntropyLoss(), num_stages=args.pipeline_parallel_size,
                         partition_method="parameters", activation_checkpoint_interval=0, seed_layers=True,
                         base_seed=args.seed, seed_fn=lambda seed: set_random_seed(int(seed)))
    # (seed_fn: DeepSpeed 0.19's default layer seeding passes a numpy integer to random.seed on 2 stages)
    engine, _, _, _ = deepspeed.initialize(args=args, model=net,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad],
                                           training_data=trainset)
    losses = [float(engine.train_batch()) for _ in range(args.steps)]
    # then the script's own repeating loader, in order, as the example's data_iter path does
    own = RepeatingLoader(torch.utils.data.DataLoader(trainset, batch_size=engine.train_micro_batch_size_per_gpu()))
    losses += [float(engine.train_batch(data_iter=own)) for _ in range(2)]
    if deepspeed.comm.get_rank() == deepspeed.comm.get_world_size() - 1:  # the last stage
        print("RESULT", {"losses": losses, "stages": engine.num_stages, "micro_batches": engine.micro_batches,
                         "global_steps": engine.global_steps}, "END", flush=True)


if __name__ == "__main__":
    args = parse_args()
    deepspeed.init_distributed(dist_backend=args.backend)
    train_pipe(args)
