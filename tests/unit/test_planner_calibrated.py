"""Issue 23 without processes: the GEMM curves, the cluster file, micro-batch choice, ZeRO-3's
per-module gathers and compressed communication priced by bytes."""

from __future__ import annotations

import json
import math

import pytest

from trident.cli.plan import main
from trident.planner import Layout, Workload, estimate, make_cluster, mixed_precision_bytes, model_preset
from trident.planner.cluster import (Calibration, CollectiveFit, calibrated_cluster, default_cluster_path,
                                     load_calibration, save_calibration)
from trident.planner.comm import GroupSpan, collective_time, data_parallel_traffic, zero3_module_elements
from trident.planner.compression import compression_from_config, error_notes
from trident.planner.gemm import GemmTable
from trident.planner.presets import GPU_PRESETS, ModelSpec
from trident.planner.search import fit_micro_batch

GRID = (32, 128, 512)


def _table(rate=lambda m, n, k: 1e10 * min(m, n, k) / (min(m, n, k) + 64)) -> GemmTable:
    points = tuple((m, n, k, 2.0 * m * n * k / rate(m, n, k)) for m in GRID for n in GRID for k in GRID)
    return GemmTable(GRID, GRID, GRID, points)


def _calibration(**kw) -> Calibration:
    fits = {op: CollectiveFit(100e-6, 1 / 1e9, 2) for op in
            ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "p2p")}
    base = dict(device="cpu", backend="gloo", world_size=2, threads=1, dtype="float32", gemm=_table(),
                memory_bandwidth=10e9, elementwise_bandwidth=5e9, op_seconds=10e-6,
                optimizer_seconds_per_param=2e-9, optimizer_seconds_per_tensor=20e-6, collectives=fits,
                memory_bytes=8 * 2**30)
    return Calibration(**{**base, **kw})


# ---- GEMM curves ---------------------------------------------------------------------------------

def test_gemm_table_is_exact_on_the_grid_and_log_linear_between():
    table = _table()
    for m, n, k, s in table.points:
        assert table.seconds(m, n, k) == pytest.approx(s)
    mid = table.rate(64, 128, 128)  # halfway (in log) between m = 32 and m = 128
    assert mid == pytest.approx(math.sqrt(table.rate(32, 128, 128) * table.rate(128, 128, 128)))
    assert table.rate(4096, 4096, 4096) == pytest.approx(table.rate(512, 512, 512))  # clamped at the edge
    assert GemmTable.from_json(json.loads(json.dumps(table.to_json()))) == table


def test_gemm_table_without_a_grid_point_is_refused():
    with pytest.raises(ValueError, match="no measurement"):
        GemmTable(GRID, GRID, GRID, _table().points[:-1])


def test_published_curve_is_slower_for_small_shapes_and_sustained_for_large():
    curve = GPU_PRESETS["a100-80gb"].gemm_curve()
    rate = lambda m, n, k: 2 * m * n * k / curve.seconds(m, n, k)  # noqa: E731
    big = rate(16384, 3 * 12288, 12288)
    assert big == pytest.approx(312e12 * 0.75, rel=0.02)  # the preset's sustained share
    assert rate(4096, 3 * 2048, 2048) < 0.95 * big  # a 2k-wide model's GEMMs run below a 12k-wide one's
    assert rate(64, 64, 64) < 0.05 * big  # launch- and memory-bound
    assert curve.quantization(128, 128, batch=108) == pytest.approx(0.93)  # a batch fills the SMs


# ---- the cluster file ----------------------------------------------------------------------------

def test_cluster_file_round_trip_and_default_location(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cluster_path() == tmp_path / "trident" / "cluster.json"
    cal = _calibration()
    path = save_calibration(cal)
    assert path == default_cluster_path() and load_calibration() == cal
    path.write_text(json.dumps({**json.loads(path.read_text()), "version": 99}))
    with pytest.raises(ValueError, match="calibrate again"):
        load_calibration(path)
    with pytest.raises(ValueError, match="--calibrate"):
        load_calibration(tmp_path / "missing.json")


def test_calibrated_collectives_scale_with_the_ring():
    fit = CollectiveFit(100e-6, 1e-9, 2)
    assert fit.seconds("all_reduce", 1e6, 2) == pytest.approx(100e-6 + 1e-3)
    # 4 ranks: 6 latency steps instead of 2, 2 x 3/4 of the bytes instead of 2 x 1/2
    assert fit.seconds("all_reduce", 1e6, 4) == pytest.approx(300e-6 + 1.5e-3)
    cluster = calibrated_cluster(_calibration())
    assert collective_time("all_gather", 1e6, GroupSpan(2, 2, 1), cluster) == pytest.approx(100e-6 + 1e-3)


def test_zero12_once_a_step_collectives_use_the_in_step_fits():
    """A CPU calibration times reduce-scatter and all-gather also one call at a time after compute
    (`<op>.in_step`): ZeRO-1/2's one of each per step is priced by those, ZeRO-3's per-module
    gathers by the back-to-back fits; without in-step fits both use the back-to-back ones."""
    slow = CollectiveFit(3e-3, 1 / 0.5e9, 2)
    cal = _calibration()
    cal = _calibration(collectives={**cal.collectives, "reduce_scatter.in_step": slow, "all_gather.in_step": slow})
    span = GroupSpan(2, 2, 1)
    assert collective_time("all_gather", 1e6, span, calibrated_cluster(cal), in_step=True) == pytest.approx(
        slow.seconds("all_gather", 1e6, 2))
    assert collective_time("all_gather", 1e6, span, calibrated_cluster(_calibration()), in_step=True) == \
        pytest.approx(100e-6 + 1e-3)
    model, w = ModelSpec("tiny", 2, 128, 4, 256, 64), Workload(64, 8, "fp32", "adamw")
    for stage, slower in ((1, True), (2, True), (3, False)):
        lay = Layout(dp=2, micro_batch=4, zero_stage=stage)
        fast = estimate(model, lay, calibrated_cluster(_calibration()), w).time.dp_comm_exposed
        measured = estimate(model, lay, calibrated_cluster(cal), w).time.dp_comm_exposed
        assert (measured > fast) is slower, stage


def test_calibrated_cluster_prices_compute_with_the_measured_table():
    model = ModelSpec("tiny", 2, 128, 4, 256, 64)
    cal = _calibration()
    est = estimate(model, Layout(dp=2, micro_batch=4), calibrated_cluster(cal), Workload(64, 8, "fp32", "adamw"))
    slow = estimate(model, Layout(dp=2, micro_batch=4),
                    calibrated_cluster(_calibration(gemm=_table(lambda m, n, k: 1e9))), Workload(64, 8, "fp32", "adamw"))
    assert slow.time.compute > 2 * est.time.compute
    assert est.time.optimizer == pytest.approx(model.num_parameters() * 2e-9 + (12 * 2 + 4) * 20e-6)


def test_fused_attention_goes_at_its_measured_rate_by_head_width():
    """A CPU's fused attention runs well below its GEMM rate, narrow heads slower still: with
    measured rates its FLOPs go at the rate of the model's head width (log-linear between the
    widths measured), forward once and backward twice."""
    from trident.planner.gemm import attention_rate
    rates = ((16, 1e9), (64, 4e9))
    assert attention_rate(rates, 32) == pytest.approx(2e9)  # halfway in log between 16 and 64
    assert attention_rate(rates, 8) == pytest.approx(1e9) and attention_rate(rates, 256) == pytest.approx(4e9)
    model, w = ModelSpec("tiny", 2, 128, 4, 256, 64), Workload(64, 8, "fp32", "adamw", attention="flash")
    lay = Layout(dp=2, micro_batch=4)
    fast = estimate(model, lay, calibrated_cluster(_calibration()), w).time.compute
    slow = estimate(model, lay, calibrated_cluster(_calibration(attention_rates=((32, 1e9),))), w).time.compute
    faster = estimate(model, lay, calibrated_cluster(_calibration(attention_rates=((32, 2e9),))), w).time.compute
    flops = 2 * 4 * 2 * 64 * 64 * 32 * 4 * 2  # (scores + values) x layers, b a batched [s, d] x [d, s]
    assert slow - faster == pytest.approx(3 * flops * (1 / 1e9 - 1 / 2e9))
    assert slow > fast  # the table's GEMM rate (up to 1e10) beats 1 GFLOP/s
    cal = _calibration(attention_rates=((32, 1e9), (64, 2e9)))
    assert Calibration.from_json(json.loads(json.dumps(cal.to_json()))) == cal


def test_cli_predicts_with_a_cluster_file(tmp_path, capsys):
    path = save_calibration(_calibration(), tmp_path / "c.json")
    assert main(["--layers", "2", "--hidden", "128", "--heads", "4", "--vocab", "256", "--seq-len", "64",
                 "--gpus", "2", "--cluster", str(path), "--global-batch", "8", "--precision", "fp32",
                 "--top", "2"]) == 0
    assert "calibrated-cpu" in capsys.readouterr().out
    assert main(["--model", "gpt2-124m", "--gpus", "2", "--cluster", str(tmp_path / "none.json")]) == 2


# ---- micro-batch left open -----------------------------------------------------------------------

def test_published_layout_without_micro_batch_gets_the_largest_that_fits():
    """Narayanan et al. 2021 Table 1, 1.7B on 32 A100s, batch 512: micro = global / dp = 16 per
    rank if one micro-batch per step; the planner picks the largest that fits and says so."""
    spec = ModelSpec("gpt-1.7b", 24, 2304, 24, 51200, 2048)
    w = Workload(2048, 512, "fp16", attention="eager", dropout=True)
    cluster = make_cluster("a100-80gb", 32)
    est = fit_micro_batch(spec, Layout(dp=32, activation_checkpointing="none"), cluster, w)
    assert est.fits and est.layout.micro_batch < 16
    bigger = estimate(spec, Layout(dp=32, micro_batch=2 * est.layout.micro_batch), cluster, w)
    assert not bigger.fits
    assert f"micro-batch {est.layout.micro_batch} chosen" in est.format()


def test_no_micro_batch_fits_says_bytes_by_category():
    est = fit_micro_batch(model_preset("gpt3-175b"), Layout(dp=8), make_cluster("a100-80gb", 8),
                          Workload(2048, 64))
    assert not est.fits and "no micro-batch fits" in est.notes[-1] and "activations" in est.notes[-1]


def test_cli_config_without_micro_batch_exits_0(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 512, "fp16": {"enabled": True}}))
    assert main(["--model", "gpt3-1.3b", "--gpus", "32", "--gpu", "a100-40gb", "--config", str(cfg)]) == 0
    assert "chosen: the largest that fits" in capsys.readouterr().out


# ---- ZeRO-3 per-module gathers -------------------------------------------------------------------

def test_zero3_pays_latency_per_module_and_reports_what_is_exposed():
    model, state = model_preset("gpt3-1.3b"), mixed_precision_bytes()
    cluster = make_cluster("a100-80gb", 64, 8)
    layout = Layout(dp=64, zero_stage=3, micro_batch=1)
    w = Workload(2048, 128)
    gathers = [t for t in data_parallel_traffic(model, layout, w, cluster, state) if t.op == "all_gather"]
    modules = len(zero3_module_elements(model, layout, w))
    assert modules == 4 * 24 + 1  # four linear layers a layer (norms persist) and the embedding
    assert [g.calls for g in gathers] == [2 * modules, 2 * modules]  # 2 micro-batches, forward and backward
    one_big = collective_time("all_gather", sum(g.bytes_per_call * g.calls for g in gathers),
                              GroupSpan(64, 8, 8), cluster)
    assert sum(g.seconds for g in gathers) > one_big  # latency x calls, not bytes / bandwidth alone
    est = estimate(model, layout, cluster, w)
    none = estimate(model, layout, cluster, Workload(2048, 128, zero3_prefetch_elems=0))
    assert none.time.zero3_gathers_exposed == pytest.approx(sum(g.seconds for g in gathers))
    assert 0 < est.time.zero3_gathers_exposed < none.time.zero3_gathers_exposed
    assert "per-module gathers" in est.format() and "exposed" in est.format()


# ---- compressed communication --------------------------------------------------------------------

def _grad_bytes(workload, stage=0):
    t = data_parallel_traffic(model_preset("gpt2-124m"), Layout(dp=8, zero_stage=stage), workload,
                              make_cluster("a100-80gb", 8), mixed_precision_bytes("fp32"))
    return t[0].bytes_per_call


def test_onebit_optimizers_send_about_a_32nd_after_freeze_step():
    for name in ("OneBitAdam", "ZeroOneAdam", "OneBitLamb"):
        key = "var_freeze_step" if name == "ZeroOneAdam" else "freeze_step"
        c = compression_from_config({"optimizer": {"type": name, "params": {key: 400}}})
        assert c.onebit == name and c.freeze_step == 400
        full, packed = _grad_bytes(Workload(1024, 8, "fp32")), _grad_bytes(Workload(1024, 8, "fp32", compression=c))
        assert packed == pytest.approx(full / 32 + 4 * 8)
        assert "400" in error_notes(c)[0]


def test_communication_data_type_and_zeropp_bytes():
    half = compression_from_config({"communication_data_type": "bf16"})
    assert _grad_bytes(Workload(1024, 8, "fp32", compression=half)) == pytest.approx(
        _grad_bytes(Workload(1024, 8, "fp32")) / 2)
    with pytest.raises(ValueError, match="communication_data_type"):
        compression_from_config({"communication_data_type": "int8"})
    model, cluster, state = model_preset("gpt3-1.3b"), make_cluster("a100-80gb", 64, 8), mixed_precision_bytes()
    layout = Layout(dp=64, zero_stage=3)
    plain = data_parallel_traffic(model, layout, Workload(2048, 64), cluster, state)
    zpp = compression_from_config({"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                                         "zero_quantized_gradients": True,
                                                         "zero_hpz_partition_size": 8}})
    quant = data_parallel_traffic(model, layout, Workload(2048, 64, compression=zpp), cluster, state)
    assert quant[0].bytes_per_call < 0.3 * plain[0].bytes_per_call  # int4 + scales vs 16-bit gradients
    assert quant[1].bytes_per_call == pytest.approx(plain[1].bytes_per_call / 2, rel=0.01)  # int8 weights
    assert quant[2].seconds < 0.5 * plain[2].seconds  # backward gathers inside the node (hpZ)
    assert len(error_notes(zpp)) == 3 and "scale/2" in error_notes(zpp)[0]


def test_hpz_secondary_partition_costs_memory():
    model, cluster = model_preset("gpt3-1.3b"), make_cluster("a100-80gb", 64, 8)
    layout = Layout(dp=64, zero_stage=3)
    hpz = compression_from_config({"zero_optimization": {"zero_hpz_partition_size": 8}})
    plain = estimate(model, layout, cluster, Workload(2048, 64)).memory.comm_buffers
    more = estimate(model, layout, cluster, Workload(2048, 64, compression=hpz)).memory.comm_buffers
    assert more - plain == pytest.approx(model.num_parameters() * 2 / 8)


def test_alpha_beta_fit_is_exact_on_a_line_and_lets_small_messages_set_the_latency():
    from trident.tools.calibrate import COMM_SIZES, fit_alpha_beta
    alpha, beta = fit_alpha_beta(COMM_SIZES, [2e-3 + s / 1e9 for s in COMM_SIZES])
    assert alpha == pytest.approx(2e-3) and beta == pytest.approx(1e-9)
    # 20% noise on the largest message: the latency moves by 2.5% (plain least squares: 8.7%)
    noisy = [2e-3 + s / 1e9 for s in COMM_SIZES[:-1]] + [1.2 * (2e-3 + COMM_SIZES[-1] / 1e9)]
    alpha, _ = fit_alpha_beta(COMM_SIZES, noisy)
    assert alpha == pytest.approx(2e-3, rel=0.03)
