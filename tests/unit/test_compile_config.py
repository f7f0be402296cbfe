"""The `compile` section: DeepSpeed's keys and defaults, DeepCompile refused by name, bad values
named by their JSON path; and which modules trident.engine.compile treats as blocks."""

from __future__ import annotations

import pytest
import torch

from trident.config import ConfigError, load_config
from trident.engine.compile import compile_targets
from trident.models.gpt import GPT, GPTConfig
from trident.models.gpt_pipe import gpt_pipe


def issue_of(config: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert len(info.value.issues) == 1, info.value.issues
    issue = info.value.issues[0]
    return f"{issue.path}: {issue.message}"


def test_defaults_are_deepspeeds_and_off():
    cfg = load_config({}).compile
    assert (cfg.enabled, cfg.backend, cfg.mode, cfg.fullgraph, cfg.kwargs) == (False, "inductor", None, False, {})
    assert cfg.compile_kwargs() == {"backend": "inductor"}


def test_named_keys_and_kwargs_become_torch_compile_arguments():
    cfg = load_config({"compile": {"enabled": True, "backend": "aot_eager", "fullgraph": True,
                                   "kwargs": {"dynamic": False}}}).compile
    assert cfg.compile_kwargs() == {"backend": "aot_eager", "fullgraph": True, "dynamic": False}
    cfg = load_config({"compile": {"options": {"max_autotune": True}}}).compile
    assert cfg.compile_kwargs() == {"backend": "inductor", "options": {"max_autotune": True}}


def test_deepcompile_is_refused_by_name():
    message = issue_of({"compile": {"enabled": True, "deepcompile": True}})
    assert message.startswith("compile.deepcompile: true asks for DeepCompile")
    assert "set compile.enabled" in message and "does not implement" in message


def test_deepcompile_off_and_its_tunables_are_ignored_with_a_note():
    cfg = load_config({"compile": {"enabled": True, "deepcompile": False, "free_activation": True,
                                   "passes": ["z3"]}})
    assert cfg.compile.enabled
    assert {n.path for n in cfg._notes} == {"compile.deepcompile", "compile.free_activation", "compile.passes"}


@pytest.mark.parametrize("section,expected", [
    ({"backend": "nope"}, "compile.backend: 'nope' is not a torch.compile backend"),
    ({"backend": "no_such_package.fn"}, "compile.backend: 'no_such_package.fn' is not a torch.compile backend"),
    ({"mode": "fast"}, "compile.mode: expected one of 'default', 'reduce-overhead'"),
    ({"fullgraph": "yes"}, "compile.fullgraph: expected true or false"),
    ({"kwargs": {"backend": "eager"}}, "compile.kwargs: ['backend'] are not torch.compile arguments"),
    ({"kwargs": {"mode": "fast"}}, "compile.kwargs: mode 'fast' is not a torch.compile mode"),
    ({"mode": "default", "kwargs": {"mode": "max-autotune"}}, "compile.kwargs: ['mode'] given both"),
    ({"mode": "max-autotune", "options": {"max_autotune": True}}, "compile.options: set together with mode"),
    ({"enable": True}, "compile.enable"),
])
def test_bad_values_name_their_key(section, expected):
    assert issue_of({"compile": section}).startswith(expected)


def test_an_importable_function_is_a_backend():
    assert load_config({"compile": {"backend": "torch._dynamo.backends.debugging.eager"}}).compile.enabled is False


def test_blocks_of_trident_models():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=61, seq_len=16, n_layer=2, n_head=2, d_model=32))
    assert [n for n, _ in compile_targets(gpt)] == ["blocks.0", "blocks.1"]
    stages = [gpt_pipe(GPTConfig(vocab_size=61, seq_len=16, n_layer=2, n_head=2, d_model=32), 2,
                       partition_method="uniform", stage_id=s) for s in (0, 1)]
    # every numbered layer with parameters; the tied embedding (layer 0 and the head) runs outside
    assert [[(n, type(m).__name__) for n, m in compile_targets(p)] for p in stages] == [
        [("1", "PositionEmbedding"), ("2", "PipeBlock")], [("3", "PipeBlock"), ("4", "FinalNorm")]]


def test_a_model_without_blocks_is_compiled_whole():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    assert compile_targets(model) == [("", model)]


def test_unset_scope_compiles_the_whole_model_on_a_gpu_where_nothing_must_stay_eager():
    from trident.config.schema import CompileConfig
    from trident.engine.compile import compile_scope

    auto = CompileConfig(enabled=True)
    assert compile_scope(auto, "cuda", whole_model_ok=True) == "model"
    assert compile_scope(auto, "cuda", whole_model_ok=False) == "blocks"   # ZeRO-3, tp, cp, pp, checkpointing
    assert compile_scope(auto, "cpu", whole_model_ok=True) == "blocks"
    assert compile_scope(CompileConfig(enabled=True, scope="model"), "cpu", whole_model_ok=False) == "model"
    assert compile_scope(CompileConfig(enabled=True, scope="blocks"), "cuda", whole_model_ok=True) == "blocks"
