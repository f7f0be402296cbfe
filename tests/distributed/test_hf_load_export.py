"""transformers models loaded without a full copy and exported for `from_pretrained`.

- `trident.zero.Init` around `AutoModelForCausalLM.from_config`: each rank holds about half of
  the parameters (dp=2) and the values equal the model built without it (transformers'
  `_init_weights` runs on whole tensors, one module at a time).
- `trident.hf.from_pretrained` of a sharded safetensors checkpoint under ZeRO-3 (dp=2) and
  tp=2: each rank reads and holds about its share; the logits equal the single-process
  `transformers` load.
- Export after training, from ZeRO-3, tp=2 and pp=2: `engine.save_pretrained` and
  `trident checkpoint export-hf` of a trident checkpoint, reloaded by
  `AutoModelForCausalLM.from_pretrained` in a fresh process that never imports trident:
  the trained model's logits.
- A checkpoint folder with a missing shard, or a missing tensor: one error naming it.

Tiny fp32 models built from configs (vocabulary 63, so tp=2 pads it), nothing downloaded.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn

import trident
from trident.cli.main import main
from trident.hf.load import LoadError
from trident.tensor_parallel import merge_state_dicts, shard_specs
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.memory import LiveTensorBytes

VOCAB, SEQ = 63, 16


def hf_config(kind: str, **extra):
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                         eos_token_id=0, **extra)
    else:
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                          tie_word_embeddings=kind == "llama_tied", bos_token_id=0, eos_token_id=0,
                                          **extra)
    config._attn_implementation = "eager"
    return config


def n_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def save_reference(kind: str, folder: Path) -> nn.Module:
    """A tiny model saved by transformers in several shards (with its index)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(kind)).eval()
    model.save_pretrained(folder, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").exists()
    return model


# -- zero.Init ------------------------------------------------------------------------------------

def build_under_init(kind: str, extra: dict):
    from trident.zero.init import full_data
    torch.manual_seed(0)
    with trident.zero.Init(mesh=cached_mesh()):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(kind, **extra))
    params = list({id(p): p for p in model.parameters()}.values())
    held = sum(p._trident_shard.numel() * p._trident_shard.element_size() for p in params)
    whole_now = sum(p.data.numel() for p in params)
    return {n: full_data(p).clone() for n, p in model.named_parameters()}, held, whole_now


@pytest.mark.parametrize("kind,extra", [("gpt2", {}), ("llama", {"pad_token_id": 3}), ("llama_tied", {})])
def test_zero_init_partitions_a_transformers_model_and_initialises_it_like_one_process(kind, extra):
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(hf_config(kind, **extra))
    for (values, held, whole_now) in run_on_ranks(2, build_under_init, kind, extra):
        assert whole_now == 0
        assert held <= n_bytes(ref) / 2 + 4 * 64, (held, n_bytes(ref))
        for name, p in ref.named_parameters():
            assert torch.equal(values[name], p.detach()), name  # _init_weights ran on whole tensors
    if "pad_token_id" in extra:  # the padding row zeroed through the gathered weight
        assert not values["model.embed_tokens.weight"][3].any()


# -- from_pretrained ------------------------------------------------------------------------------

LAYOUTS = {
    "zero3": ({"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
               "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 3}}, {}),
    "dp2_tp2_zero3": ({"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
                       "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 3},
                       "tensor_parallel": {"size": 2, "plan": "auto"}}, {"tp": 2}),
    "tp2": ({"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
             "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "tensor_parallel": {"size": 2, "plan": "auto"}},
            {"tp": 2}),
}


def load_share(folder: str, layout: str):
    from trident.zero.init import GatheredParameters
    config, axes = LAYOUTS[layout]
    with LiveTensorBytes(set()) as mem:
        model = trident.hf.from_pretrained(folder, mesh=cached_mesh(**axes), config=config,
                                           attn_implementation="eager")
    report = dict(model.trident_load_report, peak=mem.peak)
    with torch.no_grad(), GatheredParameters(list(model.parameters())):
        logits = model(input_ids=ids()).logits
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return logits, report, state, shard_specs(model)


@pytest.mark.parametrize("layout", ["zero3", "tp2"])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama_tied"])
def test_from_pretrained_reads_and_holds_this_ranks_share(tmp_path, kind, layout):
    save_reference(kind, tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        want = ref(input_ids=ids()).logits
    total = n_bytes(ref)
    largest = max(p.numel() * 4 for p in ref.parameters())
    replicated = sum(p.numel() * 4 for n, p in ref.named_parameters() if p.dim() == 1)  # norms, biases: whole on tp
    ranks = run_on_ranks(2, load_share, str(tmp_path), layout)
    whole = merge_state_dicts([r[2] for r in ranks], ranks[0][3]) if layout == "tp2" else ranks[0][2]
    for name, t in ref.state_dict().items():
        assert torch.equal(whole[name], t), name  # the tensors transformers loads, bit for bit
    for logits, report, _, _ in ranks:
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-6)
        share = total / 2 + (replicated / 2 if layout == "tp2" else 0) + 32 * 4 * 4  # + vocab pad row / row ends
        assert report["bytes_read"] <= share, (report, total)
        assert report["parameter_bytes_held"] <= share, (report, total)
        assert report["bytes_read"] >= total / 2 * 0.9
        # while loading: the share plus one tensor in flight (safetensors' memory-mapped view of it
        # and the copy of the slice kept), never the whole model
        assert report["peak"] <= share + 2 * largest < total, (report, share, largest, total)


# -- export ----------------------------------------------------------------------------------------

class CausalLMLoss(nn.Module):
    """The engine needs a scalar loss; the transformers model stays unmodified inside."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, logits: bool = False) -> torch.Tensor:
        out = self.lm(input_ids=ids, labels=None if logits else ids)
        return out.logits if logits else out.loss


def train_and_export(folder: str, layout: str, out: str, ckpt: str):
    config, axes = LAYOUTS[layout]
    mesh = cached_mesh(**axes)
    model = trident.hf.from_pretrained(folder, mesh=mesh, config=config, attn_implementation="eager")
    engine, *_ = trident.initialize(model=CausalLMLoss(model), config=config, mesh=mesh)
    data = torch.randint(0, VOCAB, (6, SEQ), generator=torch.Generator().manual_seed(5 + mesh.dp_rank))
    for batch in data.split(2):
        engine.backward(engine(batch))
        engine.step()
    engine.eval()
    with torch.no_grad():
        logits = engine(ids(), logits=True)
    engine.save_pretrained(out, max_shard_size="20KB")
    engine.save_checkpoint(ckpt)
    return logits


FRESH = """
import json, sys
import torch, transformers
out = {}
for folder in sys.argv[1:-1]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        out[folder] = model(input_ids=torch.tensor(json.loads(sys.argv[-1]))).logits.tolist()
assert "trident" not in sys.modules, "trident was imported"
print(json.dumps(out))
"""


def fresh_logits(folders: list[Path], tokens: torch.Tensor, cwd: Path) -> dict[str, torch.Tensor]:
    """Logits of each folder loaded by transformers alone in a new interpreter (isolated mode:
    no PYTHONPATH, no current directory on the path)."""
    done = subprocess.run([sys.executable, "-I", "-c", FRESH, *map(str, folders), json.dumps(tokens.tolist())],
                          capture_output=True, text=True, cwd=cwd, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {k: torch.tensor(v) for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.parametrize("layout", ["zero3", "tp2"])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama_tied"])
def test_export_is_read_by_transformers_alone(tmp_path, kind, layout):
    src, out, ckpt, cli_out = (tmp_path / x for x in ("src", "exported", "ckpt", "cli"))
    ref = save_reference(kind, src)
    logits = run_on_ranks(2, train_and_export, str(src), layout, str(out), str(ckpt))
    torch.testing.assert_close(logits[0], logits[1])
    assert main(["checkpoint", "export-hf", str(ckpt), str(cli_out), "--max-shard-size", "20KB"]) == 0
    for folder in (out, cli_out):
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 1 and all(f.startswith("model-0000") and f"-of-{len(files):05d}" in f for f in files)
        weights = {k: v for f in files for k, v in load_file(str(folder / f)).items()}
        assert set(weights) == set(ref.state_dict()) - ({"lm_head.weight"} if kind != "llama" else set())
        embed = "transformer.wte.weight" if kind == "gpt2" else "model.embed_tokens.weight"
        assert weights[embed].shape[0] == VOCAB  # tp's vocabulary padding stripped
        assert json.loads((folder / "config.json").read_text())["architectures"] == [type(ref).__name__]
    got = fresh_logits([out, cli_out], ids(), tmp_path)
    for folder in (out, cli_out):
        torch.testing.assert_close(got[str(folder)], logits[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits[0], ref(input_ids=ids()).logits, atol=1e-4)  # training changed the model


def train_pp_and_export(folder: str, out: str, ckpt: str, tp: int = 1):
    """pp=2 (the model split by trident.initialize with `trident.pipeline.from_hf`), 1F1B; with
    `tp` each stage split by the model's plan too."""
    from trident.pipeline import hf_shard_specs, hf_state_dict
    mesh = cached_mesh(pp=2, tp=tp)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "pipeline": {"stages": 2, "schedule": "1f1b"},
              "tensor_parallel": {"size": tp, "plan": "auto" if tp > 1 else None}}
    model = trident.hf.from_pretrained(folder, mesh=mesh, config=config, attn_implementation="eager")
    engine, *_ = trident.initialize(model=model, config=config, mesh=mesh)
    data = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(5))
    for step in range(2):
        engine.train_batch(iter([(b, b) for b in data[step * 4:(step + 1) * 4].split(2)]))
    weights = {k: t.detach().clone() for k, t in hf_state_dict(engine.module).items()}
    engine.save_pretrained(out, max_shard_size="20KB")
    engine.save_checkpoint(ckpt)
    return weights, hf_shard_specs(engine.module), mesh.pp_rank


@pytest.mark.parametrize("kind,tp", [("gpt2", 1), ("llama", 1), ("llama_tied", 1), ("llama", 2)])
def test_export_from_pipeline_stages_is_read_by_transformers_alone(tmp_path, kind, tp):
    src, out, ckpt, cli_out = (tmp_path / x for x in ("src", "exported", "ckpt", "cli"))
    ref = save_reference(kind, src)
    ranks = run_on_ranks(2 * tp, train_pp_and_export, str(src), str(out), str(ckpt), tp)
    trained = transformers.AutoModelForCausalLM.from_config(hf_config(kind)).eval()
    stages = [merge_state_dicts([w for w, _, pp in ranks if pp == stage], next(s for _, s, pp in ranks if pp == stage))
              for stage in (0, 1)]
    merged = {**stages[1], **stages[0]}
    assert set(merged) >= set(ref.state_dict()) - {"lm_head.weight"}
    trained.load_state_dict(merged, strict=False)
    with torch.no_grad():
        logits = trained(input_ids=ids()).logits
        assert not torch.allclose(logits, ref(input_ids=ids()).logits, atol=1e-4)  # training changed the model
    assert main(["checkpoint", "export-hf", str(ckpt), str(cli_out), "--max-shard-size", "20KB"]) == 0
    for folder in (out, cli_out):
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(ref.state_dict()) - ({"lm_head.weight"} if kind != "llama" else set())
    got = fresh_logits([out, cli_out], ids(), tmp_path)
    for folder in (out, cli_out):
        torch.testing.assert_close(got[str(folder)], logits, rtol=1e-5, atol=1e-5)


def test_dp2_tp2_zero3_load_and_export(tmp_path):
    """Both at once on 4 ranks: each rank reads and holds a quarter; the export merges tp slices
    of ZeRO-3 partitions."""
    src, out, ckpt, cli_out = (tmp_path / x for x in ("src", "exported", "ckpt", "cli"))
    ref = save_reference("llama", src)
    with torch.no_grad():
        want = ref(input_ids=ids()).logits
    total = n_bytes(ref)
    for logits, report, _, _ in run_on_ranks(4, load_share, str(src), "dp2_tp2_zero3"):
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-6)
        assert total / 4 * 0.9 <= report["bytes_read"] <= total / 4 * 1.1, (report, total)
        assert report["parameter_bytes_held"] <= total / 4 * 1.1, (report, total)
    logits = run_on_ranks(4, train_and_export, str(src), "dp2_tp2_zero3", str(out), str(ckpt))
    assert main(["checkpoint", "export-hf", str(ckpt), str(cli_out), "--max-shard-size", "20KB"]) == 0
    got = fresh_logits([out, cli_out], ids(), tmp_path)
    for folder in (out, cli_out):
        torch.testing.assert_close(got[str(folder)], logits[0], rtol=1e-5, atol=1e-5)


# -- bad input ---------------------------------------------------------------------------------------

def test_export_of_a_checkpoint_with_a_missing_file_names_it(tmp_path, capsys):
    src, out, ckpt = tmp_path / "src", tmp_path / "exported", tmp_path / "ckpt"
    save_reference("llama", src)
    run_on_ranks(2, train_and_export, str(src), "zero3", str(out), str(ckpt))
    assert main(["checkpoint", "inspect", str(ckpt)]) == 0  # the manifest's transformers record is no obstacle
    gone = next((ckpt / (ckpt / "latest").read_text()).glob("zero_pp0_tp0_dp1.pt"))
    gone.unlink()
    capsys.readouterr()
    assert main(["checkpoint", "export-hf", str(ckpt), str(tmp_path / "cli")]) == 1
    assert f"{gone}: file missing" in capsys.readouterr().err
    plain = tmp_path / "no_hf"
    assert main(["checkpoint", "export-hf", str(ckpt), str(plain), "--dtype", "float33"]) == 1
    assert "float33" in capsys.readouterr().err


def test_missing_shard_or_tensor_is_named(tmp_path):
    save_reference("llama", tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    moved = tmp_path / shard
    moved.rename(tmp_path / "elsewhere")
    with pytest.raises(LoadError, match=f"{shard}: missing shard file.*model.safetensors.index.json"):
        trident.hf.from_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "elsewhere"))
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, str(moved), metadata={"format": "pt"})
    index["weight_map"].pop("model.layers.1.mlp.up_proj.weight")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(LoadError, match="has no tensor 'model.layers.1.mlp.up_proj.weight'"):
        trident.hf.from_pretrained(tmp_path)


def test_whole_load_without_a_layout_equals_transformers(tmp_path):
    ref = save_reference("gpt2", tmp_path)
    model = trident.hf.from_pretrained(tmp_path, attn_implementation="eager")
    assert model.lm_head.weight is model.transformer.wte.weight
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], t, rtol=0, atol=0)
    assert model.trident_load_report["bytes_read"] == n_bytes(ref)
    assert math.isclose(model.trident_load_report["parameter_bytes_held"], n_bytes(ref))
