"""`trident.initialize`: turn a plain model and a config into a training engine.

The order is fixed and is the one place where strategies meet:

  1. parse the config (once, into typed objects)
  2. start torch.distributed from torchrun's environment, check every rank agrees (preflight),
     build the mesh and start the hang detector
  3. resolve the batch triangle for the mesh's data-parallel size; on CPU, tune glibc's
     malloc so per-step allocations reuse memory instead of faulting it in again
  4. tensor parallelism: the config's plan replaces layers by their tp-split twins (each rank
     keeping its slice of the full weight); context parallelism gives the model its cp handle
     (it shards every sequence itself); then every dp replica gets rank 0's weights
  5. precision: `fp8` converts linear layers to torchao's Float8Linear (trident.precision.fp8);
     cast the model to bf16/fp16, keep fp32 master weights
  6. data parallelism: stage 0's gradient buffer and bucketed all-reduce, or ZeRO's partitions
  7. optimizer and LR scheduler over the master weights; `compile`: torch.compile each block,
     after every wrapper and hook above is in place (trident.engine.compile)
  8. the data loader, sharded over the dp group (cp ranks of a replica read the same samples)
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from trident.comm import collectives
from trident.comm.backend import init_distributed
from trident.comm.logger import CommsLogger
from trident.data_parallel.compressed import CompressedStrategy, check_zero_stage, is_compressed
from trident.config import TridentConfig, load_config, resolve_batch
from trident.config.loader import read_json
from trident.config.notes import unknown_line
from trident.data_parallel.reducer import GradientReducer, communication_dtype
from trident.data_parallel.replicated import ReplicatedOptimizer
import trident.deepspeed.comm as deepspeed_comm
from trident.deepspeed.config import fill_from_run, ignored_line
from trident.engine.assembly import attach_data_and_resume, cast_to_compute_dtype, loss_scaler_for, monitors_for
from trident.engine.compile import apply_compile, compile_scope
from trident.engine.engine import Engine
from trident.engine.flops import attach_flops_profiler
import trident.engine.muon as muon
from trident.engine.param_groups import RequestedGroups, map_client_optimizer, record_deepspeed_arguments
from trident.engine.pipeline_engine import build_pipeline_engine
from trident.engine.host_allocator import tune_glibc_malloc
from trident.engine.parameter_server_run import initialize_parameter_server
from trident.monitor.log import format_bytes, logger, setup_logging
from trident.optim.factory import build_optimizer
from trident.optim.schedulers import build_scheduler
from trident.moe.parallel import apply_expert_parallel, describe_moe, is_expert
from trident.parallel.adapter import adapter_for
from trident.parallel.mesh import DENSE_GRADIENT_AXES, ParallelMesh, gradient_group
from trident.pipeline.module import PipelineModule
from trident.precision.mixed import MasterWeights, retarget_optimizer
from trident.reliability import configure as configure_hang_detector, preflight
from trident.zero.optimizer import ZeroOptimizer


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable | None = None,
    model_parameters: Iterable | None = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: Any = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: str | dict | TridentConfig | None = None,
    config_params: str | dict | None = None,
    mesh: ParallelMesh | None = None,
):
    """Build an engine; returns (engine, optimizer, training_dataloader, lr_scheduler).

    DeepSpeed's signature. `optimizer` may be an optimizer over `model.parameters()` or a
    callable taking the parameters; without it the config's `optimizer` section is used.
    `lr_scheduler` may be a scheduler or a callable taking the optimizer. `mpu` (Megatron's
    model-parallel unit) sets the mesh's tensor- and pipeline-parallel sizes, and its groups are
    checked to be the mesh's. `mesh` lets a caller (a test, or two engines in one process) pass
    the process groups explicitly.
    """
    if model is None:  # DeepSpeed asserts, with this message; raised so that python -O keeps the check
        raise AssertionError("deepspeed.initialize requires a model")
    source = config if config is not None else config_params
    if source is None and args is not None:
        source = (getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
                  or getattr(args, "trident_config", None))
    if source is None:
        raise ValueError("trident.initialize needs config=<path to a JSON file, or a dict> (or args with "
                         "--deepspeed_config, see trident.add_config_arguments)")
    cfg = _load_for_run(source, model, optimizer, lr_scheduler)
    if cfg.parameter_server.servers > 0:
        return initialize_parameter_server(cfg, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                           training_data=training_data, lr_scheduler=lr_scheduler,
                                           collate_fn=collate_fn, mesh=mesh)

    # model_parameters (and a client optimizer's groups) by name, before any transform replaces a parameter
    requested = RequestedGroups.capture(model, model_parameters)
    client_groups = (RequestedGroups.of_optimizer(model, optimizer)
                     if isinstance(optimizer, torch.optim.Optimizer) else None)
    if mesh is None and mpu is not None:
        from trident.deepspeed.engine.mpu import mesh_from_mpu
        env = init_distributed(timeout_s=cfg.distributed.timeout_s)
        preflight(cfg)
        cfg, mesh = mesh_from_mpu(mpu, cfg, env.device.type)
    if mesh is None:
        env = init_distributed(timeout_s=cfg.distributed.timeout_s)
        preflight(cfg)  # through the store, before any group: same config, world size, versions
        mesh = ParallelMesh.build(pp=cfg.pipeline.stages, tp=cfg.tensor_parallel.size, cp=cfg.context_parallel.size,
                                  ep=cfg.expert_parallel.size, device_type=env.device.type)
    configure_hang_detector(cfg.distributed, mesh)  # hang detector, before trident's first collective
    preflight(cfg, mesh)  # same layout on every rank; a tiny all-reduce per axis group
    setup_logging(mesh.global_rank)
    batch = resolve_batch(cfg, data_parallel_size(mesh))
    if cfg.pipeline.stages > 1 and not isinstance(model, PipelineModule):
        adapter, pp = adapter_for(model), cfg.pipeline  # a family that splits built models (transformers)
        stage = None if adapter is None else adapter.split_pipeline(
            pp.stages, partition_method=pp.partition_method, virtual_stages=pp.virtual_stages, stage_id=mesh.pp_rank)
        model = stage if stage is not None else model
    place_on_device(model, engine_device(mesh), cfg)
    device = _model_device(model)
    if device.type == "cpu" and cfg.host_allocator.enabled:
        ha = cfg.host_allocator
        if tune_glibc_malloc(ha.trim_threshold_mb, ha.mmap_threshold_mb):
            logger.info("host allocator: glibc keeps up to %d MiB of freed memory (host_allocator)",
                        ha.trim_threshold_mb)

    comms_logger = CommsLogger(**cfg.comms_logger.model_dump())
    deepspeed_comm.configure(logger=comms_logger)  # a bare deepspeed.comm call logs here, as in DeepSpeed
    if mesh.tp_size > 1 or cfg.tensor_parallel.plan is not None:
        from trident.tensor_parallel import apply_tensor_parallel
        model = apply_tensor_parallel(model, cfg.tensor_parallel, mesh, logger=comms_logger)
    if mesh.cp_size > 1:
        from trident.context_parallel import apply_context_parallel
        apply_context_parallel(model, cfg.context_parallel, mesh, logger=comms_logger)
    apply_expert_parallel(model, mesh, logger=comms_logger)
    if cfg.lora is not None:
        from trident.peft import apply_lora
        apply_lora(model, seed=cfg.seed, **cfg.lora.model_dump())
    fp8_report = _convert_fp8(model, cfg, mesh, device)
    _configure_activation_checkpointing(cfg, model, mesh)
    _broadcast_module(model, mesh)
    dtype = cast_to_compute_dtype(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    counts = {"trainable": sum(p.numel() for p in params),
              "frozen": sum(p.numel() for p in model.parameters() if not p.requires_grad)}
    _check_every_stage_trains(model, bool(params), mesh)
    if not params:
        raise ValueError("the model has no parameters with requires_grad=True: nothing to train")
    for key in cfg.zero_optimization.inapplicable_keys():
        logger.warning("zero_optimization.%s has no effect at ZeRO stage %d (it is kept for DeepSpeed "
                       "compatibility); remove it or change the stage", key, cfg.zero_optimization.stage)
    split = isinstance(model, PipelineModule) and model.num_stages > 1
    model_parameters = requested.resolve(model, split) if requested is not None else None
    map_client_optimizer(optimizer, client_groups, model, split)
    master, strategy, optimizer = _make_strategy(cfg, model, params, optimizer, model_parameters, mesh,
                                                comms_logger, dtype)
    whole_model_ok = (mesh.tp_size == 1 and mesh.cp_size == 1 and mesh.pp_size == 1 and cfg.zero_optimization.stage < 3
                      and not isinstance(model, PipelineModule) and not cfg.activation_checkpointing.layers)
    scope = compile_scope(cfg.compile, engine_device(mesh).type, whole_model_ok)
    compile_report = apply_compile(model, cfg.compile, scope)  # after every strategy's wrappers and hooks
    scheduler = _make_scheduler(lr_scheduler, optimizer, cfg)
    loss_scaler = loss_scaler_for(cfg)
    monitors = monitors_for(cfg, mesh.mesh_rank == 0)
    if isinstance(model, PipelineModule):
        engine = build_pipeline_engine(model, cfg, mesh, batch, master, strategy, optimizer, scheduler,
                                       loss_scaler, comms_logger, monitors)
    else:
        engine = Engine(model, cfg, mesh, batch, master, strategy, optimizer, scheduler, loss_scaler,
                        comms_logger, monitors)
    engine.compile_report = compile_report  # graph breaks per compiled block, filled on the first step
    record_deepspeed_arguments(engine, client_groups is not None, lr_scheduler, mpu, training_data, collate_fn)
    engine.parameter_counts = counts  # this rank's (tp / pp local) elements, before any ZeRO partitioning
    engine.fp8_report = fp8_report  # trident.precision.fp8.FP8Report, or None without `fp8`
    attach_flops_profiler(engine)  # `flops_profiler`: engine.flops_profiler
    _log_startup(engine, device)
    if (line := ignored_line(list(cfg._notes))) is not None:
        logger.info(line)
    if (line := unknown_line(list(cfg._notes))) is not None:
        logger.warning(line)
    loader = attach_data_and_resume(engine, cfg, training_data, collate_fn, data_parallel_size(mesh),
                                    data_parallel_rank(mesh))
    return engine, optimizer, loader, scheduler


def _load_for_run(source, model, optimizer, lr_scheduler) -> TridentConfig:
    """The config, with what the run itself tells filled in: Hugging Face `"auto"` values the
    model or a client optimizer settle (`trident.deepspeed.config.fill_from_run`), and a DeepSpeed
    PipelineModule's stage count when the config does not give one."""
    if not isinstance(source, TridentConfig):
        data = read_json(source) if not isinstance(source, dict) else source
        source = fill_from_run(data, model, optimizer, lr_scheduler)
    cfg = load_config(source)
    if isinstance(model, PipelineModule) and cfg.pipeline.stages == 1 and model.num_stages > 1:
        pipe = cfg.pipeline.model_copy(update={"stages": model.num_stages,
                                               "partition_method": model.partition_method})
        cfg = cfg.model_copy(update={"pipeline": pipe})
    return cfg


def _convert_fp8(model, cfg, mesh, device):
    """`fp8`: torchao's Float8Linear for the model's linear layers, after tp / cp / ep / LoRA
    replaced theirs and before anything records parameters (trident.precision.fp8)."""
    if not cfg.fp8.enabled:
        return None
    import dataclasses
    from trident.precision.fp8 import apply_fp8, check_fp8_hardware, unconverted_matmuls
    from trident.precision.fp8_conv1d import convert_conv1d
    from trident.tensor_parallel.fp8_convert import convert_tp_layers
    check_fp8_hardware(cfg.fp8, device)
    converted, kept = convert_tp_layers(model, cfg.fp8)  # tp-split layers: scales from tp-wide amaxes
    conv_converted, conv_kept = convert_conv1d(model, cfg.fp8)  # transformers' Conv1D (GPT-2)
    converted, kept = converted + conv_converted, {**kept, **conv_kept}
    report = apply_fp8(model, cfg.fp8, device, allow_none=bool(converted or kept))
    converted = list(dict.fromkeys(report.converted + converted))  # Float8Conv1D is a Float8Linear too
    kept = {**report.kept, **kept}
    kept.update(unconverted_matmuls(model, set(converted) | set(kept)))
    return dataclasses.replace(report, converted=converted, kept=kept)


def _configure_activation_checkpointing(cfg, model, mesh) -> None:
    """`activation_checkpointing`: this engine's settings, bound to its model, and the modules to
    wrap. With DeepSpeed's keys in the section the model owns settings made from it (another
    engine in the process keeps its own; the process-wide ones are left alone); without them its
    checkpoint() calls use the process-wide settings of trident.checkpointing.configure."""
    from trident.recompute import activation
    ac = cfg.activation_checkpointing
    partition = ac.partition_activations
    if partition and cfg.tensor_parallel.sequence_parallel:
        logger.warning("activation_checkpointing.partition_activations is ignored with "
                       "tensor_parallel.sequence_parallel: layer inputs are already split along the sequence")
        partition = False
    selective = {"layers", "every"}
    own = None
    if ac.model_dump(exclude=selective) != type(ac)().model_dump(exclude=selective):
        own = activation.make_settings(mesh, deepspeed_config=ac, partition_activations=partition)
    activation.bind(model, own)
    if ac.layers:
        activation.apply_activation_checkpointing(model, ac.layers, ac.every, settings=own)


def _fp8_gathered(model, cfg) -> list:
    """`fp8.all_gather`: the Float8Linear layers whose weights ZeRO-3 gathers as float8."""
    if not (cfg.fp8.enabled and cfg.fp8.all_gather and cfg.zero_optimization.stage == 3):
        return []
    from trident.zero.fp8_gather import fp8_gather_modules
    return fp8_gather_modules(model)


def _make_strategy(cfg, model, params, optimizer, model_parameters, mesh, comms_logger, dtype):
    """Stage 0: the all-reduce reducer and fp32 masters; stages 1-3: ZeRO's partitions.
    Returns (masters or None, the engine's gradient/step strategy, the optimizer)."""
    zero = cfg.zero_optimization
    frozen = [p for p in model.parameters() if not p.requires_grad]
    if optimizer is None:
        muon.flag_model(cfg, model)
    if zero.stage == 0:
        dense = [p for p in params if not is_expert(p)]
        experts = [p for p in params if is_expert(p)]
        params = dense + experts  # the masters, names and gradients list experts last
        master = MasterWeights(params)
        reducers = [GradientReducer(
            group_params, gradient_group(mesh, group_params), bucket_size=zero.reduce_bucket_size,
            overlap_comm=zero.overlap_comm, predivide_factor=cfg.gradient_predivide_factor,
            prescale_gradients=cfg.prescale_gradients, logger=comms_logger,
            average_over=mesh.topology.size(DENSE_GRADIENT_AXES),
            comm_dtype=communication_dtype(cfg.communication_data_type, dtype))
            for group_params in (dense, experts) if group_params]
        muon.carry_flags(master.mapping(), params, optimizer)
        optimizer = _make_optimizer(optimizer, model_parameters, params, master, cfg)
        muon.check_muon_layout(optimizer, "none", mesh)
        names = {id(p): n for n, p in model.named_parameters()}
        # 1-bit optimizers communicate themselves after warm-up: stage 0 with a switchable all-reduce
        stage0, extra = ((CompressedStrategy, {"logger": comms_logger}) if is_compressed(optimizer)
                         else (ReplicatedOptimizer, {}))
        strategy = stage0(reducers[0], master, optimizer, mesh, [names[id(p)] for p in params], frozen,
                          expert_reducer=reducers[1] if dense and experts else None, **extra)
        return master, strategy, optimizer
    optimizer = _make_optimizer(optimizer, model_parameters, params, None, cfg)
    check_zero_stage(optimizer, zero.stage)
    muon.check_muon_layout(optimizer, zero.offload_optimizer.device, mesh)
    names = {id(p): n for n, p in model.named_parameters()}
    strategy = ZeroOptimizer(zero.stage, optimizer, names, mesh, zero, dtype, cfg.gradient_predivide_factor,
                             cfg.prescale_gradients, comms_logger, model=model, aio=cfg.aio, frozen=frozen,
                             comm_dtype=communication_dtype(cfg.communication_data_type, dtype),
                             fp8_modules=_fp8_gathered(model, cfg))
    return None, strategy, optimizer


@torch.no_grad()
def _broadcast_module(model: torch.nn.Module, mesh: ParallelMesh) -> None:
    """Start every data-parallel replica from the weights of dp rank 0 (parameters built
    under zero.Init are already identical shards and are skipped)."""
    if mesh.dp_size == 1:
        return
    for t in list(model.parameters()) + list(model.buffers()):
        if not hasattr(t, "_trident_shard"):
            collectives.broadcast(t.data, src=0, group=mesh.dp_group)


def _make_optimizer(optimizer, model_parameters, params, master: MasterWeights | None,
                    cfg) -> torch.optim.Optimizer:
    """The optimizer over the masters (stage 0), or over the model's parameters for ZeRO to
    rebind to its partitions."""
    mapping = master.mapping() if master is not None else {}
    if isinstance(optimizer, torch.optim.Optimizer):
        retarget_optimizer(optimizer, mapping)
        return optimizer
    if model_parameters is not None:
        targets = _retarget_param_groups(list(model_parameters), mapping)
    else:
        targets = master.master_params if master is not None else params
    if callable(optimizer):
        return optimizer(targets)
    if optimizer is not None:
        raise TypeError(f"optimizer= must be a torch.optim.Optimizer or a callable, got {type(optimizer).__name__}")
    return build_optimizer(cfg.optimizer, targets, offload=cfg.zero_optimization.offload_optimizer.device != "none")


def _retarget_param_groups(groups: list, mapping: dict) -> list:
    if groups and isinstance(groups[0], dict):
        return [{**g, "params": [mapping.get(id(p), p) for p in g["params"]]} for g in groups]
    return [mapping.get(id(p), p) for p in groups]


def _make_scheduler(lr_scheduler, optimizer, cfg):
    if lr_scheduler is None:
        return build_scheduler(cfg.scheduler, optimizer)
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return lr_scheduler(optimizer)
    return lr_scheduler


def data_parallel_size(mesh: ParallelMesh) -> int:
    """Ranks that see different samples: dp x ep (ep ranks hold other experts and other data;
    cp ranks share their sequences)."""
    return mesh.dp_size * mesh.ep_size


def data_parallel_rank(mesh: ParallelMesh) -> int:
    """This rank's share of each global batch, 0 .. data_parallel_size - 1 (dp outer, ep inner:
    the order of the dense gradient group, which MoE routing's priority order follows)."""
    return mesh.dp_rank * mesh.ep_size + mesh.ep_rank


def _log_startup(engine: Engine, device: torch.device) -> None:
    b, mesh = engine.batch, engine.mesh
    counts = getattr(engine, "parameter_counts", None)
    n = counts["trainable"] + counts["frozen"] if counts else engine.strategy.numel
    logger.info("mesh on %s: %s", device, mesh.describe())
    if mesh.cp_size > 1:
        cp = engine.config.context_parallel
        logger.info("context parallelism: every sequence split over %d ranks (%s%s)", mesh.cp_size, cp.method,
                    f", Ulysses groups of {cp.ulysses_size}" if cp.method == "hybrid" else "")
    logger.info("batch: train_batch_size %d = micro %d x accumulation %d x dp %d%s",
                b.train_batch_size, b.micro_batch_size, b.gradient_accumulation_steps, mesh.dp_size,
                f" x ep {mesh.ep_size}" if mesh.ep_size > 1 else "")
    logger.info("model: %.2fM parameters in %s; optimizer %s; ZeRO stage %d",
                n / 1e6, engine.compute_dtype, type(engine.optimizer).__name__, engine.strategy.zero_stage)
    if counts and counts["frozen"]:
        lora = engine.config.lora
        what = f" (LoRA r={lora.r}, alpha={lora.alpha:g})" if lora is not None else ""
        logger.info("trainable %s elements, %s of the model%s; frozen %s (no gradients, no optimizer state): "
                    "%s of parameters in %s on this rank", f"{counts['trainable']:,}",
                    f"{counts['trainable'] / (counts['trainable'] + counts['frozen']):.2%}", what,
                    f"{counts['frozen']:,}", format_bytes(counts["frozen"] * engine.compute_dtype.itemsize),
                    engine.compute_dtype)
    if getattr(engine, "fp8_report", None) is not None:
        logger.info(engine.fp8_report.describe())
    seq_len = getattr(getattr(engine.module, "config", None), "seq_len", None)  # the reference GPT's
    moe = describe_moe(engine.module, mesh, b.micro_batch_size * seq_len if seq_len else None)
    if moe:
        logger.info(moe)
    mem = engine.memory_breakdown()
    logger.info("model states per rank: %s (optimizer states appear after the first step)",
                ", ".join(f"{k} {format_bytes(v)}" for k, v in mem.items()))
    placed = engine.strategy.placement_bytes()
    if placed["host"] or placed["nvme"]:
        logger.info("model states per rank by placement: %s", ", ".join(
            f"{k} {format_bytes(v)}" for k, v in placed.items()))
    predicted = _predicted_model_states(engine)
    if predicted is not None:
        logger.info("model states per rank, theory (trident.planner): %s; total %s",
                    ", ".join(f"{k} {format_bytes(v)}" for k, v in predicted.as_dict().items()),
                    format_bytes(predicted.total))


def _predicted_model_states(engine: Engine):
    """The planner's formula for this engine's stage, dp size, precision and optimizer."""
    from trident.planner.memory import OPTIMIZER_STATE_BYTES, model_state_bytes, trident_state_bytes

    name = type(engine.optimizer).__name__.lower()
    if name == "sgd" and not any(g.get("momentum", 0) for g in engine.optimizer.param_groups):
        name = "sgd-nomomentum"
    if name not in OPTIMIZER_STATE_BYTES:
        return None
    precision = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(engine.compute_dtype, "fp32")
    stage = engine.strategy.zero_stage
    state = trident_state_bytes(stage, precision, name)
    counts = getattr(engine, "parameter_counts", None)
    frozen = counts["frozen"] if counts else 0  # e.g. LoRA's base model: parameter bytes only
    mesh = engine.mesh
    experts = sum(p.numel() for p in engine.module.parameters() if is_expert(p) and p.requires_grad)
    if experts:  # dense weights partitioned over dp x ep replicas, this rank's experts over dp
        from trident.planner.memory import ModelStates
        dense = model_state_bytes(engine.strategy.numel - experts + frozen, stage,
                                  data_parallel_size(mesh) * mesh.cp_size, state,
                                  trainable=engine.strategy.numel - experts)
        expert = model_state_bytes(experts, stage, mesh.dp_size * mesh.cp_size, state)
        return ModelStates(*(a + b for a, b in zip(dense.as_dict().values(), expert.as_dict().values())))
    return model_state_bytes(engine.strategy.numel + frozen, stage, mesh.dp_size * mesh.cp_size, state,
                             trainable=engine.strategy.numel)  # ZeRO partitions over dp x cp


def engine_device(mesh: ParallelMesh) -> torch.device:
    """The device this rank computes on: its CUDA device under NCCL, else the CPU."""
    if mesh.device_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_mesh.device_type)


@torch.no_grad()
def place_on_device(model: torch.nn.Module, device: torch.device, cfg=None) -> int:
    """Move the parameters and buffers that sit on the CPU to `device`, as DeepSpeed's
    initialize does, so a script that builds its model on the CPU trains on the GPU. Parameters
    keep their identity (`.data` is replaced, as `Module.to` does between CPU and CUDA), so an
    optimizer or `model_parameters` built over them still refers to them. Returns the number
    of tensors moved."""
    if device.type == "cpu":
        return 0
    tensors = tensors_to_place(model, cfg)
    for t in tensors:
        t.data = t.data.to(device)
    return len(tensors)


def tensors_to_place(model: torch.nn.Module, cfg=None) -> list[torch.Tensor]:
    """The parameters and buffers `place_on_device` moves: those on the CPU, except shards made
    by `zero.Init` (already placed) and, under ZeRO-3 with `offload_param`, all of them (the
    partitions go to host memory or NVMe; moving the whole model first would need the very
    memory offload saves). Meta tensors are not on the CPU: a deferred load fills them."""
    zero = cfg.zero_optimization if cfg is not None else None
    if zero is not None and zero.stage == 3 and zero.offload_param.device != "none":
        return []
    return [t for t in (*model.parameters(), *model.buffers())
            if t.device.type == "cpu" and not hasattr(t, "_trident_shard")]


def _model_device(model: torch.nn.Module) -> torch.device:
    """Where the model lives: its first parameter's device, or its first buffer's (a pipeline
    stage may hold only tied copies, which are buffers), or the CPU for a model with neither."""
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def _check_every_stage_trains(model: torch.nn.Module, has_params: bool, mesh: ParallelMesh) -> None:
    """Refuse, on every rank alike, a pipeline in which some stage holds no trainable parameter
    (only parameter-free layers, or copies of tied weights another stage owns): such a stage has
    no optimizer, and the error must not leave the other stages waiting in their next collective."""
    if not isinstance(model, PipelineModule) or model.num_stages < 2:
        return
    flags: list = [None] * mesh.world_size
    collectives.all_gather_object(flags, (model.stage_id, has_params), group=mesh.mesh_group)
    empty = sorted({stage for stage, ok in flags if not ok})
    if empty:
        raise ValueError(
            f"pipeline stage(s) {empty} of {model.num_stages} hold no trainable parameter of their own (their "
            "layers have none, or only copies of tied weights owned by another stage); choose a partition in "
            "which every stage owns at least one trainable layer (pipeline.partition_method, e.g. \"uniform\" "
            "or \"parameters\", or fewer stages)")

