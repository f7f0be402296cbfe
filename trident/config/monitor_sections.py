"""Config sections of the monitors that write to other tools (DeepSpeed's `wandb` and `comet`,
trident's `mlflow`) and of DeepSpeed's legacy `curriculum_learning` (the sequence length grows
over the first steps). `tensorboard` and `csv_monitor` are in `run_sections`.

Keys and defaults are DeepSpeed 0.19's (`deepspeed/monitor/config.py`,
`deepspeed/runtime/data_pipeline/curriculum_scheduler.py`); the libraries themselves are
optional (`pip install trident[monitors]`) and asked for only when a section is enabled.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trident.config.errors import ConfigError, ConfigIssue
from trident.config.section import Section

MONITOR_SECTIONS = ("tensorboard", "csv_monitor", "wandb", "comet", "mlflow")
"""Every monitor section of a config, in the order the monitors are built and written."""


class WandbConfig(Section):
    """Weights & Biases (DeepSpeed's `wandb` section): the run's scalars on rank 0, through `wandb`.

    Offline (files under `$WANDB_DIR/wandb/`, uploaded later with `wandb sync`) when WANDB_MODE
    says so or no W&B credentials are found (WANDB_API_KEY, a netrc entry)."""

    enabled: bool = Field(False, description="Log to Weights & Biases (needs the `wandb` package).")
    team: str | None = Field(None, description="W&B entity (team or user) of the run; null = your default.")
    group: str | None = Field(None, description="W&B group that gathers related runs.")
    project: str = Field("deepspeed", description="W&B project of the run.")


class CometConfig(Section):
    """Comet (DeepSpeed's `comet` section): the run's scalars on rank 0, through `comet_ml`.

    Offline (an archive under COMET_OFFLINE_DIRECTORY, uploaded later with `comet upload`) when
    `online` is false, or unset and no Comet API key is configured."""

    enabled: bool = Field(False, description="Log to Comet (needs the `comet_ml` package).")
    samples_log_interval: int = Field(100, ge=0, description=(
        "Log a metric again only after this many more samples (the x-axis is global samples)."))
    project: str | None = Field(None, description="Comet project; null = COMET_PROJECT_NAME or Comet's config.")
    workspace: str | None = Field(None, description="Comet workspace; null = COMET_WORKSPACE or Comet's config.")
    api_key: str | None = Field(None, description="Comet API key; null = COMET_API_KEY or Comet's config.")
    experiment_name: str | None = Field(None, description="Name shown for the experiment.")
    experiment_key: str | None = Field(None, description=(
        "Key of an experiment to continue (32-50 alphanumeric characters); null = a new one."))
    online: bool | None = Field(None, description=(
        "true: log to the Comet server; false: an offline archive; null: online when an API key is configured."))
    mode: Literal["get", "create", "get_or_create"] | None = Field(None, description=(
        'How the experiment starts: "get" continues experiment_key, "create" always starts a new one, '
        '"get_or_create" (Comet\'s default) either.'))


class MLflowConfig(Section):
    """MLflow (a trident section): the run's scalars on rank 0, through MLflow's tracking client."""

    enabled: bool = Field(False, description="Log to MLflow (needs `mlflow-skinny` or `mlflow`).")
    tracking_uri: str | None = Field(None, description=(
        "Where runs are stored: a server (http://...), a database (sqlite:///...), or a folder; null = "
        "MLFLOW_TRACKING_URI, else the local file store ./mlruns."))
    experiment_name: str | None = Field(None, description=(
        "Experiment of the run, created if missing; null = MLFLOW_EXPERIMENT_NAME, else \"Default\"."))
    run_name: str | None = Field(None, description="Name of the run; null = one MLflow makes up.")


class CurriculumScheduleConfig(Section):
    """`curriculum_learning.schedule_config`: the keys of the chosen `schedule_type`."""

    total_curriculum_step: int | None = Field(None, gt=0, description=(
        "fixed_linear / fixed_root: steps from min_difficulty to max_difficulty."))
    difficulty_step: int | None = Field(None, gt=0, description=(
        "fixed_linear / fixed_root: every length is floored to a multiple of this (8 for fp16 tensor cores)."))
    root_degree: float | None = Field(None, gt=0, description=(
        "fixed_root: the root of the progress (2 = square root; 1 = linear)."))
    difficulty: list[int] | None = Field(None, description="fixed_discrete: the lengths, in order.")
    max_step: list[int] | None = Field(None, description=(
        "fixed_discrete: the last step of each length but the last (one fewer than difficulty)."))


_NEEDS = {"fixed_linear": ("total_curriculum_step", "difficulty_step"),
          "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
          "fixed_discrete": ("difficulty", "max_step")}


class CurriculumLearningConfig(Section):
    """DeepSpeed's legacy `curriculum_learning` (curriculum_type "seqlen"): step s trains on
    sequences cut to the schedule's length for s (DeepSpeed's formulas, `trident.data.curriculum`)."""

    enabled: bool = Field(False, description="Grow the training sequence length by the schedule.")
    curriculum_type: Literal["seqlen"] = Field("seqlen", description=(
        'What grows: "seqlen", the tokens per sequence (DeepSpeed\'s only legacy type).'))
    min_difficulty: int | None = Field(None, gt=0, description="The first sequence length.")
    max_difficulty: int | None = Field(None, gt=0, description="The last sequence length.")
    schedule_type: Literal["fixed_linear", "fixed_root", "fixed_discrete"] | None = Field(None, description=(
        "How the length grows with the step."))
    schedule_config: CurriculumScheduleConfig = Field(default_factory=CurriculumScheduleConfig, description=(
        "The schedule's settings."))

    @model_validator(mode="after")
    def _complete(self) -> CurriculumLearningConfig:
        if not self.enabled:
            return self
        issues = [ConfigIssue(key, "required when curriculum_learning is enabled")
                  for key in ("min_difficulty", "max_difficulty", "schedule_type") if getattr(self, key) is None]
        if issues:
            raise ConfigError(issues)
        low, high, kind, sched = self.min_difficulty, self.max_difficulty, self.schedule_type, self.schedule_config
        if low > high:
            issues.append(ConfigIssue("min_difficulty", f"{low} is above max_difficulty {high}"))
        issues += [ConfigIssue(f"schedule_config.{key}", f"required by schedule_type {kind!r}")
                   for key in _NEEDS[kind] if getattr(sched, key) is None]
        if kind == "fixed_discrete" and not issues:
            if not sched.max_step or len(sched.difficulty) != len(sched.max_step) + 1:
                issues.append(ConfigIssue("schedule_config.difficulty", (
                    f"{len(sched.difficulty)} lengths for {len(sched.max_step)} max_step entries; give one length "
                    "more than max_step (the last length holds for every later step), at least two")))
            if any(d <= 0 for d in sched.difficulty):
                issues.append(ConfigIssue("schedule_config.difficulty", "every length must be a positive integer"))
        elif kind != "fixed_discrete" and not issues and low < sched.difficulty_step:
            # DeepSpeed floors each length to a multiple of difficulty_step: the first would be 0 tokens
            issues.append(ConfigIssue("min_difficulty", (
                f"{low} is below schedule_config.difficulty_step {sched.difficulty_step}: the schedule floors "
                f"every length to a multiple of difficulty_step, so the first steps would train on 0 tokens; "
                f"set min_difficulty to at least {sched.difficulty_step}")))
        if issues:
            raise ConfigError(issues)
        return self
