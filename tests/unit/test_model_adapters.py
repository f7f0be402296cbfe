"""The `ModelAdapter` registry (trident.parallel.adapter): each family's adapter finds its models,
names their layers from the model trident was given, and a new family is one registration."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from trident.engine.compile import compile_targets
from trident.models.gpt import GPT, GPTConfig
from trident.parallel import adapter as registry
from trident.parallel.adapter import ModelAdapter, adapter_for, register_adapter, registered_families
from trident.pipeline import from_hf

TINY = dict(vocab_size=64, max_position_embeddings=16)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, **TINY),
    "mistral": lambda: transformers.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, **TINY),
    "qwen3": lambda: transformers.Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, **TINY),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                   num_attention_heads=4, **TINY),
    "mixtral": lambda: transformers.MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                                  **TINY),
    "olmo": lambda: transformers.OlmoConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, pad_token_id=1, eos_token_id=0, **TINY),
}
FAMILY = {"llama": "llama", "mistral": "llama", "qwen3": "llama", "gpt2": "gpt2", "gpt_neox": "gpt_neox",
          "mixtral": "mixtral", "olmo": "olmo"}


def hf_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]())


class Wrapper(nn.Module):
    """A user's module around a family's model (returns the loss)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


def tiny_gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16))


def test_every_family_registers_when_trident_is_imported():
    assert set(registered_families()) >= {"gpt", "llama", "gpt2", "gpt_neox", "mixtral", "olmo", "transformers"}
    assert registered_families()[-1] == "transformers"  # the fallback is asked last


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_each_transformers_family_finds_its_models(kind):
    model = hf_model(kind)
    adapter = adapter_for(model)
    assert isinstance(adapter, ModelAdapter)
    assert adapter.family == FAMILY[kind]
    layers = adapter.decoder_layers()
    assert len(layers) == 2 and all(model.get_submodule(name) is layer for name, layer in layers)
    embed, head = adapter.embedding_and_head()
    assert model.get_submodule(head) is model.get_output_embeddings()
    assert isinstance(model.get_submodule(embed), nn.Embedding)
    assert set(adapter.state_dict_names().values()) == set(model.state_dict())
    assert adapter.export_root() == ("", model)


def test_an_unknown_transformers_model_gets_the_shared_adapter():
    model = transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global"], 2]]))
    adapter = adapter_for(model)
    assert adapter.family == "transformers"
    with pytest.raises(ValueError, match=r"model_type 'gpt_neo' is not one trident has checked"):
        adapter.split_pipeline(2, stage_id=0)


def test_names_are_the_wrappers():
    model = Wrapper(hf_model("llama"))
    adapter = adapter_for(model)
    assert [n for n, _ in adapter.decoder_layers()] == ["inner.model.layers.0", "inner.model.layers.1"]
    assert adapter.embedding_and_head() == ("inner.model.embed_tokens", "inner.lm_head")
    assert adapter.state_dict_names()["inner.lm_head.weight"] == "lm_head.weight"
    assert adapter.export_root()[0] == "inner"


def test_gpt_adapter():
    gpt = tiny_gpt()
    adapter = adapter_for(Wrapper(gpt))
    assert isinstance(adapter, ModelAdapter) and adapter.family == "gpt"
    assert [n for n, _ in adapter.decoder_layers()] == ["inner.blocks.0", "inner.blocks.1"]
    assert adapter.embedding_and_head() == ("inner.embed.wte", "inner.lm_head")
    assert adapter.state_dict_names()["inner.lm_head.weight"] == "lm_head.weight"
    assert adapter.split_pipeline(2) is None and adapter.export_root() is None and adapter.export_record() is None
    with pytest.raises(ValueError, match="GPT splits itself over tp"):
        adapter.tensor_parallel_plan("auto", 2)


def test_a_plain_module_has_no_adapter():
    assert adapter_for(nn.Linear(2, 2)) is None
    with pytest.raises(ValueError, match=r"from_hf: Linear is not \(and holds no\) transformers causal LM"):
        from_hf(nn.Linear(2, 2), 2)


def test_a_stage_names_the_models_own_layers_for_compile():
    stage = from_hf(hf_model("llama"), 2, stage_id=1, partition_method="type:DecoderLayer")
    adapter = adapter_for(stage)
    assert adapter.family == "llama"
    (name, layer), = adapter.decoder_layers()
    assert name.endswith(".layer") and type(layer).__name__ == "LlamaDecoderLayer"
    assert [n for n, _ in compile_targets(stage)][0] == name
    assert set(adapter.state_dict_names().values()) <= set(hf_model("llama").state_dict())
    assert adapter.export_root() is None and adapter.export_record()["pipeline"]


class ToyAdapter:
    """The smallest family: a model class of its own, its blocks named for compile."""

    family = "toy"

    def __init__(self, root: nn.Module, model: "ToyModel") -> None:
        self.root, self.model = root, model

    @classmethod
    def find(cls, root: nn.Module) -> "ToyAdapter | None":
        return next((cls(root, m) for m in root.modules() if isinstance(m, ToyModel)), None)

    def decoder_layers(self):
        return [(f"stack.{i}", m) for i, m in enumerate(self.model.stack)]

    def __getattr__(self, name):  # the rest of the protocol is not needed by this test
        raise AttributeError(name)


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stack = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def test_a_new_family_is_one_registration(monkeypatch):
    monkeypatch.setattr(registry, "_FINDERS", dict(registry._FINDERS))  # leave the real registry as it was
    plain = ToyModel()
    assert compile_targets(plain) == [("", plain)]  # no family knows it: the whole model
    register_adapter("toy", ToyAdapter.find)
    model = ToyModel()
    assert adapter_for(model).family == "toy"
    assert [n for n, _ in compile_targets(model)] == ["stack.0", "stack.1"]
