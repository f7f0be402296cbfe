"""`trident plan` from the command line: presets, config files, explicit shapes, --params."""

from __future__ import annotations

import json

import pytest

from trident.cli.plan import main


def test_params_prints_model_states_per_zero_stage(capsys):
    assert main(["--params", "7.5e9", "--gpus", "64"]) == 0
    out = capsys.readouterr().out
    for figure in ("120.00GB", "31.41GB", "16.64GB", "1.88GB"):
        assert figure in out
    assert "per node host" in out and "cpu/cpu" in out


def test_params_json(capsys):
    assert main(["--params", "1e9", "--gpus", "8", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows[0] == {"stage": 0, "offload_optimizer": "none", "offload_params": "none",
                       "device_per_gpu": 16e9, "host_per_node": 0.0}


def test_search_table_and_json(capsys):
    assert main(["--model", "trident-demo", "--gpus", "4", "--gpu", "v100-32gb", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "layouts fit" in out and " 1  dp" in out
    assert main(["--model", "trident-demo", "--gpus", "4", "--top", "2", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert len(ranked) == 2 and ranked[0]["tokens_per_s_per_gpu"] >= ranked[1]["tokens_per_s_per_gpu"]


def test_config_layout(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                               "zero_optimization": {"stage": 1}, "tensor_parallel": {"size": 2}}))
    assert main(["--model", "gpt2-124m", "--gpus", "8", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "dp4 tp2 pp1 zero1 mb2" in out and "fits" in out and "tp all_reduce" in out
    assert main(["--model", "gpt2-124m", "--gpus", "8", "--config", str(cfg), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layout"]["zero_stage"] == 1 and data["workload"]["global_batch"] == 32


def test_hf_config_and_explicit_shape(tmp_path, capsys):
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 4096, "n_positions": 128}))
    assert main(["--model", str(hf), "--gpus", "2", "--top", "1"]) == 0
    by_file = capsys.readouterr().out
    assert main(["--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "4096", "--seq-len", "128",
                 "--gpus", "2", "--top", "1"]) == 0
    by_flags = capsys.readouterr().out
    assert by_file.splitlines()[4:] == by_flags.splitlines()[4:]  # same model, same ranking


@pytest.mark.parametrize("argv,message", [
    (["--model", "gpt5", "--gpus", "8"], "unknown model 'gpt5'"),
    (["--layers", "4", "--gpus", "8"], "needs all of --layers --hidden --heads --vocab"),
    (["--gpus", "8"], "say which model"),
    (["--params", "1e9", "--model", "gpt2-124m", "--gpus", "8"], "give --params or a model, not both"),
])
def test_bad_arguments_exit_2_with_the_reason(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_nothing_fits_exits_1(capsys):
    assert main(["--model", "gpt3-175b", "--gpus", "1", "--gpu", "v100-32gb"]) == 1
    assert "0 layouts fit" in capsys.readouterr().out
