"""Activation checkpointing in one process: same losses and gradients as without it (dropout
replayed exactly), the memory it saves against the planner's figure, the DeepSpeed-style knobs
and the config section."""

from __future__ import annotations

import pytest
import torch

from trident import checkpointing
from trident.config import load_config
from trident.config.errors import ConfigError
from trident.models.gpt import GPT, GPTConfig
from trident.parallel.rng import RNGTracker
from trident.planner import model_from_gpt_config
from trident.planner.memory import layer_activation_bytes
from trident.testing.memory import LiveTensorBytes

CFG = GPTConfig(vocab_size=64, seq_len=32, n_layer=4, n_head=4, d_model=64, dropout=0.1)


@pytest.fixture(autouse=True)
def fresh_settings():
    checkpointing.reset()
    yield
    checkpointing.reset()


def run(cfg: GPTConfig, layers=None, every: int = 1, steps: int = 2, **settings):
    """Losses and gradients of `steps` forward/backward passes (dropout on, same seed)."""
    torch.manual_seed(0)
    model = GPT(cfg)
    if settings:
        checkpointing.configure(None, **settings)
    wrapped = checkpointing.apply_activation_checkpointing(model, layers, every) if layers else []
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=g)
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        losses.append(loss.item())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}, wrapped


def assert_same(a, b) -> None:
    assert a[0] == b[0]
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=0, atol=0, msg=name)


def test_every_block_recomputed_gives_identical_losses_and_gradients_with_dropout():
    plain = run(CFG)
    ac = run(CFG, layers=[r"blocks\.\d+"])
    assert ac[2] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert_same(ac, plain)


def test_selective_every_second_block_and_by_name():
    assert run(CFG, layers=[r"blocks\.\d+"], every=2)[2] == ["blocks.0", "blocks.2"]
    mlps = run(CFG, layers=[r"blocks\.\d+\.mlp"])
    assert mlps[2] == [f"blocks.{i}.mlp" for i in range(4)]
    assert_same(mlps, run(CFG))


@pytest.mark.parametrize("settings", [dict(cpu_checkpointing=True),
                                      dict(contiguous_memory_optimization=True, number_checkpoints=4),
                                      dict(profile=True, synchronize=True)],
                         ids=["cpu", "contiguous", "profile"])
def test_knobs_keep_results_identical(settings):
    assert_same(run(CFG, layers=[r"blocks\.\d+"], **settings), run(CFG))
    if settings.get("profile"):
        timings = checkpointing.profile_timings()
        assert timings["calls"] == 8 and timings["forward_s"] > 0 and timings["recompute_s"] > 0


def test_too_few_contiguous_slots_is_named():
    with pytest.raises(RuntimeError, match="number_checkpoints=2 is too small"):
        run(CFG, layers=[r"blocks\.\d+"], contiguous_memory_optimization=True, number_checkpoints=2)


def test_contiguous_without_number_checkpoints_names_the_key():
    with pytest.raises(ValueError, match="activation_checkpointing.number_checkpoints"):
        checkpointing.configure(None, contiguous_memory_optimization=True)


def test_is_configured_and_deepspeed_config_values():
    assert not checkpointing.is_configured()
    cfg = load_config({"train_micro_batch_size_per_gpu": 1,
                       "activation_checkpointing": {"cpu_checkpointing": True, "synchronize_checkpoint_boundary": True,
                                                    "number_checkpoints": 3}})
    settings = checkpointing.configure(None, deepspeed_config=cfg)
    assert checkpointing.is_configured()
    assert settings.cpu_checkpointing and settings.synchronize and settings.number_checkpoints == 3
    assert not settings.partition_activations


def measured(cfg: GPTConfig, layers) -> tuple[int, int]:
    """(bytes kept when backward starts, peak bytes) of one forward/backward, model states excluded."""
    torch.manual_seed(0)
    model = GPT(cfg)
    if layers:
        checkpointing.apply_activation_checkpointing(model, layers)
    states = {p.untyped_storage().data_ptr() for p in model.parameters()}
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
    tracker = LiveTensorBytes(states)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION), tracker:
        loss = model(idx, idx)
        kept = tracker.live
        loss.backward()
    return kept, tracker.peak


def test_memory_saved_matches_the_planner():
    """With every block checkpointed a block keeps only its input (s b h e); the saving is
    n_layer x (the layer's full activations - its input), the planner's 'full' recompute."""
    cfg = GPTConfig(vocab_size=64, seq_len=64, n_layer=4, n_head=4, d_model=64, dropout=0.0)
    off, _ = measured(cfg, None)
    on, peak = measured(cfg, [r"blocks\.\d+"])
    spec = model_from_gpt_config(cfg)
    kw = dict(act_bytes=4, dropout=False, attention="flash")
    full = layer_activation_bytes(spec, 4, cfg.seq_len, checkpointing="none", **kw)
    kept = layer_activation_bytes(spec, 4, cfg.seq_len, checkpointing="full", **kw)
    # 1%: the planner leaves out the LayerNorms' saved mean and rstd (4 fp32 per token per
    # layer, 0.4% of the saving here).
    assert off - on == pytest.approx(cfg.n_layer * (full - kept), rel=0.01)
    assert on < 0.5 * off
    assert peak < off


@pytest.mark.parametrize("section,path", [({"number_checkpoints": 0}, "activation_checkpointing.number_checkpoints"),
                                          ({"every": 0}, "activation_checkpointing.every"),
                                          ({"layers": "blocks"}, "activation_checkpointing.layers"),
                                          ({"partition": True}, "activation_checkpointing.partition")])
def test_bad_section_values_name_the_json_path(section, path):
    with pytest.raises(ConfigError, match=path.replace(".", r"\.")):
        load_config({"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": section})


def test_layers_matching_nothing_is_an_error():
    with pytest.raises(ValueError, match="match no submodule"):
        checkpointing.apply_activation_checkpointing(GPT(CFG), [r"layers\.\d+"])


def test_invalid_layer_regex_names_the_json_path():
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.layers.*not a valid regular expression"):
        load_config({"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {"layers": ["blocks["]}})


class TrackerDropout(torch.nn.Module):
    """Dropout drawn from an RNGTracker stream (the model-parallel region), as Megatron layers do."""

    def __init__(self, tracker: RNGTracker, new_stream: str | None = None) -> None:
        super().__init__()
        self.fc, self.tracker, self.new_stream = torch.nn.Linear(8, 8), tracker, new_stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.new_stream is not None:
            self.tracker.unit_generators(self.new_stream, range(1))
        with self.tracker.fork():
            return torch.nn.functional.dropout(self.fc(x), 0.5)


def tracker_grads(checkpointed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layer = TrackerDropout(RNGTracker(seed=3))
    x = torch.randn(4, 8, requires_grad=True)
    out = checkpointing.checkpoint(layer, x) if checkpointed else layer(x)
    (out * torch.arange(8.0)).sum().backward()
    return out.detach(), layer.fc.weight.grad


def test_rng_tracker_streams_are_replayed_in_the_rerun():
    plain, ac = tracker_grads(False), tracker_grads(True)
    assert (plain[0] == 0).any()  # the dropout did drop something
    torch.testing.assert_close(ac[0], plain[0], rtol=0, atol=0)
    torch.testing.assert_close(ac[1], plain[1], rtol=0, atol=0)


def test_stream_created_inside_a_checkpoint_is_refused():
    layer = TrackerDropout(RNGTracker(seed=3), new_stream="late")
    with pytest.raises(RuntimeError, match=r"RNG streams \['late/0'\] were created inside a checkpointed function"):
        checkpointing.checkpoint(layer, torch.randn(2, 8, requires_grad=True))


def test_deepspeed_argument_names_are_accepted():
    settings = checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=2, checkpoint_in_cpu=True)
    assert settings.contiguous_memory_optimization and settings.number_checkpoints == 2 and settings.cpu_checkpointing
    with pytest.raises(ValueError, match="given twice"):
        checkpointing.configure(None, number_checkpoints=3, num_checkpoints=2)
