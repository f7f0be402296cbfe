"""A Hugging Face style DeepSpeed script, unmodified: a transformers GPT-2 (built from a config,
nothing downloaded), AdamW param groups with and without weight decay built the way the HF
Trainer builds them, `deepspeed.initialize(model_parameters=groups, training_data=...)`.

Prints one `RESULT {...} END` line on rank 0: every optimizer step's mean loss.
"""

import argparse

import torch
import transformers

import deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--weight_decay", type=float, default=0.1)
args = deepspeed.add_config_arguments(parser).parse_args()
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                 embd_pdrop=0.0, attn_pdrop=0.0)
model = transformers.GPT2LMHeadModel(config).float()
no_decay = ["bias", "ln_1.weight", "ln_2.weight", "ln_f.weight"]
groups = [
    {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
     "weight_decay": args.weight_decay},
    {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
]
ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(3))
data = torch.utils.data.TensorDataset(ids)
engine, optimizer, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=groups, training_data=data)
world, gas = deepspeed.comm.get_world_size(), engine.gradient_accumulation_steps()
micro_losses = []
for (batch,) in loader:
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    deepspeed.comm.all_reduce(mean)
    micro_losses.append(mean.item() / world)
steps = [sum(micro_losses[i:i + gas]) / gas for i in range(0, len(micro_losses), gas)]
if deepspeed.comm.get_rank() == 0:
    print("RESULT", {"losses": steps, "world": world, "groups": len(optimizer.param_groups),
                     "decays": sorted(g["weight_decay"] for g in optimizer.param_groups)}, "END", flush=True)
