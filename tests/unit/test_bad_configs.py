"""Bad configs and the exact error text each must produce: the JSON path and the advice."""

import json

import pytest

from trident.config import ConfigError, load_config, resolve_batch

BATCH = {"train_micro_batch_size_per_gpu": 4}

# (id, config, data-parallel size or None, substring the error must contain)
CASES = [
    ("unknown top-level key", {"gradient_cliping": 1.0}, None,
     "gradient_cliping: unknown key; did you mean 'gradient_clipping'? Allowed keys: train_batch_size,"),
    ("unknown nested key", {"fp16": {"loss_scal": 128}}, None,
     "fp16.loss_scal: unknown key; did you mean 'loss_scale'? Allowed keys: enabled, loss_scale,"),
    ("unknown key, nothing close", {"trainer": {"zzz": 1}}, None,
     "trainer.zzz: unknown key; remove it or fix the spelling. Allowed keys: train_steps,"),
    ("wrong type", {"train_micro_batch_size_per_gpu": "abc"}, None,
     "train_micro_batch_size_per_gpu: expected a positive integer, \"auto\" or null, got 'abc' (str)"),
    ("bool given as int", {"fp16": {"enabled": 1}}, None, "fp16.enabled: expected true or false, got 1 (int)"),
    ("section not an object", {"bf16": True}, None, "bf16: expected an object ({...}), got true (bool)"),
    ("negative clipping", {"gradient_clipping": -0.5}, None,
     "gradient_clipping: expected a non-negative number, got -0.5 (float); 0 disables clipping"),
    ("fp16 and bf16", {"fp16": {"enabled": True}, "bf16": {"enabled": True}}, None,
     "fp16.enabled: fp16.enabled and bf16.enabled are both true; enable at most one"),
    ("batch contradiction", {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                             "gradient_accumulation_steps": 2}, 2,
     "train_batch_size: 32 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x data-parallel "
     "size 2 = 16; change one of them (or drop train_batch_size and it is derived)"),
    ("batch not divisible", {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2,
     "train_batch_size: 30 is not divisible by train_micro_batch_size_per_gpu 4 x data-parallel size 2 = 8, so "
     "gradient_accumulation_steps = train_batch_size / (train_micro_batch_size_per_gpu x dp) is not whole"),
    ("batch per rank not whole", {"train_batch_size": 12, "gradient_accumulation_steps": 5}, 1,
     "train_batch_size: 12 is not divisible by gradient_accumulation_steps 5 x data-parallel size 1 = 5"),
    ("only gas given", {"gradient_accumulation_steps": 4}, 2,
     "train_micro_batch_size_per_gpu: neither train_batch_size nor train_micro_batch_size_per_gpu is set "
     "(train_batch_size unset, train_micro_batch_size_per_gpu unset, gradient_accumulation_steps 4, "
     "data-parallel size 2); set train_micro_batch_size_per_gpu"),
    ("zero bucket not whole", {"zero_optimization": {"stage": 2, "reduce_bucket_size": 2.5}}, None,
     "zero_optimization.reduce_bucket_size: expected a positive integer, got 2.5 (float)"),
    ("zero stage 7", {"zero_optimization": {"stage": 7}}, None,
     "zero_optimization.stage: expected one of 0, 1, 2, 3 (the ZeRO stage), got 7"),
    ("known but unimplemented ZeRO key", {"zero_optimization": {"stage": 1, "zeropp_loco_param": {"err_beta": 0.8}}},
     None, "zero_optimization.zeropp_loco_param: {\"err_beta\": 0.8} asks for ZeRO++ LoCo error feedback, which "
           "trident does not implement; remove the key or switch it off"),
    ("ZeRO++ below stage 3", {"zero_optimization": {"stage": 2, "zero_quantized_weights": True}}, None,
     "zero_optimization.zero_quantized_weights: true needs stage 3 (ZeRO++ works on partitioned parameters), "
     "but stage is 2; set stage to 3 or remove the key"),
    ("lower-precision gradients misspelt", {"communication_data_type": "float16"}, None,
     "communication_data_type: expected one of 'fp32', 'fp16', 'bf16' or null, got 'float16' (str)"),
    ("optimizer offload without ZeRO", {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     None, "offload_optimizer.device is 'cpu' but stage is 0; offload_optimizer needs stage >= 1"),
    ("DeepSpeed-only top-level section", {"autotuning": {"enabled": True}}, None,
     "autotuning: {\"enabled\": true} asks for DeepSpeed's autotuner (see `trident plan`), which trident does not "
     "implement"),
    ("FLOPs profiler step below 0", {"flops_profiler": {"enabled": True, "profile_step": -1}}, None,
     "flops_profiler.profile_step: expected a non-negative integer, got -1 (int)"),
    ("unknown optimizer type", {"optimizer": {"type": "AdamX", "params": {}}}, None,
     "optimizer.type: unknown optimizer type 'AdamX'; did you mean 'Adam'? Allowed optimizer types: Adam, AdamW, "
     "SGD, Adagrad, Lion"),
    ("DeepSpeed-only optimizer", {"optimizer": {"type": "MuAdam"}}, None,
     "optimizer.type: 'MuAdam' is a DeepSpeed optimizer that this version of trident does not implement"),
    ("unknown optimizer param", {"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}}, None,
     "optimizer.params.weight_decy: unknown key; did you mean 'weight_decay'?"),
    ("bad lr", {"optimizer": {"type": "SGD", "params": {"lr": -1}}}, None,
     "optimizer.params.lr: expected a non-negative number, got -1 (int)"),
    ("lr as a string", {"optimizer": {"type": "Adam", "params": {"lr": "1e-3"}}}, None,
     "optimizer.params.lr: expected a non-negative number, got '1e-3' (str)"),
    ("bad betas", {"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.0]}}}, None,
     "optimizer.params.betas: expected two numbers [beta1, beta2], each in [0, 1), got [0.9, 1.0] (list)"),
    ("three betas", {"optimizer": {"type": "Lion", "params": {"betas": [0.9, 0.99, 0.9]}}}, None,
     "optimizer.params.betas: expected two numbers [beta1, beta2]"),
    ("max_grad_norm", {"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, None,
     "optimizer.params.max_grad_norm: is not an optimizer parameter; use the top-level `gradient_clipping`"),
    ("nesterov without momentum", {"optimizer": {"type": "SGD", "params": {"nesterov": True}}}, None,
     "optimizer.params.nesterov: true needs momentum > 0 and dampening 0"),
    ("unknown scheduler type", {"scheduler": {"type": "CosineLR", "params": {}}}, None,
     "scheduler.type: unknown scheduler type 'CosineLR'"),
    ("scheduler type case", {"scheduler": {"type": "warmuplr"}}, None,
     "scheduler.type: unknown scheduler type 'warmuplr'; did you mean 'WarmupLR'?"),
    ("unknown scheduler param", {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}}, None,
     "scheduler.params.warmup_num_step: unknown key; did you mean 'warmup_num_steps'?"),
    ("missing scheduler param", {"scheduler": {"type": "WarmupDecayLR", "params": {}}}, None,
     "scheduler.params.total_num_steps: required; add it (a positive integer)"),
    ("bad warmup_type", {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}, None,
     "scheduler.params.warmup_type: expected one of 'log', 'linear', got 'cosine' (str)"),
    ("warmup_num_steps 0", {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}, None,
     "scheduler.params.warmup_num_steps: expected a positive integer, got 0 (int)"),
    ("timeout_s 0", {"distributed": {"timeout_s": 0}}, None,
     "distributed.timeout_s: expected a positive number, got 0 (int)"),
    ("steps_per_print negative", {"steps_per_print": -1}, None,
     "steps_per_print: expected a non-negative integer or null, got -1 (int)"),
    ("predivide factor 0", {"gradient_predivide_factor": 0.0}, None,
     "gradient_predivide_factor: expected a positive number, got 0.0 (float)"),
    ("alias and new name together", {"bfloat16": {"enabled": True}, "bf16": {"enabled": True}}, None,
     "bfloat16: `bfloat16` is the old name of `bf16` and both are given; keep only the new one"),
    ("hf auto outside the batch keys", {"gradient_clipping": "auto"}, None,
     "gradient_clipping: \"auto\" is a Hugging Face placeholder still unfilled; it is filled from "
     "TrainingArguments.max_grad_norm: call trident.config.fill_auto(config, training_args) first"),
    ("hybrid context parallelism without ulysses_size", {"context_parallel": {"size": 4, "method": "hybrid"}}, None,
     "context_parallel: method 'hybrid' needs ulysses_size dividing size=4, got None; Ulysses runs inside groups "
     "of ulysses_size ranks and the ring across them"),
    ("experts not divisible by ep", {"expert_parallel": {"size": 4}, "model": {"moe": {"num_experts": 6}}}, None,
     "model.moe.num_experts: 6 is not divisible by expert_parallel.size=4; each ep rank holds num_experts / ep "
     "experts, so choose a multiple of 4"),
    ("moe k above experts", {"model": {"moe": {"num_experts": 2, "k": 3}}}, None,
     "model.moe: k=3 is larger than num_experts=2; each token picks k distinct experts, so choose k <= num_experts"),
    ("unknown expert_parallel key", {"expert_parallel": {"num_experts": 8}}, None,
     "expert_parallel.num_experts: unknown key; remove it or fix the spelling. Allowed keys: size"),
    ("model type", {"model": {"type": "bert"}}, None, "model.type: expected one of 'gpt', got 'bert' (str)"),
    ("val_fraction 1", {"data": {"val_fraction": 1.0}}, None,
     "data.val_fraction: expected a number in [0, 1), got 1.0 (float)"),
    ("fp8 all-gather with rowwise", {"fp8": {"enabled": True, "recipe": "rowwise", "all_gather": True},
                                     "zero_optimization": {"stage": 3}}, None,
     "fp8.all_gather: true with fp8.recipe 'rowwise'; the float8 all-gather casts each weight with one scale "
     "(torchao's tensorwise recipe), a rowwise weight is cast per row inside each matmul: set fp8.recipe to "
     "\"tensorwise\" or fp8.all_gather to false"),
    ("fp8 all-gather below stage 3", {"fp8": {"enabled": True, "all_gather": True},
                                      "zero_optimization": {"stage": 2}}, None,
     "fp8.all_gather: true with zero_optimization.stage 2; the float8 all-gather of weights needs fp8.enabled "
     "true and zero_optimization.stage 3"),
    ("fp8 all-gather with offload_param", {"fp8": {"enabled": True, "all_gather": True}, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu"}}}, None,
     "fp8.all_gather: true with zero_optimization.offload_param.device 'cpu'; "),
    ("fp8 all-gather with qwZ", {"fp8": {"enabled": True, "all_gather": True}, "zero_optimization": {
        "stage": 3, "zero_quantized_weights": True}}, None,
     "fp8.all_gather: true with zero_optimization.zero_quantized_weights true; "),
]


def error_text(config: dict, dp_size: int | None) -> str:
    with pytest.raises(ConfigError) as info:
        cfg = load_config(config)
        if dp_size is not None:
            resolve_batch(cfg, dp_size)
    return str(info.value)


@pytest.mark.parametrize("config,dp_size,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_config_message(config, dp_size, expected):
    assert expected in error_text(config, dp_size)


def test_every_case_is_distinct():
    assert len(CASES) >= 20 and len({c[0] for c in CASES}) == len(CASES)


def test_json_syntax_error_names_file_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_micro_batch_size_per_gpu": 4,\n  "fp16": {"enabled": true,}\n}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"{path}: invalid JSON at line 3, column 28: Expecting property name" in str(info.value)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the config file .*; check the path"):
        load_config(tmp_path / "nope.json")


def test_duplicate_json_key_is_reported(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text(json.dumps({"seed": 1})[:-1] + ', "seed": 2}')
    with pytest.raises(ConfigError, match="key 'seed' appears twice in one JSON object; keep one"):
        load_config(path)


def test_top_level_must_be_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"expected a JSON object \{...\} at the top, got \[1, 2\] \(list\)"):
        load_config(path)
