"""`TridentTrainer`: a `transformers.Trainer` whose training runs on trident's engine.

    trainer = TridentTrainer(model=model, args=TrainingArguments(...), train_dataset=...,
                             eval_dataset=..., data_collator=..., trident_config="trident.json")
    trainer.train()                      # or train(resume_from_checkpoint=True / "out/checkpoint-5")
    trainer.evaluate(); trainer.save_model()

The Trainer's loop, logging, callbacks, evaluation, checkpoint folders and resume stay the
Trainer's; what changes is who holds the model and takes the step. The model goes through
`trident.initialize` with the config (any ZeRO stage, `tensor_parallel` with the model's own
plan, context parallelism), and, as for DeepSpeed in transformers:

* every `"auto"` in the config is filled from the `TrainingArguments`
  (`trident.config.fill_auto`); keys the Trainer always decides (micro batch, accumulation,
  gradient clipping, fp16 / bf16, seed) count as `"auto"` when the config leaves them out, and a
  value that disagrees with the arguments is the fill's mismatch error. `TrainingArguments.fsdp`
  names a sharding too: `full_shard` / `hybrid_shard` is ZeRO stage 3, `shard_grad_op` stage 2,
  and `zero_optimization.stage` must agree (or be `"auto"`); trident then does the sharding;
* the optimizer is the config's `optimizer` section when it has one, else the one the Trainer
  would build (`TrainingArguments.optim`, weight decay off for biases and norms), built by the
  engine over what it updates (tp shards, ZeRO partitions); the schedule is the config's
  `scheduler` section, else `TrainingArguments.lr_scheduler_type`. The engine clips and steps;
  the Trainer's `optimizer.step()` / `lr_scheduler.step()` / `zero_grad()` are no-ops;
* data: each data-parallel rank (trident's dp x ep) reads its share of every batch the way
  the Trainer's DDP path shards it (accelerate's batch sharding, same seeded order); tensor-,
  context- and pipeline-parallel ranks of a replica read the same samples. Losses, token counts
  and metrics are reduced as the Trainer reduces them under DDP;
* checkpoints: `checkpoint-N/` holds the model as `from_pretrained` reads it (gathered from
  ZeRO-3 partitions and tp shards), the Trainer's own state files, and the engine's checkpoint
  (`global_stepN/`: optimizer state, masters, scheduler, per-rank partitions), which
  `train(resume_from_checkpoint=...)` loads.

On several ranks (torchrun, `trident launch`, or `trident.testing.distributed.run_on_ranks`)
the mesh is built from the config's sizes over the whole world, or passed as `mesh=`.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedModel, Trainer, get_scheduler
from transformers.trainer import TRAINING_ARGS_NAME

from trident.config.loader import read_json
from trident.engine.build import data_parallel_size, initialize
from trident.engine.engine import Engine
from trident.integrations.trainer_config import guess_dp, layout_sizes, trident_config_for, world_size
from trident.integrations.trainer_views import EngineOptimizer, EngineScheduler, TridentAccelerator
from trident.parallel.mesh import ParallelMesh

__all__ = ["TridentTrainer", "trident_config_for"]

if not all(hasattr(Trainer, m) for m in ("_prepare_for_training", "set_initial_training_values", "_get_grad_norm")):
    import transformers as _transformers
    raise ImportError(f"trident.integrations.transformers needs the Trainer of transformers 5.x (checked with 5.24); "
                      f"this is transformers {_transformers.__version__}: pip install 'trident[hf]'")


class TridentTrainer(Trainer):
    """A `transformers.Trainer` training on trident's engine under the layout `trident_config`
    names (a JSON path or dict, DeepSpeed-style, `"auto"` values allowed). `mesh=` passes the
    process groups explicitly (tests, several engines in one process). After training starts,
    `trainer.engine` is the engine and `trainer.model_wrapped` is it too; `trainer.model` is the
    (possibly tp-split) model inside."""

    def __init__(self, model=None, args=None, *positional: Any, trident_config: str | dict | None = None,
                 mesh: ParallelMesh | None = None, **kwargs: Any) -> None:
        if trident_config is None:
            raise ValueError("TridentTrainer needs trident_config=<path to a JSON config, or a dict> naming the "
                             "layout (zero_optimization, tensor_parallel, ...); values the TrainingArguments "
                             "set may be \"auto\"")
        self._trident_source = copy.deepcopy(trident_config) if isinstance(trident_config, dict) \
            else read_json(trident_config)
        self._trident_given_mesh = mesh
        self._trident_built_mesh: ParallelMesh | None = None
        self.engine: Engine | None = None
        if args is not None:  # the contradictions fail here, before any process group or model work
            self._trident_config(args, model=model)
        if layout_sizes(self._trident_source)["pp"] > 1:
            raise ValueError("TridentTrainer does not run pipeline parallelism (pipeline.stages > 1): the Trainer's "
                             "loop runs one micro-batch at a time; use trident.initialize with a PipelineModule "
                             "and engine.train_batch instead")
        super().__init__(model, args, *positional, **kwargs)

    # -- layout ------------------------------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator.__class__ = TridentAccelerator
        self.accelerator._trident_trainer = self
        self.gather_function = self.accelerator.gather_for_metrics
        if self.args.eval_use_gather_object:
            self.gather_function = functools.partial(self.gather_function, use_gather_object=True)

    def _trident_mesh(self) -> ParallelMesh | None:
        """The mesh given as `mesh=`, the engine's, or one built from the config's sizes over
        the whole world (collective, on first use); None in a single process."""
        if self._trident_given_mesh is not None:
            return self._trident_given_mesh
        if self.engine is not None:
            return self.engine.mesh
        if self._trident_built_mesh is None and dist.is_available() and dist.is_initialized():
            sizes = layout_sizes(self._trident_source)
            device = self.args.device.type if self.args.device.type != "mps" else "cpu"
            self._trident_built_mesh = ParallelMesh.build(device_type=device, **sizes)
        return self._trident_built_mesh

    def _data_parallel_size(self) -> int:
        mesh = self._trident_mesh()
        return data_parallel_size(mesh) if mesh is not None else guess_dp(self._trident_source)

    def get_tp_size(self) -> int:
        """Ranks that read the same samples (tp x cp x pp of a replica): the Trainer divides its
        token counts and world-wide loss scaling by this, as it does for its own tensor parallelism."""
        return max(1, world_size() // self._data_parallel_size())

    def _trident_config(self, args: Any = None, num_training_steps: int | None = None, model: Any = None) -> dict:
        args = args if args is not None else self.args
        model = model if model is not None else getattr(self, "model", None)
        dp = self._data_parallel_size() if hasattr(self, "accelerator") else guess_dp(self._trident_source)
        return trident_config_for(self._trident_source, args, model=model, data_parallel_size=dp,
                                  num_training_steps=num_training_steps)

    # -- the engine --------------------------------------------------------------------------

    def _planned_steps(self) -> int | None:
        if self.args.max_steps > 0:
            return self.args.max_steps
        if self.train_dataset is None:
            return None
        return self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]

    def _build_engine(self, num_training_steps: int | None = None) -> Engine:
        """`trident.initialize` on the model, once; the Trainer's optimizer and scheduler
        become views of the engine's."""
        if self.engine is not None:
            return self.engine
        steps = num_training_steps if num_training_steps is not None else self._planned_steps()
        data = self._trident_config(num_training_steps=steps)
        model = self.model
        optimizer = self.optimizer if not isinstance(self.optimizer, EngineOptimizer) else None
        if optimizer is None and "optimizer" not in data:
            optimizer = self._optimizer_factory(model)
        scheduler = self.lr_scheduler if not isinstance(self.lr_scheduler, EngineScheduler) else None
        if scheduler is None and "scheduler" not in data:
            if steps is None:
                raise ValueError("TridentTrainer needs the run's length for the learning-rate schedule: set "
                                 "TrainingArguments.max_steps, give a train_dataset with a length, or put a "
                                 "scheduler section in the trident config")
            scheduler = functools.partial(self._hf_scheduler, steps)
        engine, _, _, _ = initialize(model=model, config=data, optimizer=optimizer, lr_scheduler=scheduler,
                                             mesh=self._trident_mesh())
        self.engine = engine
        self.model_wrapped = engine
        self.model = engine.module
        self.optimizer = EngineOptimizer(engine)
        self.lr_scheduler = EngineScheduler(engine)
        self._created_lr_scheduler = False
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        return engine

    def _hf_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer):
        """`TrainingArguments.lr_scheduler_type` over the engine's optimizer (the Trainer's own schedule)."""
        return get_scheduler(self.args.lr_scheduler_type, optimizer=optimizer,
                             num_warmup_steps=self.args.get_warmup_steps(num_training_steps),
                             num_training_steps=num_training_steps,
                             scheduler_specific_kwargs=self.args.lr_scheduler_kwargs)

    def _optimizer_factory(self, model: torch.nn.Module):
        """The optimizer the Trainer would build (`TrainingArguments.optim`, weight decay off for
        biases and norms), as a callable the engine applies to what it updates: the tp-split
        parameters, its ZeRO partitions, or its fp32 masters."""
        if self.optimizer_cls_and_kwargs is not None:
            cls, kwargs = self.optimizer_cls_and_kwargs
        else:
            cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
        kwargs = dict(kwargs)
        if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer) or \
                {"params", "model", "optimizer_dict"} & set(kwargs):
            raise ValueError(f"TridentTrainer cannot build TrainingArguments.optim = {self.args.optim!r} "
                             f"({getattr(cls, '__name__', cls)}) over the engine's parameters; give the trident "
                             "config an optimizer section, or pick a torch.optim optimizer (adamw_torch, sgd, ...)")
        weight_decay = self.args.weight_decay
        trainer = self

        def build(targets):
            targets = list(targets)
            if targets and isinstance(targets[0], dict):  # already grouped by the caller
                return cls(targets, **kwargs)
            names = {id(p): n for n, p in model.named_parameters()}
            if not all(id(t) in names for t in targets):  # 16-bit masters: copies without names
                return cls([{"params": targets, "weight_decay": weight_decay}], **kwargs)
            decay = set(trainer.get_decay_parameter_names(model))
            groups = [{"params": [t for t in targets if names[id(t)] in decay], "weight_decay": weight_decay},
                      {"params": [t for t in targets if names[id(t)] not in decay], "weight_decay": 0.0}]
            return cls([g for g in groups if g["params"]], **kwargs)
        return build

    def create_optimizer(self, model=None):
        """The engine builds the optimizer (`_build_engine`); before that there is none."""
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        return self.lr_scheduler

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self._build_engine(num_training_steps)

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        return self.engine if self.engine is not None else model

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        engine = self._build_engine(max_steps)
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return engine, train_dataloader

    def get_total_train_batch_size(self, args) -> int:
        return self._train_batch_size * args.gradient_accumulation_steps * self._data_parallel_size()

    # -- a training micro-step ---------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """Forward through the engine, `engine.backward`, `engine.step()` (which, on the
        accumulation boundary the Trainer's loop set, reduces, clips and steps)."""
        engine = self._build_engine()
        engine.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(engine, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or self.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        boundary = bool(self.accelerator.gradient_state.sync_gradients)
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(loss, scale_wrt_gas=False)
        if boundary:
            self.lr_scheduler.step_lr = engine.get_lr()
        engine.step()
        return loss.detach()

    def _clip_grad_norm(self, model):
        """The engine clipped to `gradient_clipping` (= max_grad_norm) in its step; its norm,
        before clipping, is the Trainer's `grad_norm`."""
        return self._engine_grad_norm()

    def _get_grad_norm(self, model, grad_norm=None):
        return self._engine_grad_norm() if grad_norm is None else grad_norm

    def _engine_grad_norm(self):
        return self.engine.get_global_grad_norm() if self.engine is not None else None

    # -- evaluation --------------------------------------------------------------------------

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        self._build_engine()  # every rank of the layout takes part in the forward
        return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test"):
        self._build_engine()
        return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        engine = self._build_engine()
        engine.eval()
        return super().prediction_step(engine, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    # -- saving and resuming -----------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights as the unmodified model names them: gathered from ZeRO-3
        partitions and merged from tp shards. Collective; every rank gets them (`save_model`
        writes a `PreTrainedModel` with `engine.save_pretrained` instead, a file at a time)."""
        engine = self.engine
        if engine is None:
            return None
        state = engine.consolidated_state_dict()
        mesh = engine.mesh
        if mesh is not None and mesh.tp_size > 1:
            from trident.tensor_parallel import merge_state_dicts, shard_specs
            shards: list = [None] * mesh.tp_size
            dist.all_gather_object(shards, {k: v.cpu() for k, v in state.items()}, group=mesh.tp_group)
            state = merge_state_dicts(shards, shard_specs(engine.module))
        return state

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model as `from_pretrained` reads it (collective: every rank calls it, rank 0 writes)."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call=_internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if isinstance(self.model, PreTrainedModel):  # trident's export: one output file gathered at a time
            self.engine.save_pretrained(output_dir)
            if self.args.should_save:
                self._save_alongside_model(output_dir)
        else:
            self._save(output_dir, state_dict=self.full_state_dict())
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def _save_alongside_model(self, output_dir: str) -> None:
        """What the Trainer writes next to the weights: the tokenizer / processor and the arguments."""
        processor = self.processing_class
        if processor is None:
            processor = getattr(self.data_collator, "tokenizer", None)
        if processor is not None:
            processor.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's checkpoint (optimizer state, masters, scheduler, counters; per rank under
        ZeRO) in `output_dir/global_stepN` (collective)."""
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(output_dir, tag=f"global_step{self.state.global_step}")

    def _save_scaler(self, output_dir: str) -> None:
        return None  # the engine's loss scaler is in its checkpoint

    def _load_scaler(self, checkpoint: str | None) -> None:
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The weights come with the engine's checkpoint: `train(resume_from_checkpoint=...)`
        loads it once the engine exists (`_prepare_for_training`); outside training, now."""
        if self.engine is not None and not self.is_in_train:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        if self.engine is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        from trident.checkpointing.state import resolve_tag
        if resolve_tag(checkpoint, None) is None:
            raise FileNotFoundError(f"{checkpoint} holds no trident engine checkpoint (a global_stepN folder with its "
                                    "'latest' file): it was not written by a TridentTrainer")
        path, _ = self.engine.load_checkpoint(checkpoint)
        if path is None:
            raise FileNotFoundError(f"no trident checkpoint could be loaded from {checkpoint}")

    def _load_best_model(self) -> None:
        """The best checkpoint's engine state (weights with it)."""
        if self.engine is None:
            return super()._load_best_model()
        self._load_optimizer_and_scheduler(self.state.best_model_checkpoint)
