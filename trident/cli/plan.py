"""`trident plan`: predict memory, communication and step time, and choose a layout.

    trident plan --model gpt3-175b --gpus 1024 [--gpu a100-80gb] [--nodes-of 8]
                 [--seq-len 2048] [--global-batch 1536] [--config ds.json] [--top 10] [--json]
    trident plan --params 7.5e9 --gpus 64
    trident plan --calibrate [--cluster FILE] [--gpus 2] [--threads 1]
    trident plan --model trident-small --gpus 2 --config ds.json --cluster FILE
    trident plan --model llama-7b --gpus 8 --lora-r 16 [--lora-targets qkv,o,mlp]
    trident plan --model llama-7b --gpus 8 --seq-len 131072 [--cp-method ring|ulysses]

MODEL is a preset, a Hugging Face-style config.json, or --layers/--hidden/--heads/--vocab.
Without --config every valid layout is estimated and those that fit are ranked by predicted
throughput; with --config the one layout it describes is reported in full. --params gives
model-state memory per GPU and per node for each ZeRO stage and offload choice. --lora-r
plans LoRA fine-tuning: the model frozen (parameter bytes only), adapters of rank R on the
--lora-targets layers trained (gradients and optimizer states); a --config with a `lora`
section implies its r. The search tries context parallelism (cp: every sequence split over cp
ranks) where 2 x cp divides --seq-len and each rank keeps at least 4096 tokens; --cp-method
says how its attention talks (a --config's context_parallel section says it there). When the
--config leaves the micro-batch open (no train_micro_batch_size_per_gpu) the largest that fits
is chosen and named. --calibrate measures this machine (GEMM by shape, bandwidths, per-op cost,
every collective's alpha-beta on gloo or NCCL) into a cluster file; --cluster FILE predicts
with it instead of a GPU preset. Compressed communication in the --config (1-bit optimizers,
communication_data_type, ZeRO++) is priced by its bytes. The exit status is 1 when nothing
fits (or the --config layout does not at any micro-batch), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trident.cli.args import positive_int
from trident.planner.cluster import calibrated_cluster, default_cluster_path, load_calibration, save_calibration
from trident.planner.compression import compression_from_config
from trident.planner.estimate import estimate
from trident.planner.layout import DEFAULT_LORA_TARGETS, LORA_TARGETS, Layout, Workload
from trident.planner.memory import mixed_precision_bytes, zero_state_table
from trident.planner.presets import (GPU_PRESETS, MODEL_PRESETS, GiB, ModelSpec, make_cluster, model_from_hf_config,
                                     model_preset)
from trident.planner.search import fit_micro_batch, search



def _positive_count(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number such as 7.5e9, got {text!r}")
    return value


def _lora_targets(text: str) -> tuple[str, ...]:
    targets = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(LORA_TARGETS)}, got {text!r}")
    return targets


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `plan` on the `trident` subparsers."""
    p = subparsers.add_parser("plan", help="predict memory and speed; choose a parallel layout",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_argument_group("model (one of)")
    what.add_argument("--model", help=f"a preset ({', '.join(MODEL_PRESETS)}) or a config.json path")
    what.add_argument("--params", type=_positive_count, help="a parameter count: model-state memory only")
    for flag, help_ in (("--layers", "transformer layers"), ("--hidden", "d_model"), ("--heads", "attention heads"),
                        ("--vocab", "vocabulary size")):
        what.add_argument(flag, type=positive_int, help=help_)
    p.add_argument("--gpus", type=positive_int, default=None,
                   help="number of GPUs (the world size); with --calibrate the ranks to measure (default: the GPUs, "
                        "or 2 on a CPU)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine (GEMM by shape, bandwidths, per-op cost, alpha-beta of every collective "
                        "and p2p on gloo/NCCL) and write a cluster file (to --cluster, default "
                        f"{default_cluster_path()})")
    p.add_argument("--cluster", default=None, metavar="FILE",
                   help="predict with a cluster file written by --calibrate instead of a --gpu preset")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="with --calibrate on a CPU: threads per rank (default: cores / ranks)")
    p.add_argument("--gpu", default="a100-80gb", choices=sorted(GPU_PRESETS), help="GPU preset (default a100-80gb)")
    p.add_argument("--nodes-of", type=positive_int, default=None, help="GPUs per node (default 8)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--global-batch", type=positive_int, default=None,
                   help="sequences per optimizer step (default: about 1M tokens, a multiple of --gpus)")
    p.add_argument("--config", default=None, help="a trident/DeepSpeed JSON config: report its layout")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None, help="default bf16 (or the config's)")
    p.add_argument("--optimizer", default="adam", help="adam, adamw, sgd, lion, adagrad or muon (default adam)")
    p.add_argument("--attention", choices=("flash", "eager"), default=None,
                   help="attention kernel: flash (fused, no s x s scores kept or moved) or eager (unfused softmax, "
                        "as Megatron-LM 2021 and many older runs); default: a model config's attn_implementation, "
                        "else flash")
    p.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=None,
                   help="the model trains with dropout (its masks are kept and moved); default: a model config's "
                        "dropout probabilities (GPT-2's attn_pdrop / resid_pdrop, ...) when one is above 0, else none")
    p.add_argument("--fp8", action="store_true", default=False,
                   help="price the layers' dense GEMMs at the GPU's FP8 rate and their float8 casts at its memory "
                        "bandwidth (the config's fp8.enabled does too)")
    p.add_argument("--kernels", choices=("eager", "compile", "fused"), default=None,
                   help="the kernels of the memory-bound work between GEMMs and of attention: eager PyTorch, "
                        "torch.compile of each block, or hand-fused (Megatron / Transformer Engine); default: what "
                        "trident runs, compile when the config's compile section is on, else eager")
    p.add_argument("--lora-r", type=positive_int, default=None,
                   help="LoRA fine-tuning with adapters of this rank (default: full training, or --config's lora.r)")
    p.add_argument("--lora-targets", type=_lora_targets, default=DEFAULT_LORA_TARGETS,
                   help=f"comma-separated layers LoRA adapts, of {','.join(LORA_TARGETS)} "
                        f"(default {','.join(DEFAULT_LORA_TARGETS)})")
    p.add_argument("--cp-method", choices=("ring", "ulysses"), default=None,
                   help="context-parallel attention: ring (k/v blocks around the cp ranks) or ulysses (all-to-all to "
                        "head shards); default ring, or --config's context_parallel.method")
    p.add_argument("--top", type=positive_int, default=10, help="ranked layouts to print (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)
    return p


def _model(args: argparse.Namespace) -> ModelSpec:
    shape = {"n_layer": args.layers, "d_model": args.hidden, "n_head": args.heads, "vocab_size": args.vocab}
    given = {k: v for k, v in shape.items() if v is not None}
    if given:
        if args.model or len(given) < 4:
            raise ValueError("an explicit model needs all of --layers --hidden --heads --vocab and no --model")
        return ModelSpec("custom", seq_len=args.seq_len or 2048, **given)
    if not args.model:
        raise ValueError("say which model: --model PRESET_OR_CONFIG_JSON, --params COUNT, or "
                         "--layers --hidden --heads --vocab")
    if args.model.endswith(".json") or Path(args.model).is_file():
        return model_from_hf_config(args.model)
    return model_preset(args.model)


_DROPOUT_KEYS = ("attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout", "attention_dropout",
                 "hidden_dropout_prob", "attention_probs_dropout_prob", "dropout")


def _attention_and_dropout(args: argparse.Namespace) -> tuple[str, bool]:
    """What the flags say, else what a Hugging Face-style model config says (a GPT-2 config.json
    saved by transformers carries attn_pdrop 0.1): a run is priced as the model trains."""
    data: dict = {}
    if args.model and (args.model.endswith(".json") or Path(args.model).is_file()):
        data = json.loads(Path(args.model).read_text())
    kernel = data.get("attn_implementation") or data.get("_attn_implementation")
    attention = args.attention or ("eager" if kernel == "eager" else "flash")
    dropout = args.dropout
    if dropout is None:
        dropout = any(isinstance(data.get(k), (int, float)) and data[k] > 0 for k in _DROPOUT_KEYS)
    return attention, dropout


def _offload_device(zero, key: str) -> str:
    """DeepSpeed's `zero_optimization.<key>.device` ("cpu", "nvme" or "none"); absent = "none"."""
    device = getattr(getattr(zero, key, None), "device", None) or "none"
    return str(getattr(device, "value", device))


def _config_layout(path: str, gpus: int) -> tuple[Layout, dict]:
    """The layout a trident/DeepSpeed config describes, and what it says of batch and precision."""
    from trident.config import load_config, resolve_batch
    cfg = load_config(path)
    tp, pp = cfg.tensor_parallel.size, cfg.pipeline.stages
    cp_section = getattr(cfg, "context_parallel", None)
    cp = cp_section.size if cp_section is not None else 1
    if gpus % (tp * pp * cp):
        raise ValueError(f"--gpus {gpus} is not a multiple of tensor_parallel.size {tp} x pipeline.stages {pp}"
                         + (f" x context_parallel.size {cp}" if cp > 1 else "") + "; change --gpus or the config")
    dp = gpus // (tp * pp * cp)
    batch = resolve_batch(cfg, dp)
    zero = cfg.zero_optimization
    # trident.initialize wraps the modules `activation_checkpointing.layers` names (full
    # recomputation of each); with none named nothing is recomputed unless the model itself
    # calls checkpoint(), which a config cannot tell.
    ckpt = "full" if cfg.activation_checkpointing.layers else "none"
    layout = Layout(dp, tp, pp, zero.stage, batch.micro_batch_size, ckpt, cfg.tensor_parallel.sequence_parallel,
                    _offload_device(zero, "offload_optimizer"), _offload_device(zero, "offload_param"),
                    cfg.pipeline.schedule, cfg.pipeline.virtual_stages, cp=cp)
    precision = "bf16" if cfg.bf16.enabled else "fp16" if cfg.fp16.enabled else "fp32"
    optimizer = cfg.optimizer.type.lower() if cfg.optimizer else None
    lora_r = cfg.lora.r if getattr(cfg, "lora", None) is not None else 0
    method = cp_section.method if cp_section is not None else "ring"
    buckets = {"reduce_bucket_elems": zero.reduce_bucket_size, "zero3_prefetch_elems": zero.stage3_prefetch_bucket_size,
               "zero3_persistence_threshold": zero.stage3_param_persistence_threshold,
               "zero3_max_reuse_distance": zero.stage3_max_reuse_distance}
    return layout, {"global_batch": batch.train_batch_size, "precision": precision, "optimizer": optimizer,
                    "buckets": buckets,
                    "micro_batch_open": cfg.train_micro_batch_size_per_gpu is None,
                    "compression": compression_from_config(json.loads(Path(path).read_text())),
                    "lora_r": lora_r, "cp_method": method, "fp8": cfg.fp8.enabled,
                    "kernels": "compile" if cfg.compile.enabled else "eager",
                    "cp_ulysses_size": cp_section.ulysses_size if method == "hybrid" else None}


def _state_table(args: argparse.Namespace, out) -> int:
    per_node = args.nodes_of or min(8, args.gpus)
    precision = args.precision or "bf16"
    rows = zero_state_table(args.params, args.gpus, per_node, precision, args.optimizer)
    if args.json:
        print(json.dumps({"params": args.params, "gpus": args.gpus, "gpus_per_node": per_node, "precision": precision,
                          "optimizer": args.optimizer, "rows": [r.__dict__ for r in rows]}, indent=2), file=out)
        return 0
    b = mixed_precision_bytes(precision, args.optimizer)
    print(f"model states of {args.params / 1e9:.2f}B parameters on {args.gpus} GPUs ({per_node} per node), "
          f"{precision} + {args.optimizer}: {b.parameter:g} + {b.gradient:g} + {b.k:g} bytes per parameter", file=out)
    print(f"{'stage':<7}{'offload optimizer/params':<26}{'per GPU':>10}{'(GiB)':>8}{'per node host':>15}{'(GiB)':>9}",
          file=out)
    for r in rows:
        print(f"{r.stage:<7}{r.offload_optimizer + '/' + r.offload_params:<26}{r.device_per_gpu / 1e9:>8.2f}GB"
              f"{r.device_per_gpu / GiB:>8.2f}{r.host_per_node / 1e9:>13.2f}GB{r.host_per_node / GiB:>9.2f}", file=out)
    print("(activations, buffers and fragmentation come on top; give a model shape for the whole picture)", file=out)
    return 0


def _default_batch(seq_len: int, gpus: int) -> int:
    wanted = max(1, (1 << 20) // seq_len)
    return -(-wanted // gpus) * gpus


def _calibrate(args: argparse.Namespace, out) -> int:
    from trident.tools.calibrate import calibrate
    cal = calibrate(args.gpus, args.threads)
    path = save_calibration(cal, args.cluster)
    print(f"calibrated {cal.describe()}\nwrote {path}", file=out)
    for op, fit in cal.collectives.items():
        print(f"  {op:<15} alpha {fit.alpha * 1e6:9.1f} us   {1 / fit.beta / 1e9:7.2f} GB/s on {fit.world} ranks", file=out)
    return 0


def _cluster(args: argparse.Namespace):
    if args.cluster:
        return calibrated_cluster(load_calibration(args.cluster), args.gpus, args.nodes_of)
    return make_cluster(args.gpu, args.gpus, args.nodes_of)


def run(args: argparse.Namespace, out=None) -> int:
    """Print the plan; 0 when something fits, 1 when nothing does, 2 for bad arguments."""
    out = out or sys.stdout
    try:
        if args.calibrate:
            return _calibrate(args, out)
        if args.gpus is None:
            raise ValueError("--gpus is required (the world size to plan for)")
        if args.params is not None:
            if args.model or args.layers:
                raise ValueError("--params replaces the model: give --params or a model, not both")
            if args.lora_r:
                raise ValueError("--lora-r needs the model's shape (adapters have r x (in + out) parameters per "
                                 "layer): give --model or --layers --hidden --heads --vocab instead of --params")
            return _state_table(args, out)
        model = _model(args)
        cluster = _cluster(args)
        seq = args.seq_len or model.seq_len
        attention, dropout = _attention_and_dropout(args)
        if args.config:
            layout, cfg = _config_layout(args.config, args.gpus)
            workload = Workload(seq, args.global_batch or cfg["global_batch"], args.precision or cfg["precision"],
                                cfg["optimizer"] or args.optimizer, lora_r=args.lora_r or cfg["lora_r"],
                                lora_targets=args.lora_targets,
                                cp_method=args.cp_method or cfg["cp_method"],
                                cp_ulysses_size=None if args.cp_method else cfg["cp_ulysses_size"],
                                compression=cfg["compression"] if cfg["compression"].active else None,
                                attention=attention, dropout=dropout, fp8=args.fp8 or cfg["fp8"],
                                kernels=args.kernels or cfg["kernels"], **cfg["buckets"])
            if cfg["micro_batch_open"]:  # the config leaves it open: the largest that fits
                est = fit_micro_batch(model, layout, cluster, workload)
            else:
                est = estimate(model, layout, cluster, workload)
            print(json.dumps(est.to_dict(), indent=2) if args.json else est.format(), file=out)
            return 0 if est.valid and est.fits else 1
        workload = Workload(seq, args.global_batch or _default_batch(seq, args.gpus), args.precision or "bf16",
                            args.optimizer, lora_r=args.lora_r or 0, lora_targets=args.lora_targets,
                            cp_method=args.cp_method or "ring", attention=attention, dropout=dropout, fp8=args.fp8,
                            kernels=args.kernels or "eager")
        result = search(model, cluster, workload)
    except (ValueError, OSError) as err:
        print(f"trident plan: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(args.top), indent=2), file=out)
    else:
        lora = f"; LoRA r={workload.lora_r} on {','.join(workload.lora_targets)}" if workload.lora_r else ""
        print(f"{model.describe()}\n{args.gpus} x {cluster.gpu.name} ({cluster.gpus_per_node} per node); global batch "
              f"{workload.global_batch} x {seq} tokens; {workload.precision}{' + fp8 GEMMs' if workload.fp8 else ''} + "
              f"{workload.optimizer}{lora}"
              f"{'; cp attention: ' + workload.cp_method if any(c.layout.cp > 1 for c in result.ranked) else ''}\n",
              file=out)
        print(result.format(args.top), file=out)
    return 0 if result.ranked else 1


def main(argv: list[str] | None = None) -> int:
    """Run standalone: `python -m trident.cli.plan --model gpt2-124m --gpus 8`."""
    parser = argparse.ArgumentParser(prog="trident")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
