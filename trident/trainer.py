"""The built-in trainer behind `trident train`: the reference GPT on a text corpus.

Runs inside every worker that `trident launch` starts. It is also the example of how a user's
own script drives the engine: build the model, `trident.initialize`, then per micro-batch
`engine(x, y)`, `engine.backward(loss)`, `engine.step()`.

A run leaves one folder, `<trainer.run_dir>/<run name>/`:
  config.json          the resolved config (every default filled in)
  metrics.csv          step, loss, lr, loss scale, grad norm, tokens/s (and seq_len under a curriculum)
  tensorboard/         TensorBoard event file with the same scalars
  loss.png             the loss curve
  checkpoints/         engine checkpoints (`latest` names the newest)
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from trident.comm import collectives
from trident.comm.backend import init_distributed
from trident.config import TridentConfig, load_config
from trident.data.build import build_loader, prepared_text_dir
from trident.data.curriculum import truncate
from trident.data.tokenizer import load_tokenizer
from trident.engine.build import data_parallel_rank, data_parallel_size, initialize
from trident.models.gpt import GPT, GPT_PRESETS, GPTConfig
from trident.moe.parallel import moe_metrics
from trident.monitor.log import format_bytes, logger
from trident.monitor.plot import plot_metrics
from trident.monitor.progress import ProgressBar
from trident.monitor.writers import CSVMonitor, TensorBoardMonitor
from trident.parallel.mesh import ParallelMesh
from trident.reliability import preflight
from trident.tools.planner_check import STEPS_BEFORE_REPORT, step_time_report

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "demo.json"


def gpt_config(cfg: TridentConfig, vocab_size: int) -> GPTConfig:
    """The model section on top of its preset; explicit fields win."""
    m = cfg.model
    fields = dict(GPT_PRESETS[m.preset]) if m.preset else {}
    for key in ("n_layer", "n_head", "d_model", "seq_len", "d_ff"):
        if getattr(m, key) is not None:
            fields[key] = getattr(m, key)
    missing = [k for k in ("n_layer", "n_head", "d_model", "seq_len") if k not in fields]
    if missing:
        raise ValueError(f"model: {', '.join(missing)} not set; give model.preset (one of "
                         f"{', '.join(GPT_PRESETS)}) or set them explicitly")
    fields.update(dropout=m.dropout, bias=m.bias, tie_embeddings=m.tie_embeddings, vocab_size=vocab_size,
                  moe=m.moe.model_dump() if m.moe is not None else None)
    return GPTConfig(**fields)


def _run_dir(cfg: TridentConfig, mesh: ParallelMesh) -> Path:
    """Rank 0 picks the run folder name; every rank learns it."""
    name = [cfg.trainer.run_name or time.strftime("gpt-%Y%m%d-%H%M%S")]
    collectives.broadcast_object_list(name, src=0, group=mesh.mesh_group)
    return Path(cfg.trainer.run_dir) / name[0]


def _data_paths(cfg: TridentConfig, tokenizer, env, mesh: ParallelMesh) -> list[str]:
    """`data.paths`, or `data.dataset` prepared on first use (by local rank 0 while the others wait)."""
    if cfg.data.paths is not None:
        return list(cfg.data.paths)
    text = None if cfg.data.dataset == "kjv" else cfg.data.dataset
    if env.local_rank == 0:
        prepared_text_dir(text, tokenizer)
    collectives.barrier(group=mesh.mesh_group)
    return [str(prepared_text_dir(text, tokenizer, create=False))]


def _model_inputs(batch: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(input ids, labels, keyword inputs) of a loader batch; packed rows add position and document ids."""
    extra = {k: batch[k].to(device) for k in ("position_ids", "doc_ids") if k in batch}
    return batch["input_ids"].to(device), batch["labels"].to(device), extra


def _memory_report(engine, model_cfg: GPTConfig) -> str:
    """After the first step: this rank's model states against trident.planner's estimate for
    the same model and layout, and the planner's activation estimate."""
    from trident.planner import Layout, Workload, estimate, make_cluster, model_from_gpt_config
    from trident.planner.memory import trident_state_bytes

    precision = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(engine.compute_dtype, "fp32")
    stage, mesh = engine.strategy.zero_stage, engine.mesh
    layout = Layout(dp=mesh.dp_size, tp=mesh.tp_size, pp=mesh.pp_size, ep=mesh.ep_size, zero_stage=stage,
                    micro_batch=engine.train_micro_batch_size_per_gpu(), cp=mesh.cp_size)
    cp = engine.config.context_parallel
    workload = Workload(seq_len=model_cfg.seq_len, global_batch=engine.train_batch_size(), precision=precision,
                        optimizer="adamw", attention="eager", dropout=model_cfg.dropout > 0,
                        cp_method=cp.method, cp_ulysses_size=cp.ulysses_size)
    est = estimate(model_from_gpt_config(model_cfg), layout, make_cluster("a100-80gb", mesh.world_size),
                   workload, trident_state_bytes(stage, precision, "adamw"))
    measured = engine.memory_breakdown()
    rows = [f"{k} {format_bytes(v)} (planner {format_bytes(est.memory.states.as_dict()[k])})"
            for k, v in measured.items()]
    return ("memory per rank after step 1: " + ", ".join(rows)
            + f"; activations, planner: {format_bytes(est.memory.activations)}")


def train(cfg: TridentConfig) -> Path:
    if cfg.parameter_server.servers > 0:
        raise ValueError("parameter_server.servers > 0: `trident train` runs collective training only; "
                         "drive a parameter-server run from your own script with trident.initialize "
                         "(see docs/parameter_server.md) and `trident launch`")
    env = init_distributed(timeout_s=cfg.distributed.timeout_s)
    preflight(cfg)
    mesh = ParallelMesh.build(pp=1, tp=cfg.tensor_parallel.size, cp=cfg.context_parallel.size,
                              ep=cfg.expert_parallel.size, device_type=env.device.type)
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    model_cfg = gpt_config(cfg, tokenizer.get_vocab_size())
    seq_len = cfg.data.seq_len or model_cfg.seq_len
    if seq_len > model_cfg.seq_len:
        raise ValueError(f"data.seq_len = {seq_len} exceeds the model's seq_len {model_cfg.seq_len}; lower "
                         f"data.seq_len or raise model.seq_len")
    paths = _data_paths(cfg, tokenizer, env, mesh)
    model = GPT(model_cfg).to(env.device)
    engine, _, _, _ = initialize(model=model, config=cfg, mesh=mesh)
    loader = build_loader(cfg.data, seq_len=seq_len, vocab_size=model_cfg.vocab_size,
                          micro_batch_size=engine.train_micro_batch_size_per_gpu(), dp_rank=data_parallel_rank(mesh),
                          dp_size=data_parallel_size(mesh), seed=cfg.seed if cfg.data.seed is None else cfg.data.seed,
                          paths=paths, tokenizer=tokenizer)
    engine.training_dataloader = loader  # the engine's periodic checkpoints record its position
    resumed = (engine.resumed_client_state or {}).get("sampler")
    if resumed is not None:
        loader.load_state_dict(resumed)
    run_dir = _run_dir(cfg, mesh)
    is_writer = mesh.global_rank == 0
    if is_writer:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(cfg.resolved_json())
        (run_dir / "model.json").write_text(json.dumps(asdict(model_cfg), indent=2))
    csv = CSVMonitor(str(run_dir), "") if is_writer else None
    tb = TensorBoardMonitor(str(run_dir), "tensorboard") if is_writer else None
    steps = cfg.trainer.train_steps
    bar = ProgressBar(steps, enabled=is_writer)
    ckpt_dir = str(run_dir / "checkpoints")
    metrics = {"loss": float("nan")}
    step_seconds: list[float] = []  # the first few steps' wall time, for the planner's step-time check
    for step in range(engine.global_steps + 1, steps + 1):
        start = time.perf_counter()
        counts = torch.zeros(2)  # padding and input tokens of this rank's micro-batches
        seqlen = engine.curriculum_seqlen()  # curriculum_learning: this step's sequence length, else None
        for _ in range(engine.gradient_accumulation_steps()):
            batch = next(loader) if seqlen is None else truncate(next(loader), seqlen)
            counts += torch.tensor([batch["pad_tokens"], batch["tokens"]], dtype=torch.float32)
            x, y, extra = _model_inputs(batch, env.device)
            engine.backward(engine(x, y, **extra))
            engine.step()
        collectives.all_reduce(counts, group=mesh.group("dp", "ep"))  # ep ranks see other samples
        loss = torch.tensor([engine.last_loss], dtype=torch.float32)
        collectives.all_reduce(loss, group=mesh.group("dp", "ep"))
        metrics = {
            "loss": loss.item() / data_parallel_size(mesh),
            "lr": engine.get_lr()[0],
            "loss_scale": engine.loss_scale,
            "grad_norm": engine.get_global_grad_norm() or float("nan"),
            "tokens_per_s": (counts[1] - counts[0]).item() / (time.perf_counter() - start),
            **moe_metrics(engine.module),
        }
        if cfg.data.packing or cfg.data.bucketing:
            metrics["pad_share"] = (counts[0] / counts[1]).item()
        if seqlen is not None:
            metrics["seq_len"] = seqlen
        if step == 1 and is_writer:
            logger.info(_memory_report(engine, model_cfg))
        step_seconds.append(time.perf_counter() - start)
        if len(step_seconds) == STEPS_BEFORE_REPORT and is_writer:
            logger.info(step_time_report(engine, model_cfg, step_seconds))
        bar.update(step, metrics)
        if is_writer and step % cfg.trainer.log_interval == 0:
            csv.write_events([(k, v, step) for k, v in metrics.items()])
            tb.write_events([(f"train/{k}", v, step) for k, v in metrics.items()])
        if cfg.trainer.save_interval and step % cfg.trainer.save_interval == 0 and step != steps:
            engine.save_checkpoint(ckpt_dir, client_state={"step": step, "sampler": loader.state_dict()})
    bar.close()
    loader.close()
    engine.save_checkpoint(ckpt_dir, client_state={"step": steps, "sampler": loader.state_dict()})
    if cfg.comms_logger.enabled and is_writer:
        print(engine.comms_logger.summary())
    if is_writer:
        csv.close()
        tb.close()
        plot_metrics(str(run_dir / "metrics.csv"), str(run_dir / "loss.png"))
        print(f"\nrun folder: {run_dir.resolve()}\n"
              f"  config.json, model.json, metrics.csv, loss.png, tensorboard/, checkpoints/"
              f"\n  final loss {metrics['loss']:.4f}; view curves with: tensorboard --logdir {run_dir}")
    return run_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trident.trainer")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--steps", type=int, default=None, help="override trainer.train_steps")
    parser.add_argument("--run-dir", default=None, help="override trainer.run_dir")
    parser.add_argument("--run-name", default=None, help="override trainer.run_name")
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    overrides = {"train_steps": args.steps, "run_dir": args.run_dir, "run_name": args.run_name}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if overrides:
        cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update=overrides)})
    train(cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
