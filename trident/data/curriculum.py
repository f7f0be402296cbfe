"""DeepSpeed's legacy sequence-length curriculum (`curriculum_learning`, curriculum_type "seqlen").

`CurriculumScheduler` gives the sequence length of every step with DeepSpeed 0.19's formulas
(`deepspeed/runtime/data_pipeline/curriculum_scheduler.py`), step by step the same values:

  fixed_linear    floor(s / total x (max - min) + min), floored to a multiple of difficulty_step,
                  capped at max
  fixed_root      the same with (s / total) ** (1 / root_degree)
  fixed_discrete  difficulty[i] for the first i with s <= max_step[i]; difficulty[-1] after the last

where s is the step about to run: DeepSpeed's engine asks for `global_steps + 1` before each
forward (so the first step is s = 1), and keeps the length once it has reached max_difficulty.

`truncate` cuts a batch to the length: dimension 1 (the sequence) of every tensor with two or
more dimensions (a contiguous copy), as Megatron's GPT does with DeepSpeed's `curriculum_seqlen`; the trident
loader's batch dicts keep their token counts (`tokens`, `pad_tokens`, `row_tokens`) right.
"""

from __future__ import annotations

import math
from typing import Any

import torch

CURRENT = "current_difficulty"


class CurriculumScheduler:
    """DeepSpeed's `CurriculumScheduler` (the same state keys and methods), built from the
    `curriculum_learning` section (a typed section or DeepSpeed's dict)."""

    def __init__(self, config: Any) -> None:
        section = config.model_dump() if hasattr(config, "model_dump") else dict(config)
        schedule = {k: v for k, v in dict(section.get("schedule_config") or {}).items() if v is not None}
        self.state: dict[str, Any] = {
            "min_difficulty": section["min_difficulty"], "max_difficulty": section["max_difficulty"],
            CURRENT: section["min_difficulty"], "schedule_type": section["schedule_type"],
            "schedule_config": schedule}
        if self.state["schedule_type"] not in ("fixed_linear", "fixed_root", "fixed_discrete"):
            raise ValueError(f"curriculum_learning.schedule_type {self.state['schedule_type']!r} is not one of "
                             "fixed_linear, fixed_root, fixed_discrete")
        self.first_step = True

    # -- DeepSpeed's methods ---------------------------------------------------------------

    def get_current_difficulty(self) -> int:
        return self.state[CURRENT]

    def set_current_difficulty(self, difficulty: int) -> None:
        self.state[CURRENT] = difficulty

    def get_state(self) -> dict:
        return self.state

    def set_state(self, state: dict) -> None:
        self.state = state

    def get_difficulty(self, global_steps: int) -> int:
        """The schedule's length for step `global_steps` (1 = the first step)."""
        kind = self.state["schedule_type"]
        if kind == "fixed_discrete":
            return self._fixed_discrete(global_steps)
        return self._fixed_root(global_steps, 1 if kind == "fixed_linear" else None)

    def update_difficulty(self, global_steps: int) -> int:
        """Move to step `global_steps`'s length unless max_difficulty was reached; the length."""
        if self.state[CURRENT] < self.state["max_difficulty"]:
            self.state[CURRENT] = self.get_difficulty(global_steps)
        return self.state[CURRENT]

    def _fixed_discrete(self, global_steps: int) -> int:
        s = self.state["schedule_config"]
        if global_steps > s["max_step"][-1]:
            return s["difficulty"][-1]
        for i, last in enumerate(s["max_step"]):
            if global_steps <= last:
                return s["difficulty"][i]
        raise AssertionError("unreachable: global_steps is at most max_step[-1]")

    def _fixed_root(self, global_steps: int, root_degree: float | None) -> int:
        s, low, high = self.state["schedule_config"], self.state["min_difficulty"], self.state["max_difficulty"]
        if root_degree is None:
            root_degree = s["root_degree"]
        progress = (float(global_steps) / s["total_curriculum_step"]) ** (1.0 / root_degree)
        length = math.floor(progress * (high - low) + low)
        length -= length % s["difficulty_step"]
        return min(length, high)

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"state": dict(self.state), "first_step": self.first_step}

    def load_state_dict(self, saved: dict) -> None:
        """Continue a saved schedule: its current length; the configured schedule stays in force."""
        self.state[CURRENT] = saved["state"][CURRENT]
        self.first_step = saved["first_step"]


def truncate(obj: Any, seqlen: int) -> Any:
    """`obj` (a tensor, or tuples, lists and dicts of them) with dimension 1 of every tensor of
    two or more dimensions cut to its first `seqlen` positions. A trident loader batch (a dict with
    `tokens` / `pad_tokens` / `row_tokens`) gets its counts for the cut batch."""
    if isinstance(obj, torch.Tensor):
        return obj[:, :seqlen].contiguous() if obj.dim() >= 2 and obj.shape[1] > seqlen else obj
    if isinstance(obj, dict):
        out = {k: truncate(v, seqlen) for k, v in obj.items()}
        if "row_tokens" in obj and "tokens" in obj:
            rows = [min(n, seqlen) for n in obj["row_tokens"]]
            width = min(max(obj["tokens"] // max(len(rows), 1), 0), seqlen)
            out.update(row_tokens=rows, tokens=width * len(rows), pad_tokens=width * len(rows) - sum(rows))
        return out
    if isinstance(obj, (list, tuple)) and not isinstance(obj, str):
        items = [truncate(v, seqlen) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj
