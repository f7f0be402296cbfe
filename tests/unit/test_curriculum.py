"""DeepSpeed's legacy sequence-length curriculum (`curriculum_learning`): the length of every step
of a 100-step schedule equals DeepSpeed's formula for each schedule type, a resumed scheduler
continues the schedule, batches are cut right, and the config section is checked."""

from __future__ import annotations

import math

import pytest
import torch

from trident.config import ConfigError, load_config
from trident.data.curriculum import CurriculumScheduler, truncate
from trident.data.loader import collate

STEPS = 100
SCHEDULES = {
    "fixed_linear": {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
                     "schedule_config": {"total_curriculum_step": 70, "difficulty_step": 8}},
    "fixed_root": {"min_difficulty": 16, "max_difficulty": 120, "schedule_type": "fixed_root",
                   "schedule_config": {"total_curriculum_step": 80, "difficulty_step": 16, "root_degree": 2}},
    "fixed_root_cube_off_grid": {"min_difficulty": 12, "max_difficulty": 100, "schedule_type": "fixed_root",
                                 "schedule_config": {"total_curriculum_step": 60, "difficulty_step": 8,
                                                     "root_degree": 3}},
    "fixed_discrete": {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_discrete",
                       "schedule_config": {"difficulty": [8, 16, 32, 64], "max_step": [10, 25, 60]}},
}


def deepspeed_length(section: dict, step: int) -> int:
    """DeepSpeed 0.19's CurriculumScheduler.get_difficulty, written out from its definition
    (deepspeed/runtime/data_pipeline/curriculum_scheduler.py)."""
    low, high, s = section["min_difficulty"], section["max_difficulty"], section["schedule_config"]
    if section["schedule_type"] == "fixed_discrete":
        if step > s["max_step"][-1]:
            return s["difficulty"][-1]
        return next(d for d, last in zip(s["difficulty"], s["max_step"]) if step <= last)
    degree = 1 if section["schedule_type"] == "fixed_linear" else s["root_degree"]
    length = math.floor((float(step) / s["total_curriculum_step"]) ** (1.0 / degree) * (high - low) + low)
    length -= length % s["difficulty_step"]
    return min(length, high)


def deepspeed_run(section: dict, steps: int) -> list[int]:
    """The lengths DeepSpeed's engine trains steps 1..steps on: before each step's forward it calls
    update_difficulty(global_steps + 1), which moves only while the length is below max_difficulty."""
    current, out = section["min_difficulty"], []
    for global_steps in range(steps):
        if current < section["max_difficulty"]:
            current = deepspeed_length(section, global_steps + 1)
        out.append(current)
    return out


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_step_of_a_100_step_schedule_is_deepspeeds(name):
    section = SCHEDULES[name]
    scheduler = CurriculumScheduler(section)
    got = [scheduler.update_difficulty(global_steps + 1) for global_steps in range(STEPS)]
    assert got == deepspeed_run(section, STEPS)
    assert got[-1] == section["max_difficulty"] and len(set(got)) > 3  # the schedule did grow, to the end
    assert all(scheduler.get_difficulty(s) == deepspeed_length(section, s) for s in range(1, STEPS + 1))


def test_known_values_of_the_formulas():
    """A few lengths by hand: linear 8..64 over 70 steps, difficulty_step 8."""
    scheduler = CurriculumScheduler(SCHEDULES["fixed_linear"])
    # step 1: floor(1/70 * 56 + 8) = 8; step 10: floor(8 + 8) = 16; step 35: 36 -> 32; step 70+: 64
    assert [scheduler.get_difficulty(s) for s in (1, 10, 35, 69, 70, 90)] == [8, 16, 32, 56, 64, 64]
    root = CurriculumScheduler(SCHEDULES["fixed_root"])
    # sqrt(20/80) = 0.5: floor(0.5 * 104 + 16) = 68 -> 64 (multiple of 16)
    assert root.get_difficulty(20) == 64
    cube = CurriculumScheduler(SCHEDULES["fixed_root_cube_off_grid"])
    assert cube.get_difficulty(1) == 32  # (1/60) ** (1/3) * 88 + 12 = 34.5 -> 34 -> 32
    # a min_difficulty off the difficulty_step grid: DeepSpeed floors the first length below it
    off_grid = CurriculumScheduler({**SCHEDULES["fixed_linear"], "min_difficulty": 12})
    assert off_grid.get_difficulty(1) == 8


def test_resume_continues_the_schedule():
    section = SCHEDULES["fixed_root"]
    first = CurriculumScheduler(section)
    lengths = [first.update_difficulty(s + 1) for s in range(37)]
    saved = first.state_dict()
    resumed = CurriculumScheduler(section)
    resumed.load_state_dict(saved)
    assert resumed.get_current_difficulty() == lengths[-1]
    lengths += [resumed.update_difficulty(s + 1) for s in range(37, STEPS)]
    assert lengths == deepspeed_run(section, STEPS)


def test_discrete_schedule_stays_at_max_once_reached():
    """DeepSpeed stops moving once the length reaches max_difficulty, even if the list goes on."""
    section = {"min_difficulty": 8, "max_difficulty": 32, "schedule_type": "fixed_discrete",
               "schedule_config": {"difficulty": [8, 32, 16], "max_step": [3, 6]}}
    scheduler = CurriculumScheduler(section)
    assert [scheduler.update_difficulty(s) for s in range(1, 10)] == [8, 8, 8, 32, 32, 32, 32, 32, 32]
    assert deepspeed_run(section, 9) == [8, 8, 8, 32, 32, 32, 32, 32, 32]


def test_truncate_cuts_the_sequence_dimension_and_keeps_loader_counts():
    samples = [{"input_ids": torch.arange(8), "labels": torch.arange(1, 9), "pad_tokens": 3},
               {"input_ids": torch.arange(8), "labels": torch.arange(1, 9), "pad_tokens": 0}]
    batch = collate(samples)
    assert batch["row_tokens"] == [5, 8] and batch["pad_tokens"] == 3 and batch["tokens"] == 16
    cut = truncate(batch, 6)
    assert cut["input_ids"].shape == (2, 6) and torch.equal(cut["labels"][1], torch.arange(1, 7))
    assert cut["row_tokens"] == [5, 6] and cut["tokens"] == 12 and cut["pad_tokens"] == 1
    assert truncate(batch, 16)["input_ids"].shape == (2, 8)  # longer than the batch: unchanged
    x, y, mask4d = torch.zeros(2, 8, 4), torch.zeros(2, dtype=torch.long), torch.zeros(2, 1, 8, 8)
    cx, cy, cm = truncate((x, y, mask4d), 3)
    assert cx.shape == (2, 3, 4) and cy.shape == (2,) and cm.shape == (2, 1, 8, 8)  # dimension 1 only


def test_config_section_accepted_from_a_deepspeed_config_and_checked():
    cfg = load_config({"train_micro_batch_size_per_gpu": 1,
                       "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", **SCHEDULES["fixed_root"]}})
    assert cfg.curriculum_learning.enabled and cfg.curriculum_learning.schedule_config.root_degree == 2
    assert [CurriculumScheduler(cfg.curriculum_learning).update_difficulty(s) for s in (1, 20)] == [16, 64]
    assert not load_config({"train_micro_batch_size_per_gpu": 1,
                            "curriculum_learning": {"enabled": False}}).curriculum_learning.enabled
    bad = {
        "curriculum_learning.schedule_type": {"enabled": True, "min_difficulty": 8, "max_difficulty": 64},
        "curriculum_learning.schedule_config.root_degree": {**SCHEDULES["fixed_root"], "enabled": True,
                                                            "schedule_config": {"total_curriculum_step": 9,
                                                                                "difficulty_step": 8}},
        "curriculum_learning.min_difficulty": {**SCHEDULES["fixed_linear"], "enabled": True, "min_difficulty": 4},
        "curriculum_learning.schedule_config.difficulty": {**SCHEDULES["fixed_discrete"], "enabled": True,
                                                           "schedule_config": {"difficulty": [8, 16],
                                                                               "max_step": [5, 9]}},
        "curriculum_learning.curriculum_type": {**SCHEDULES["fixed_linear"], "enabled": True,
                                                "curriculum_type": "vocabularysize"},
    }
    for path, section in bad.items():
        with pytest.raises(ConfigError) as err:
            load_config({"train_micro_batch_size_per_gpu": 1, "curriculum_learning": section})
        assert path in str(err.value), (path, str(err.value))
