"""The planner's formulas against the published numbers they come from: ZeRO's model-state
figures, the training walls of GPT-3, Korthikanti et al.'s activation counts, alpha-beta
collective costs, and the FLOP accounting behind tokens/s and MFU."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from trident.models.gpt import GPT, GPTConfig
from trident.planner import (Layout, StateBytes, Workload, estimate, make_cluster, mixed_precision_bytes,
                             model_from_gpt_config, model_from_hf_config, model_preset, model_state_bytes,
                             trident_state_bytes, zero_paper_bytes, zero_state_table)
from trident.planner.comm import (GroupSpan, Link, all_reduce, collective_time, data_parallel_traffic, group_span,
                                  replica_gradient_bytes, ring_all_reduce, ring_all_reduce_wire_bytes, tree_all_reduce)
from trident.planner.memory import activation_memory, layer_activation_bytes, rank_parameters
from trident.planner.presets import GPU_PRESETS, MODEL_PRESETS, ModelSpec
from trident.planner.time import training_flops, training_flops_per_token

GB = 1e9  # the ZeRO paper's gigabyte


# ---- ZeRO's model states (Rajbhandari et al. 2020, Figure 1 and Table 1) ---------------------

@pytest.mark.parametrize("stage,paper_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1_for_7_5b_on_64_gpus(stage, paper_gb):
    """7.5B parameters, 64-way data parallelism, mixed-precision Adam (K = 12); the paper's
    figures are in GB of 1e9 bytes, rounded to one decimal (1.875 prints as 1.9)."""
    assert round(zero_paper_bytes(7.5e9, stage, 64) / GB, 1) == paper_gb


@pytest.mark.parametrize("params,n,expected_gb", [
    (7.5e9, 1024, (120, 30.1, 15.1, 0.12)),      # Table 1: 7.5B at Nd = 1024
    (1e12, 1024, (16000, 4011.7, 2013.7, 15.6)),  # Table 1: 1T at Nd = 1024
    (128e9, 64, (2048, 536, 284, 32)),
])
def test_zero_formulas_at_other_data_parallel_sizes(params, n, expected_gb):
    got = [zero_paper_bytes(params, s, n) / GB for s in range(4)]
    assert got == pytest.approx(expected_gb, rel=2e-3, abs=0.01)


def test_zero_formulas_in_closed_form():
    psi = 3e9
    for n in (1, 2, 8, 64, 1000):
        assert [zero_paper_bytes(psi, s, n) for s in range(4)] == pytest.approx(
            [16 * psi, 4 * psi + 12 * psi / n, 2 * psi + 14 * psi / n, 16 * psi / n])
    assert len({zero_paper_bytes(psi, s, 1) for s in range(4)}) == 1  # one rank: nothing to partition


def test_fp32_equivalents():
    """All-fp32 Adam: 4 + 4 bytes of weights and gradients, 8 of moments, no separate master."""
    fp32 = mixed_precision_bytes("fp32", "adam")
    assert fp32 == StateBytes(4, 4, 0, 8)
    got = [model_state_bytes(7.5e9, s, 64, fp32).total / GB for s in range(4)]
    assert got == pytest.approx([120, 60 + 60 / 64, 30 + 90 / 64, 120 / 64])


def test_trident_stage_0_keeps_fp32_gradients():
    """The engine's reducer holds one fp32 gradient buffer: 2 + 4 + 4 + 8 bytes under bf16."""
    assert trident_state_bytes(0, "bf16", "adamw") == StateBytes(2, 4, 4, 8)
    assert trident_state_bytes(2, "bf16", "adamw") == mixed_precision_bytes("bf16", "adamw")
    states = model_state_bytes(1000, 0, 2, trident_state_bytes(0, "bf16", "adamw"))
    assert states.as_dict() == {"parameters": 2000, "gradients": 4000, "optimizer_states": 12000}


def test_state_table_answers_deepspeeds_estimator_questions():
    rows = {(r.stage, r.offload_optimizer, r.offload_params): r for r in zero_state_table(7.5e9, 64, 8)}
    assert rows[(2, "none", "none")].device_per_gpu == pytest.approx(2 * 7.5e9 + 14 * 7.5e9 / 64)
    offloaded = rows[(2, "cpu", "none")]  # masters and moments move to the host, 8 ranks per node
    assert offloaded.device_per_gpu == pytest.approx(2 * 7.5e9 + 2 * 7.5e9 / 64)
    assert offloaded.host_per_node == pytest.approx(8 * 12 * 7.5e9 / 64)
    assert rows[(3, "cpu", "cpu")].device_per_gpu == pytest.approx(2 * 7.5e9 / 64)


def test_bad_stage_and_optimizer_are_named():
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3, got 4"):
        model_state_bytes(1, 4, 1, mixed_precision_bytes())
    with pytest.raises(ValueError, match="unknown optimizer 'adafactor'"):
        mixed_precision_bytes("bf16", "adafactor")


# ---- GPT-3's training walls (the issue's figures) ---------------------------------------------

def test_gpt3_total_flops_is_6_psi_tokens():
    assert training_flops(175e9, 300e9) == pytest.approx(3.15e23)


def test_gpt3_fp16_weights_are_350_gb_and_exceed_every_gpu():
    weights = model_state_bytes(175e9, 3, 1, mixed_precision_bytes("fp16")).parameters
    assert weights == pytest.approx(350 * GB)
    assert model_preset("gpt3-175b").num_parameters() * 2 == pytest.approx(350 * GB, rel=0.01)
    assert weights > max(g.memory_bytes for g in GPU_PRESETS.values())


def test_gpt3_gradient_traffic_of_128_replicas():
    """89.6 TB = 128 replicas x 175e9 fp32 gradients (700 GB each): the gradient bytes that enter
    one data-parallel reduction. A ring all-reduce sends 2 (N-1)/N of each replica's gradient,
    so the wire carries almost twice that."""
    assert replica_gradient_bytes(175e9, 128, 4) == pytest.approx(89.6e12)
    assert ring_all_reduce_wire_bytes(175e9, 128, 4) == pytest.approx(2 * 127 * 700 * GB)


def test_training_flops_per_token_is_about_6_psi_for_large_models():
    gpt3 = model_preset("gpt3-175b")
    model_flops, hw_flops = training_flops_per_token(gpt3, 2048, "full")
    assert model_flops / (6 * gpt3.num_parameters()) == pytest.approx(1.0, abs=0.05)
    h, l, s, v = gpt3.d_model, gpt3.n_layer, 2048, gpt3.vocab_size  # Narayanan et al.'s 96 B s l h^2 (...)
    assert hw_flops == pytest.approx(96 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)))


# ---- activations (Korthikanti et al. 2022) -------------------------------------------------------

SBH = dict(micro_batch=2, seq_len=2048)


def test_korthikanti_per_layer_activations():
    m = model_preset("gpt3-175b")
    s, b, h, a = 2048, 2, m.d_model, m.n_head
    sbh = s * b * h
    paper = dict(act_bytes=2, dropout=True, attention="eager")
    assert layer_activation_bytes(m, **SBH, **paper) == pytest.approx(sbh * (34 + 5 * a * s / h))
    for t in (2, 8):
        tensor_parallel = sbh * (10 + 24 / t + 5 * a * s / (h * t))
        assert layer_activation_bytes(m, **SBH, tp=t, **paper) == pytest.approx(tensor_parallel)
        assert layer_activation_bytes(m, **SBH, tp=t, sp=True, **paper) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
        assert layer_activation_bytes(m, **SBH, tp=t, sp=True, checkpointing="selective", **paper) == \
            pytest.approx(sbh / t * 34)
    assert layer_activation_bytes(m, **SBH, checkpointing="full", **paper) == pytest.approx(2 * sbh)


def test_first_pipeline_stage_holds_a_whole_model_of_activations():
    """1F1B keeps pp micro-batches in flight on stage 0: L/pp layers x pp = L layers' worth."""
    m = model_preset("gpt3-175b")
    w = Workload(2048, 64, attention="eager", dropout=True)
    layout = Layout(dp=1, tp=8, pp=8, micro_batch=1, sequence_parallel=True)
    per_layer = layer_activation_bytes(m, 1, 2048, tp=8, sp=True)
    assert activation_memory(m, layout, w) == pytest.approx(m.n_layer * per_layer)


# ---- presets ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,billions", [("gpt2-124m", 0.124), ("gpt3-175b", 174.6), ("bloom-176b", 176.2),
                                           ("llama-7b", 6.74), ("llama-13b", 13.0), ("llama-70b", 69.0),
                                           ("mt-nlg-530b", 529.6)])
def test_preset_parameter_counts_match_publications(name, billions):
    assert model_preset(name).num_parameters() / 1e9 == pytest.approx(billions, rel=0.005)


def test_trident_presets_count_like_the_reference_gpt():
    for name in ("trident-tiny", "trident-demo"):
        spec = MODEL_PRESETS[name]
        gpt = GPT(GPTConfig(vocab_size=spec.vocab_size, seq_len=spec.seq_len, n_layer=spec.n_layer,
                            n_head=spec.n_head, d_model=spec.d_model))
        assert spec.num_parameters() == gpt.num_parameters()
        assert model_from_gpt_config(gpt.config).num_parameters() == gpt.num_parameters()


def test_hf_config(tmp_path):
    cfg = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "vocab_size": 32000,
           "intermediate_size": 11008, "max_position_embeddings": 2048, "hidden_act": "silu", "rms_norm_eps": 1e-6,
           "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(__import__("json").dumps(cfg))
    assert model_from_hf_config(path).num_parameters() == model_preset("llama-7b").num_parameters()
    with pytest.raises(ValueError, match="none of the keys n_head, num_attention_heads"):
        model_from_hf_config({"n_layer": 2, "n_embd": 8, "vocab_size": 10})


def test_unknown_presets_list_the_choices():
    with pytest.raises(ValueError, match="unknown model 'gpt5'.*gpt2-124m"):
        model_preset("gpt5")
    with pytest.raises(ValueError, match="d_model=10 is not divisible by n_head=3"):
        ModelSpec("x", 2, 10, 3, 100, 16)


def test_rank_parameters_split_over_tensor_and_pipeline_ranks():
    m = model_preset("gpt3-175b")
    assert rank_parameters(m, 1, 1) == m.num_parameters()
    assert rank_parameters(m, 8, 1) == pytest.approx(m.num_parameters() / 8)
    busiest = rank_parameters(m, 8, 12) * 8
    assert m.num_parameters() / 12 < busiest < m.num_parameters() / 12 + m.vocab_size * m.d_model * 1.01


# ---- collectives ------------------------------------------------------------------------------

def test_alpha_beta_collectives():
    link = Link(bandwidth=100e9, latency=5e-6)
    assert ring_all_reduce(1e9, 8, link) == pytest.approx(14 * 5e-6 + 2 * 7 / 8 * 1e9 / 100e9)
    assert tree_all_reduce(1e9, 8, link) == pytest.approx(6 * 5e-6 + 2 * 1e9 / 100e9)
    assert all_reduce(1e9, 8, link) == ring_all_reduce(1e9, 8, link)   # big message: ring
    assert all_reduce(1e3, 512, link) == tree_all_reduce(1e3, 512, link)  # small, many ranks: tree
    assert ring_all_reduce(1e9, 1, link) == 0


def test_hierarchical_collective_uses_nvlink_inside_nodes():
    cluster = make_cluster("a100-80gb", 64, 8)
    one_node = collective_time("all_reduce", 1e9, GroupSpan(8, 8, 1), cluster)
    flat = collective_time("all_reduce", 1e9, GroupSpan(8, 1, 8), cluster)  # one rank per node
    both = collective_time("all_reduce", 1e9, GroupSpan(64, 8, 8), cluster)
    assert one_node < both < flat


def test_group_placement_follows_tp_innermost_rank_order():
    layout = Layout(dp=16, tp=2, pp=2)
    assert group_span("tp", layout, 8) == GroupSpan(2, 2, 1)
    assert group_span("dp", layout, 8) == GroupSpan(16, 4, 4)
    assert group_span("pp", layout, 8) == GroupSpan(2, 1, 2)


def test_zero_3_moves_one_and_a_half_times_the_data_of_stage_0():
    """ZeRO paper section 7: stages 1-2 cost the all-reduce's 2 Psi per rank, stage 3 3 Psi
    (every module gathered: no persistent ones)."""
    m, cluster = model_preset("gpt2-1.5b"), make_cluster("a100-80gb", 64, 8)
    w = Workload(1024, 64, zero3_persistence_threshold=0)
    state = mixed_precision_bytes()

    def wire(stage: int) -> float:
        total = 0.0
        for t in data_parallel_traffic(m, Layout(dp=64, zero_stage=stage), w, cluster, state):
            total += t.bytes_per_step * (2 if t.op == "all_reduce" else 1) * 63 / 64
        return total

    assert wire(1) == pytest.approx(wire(0)) and wire(2) == pytest.approx(wire(0))
    assert wire(3) == pytest.approx(1.5 * wire(0))


# ---- step time --------------------------------------------------------------------------------

def test_estimate_is_consistent():
    m, cluster = model_preset("gpt3-13b"), make_cluster("a100-80gb", 64, 8)
    w = Workload(2048, 512)
    est = estimate(m, Layout(dp=8, tp=8, micro_batch=1, activation_checkpointing="full"), cluster, w)
    t = est.time
    assert est.valid and est.fits
    assert t.step == pytest.approx(t.compute + t.tp_comm + t.pp_comm + t.dp_comm_exposed + t.bubble + t.optimizer)
    assert t.tokens_per_s == pytest.approx(w.tokens_per_step() / t.step)
    assert 0.2 < t.mfu < t.hfu < 0.75
    text = est.format()
    for needle in ("parameters", "optimizer states", "activations", "communication buffers", "fragmentation",
                   "tokens/s", "MFU", "dp all_reduce", "tp all_reduce"):
        assert needle in text
    assert math.isclose(est.to_dict()["time"]["step"], t.step)


def test_bubble_grows_with_stages_and_shrinks_with_interleaving():
    m, cluster = model_preset("gpt3-13b"), make_cluster("a100-80gb", 64, 8)
    w = Workload(2048, 64)
    plain = estimate(m, Layout(dp=2, tp=4, pp=8, micro_batch=1), cluster, w).time
    inter = estimate(m, Layout(dp=2, tp=4, pp=8, micro_batch=1, schedule="interleaved_1f1b", virtual_stages=5),
                     cluster, w).time
    # (p - 1) / v idle slots, each slot a little longer: interleaving sends v times as often
    assert plain.bubble > 0 and plain.bubble / 5 < inter.bubble < plain.bubble / 4


def test_invalid_layout_is_reported_not_hidden():
    est = estimate("gpt2-124m", Layout(dp=1, tp=5, pp=1), make_cluster("a100-80gb", 5, 5))
    assert not est.valid and "tp 5 does not divide the 12 attention heads" in est.problems[0]
    assert "INVALID" in est.format()


def test_published_runs_stay_within_20_percent(monkeypatch):
    """bench/planner_vs_published.py's claim, kept true: the Megatron-LM and BLOOM runs are
    predicted within 20% (MT-NLG is the documented miss, see bench/PLANNER.md)."""
    path = Path(__file__).resolve().parents[2] / "bench" / "planner_vs_published.py"
    spec = importlib.util.spec_from_file_location("planner_vs_published", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    for run in bench.RUNS:
        _, error = bench.row(run)
        if not run.name.startswith("MT-NLG"):
            assert abs(error) <= 0.20, f"{run.name} on {run.gpus} GPUs: {100 * error:+.0f}%"
