"""`trident data prepare` then `trident train --nproc 2` on the shards: a blend of two corpora with
packing, then length bucketing under a token budget, and an automatic resume that continues at
the saved step (the data position comes back with it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scripts.jobs import run_trident, train_and_read_metrics

pytestmark = pytest.mark.launch


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("corpora")
    out = []
    for name, topic in (("law", "commandments"), ("poetry", "psalms")):
        src = folder / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": f"The {topic} number {i}: " + "and it was good. " * (i % 9)})
                               + "\n" for i in range(300)))
        proc = run_trident(["data", "prepare", str(src), "--tokenizer", "bundled", "--out", str(folder / name),
                            "--workers", "2", "--append-eod"], timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out.append(str(folder / name))
    return out


def _train(tmp_path: Path, data: dict, steps: int, name: str, **checkpoint) -> list[dict]:
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "model": {"type": "gpt", "preset": "tiny"}, "data": data,
              "trainer": {"train_steps": steps, "save_interval": 2}, "checkpoint": checkpoint}
    return train_and_read_metrics(tmp_path, config, name)


def test_packed_blend_trains_and_reports_padding(tmp_path, corpora):
    rows = _train(tmp_path, {"paths": corpora, "weights": [3, 1], "packing": True, "num_workers": 1}, 3, "packed")
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    assert all(0.0 <= float(r["pad_share"]) < 0.5 for r in rows)


def test_bucketed_run_resumes_at_the_saved_step(tmp_path, corpora):
    data = {"paths": corpora[:1], "bucketing": True, "max_tokens_per_batch": 256, "num_workers": 0}
    ckpt = {"path": str(tmp_path / "ckpt"), "save_interval": 2, "auto_resume": True}
    first = _train(tmp_path, data, 2, "first", **ckpt)
    assert [int(r["step"]) for r in first] == [1, 2]
    assert all(0.0 <= float(r["pad_share"]) < 1.0 for r in first)  # bucketing reports its padding
    resumed = _train(tmp_path, data, 4, "resumed", **ckpt)
    assert [int(r["step"]) for r in resumed] == [3, 4]
