"""README's Hugging Face snippet ("Hugging Face checkpoints") runs as written (issue 32, item 8): a
transformers model from `trident.hf.from_pretrained`, trained through the engine with the model's own
`.loss`, saved with `engine.save_pretrained` and read back by `from_pretrained` without trident."""

from __future__ import annotations

import torch
import transformers

import trident
from trident.testing.distributed import cached_mesh, run_on_ranks


def readme_snippet(path: str) -> list[float]:
    mesh = cached_mesh()
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 3}}
    batches = torch.randint(0, 64, (4, 2, 8), generator=torch.Generator().manual_seed(0))
    # -- as in README.md --
    model = trident.hf.from_pretrained(path, mesh=mesh, config=cfg)   # a local safetensors folder
    engine, *_ = trident.initialize(model=model, config=cfg, mesh=mesh)
    losses = []
    for batch in batches:
        loss = engine(input_ids=batch, labels=batch).loss   # the model's own loss (labels shifted inside)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.save_pretrained(f"{path}/out")
    return losses


def test_readme_hf_snippet_runs(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    first, second = run_on_ranks(2, readme_snippet, str(tmp_path))
    assert first == second and first[-1] < first[0]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(reloaded).__name__ == "LlamaForCausalLM"
