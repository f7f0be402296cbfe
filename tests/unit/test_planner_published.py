"""Issue 35 without processes: every row of Narayanan et al. 2021's Tables 1 and 2 (PTD-P and
ZeRO-3 without model parallelism) within 20%, ZeRO-3's collapse with GPU count coming out of
the per-module schedule, GEMM rate by reduction depth on H100/H200, the loss's passes over the
logits, and the steps measured on one H200 within 0.8-1.25x."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from trident.planner import Layout, Workload, estimate, make_cluster, mixed_precision_bytes, model_preset
from trident.planner.comm import GroupSpan, collective_time, data_parallel_traffic, flat_collective_time
from trident.planner.compute import loss_bytes_per_logit
from trident.planner.presets import GPU_PRESETS, ModelSpec
from trident.planner.zero3 import Ops, play


def _bench():
    path = Path(__file__).resolve().parents[2] / "bench" / "planner_vs_published.py"
    spec = importlib.util.spec_from_file_location("planner_vs_published_35", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


BENCH = _bench()
NARAYANAN_ROWS = [r for r in BENCH.RUNS if r.source.startswith("Narayanan")]
ZERO3 = Workload(2048, 1536, "fp16", attention="eager", dropout=True)


# ---- the published rows ---------------------------------------------------------------------

def test_every_row_of_both_tables_is_in_the_bench():
    """Table 1: ten weak-scaling rows; Table 2: six PTD-P rows and six ZeRO-3 rows."""
    assert sum("weak scaling" in r.name for r in NARAYANAN_ROWS) == 10
    assert sum(r.name.startswith("Megatron-LM") and "weak" not in r.name for r in NARAYANAN_ROWS) == 6
    zero3 = [(r.model, r.gpus, r.layout.micro_batch, r.workload.global_batch, r.published_tflops)
             for r in NARAYANAN_ROWS if r.name.startswith("ZeRO-3")]
    assert zero3 == [("gpt3-175b", 384, 4, 1536, 144), ("gpt3-175b", 768, 2, 1536, 88),
                     ("gpt3-175b", 1536, 1, 1536, 44), ("mt-nlg-530b", 640, 4, 2560, 138),
                     ("mt-nlg-530b", 1120, 2, 2240, 98), ("mt-nlg-530b", 2240, 1, 2240, 48)]


@pytest.mark.parametrize("run", NARAYANAN_ROWS, ids=[f"{r.name} {r.gpus}" for r in NARAYANAN_ROWS])
def test_narayanan_row_within_20_percent(run):
    _, error = BENCH.row(run)
    assert abs(error) <= 0.20, f"{run.name} on {run.gpus} GPUs: predicted / published {1 + error:.2f}"


@pytest.mark.parametrize("name,measured,predicted", BENCH.gpu_rows(), ids=[r[0] for r in BENCH.H200_STEPS])
def test_h200_steps_within_080_to_125(name, measured, predicted):
    """shared/measurements/gpu-2026-11-27.md: the plain eager loop's median step on one H200."""
    assert 0.8 <= predicted / measured <= 1.25, f"{name}: predicted {predicted * 1e3:.1f} ms, measured " \
                                                f"{measured * 1e3:.1f} ms"


# ---- ZeRO-3's collapse at a fixed global batch ------------------------------------------------

def _zero3(gpus: int, micro: int, **network) -> object:
    return estimate("gpt3-175b", Layout(gpus, 1, 1, 3, micro, "full"), make_cluster("a100-80gb", gpus, 8, **network),
                    ZERO3).time


def test_zero3_collapses_as_gpus_are_added_at_a_fixed_batch():
    """Each GPU gathers every parameter three or four times a step whatever the GPU count while
    its share of the batch halves: past the point where the collectives outlast the compute the
    step stops shrinking and throughput per GPU halves with every doubling (published: 144, 88,
    44 TFLOP/s per GPU). Nothing in the model is fitted to those rows."""
    t = {n: _zero3(n, mb) for n, mb in ((384, 4), (768, 2), (1536, 1))}
    per_gpu = {n: x.hardware_flops_per_gpu for n, x in t.items()}
    assert per_gpu[384] / per_gpu[1536] > 2.5
    assert t[1536].step == pytest.approx(t[768].step, rel=0.10)  # bytes per GPU fixed: the step stays
    assert t[1536].compute < 0.55 * t[768].compute  # while the compute halves
    assert t[384].dp_comm_exposed < 0.4 * t[384].step < t[1536].dp_comm_exposed
    faster = _zero3(1536, 1, inter_node_bandwidth=2 * GPU_PRESETS["a100-80gb"].inter_node_bandwidth)
    assert faster.hardware_flops_per_gpu > 1.6 * per_gpu[1536]  # the network sets it


def test_ptdp_does_not_collapse_where_zero3_does():
    runs = [r for r in NARAYANAN_ROWS if r.name == "Megatron-LM GPT-3 175B"]
    rates = [r.predict().time.hardware_flops_per_gpu for r in runs]
    assert min(rates) > 0.85 * max(rates)


def test_zero3_collectives_are_flat_over_the_network():
    """A per-module gather over 64 ranks on 8 nodes: every rank's (n-1)/n S at its share of the
    network, not the NVLink-first hierarchy of stage 0-2's bucketed collectives."""
    cluster = make_cluster("a100-80gb", 64, 8)
    span, size = GroupSpan(64, 8, 8), 1e9
    flat = flat_collective_time("all_gather", size, span, cluster)
    inter = cluster.gpu.inter_node_bandwidth * 0.8
    assert flat == pytest.approx(56 * 3e-6 + 7 * 10e-6 + 63 / 64 * size / inter)
    assert flat > 5 * collective_time("all_gather", size, span, cluster)
    one_node = GroupSpan(8, 8, 1)
    assert flat_collective_time("all_gather", size, one_node, cluster) == collective_time("all_gather", size,
                                                                                          one_node, cluster)


# ---- the schedule's rules -------------------------------------------------------------------

def _ops(rows):
    ops = Ops()
    for elements, compute, gather, reduce in rows:
        ops.add(elements, compute, gather)
        ops.reduce[-1] = reduce
    return ops


def test_prefetch_hides_a_gather_behind_the_module_before_it():
    """Three modules of 1 s compute and 1 s gathers: without prefetch each gather waits in full
    (6 s); with one module of prefetch only the first is exposed (4 s); a gather issued ahead
    waits for the compute issued before it, so a small module before a large gather exposes the
    difference."""
    even = _ops([(10, 1.0, 1.0, 0.0)] * 3)
    assert play(even, 0) == pytest.approx(6.0)
    assert play(even, 10) == pytest.approx(4.0)
    # the large gather is issued as the small module starts, waits for the module before it
    # (done at 2 s), lands at 6 s: the small module's 0.2 s hide 0.2 s of its 4 s
    uneven = _ops([(10, 1.0, 1.0, 0.0), (10, 0.2, 1.0, 0.0), (40, 4.0, 4.0, 0.0)])
    assert play(uneven, 10) == pytest.approx(1.0 + 1.0 + 4.0 + 4.0)
    assert play(uneven, 20) == pytest.approx(10.0)  # deeper prefetch cannot beat the link: 6 s of gathers
    assert play(_ops([(10, 1.0, 1.0, 0.0), (10, 3.0, 1.0, 0.0), (40, 4.0, 1.0, 0.0)]), 10) == pytest.approx(9.0)


def test_reduce_scatters_share_the_link_with_the_gathers():
    ops = _ops([(10, 1.0, 1.0, 2.0), (10, 1.0, 1.0, 0.0)])
    assert play(ops, 10, reduce=False) == pytest.approx(3.0)
    assert play(ops, 10) == pytest.approx(1.0 + 1.0 + 2.0)  # the second gather queues behind the first op's


def test_reuse_distance_decides_which_backward_gathers_repeat():
    """Under full recomputation a layer's modules stay gathered from the recomputed forward to their
    backward while the gathers in between are within stage3_max_reuse_distance: a 1.3B layer (50M
    elements) keeps all of them by default, only its last with a distance of 0."""
    model, cluster, state = model_preset("gpt3-1.3b"), make_cluster("a100-80gb", 64, 8), mixed_precision_bytes()
    layout = Layout(dp=64, zero_stage=3, activation_checkpointing="full")

    def backward_calls(distance: int) -> int:
        w = Workload(2048, 64, zero3_max_reuse_distance=distance)
        return sum(t.calls for t in data_parallel_traffic(model, layout, w, cluster, state)
                   if t.op == "all_gather" and "backward (" in t.what)

    assert backward_calls(1_000_000_000) == 1  # the embedding, gathered again for its backward
    assert backward_calls(0) == 1 + 3 * 24  # qkv, proj and the MLP's input layer again in every layer


def test_zero3_gathered_buffers_are_modules_not_layers():
    """The 530B model on 640 GPUs at micro-batch 4 ran (Table 2): the gathered parameters are the
    running module and the one prefetched, not two whole layers."""
    est = estimate("mt-nlg-530b", Layout(640, 1, 1, 3, 4, "full"), make_cluster("a100-80gb", 640, 8),
                   Workload(2048, 2560, "fp16", attention="eager", dropout=True))
    assert est.fits
    mlp = 4 * 20480 * 20480
    assert est.memory.comm_buffers == pytest.approx(3 * mlp * 2 + 5e8 * 2, rel=0.01)  # + the kept last module


# ---- GEMM depth and the loss ------------------------------------------------------------------

def test_h100_gemm_rate_falls_with_reduction_depth_as_measured():
    h100, a100 = GPU_PRESETS["h100-80gb"].gemm_curve(), GPU_PRESETS["a100-80gb"].gemm_curve()
    rate = lambda c, k: 2 * 4096 * 4096 * k / (c.seconds(4096, 4096, k) - c.launch_seconds)  # noqa: E731
    assert rate(h100, 512) / rate(h100, 4096) == pytest.approx(543.1 / 783.3, rel=0.02)
    assert rate(h100, 768) < rate(h100, 1024) < rate(h100, 2048)
    assert rate(a100, 512) / rate(a100, 4096) == pytest.approx(1.0, rel=0.02)  # no table published: unchanged
    fused = h100.seconds(4096, 4096, 64, dtype_bytes=0)  # flash attention's loop runs over the sequence
    assert fused == pytest.approx(2 * 4096 * 4096 * 64 / (989e12 * 0.70 * h100.quantization(4096, 4096))
                                  + h100.launch_seconds)


def test_loss_passes_over_the_logits():
    assert loss_bytes_per_logit(2) == (22, 26) and loss_bytes_per_logit(4) == (16, 20)
    spec = ModelSpec("narrow", 2, 256, 4, 50304, 1024)
    w, lay = Workload(1024, 8, "bf16", "adamw", kernels="eager"), Layout(1, micro_batch=8)  # the eager loss
    gpu = GPU_PRESETS["h200-141gb"]
    small_vocab = estimate(replace(spec, vocab_size=256), lay, make_cluster("h200-141gb", 1), w).time.compute
    big_vocab = estimate(spec, lay, make_cluster("h200-141gb", 1), w).time.compute
    loss = 8 * 1024 * (50304 - 256) * 48 / (gpu.hbm_bandwidth * gpu.memory_efficiency)
    assert big_vocab - small_vocab > loss  # the passes, and the logits GEMMs on top


# ---- the same runs as a user passes them ----------------------------------------------------

def _cli(tmp_path, capsys, hf: dict, ds: dict, gpus: int, *flags: str) -> str:
    from trident.cli.plan import main
    model, config = tmp_path / "config.json", tmp_path / "ds.json"
    model.write_text(json.dumps(hf))
    config.write_text(json.dumps(ds))
    assert main(["--model", str(model), "--gpus", str(gpus), "--config", str(config), *flags]) == 0
    return capsys.readouterr().out


def _hfu_tflops(out: str) -> float:
    return float(out.split("HFU ")[1].split("%")[0]) / 100 * 312


def test_table_1_as_a_user_passes_it(tmp_path, capsys):
    """Narayanan et al.'s 1.7B from a GPT-2 config and a DeepSpeed config with recomputation, as
    Megatron-LM 2021 ran it: unfused softmax and dropout (`--attention eager --dropout`)."""
    hf = {"model_type": "gpt2", "n_embd": 2304, "n_layer": 24, "n_head": 24, "vocab_size": 51200,
          "n_positions": 2048}
    ds = {"train_batch_size": 512, "fp16": {"enabled": True}, "activation_checkpointing": {"layers": ["blocks"]}}
    out = _cli(tmp_path, capsys, hf, ds, 32, "--attention", "eager", "--dropout")
    assert _hfu_tflops(out) / 137 == pytest.approx(1.0, abs=0.20)


def test_a_saved_gpt2_config_says_how_the_model_trains(tmp_path, capsys):
    """A config.json as transformers saves it carries its dropout (GPT-2: attn_pdrop 0.1) and may
    name its attention kernel: the plan prices those without flags, and flags still win."""
    hf = {"model_type": "gpt2", "n_embd": 2304, "n_layer": 24, "n_head": 24, "vocab_size": 51200,
          "n_positions": 2048, "attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_implementation": "eager"}
    ds = {"train_batch_size": 512, "fp16": {"enabled": True}, "activation_checkpointing": {"layers": ["blocks"]}}
    from_config = _cli(tmp_path, capsys, hf, ds, 32)
    assert "eager attention, dropout" in from_config
    assert _hfu_tflops(from_config) / 137 == pytest.approx(1.0, abs=0.20)
    flags = _cli(tmp_path, capsys, {k: v for k, v in hf.items() if "drop" not in k and "attn_impl" not in k}, ds, 32,
                 "--attention", "eager", "--dropout")
    assert _hfu_tflops(flags) == _hfu_tflops(from_config)
    overridden = _cli(tmp_path, capsys, hf, ds, 32, "--attention", "flash", "--no-dropout")
    assert "flash attention" in overridden and ", dropout" not in overridden
    assert _hfu_tflops(overridden) > _hfu_tflops(from_config)


def test_zero3_settings_come_from_the_config(tmp_path, capsys):
    hf = {"model_type": "gpt2", "n_embd": 2048, "n_layer": 24, "n_head": 16, "vocab_size": 50257,
          "n_positions": 2048}
    ds = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
          "activation_checkpointing": {"layers": ["blocks"]},
          "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}}
    out = _cli(tmp_path, capsys, hf, ds, 64, "--json")
    est = json.loads(out)
    assert est["workload"]["zero3_max_reuse_distance"] == 0 and est["workload"]["zero3_prefetch_elems"] == 0
    backward = [t for t in est["traffic"] if "backward (one per module not kept" in t["what"]]
    assert backward[0]["calls"] == 1 + 3 * 24
