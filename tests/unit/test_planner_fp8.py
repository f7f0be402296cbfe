"""The planner prices `fp8` runs: the dense GEMMs at the GPU preset's FP8 rate, plus their float8
casts at the memory bandwidth."""

from __future__ import annotations

import pytest

from trident.planner import Layout, Workload, estimate, make_cluster
from trident.planner.compute import fp8_cast_bytes, micro_batch_compute
from trident.planner.presets import GPU_PRESETS, MODEL_PRESETS


def test_fp8_rates_of_the_presets():
    assert GPU_PRESETS["h100-80gb"].fp8_peak_flops == GPU_PRESETS["h200-141gb"].fp8_peak_flops == 1979e12
    assert GPU_PRESETS["a100-80gb"].fp8_peak_flops is None and GPU_PRESETS["a100-80gb"].fp8_gemm_curve() is None
    assert GPU_PRESETS["h100-80gb"].fp8_gemm_curve().peak_flops == 1979e12


def compute(gpu: str, fp8: bool, model: str = "gpt3-1.3b"):
    spec = MODEL_PRESETS[model]
    w = Workload(2048, 64, fp8=fp8)
    return micro_batch_compute(spec, Layout(dp=1, micro_batch=4), w, make_cluster(gpu, 1), 0.0)


def test_fp8_halves_the_dense_gemms_on_h100_and_changes_nothing_on_a100():
    bf16, fp8 = compute("h100-80gb", False), compute("h100-80gb", True)
    # the dense GEMMs at 2x, plus the casts; attention, head, element-wise passes and kernels
    # unchanged: measured 0.82 (forward) and 0.89 (backward); 0.65 / 0.64 without the casts
    assert 0.75 < fp8.forward / bf16.forward < 0.9
    assert 0.8 < fp8.backward / bf16.backward < 0.95
    assert compute("a100-80gb", True) == compute("a100-80gb", False)  # no FP8 units: the 16-bit rate


def test_fp8_cast_bytes_by_hand():
    """gpt3-1.3b (h 2048, MLP 8192), micro-batch 4 x 2048 tokens (T = 8192), tp 1, bf16: each cast
    moves 2 x 2 + 1 = 5 bytes per element. Forward casts x and w of each GEMM [T, k] x [k, n]:
    qkv 8192*2048 + 6144*2048, out 8192*2048 + 2048*2048, MLP in 8192*2048 + 8192*2048, MLP out
    8192*8192 + 2048*8192 = 167,772,160 elements; backward the output gradient twice and x and w
    once: 130,023,424 + 54,525,952 + 167,772,160 + 117,440,512 = 469,762,048."""
    spec = MODEL_PRESETS["gpt3-1.3b"]
    fwd, bwd = fp8_cast_bytes(spec, Layout(dp=1, micro_batch=4), Workload(2048, 64, fp8=True))
    assert (fwd, bwd) == (5 * 167_772_160, 5 * 469_762_048)
    # On an H100 whose FP8 rate is its 16-bit one, FP8 costs exactly the casts: 24 layers at
    # 3350 GB/s x 0.8 sustained: 7.51 ms forward (313 us a layer), 21.0 ms backward.
    same_rate = make_cluster("h100-80gb", 1, fp8_peak_flops=989e12)
    w = Workload(2048, 64)
    bf16 = micro_batch_compute(spec, Layout(dp=1, micro_batch=4), w, same_rate, 0.0)
    fp8 = micro_batch_compute(spec, Layout(dp=1, micro_batch=4), Workload(2048, 64, fp8=True), same_rate, 0.0)
    assert fp8.forward - bf16.forward == pytest.approx(24 * 5 * 167_772_160 / (3350e9 * 0.8), rel=1e-9)
    assert fp8.backward - bf16.backward == pytest.approx(24 * 5 * 469_762_048 / (3350e9 * 0.8), rel=1e-9)


def test_fp8_estimate_is_faster_on_h100():
    cluster, layout = make_cluster("h100-80gb", 8), Layout(dp=8, micro_batch=4)
    bf16 = estimate("gpt3-1.3b", layout, cluster, Workload(2048, 256)).time
    fp8 = estimate("gpt3-1.3b", layout, cluster, Workload(2048, 256, fp8=True)).time
    assert fp8.compute < bf16.compute and fp8.tokens_per_s > bf16.tokens_per_s
    assert fp8.step == pytest.approx(fp8.compute + fp8.tp_comm + fp8.pp_comm + fp8.dp_comm_exposed + fp8.bubble
                                     + fp8.optimizer)


def test_trident_plan_prices_fp8_from_the_flag_and_from_the_config(capsys, tmp_path):
    import json
    from trident.cli.plan import main
    args = ["--model", "gpt3-1.3b", "--gpus", "8", "--gpu", "h100-80gb", "--json"]
    config = tmp_path / "ds.json"
    rates = {}
    for name, extra in (("bf16", []), ("flag", ["--fp8"])):
        assert main(args + extra) == 0
        rates[name] = json.loads(capsys.readouterr().out)
    best = [r["ranked"][0]["tokens_per_s_per_gpu"] for r in rates.values()]
    assert best[1] > 1.1 * best[0]  # measured 67.5k vs 58.0k tokens/s per GPU (85.1k without the casts)
    for fp8 in (False, True):
        config.write_text('{"train_batch_size": 256, "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": true}, '
                          f'"fp8": {{"enabled": {str(fp8).lower()}}}}}')
        assert main(args + ["--config", str(config)]) == 0
        rates[fp8] = json.loads(capsys.readouterr().out)["time"]["tokens_per_s"]
    assert rates[True] > 1.1 * rates[False]
