"""The `fp8` section: its errors, the hardware check, the module filter and the start-up line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchao.float8.float8_linear import Float8Linear  # the dev extra has torchao: missing, it fails

from trident.config import ConfigError, load_config
from trident.precision.fp8 import FP8Report, apply_fp8, check_fp8_hardware


def fp8(**section):
    return load_config({"fp8": {"enabled": True, **section}}).fp8


def test_section_defaults_and_errors_name_the_path():
    cfg = load_config({}).fp8
    assert (cfg.enabled, cfg.recipe, cfg.emulate, cfg.filter.convert, cfg.filter.skip) == (
        False, "tensorwise", False, [], [])
    with pytest.raises(ConfigError, match=r"fp8.recipe: expected one of 'tensorwise', 'rowwise', got 'delayed'"):
        fp8(recipe="delayed")
    with pytest.raises(ConfigError, match=r"fp8.filter.skip: entry 1, '\[', is not a valid regular expression"):
        fp8(filter={"skip": ["head", "["]})
    with pytest.raises(ConfigError, match="fp8.filter.keep: unknown key"):
        fp8(filter={"keep": ["head"]})
    with pytest.raises(ConfigError, match="fp8.enabled: true with parameter_server.servers > 0"):
        load_config({"fp8": {"enabled": True}, "parameter_server": {"servers": 1}})


def test_cpu_without_emulate_is_refused_saying_why():
    with pytest.raises(ConfigError, match=r"fp8.enabled: true, but the run computes on cpu, which has no FP8 "
                                          r"matmul units.*fp8.emulate to true"):
        check_fp8_hardware(fp8(), torch.device("cpu"))
    check_fp8_hardware(fp8(emulate=True), torch.device("cpu"))  # emulation runs anywhere


def model() -> nn.Module:
    blocks = nn.ModuleList(nn.ModuleDict({"fc": nn.Linear(16, 32), "proj": nn.Linear(32, 16)}) for _ in range(3))
    return nn.ModuleDict({"blocks": blocks, "head": nn.Linear(16, 8), "norm": nn.LayerNorm(16)})


def converted(m: nn.Module) -> list[str]:
    return [n for n, mod in m.named_modules() if isinstance(mod, Float8Linear)]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_filter_convert_and_skip_pick_the_layers(recipe):
    m = model()
    weight = m["head"].weight
    report = apply_fp8(m, fp8(recipe=recipe, emulate=True, filter={"skip": ["head", r"^blocks\.(0|2)\."]}),
                       torch.device("cpu"))
    assert converted(m) == report.converted == ["blocks.1.fc", "blocks.1.proj"]
    assert report.kept == {"blocks.0.fc": "fp8.filter.skip", "blocks.0.proj": "fp8.filter.skip",
                           "blocks.2.fc": "fp8.filter.skip", "blocks.2.proj": "fp8.filter.skip",
                           "head": "fp8.filter.skip"}
    assert m["head"].weight is weight
    m = model()
    apply_fp8(m, fp8(emulate=True, filter={"convert": [r"\.fc$"]}), torch.device("cpu"))
    assert converted(m) == ["blocks.0.fc", "blocks.1.fc", "blocks.2.fc"]
    with pytest.raises(ConfigError, match="fp8.filter: fp8.enabled is true but no linear layer was converted"):
        apply_fp8(model(), fp8(emulate=True, filter={"convert": ["nothing"]}), torch.device("cpu"))


def test_converted_layer_keeps_its_parameter_and_runs_emulated():
    lin = nn.Linear(16, 32)
    m = nn.Sequential(lin)
    weight = lin.weight
    apply_fp8(m, fp8(emulate=True), torch.device("cpu"))
    assert isinstance(m[0], Float8Linear) and m[0].weight is weight
    x = torch.randn(4, 16, requires_grad=True)
    y = m(x)
    y.sum().backward()
    assert weight.grad is not None and 0 < (y - lin_ref(weight, m[0].bias, x)).abs().max() < 0.1


def lin_ref(w, b, x):
    return torch.nn.functional.linear(x, w, b)


def test_start_up_line_folds_numbered_blocks():
    report = FP8Report("rowwise", True, ["blocks.0.fc", "blocks.1.fc", "blocks.0.proj"],
                       {"head": "fp8.filter.skip", "blocks.9.x": "fp8.filter.skip"})
    assert report.describe() == (
        "fp8 (rowwise, emulated): 3 linear layers run their matmuls in float8: blocks.*.fc (x2), blocks.*.proj; "
        "kept in the compute dtype: head, blocks.*.x (fp8.filter.skip)")
