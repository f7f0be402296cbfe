"""`trident verify`: a correct layout passes, a planted bug is caught and its module named.

The planted bugs are rank-dependent (they act on rank 1 only), as real layout bugs are; the
serial reference runs in rank 0's process, so it never has them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.scripts.jobs import run_trident
from trident.config import load_config
from trident.tools.verify import reference_gpt, verify
from trident.models.toy import TinyMLP, make_regression_data
from trident.testing.distributed import run_on_ranks

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "seed": 5}


def verify_reference_gpt() -> tuple[str, bool]:
    cfg = load_config({**CONFIG, "model": {"preset": "tiny", "seq_len": 16, "dropout": 0.1}})
    return verify(cfg, reference_gpt, steps=2)


def test_data_parallel_gpt_matches_one_process():
    (text, ok), _ = run_on_ranks(2, verify_reference_gpt)
    assert ok, text
    lines = text.splitlines()
    assert lines[0].startswith("trident verify: pp 1 x dp 2 x tp 1, ZeRO stage 0, float32 against one process")
    assert [line.split()[0] for line in lines[2:4]] == ["1", "2"]  # one row per step
    assert any(line.strip().startswith("blocks.0.attn.qkv.weight") for line in lines)
    assert lines[-1] == "OK: the layout matches one process within rtol."


class ScaledOnRank1(torch.nn.Module):
    """Wraps a layer; on rank 1 its output is off by 1% (a rank-dependent forward bug)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        return out * 1.01 if dist.is_initialized() and dist.get_rank() == 1 else out


def mlp_with_forward_bug(config):
    model = TinyMLP(n_layers=3)
    model.layers[1] = ScaledOnRank1(model.layers[1])
    x, y = make_regression_data(32)
    return model, torch.utils.data.TensorDataset(x, y)


def verify_forward_bug() -> tuple[str, bool]:
    return verify(load_config({**CONFIG, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}),
                  mlp_with_forward_bug, steps=1)


def test_a_forward_bug_names_the_first_module_whose_output_differs():
    (text, ok), _ = run_on_ranks(2, verify_forward_bug)
    assert not ok
    # layers.1.inner's own output is fine; the wrapper layers.1 is the first to differ
    assert text.splitlines()[-1].startswith("MISMATCH: first divergence at step 1: the output of module layers.1 "
                                            "(micro-batch 2, call 0: relative error 1.00e-02"), text


@pytest.mark.launch
def test_verify_cli_catches_a_gradient_scaled_twice_on_one_rank(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**CONFIG, "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}))
    proc = run_trident(["verify", str(config), "--steps", "2", "--nproc", "2",
                        "--model", f"{SCRIPTS / 'verify_models.py'}:mlp_with_a_bug_on_rank_1"], timeout=180)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "trident verify: pp 1 x dp 2 x tp 1, ZeRO stage 0, float32 against one process, 2 step(s)" in out
    assert "MISMATCH: first divergence at step 1: the parameter gradient of module layers.1 (layers.1.weight: " in out
    table = out[out.index("max |parallel - serial| per parameter"):].splitlines()[1:7]
    worst = max(table, key=lambda line: float(line.split()[1]))
    assert worst.split()[0] == "layers.1.weight"
