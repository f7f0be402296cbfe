"""The FLOPs profiler on one process: the reference GPT's count, the report, the config section.

The count. torch's flop counter counts matrix multiplies (2 FLOPs per multiply-accumulate; a
bias add or an embedding lookup counts nothing) and scaled_dot_product_attention as torch's
GPU kernels are counted: the whole T x T score matrix whether the mask is causal or not, 2
batched matmuls forward (Q K^T, then the scores times V) and 5 backward (the scores are
recomputed, then dV, dP, dQ, dK). Per token of a GPT with n_layer L, width d, context T:

    forward  = 2 N + 4 L T d        N = the weights of matmuls: L x 12 d^2 (qkv 3d^2, proj d^2,
    backward = 4 N + 10 L T d           fc 4d^2, proj 4d^2) + V d (the output layer; tied or not)
    training = 6 N + 14 L T d

(PaLM's MFU convention writes the attention term as 12 L T d: a backward of twice the forward;
the fused kernels' recomputed scores are the other 2 L T d.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trident.config import ConfigError, load_config
from trident.models.gpt import GPT, GPT_PRESETS, GPTConfig
from trident.monitor.flops_profiler import FlopsProfiler, get_model_profile
from trident.monitor.flops_report import merge, render
from trident.planner.peak import device_peak

VOCAB = 256


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, **GPT_PRESETS["tiny"]))


def gpt_flops_per_token(cfg: GPTConfig, seq: int) -> tuple[int, int]:
    """(forward, training) FLOPs per token by the formula in the module docstring."""
    n_matmul = cfg.n_layer * 12 * cfg.d_model ** 2 + cfg.vocab_size * cfg.d_model
    attention = cfg.n_layer * seq * cfg.d_model
    return 2 * n_matmul + 4 * attention, 6 * n_matmul + 14 * attention


def batch(cfg: GPTConfig, rows: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    return data[:, :-1], data[:, 1:]


def test_gpt_training_flops_are_6n_plus_attention():
    model = tiny_gpt()
    x, y = batch(model.config)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x, y).backward()
    prof.stop_profile()
    forward, training = gpt_flops_per_token(model.config, model.config.seq_len)
    assert prof.counted_tokens == x.numel()
    assert prof.get_total_flops() / x.numel() == pytest.approx(forward, rel=0.01)
    assert (prof.forward_flops + prof.backward_flops) / x.numel() == pytest.approx(training, rel=0.01)
    assert prof.get_total_macs() == prof.get_total_flops() // 2
    assert prof.get_total_params() == sum(p.numel() for p in model.parameters())
    blocks = [prof.modules[f"blocks.{i}"] for i in range(model.config.n_layer)]
    assert all(b.flops == blocks[0].flops > 0 and b.calls == 1 for b in blocks)
    assert prof.modules["lm_head"].flops == 2 * x.numel() * VOCAB * model.config.d_model
    assert prof.recompute_flops == 0


def test_attention_counts_the_whole_score_matrix_causal_or_not():
    q, k, v = (torch.randn(2, 4, 32, 8, requires_grad=True) for _ in range(3))
    counts = []
    for causal in (True, False):
        prof = FlopsProfiler(torch.nn.Identity())
        prof.start_profile()
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()
        prof.stop_profile()
        counts.append((prof.forward_flops, prof.backward_flops))
    scores = 2 * 2 * 4 * 32 * 32 * 8  # one batched [T, hd] x [hd, T]
    assert counts[0] == counts[1] == (2 * scores, 5 * scores)


def test_profiling_changes_no_result():
    model, twin = tiny_gpt(), tiny_gpt()
    x, y = batch(model.config)
    prof = FlopsProfiler(model)
    prof.start_profile()
    loss = model(x, y)
    loss.backward()
    prof.end_profile()
    reference = twin(x, y)
    reference.backward()
    assert torch.equal(loss, reference)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), twin.parameters()))


def test_report_lists_modules_down_to_module_depth_and_goes_to_output_file(tmp_path, capsys):
    model = tiny_gpt()
    x, y = batch(model.config)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x, y)
    out = tmp_path / "reports" / "flops.txt"
    prof.print_model_profile(profile_step=3, module_depth=1, top_modules=2, output_file=str(out))
    assert capsys.readouterr().out == ""  # the file, not stdout
    text = out.read_text()
    assert "Profile Summary at step 3:" in text and "Top 2 modules" in text
    assert any(line.startswith("GPT (the model): ") and "= 100% Params" in line for line in text.splitlines())
    lines = text.splitlines()
    for name in ("embed (Embedding)", "blocks (ModuleList)", "ln_f (LayerNorm)", "lm_head (Linear)"):
        assert any(line.startswith(f"  {name}: ") and "MACs" in line and "latency" in line for line in lines), name
    assert "blocks.0" not in text  # depth 2: below module_depth
    prof.print_model_profile(profile_step=3, module_depth=2, detailed=True)
    printed = capsys.readouterr().out
    assert "    blocks.0 (Block): " in printed and "blocks.0.attn" not in printed
    prof.print_model_profile(profile_step=3, detailed=False)
    assert "Detailed Profile" not in capsys.readouterr().out
    prof.end_profile()


def test_get_model_profile_as_deepspeed_returns_it():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    flops, macs, params = get_model_profile(model, input_shape=(3, 8), print_profile=False, as_string=False)
    assert (flops, macs, params) == (2 * 3 * (8 * 4 + 4 * 2), 3 * (8 * 4 + 4 * 2), 8 * 4 + 4 + 4 * 2 + 2)
    assert get_model_profile(model, args=[torch.ones(3, 8)], print_profile=False) == ("240 ", "120 MACs", "46")  # DeepSpeed's strings


def test_merge_adds_tensor_parallel_shards_and_pipeline_stages():
    """Two tp ranks of one stage and one rank of a second stage, then a second dp replica (left out)."""
    def rank(dp, pp, tp, modules, forward, tokens):
        return {"coords": {"dp": dp, "pp": pp, "tp": tp}, "modules": modules, "forward": forward, "backward": 2 * forward,
                "recompute": 0, "tokens": tokens, "forward_seconds": 0.5, "iter_seconds": 2.0,
                "root_params": (sum(m[3] for m in modules if m[2] == 1), sum(m[4] for m in modules if m[2] == 1))}
    stage0 = [("", "Pipe", 0, 0, 0, 0, 0.0, 0), ("0", "Block", 1, 50, 10, 100, 0.25, 1)]
    stage1 = [("", "Pipe", 0, 0, 0, 0, 0.0, 0), ("1", "Block", 1, 100, 10, 200, 0.4, 1)]
    ranks = [rank(0, 0, 0, stage0, 100, 64), rank(0, 0, 1, stage0, 100, 64), rank(0, 1, 0, stage1, 200, 64),
             rank(1, 0, 0, stage0, 100, 64)]
    profile = merge(ranks)
    assert profile["replica_ranks"] == 3 and profile["world"] == 4
    assert profile["modules"]["0"]["params"] == 2 * 50 + 10 and profile["modules"]["0"]["flops"] == 200
    assert profile["modules"][""]["params"] == 2 * 50 + 10 + 100 + 10
    assert profile["forward"] == 400 and profile["backward"] == 800 and profile["tokens"] == 64
    assert profile["modules"][""]["seconds"] == 1.0  # the two stages' forwards, one after the other
    text = render(profile, 1, layout={"world": 4, "dp": 2, "tp": 2, "pp": 2}, peak=(1e3, "a test peak"))
    assert "flops per token, fwd+bwd as counted:" in text and "18.75 " in text  # 1200 / 64
    assert "MFU = achieved / peak: " in text and "20.00% of" in text  # 1200 / 3 ranks / 2 s / 1e3
    assert "MFU:" not in render(profile, 1, peak=(1e3, "x")) and "n/a" in render(profile, 1, device="cpu")


def test_peak_comes_from_the_planner_presets_or_a_cpu_calibration(tmp_path):
    from tests.unit.test_planner_calibrated import _calibration
    from trident.planner.cluster import save_calibration

    assert device_peak("cuda", "NVIDIA H100 80GB HBM3", 80 * 2**30)[0] == 989e12
    assert device_peak("cuda", "Some Other GPU", 16 * 2**30) is None
    assert device_peak("cpu", cluster_file=tmp_path / "none.json") is None
    cal = _calibration()
    path = save_calibration(cal, tmp_path / "cluster.json")
    peak, source = device_peak("cpu", cluster_file=path)
    assert peak == cal.gemm.peak and "calibrated" in source and str(path) in source


def test_config_section_takes_deepspeed_keys_and_defaults():
    cfg = load_config({"flops_profiler": {"enabled": True, "recompute_fwd_factor": 1.0, "profile_step": 5,
                                          "module_depth": 2, "top_modules": 3, "detailed": False,
                                          "output_file": "out/flops.txt"}}).flops_profiler
    assert (cfg.enabled, cfg.recompute_fwd_factor, cfg.profile_step, cfg.module_depth, cfg.top_modules, cfg.detailed,
            cfg.output_file) == (True, 1.0, 5, 2, 3, False, "out/flops.txt")
    default = load_config({}).flops_profiler
    assert (default.enabled, default.recompute_fwd_factor, default.profile_step, default.module_depth,
            default.top_modules, default.detailed, default.output_file) == (False, 0.0, 1, -1, 1, True, None)


@pytest.mark.parametrize("section, message", [
    ({"profile_step": -1}, "flops_profiler.profile_step: expected a non-negative integer, got -1"),
    ({"module_depth": -2}, "flops_profiler.module_depth: expected an integer >= -1, got -2"),
    ({"top_modules": 0}, "flops_profiler.top_modules: expected a positive integer, got 0"),
    ({"recompute_fwd_factor": -0.5}, "flops_profiler.recompute_fwd_factor: expected a non-negative number"),
    ({"detailed": "yes"}, "flops_profiler.detailed: expected"),
    ({"output_file": 3}, "flops_profiler.output_file: expected a string or null, got 3"),
    ({"profile_stpe": 2}, "flops_profiler.profile_stpe: unknown key; did you mean 'profile_step'?"),
])
def test_bad_values_name_their_json_path(section, message):
    with pytest.raises(ConfigError) as err:
        load_config({"flops_profiler": {"enabled": True, **section}})
    assert message in str(err.value)


@pytest.mark.parametrize("reentrant", [True, False])
def test_recomputation_is_counted_in_backward_and_apart(reentrant):
    """Checkpointed blocks re-run their forward in backward: counted there, and as recomputation
    (non-reentrant checkpointing stops re-running once it has what backward needs)."""
    from torch.utils.checkpoint import checkpoint

    model, plain = tiny_gpt(), FlopsProfiler(tiny_gpt())
    x, y = batch(model.config)
    plain.start_profile()
    plain.model(x, y).backward()
    plain.stop_profile()
    for block in model.blocks:
        block.forward = (lambda f: lambda h: checkpoint(f, h, use_reentrant=reentrant))(block.forward)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x, y).backward()
    prof.stop_profile()
    blocks = sum(prof.modules[f"blocks.{i}"].flops for i in range(model.config.n_layer))
    assert prof.forward_flops == plain.forward_flops
    assert prof.backward_flops == plain.backward_flops + prof.recompute_flops
    assert (prof.recompute_flops == blocks) if reentrant else (0 < prof.recompute_flops < blocks)
