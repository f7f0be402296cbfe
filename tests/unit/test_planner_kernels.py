"""Issue 45: the planner prices the kernels that run (`Workload.kernels`, `trident plan --kernels`):
eager PyTorch, torch.compile of each block, or hand-fused kernels; counted passes, not a factor."""

from __future__ import annotations

import json

import pytest

from trident.cli.plan import main
from trident.planner import Layout, Workload, estimate, make_cluster, model_preset
from trident.planner.kernels import FLASH_ATTENTION_SHARE, gated_activation_bytes, norm_bytes, rotary_bytes
from trident.planner.time import elementwise_bytes_fwd_bwd

LLAMA = model_preset("llama3-8b")
LAYOUT = Layout(8, 1, 1, 3, 2, "full")


def _step(kernels: str, gpu: str = "h100-80gb") -> float:
    w = Workload(8192, 16, "bf16", "adamw", kernels=kernels)
    return estimate(LLAMA, LAYOUT, make_cluster(gpu, 8), w).time.step


def test_eager_is_slower_than_compile_which_is_slower_than_fused():
    eager, compiled, fused = (_step(k) for k in ("eager", "compile", "fused"))
    assert eager > compiled > fused


def test_counted_passes_of_the_eager_ops():
    """Eager RMSNorm is six kernels with an fp32 upcast: 36 bytes per bf16 element forward, a
    fused norm 4; SwiGLU unfused 10 against 6; rotary's fp32 complex product 20 against 4."""
    assert norm_bytes("eager", "rmsnorm", 2) == (36, 62) and norm_bytes("compile", "rmsnorm", 2) == (4, 8)
    assert norm_bytes("eager", "layernorm", 2) == (4, 8)  # native_layer_norm is one kernel even eager
    assert gated_activation_bytes("eager", 2) == (10, 16) and gated_activation_bytes("fused", 2) == (6, 12)
    assert rotary_bytes("eager", 2) == (20, 20) and rotary_bytes("compile", 2) == (4, 8)
    w = {k: Workload(8192, 16, "bf16", kernels=k) for k in ("eager", "compile", "fused")}
    f = {k: elementwise_bytes_fwd_bwd(LLAMA, 8192, Layout(8), w[k]) for k in w}
    assert f["compile"] == f["fused"]  # the same element-wise passes; they differ in attention and the loss
    h, kv, ff = LLAMA.d_model, LLAMA.kv_dim, LLAMA.ff_dim
    assert f["eager"][0] - f["compile"][0] == pytest.approx(2 * (36 - 4) * h + (10 - 6) * ff + (20 - 4) * (h + kv))


def test_attention_goes_at_the_published_hopper_shares():
    assert FLASH_ATTENTION_SHARE["sdpa"] == 0.35 and FLASH_ATTENTION_SHARE["fused"] == pytest.approx(0.525)
    # compile and fused share the element-wise passes; what is left is attention and the loss
    assert _step("compile") > _step("fused")


def test_bad_kernels_name_the_choices():
    with pytest.raises(ValueError, match="kernels must be one of eager, compile, fused, got 'triton'"):
        Workload(1024, 8, kernels="triton")


def test_cli_kernels_default_follows_the_compile_section(tmp_path, capsys):
    base = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3}}
    runs = {}
    for name, extra, flags in (("eager", {}, []), ("compile", {"compile": {"enabled": True}}, []),
                               ("flag", {}, ["--kernels", "compile"]), ("fused", {}, ["--kernels", "fused"])):
        cfg = tmp_path / f"{name}.json"
        cfg.write_text(json.dumps({**base, **extra}))
        main(["--model", "llama3-8b", "--gpus", "8", "--gpu", "h200-141gb", "--config", str(cfg), "--json", *flags])
        data = json.loads(capsys.readouterr().out)
        runs[name] = (data["workload"]["kernels"], data["time"]["tokens_per_s_per_gpu"])
    assert [runs[n][0] for n in ("eager", "compile", "flag", "fused")] == ["eager", "compile", "compile", "fused"]
    assert runs["eager"][1] < runs["compile"][1] == runs["flag"][1] < runs["fused"][1]


def test_per_op_checkpointing_keeps_matmul_outputs_and_recomputes_the_rest():
    """ckpt="op": memory between full and none, recompute only the element-wise chain (no FLOPs)."""
    w = Workload(8192, 16, "bf16", "adamw", kernels="eager")
    cluster = make_cluster("h100-80gb", 8)
    est = {c: estimate(LLAMA, Layout(8, 1, 1, 3, 2, c), cluster, w) for c in ("none", "op", "full")}
    act = {c: e.memory.activations for c, e in est.items()}
    assert act["full"] < act["op"] < act["none"]
    step = {c: e.time.step for c, e in est.items()}
    assert step["none"] < step["op"] < step["full"]
    assert est["op"].time.hardware_flops_per_gpu == pytest.approx(est["op"].time.model_flops_per_gpu)
    kept = act["op"] / (2 * 8192 * LLAMA.n_layer)  # bytes per token and layer, plus the head's share
    h, kv, ff = LLAMA.d_model, LLAMA.kv_dim, LLAMA.ff_dim
    per_layer = 2 * (3 * h + h + 2 * kv + h + 2 * ff) + 4 * LLAMA.n_head
    assert kept >= per_layer
