"""A DeepSpeed CIFAR-style training script (the shape of DeepSpeedExamples' cifar10_deepspeed.py),
run by tests/distributed/test_deepspeed_scripts.py with only the import changed.

    trident launch --nproc 2 cifar_style.py --deepspeed --deepspeed_config cifar_config.json

Prints one `RESULT` line: the mean loss of every optimizer step over all ranks and a weight checksum.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import trident as deepspeed


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--epochs", type=int, default=2, help="number of total epochs")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(4 * 3 * 3, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


deepspeed.init_distributed()
args = add_argument()
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
trainset = torch.utils.data.TensorDataset(torch.randn(64, 3, 8, 8, generator=g),
                                          torch.randint(0, 10, (64,), generator=g))

net = Net()
parameters = filter(lambda p: p.requires_grad, net.parameters())
model_engine, optimizer, trainloader, _ = deepspeed.initialize(args=args, model=net, model_parameters=parameters,
                                                               training_data=trainset)
criterion = nn.CrossEntropyLoss()
world = deepspeed.comm.get_world_size()
micro_losses = []
for epoch in range(args.epochs):
    trainloader.sampler.set_epoch(epoch)
    for i, data in enumerate(trainloader):
        inputs, labels = data[0].to(model_engine.device), data[1].to(model_engine.device)
        outputs = model_engine(inputs)
        loss = criterion(outputs, labels)
        model_engine.backward(loss)
        model_engine.step()
        mean = loss.detach().clone()
        deepspeed.comm.all_reduce(mean)
        micro_losses.append(mean.item() / world)

gas = model_engine.gradient_accumulation_steps()
steps = [sum(micro_losses[i:i + gas]) / gas for i in range(0, len(micro_losses), gas)]
weights = torch.cat([p.detach().flatten() for p in model_engine.module.parameters()])
if deepspeed.comm.get_rank() == 0:
    print("RESULT", {"losses": steps, "checksum": weights.double().sum().item(), "world": world,
                     "global_steps": model_engine.global_steps, "lr": model_engine.get_lr()[0],
                     "stage": model_engine.zero_optimization_stage()}, "END", flush=True)
