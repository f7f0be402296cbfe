"""The Hugging Face Trainer arguments the config corpus is filled with (shared by
tests/unit/test_deepspeed_corpus.py and bench/ds_config_corpus.py, which runs without pytest)."""

from types import SimpleNamespace


def training_args(data: dict):
    """A TrainingArguments that agrees with the values the file fixes (as a user's would: the
    Trainer refuses a config that contradicts its arguments)."""
    from transformers import TrainingArguments

    def fixed(value, default):
        return value if isinstance(value, int) and not isinstance(value, bool) else default

    micro = fixed(data.get("train_micro_batch_size_per_gpu"), 4)
    accumulation = fixed(data.get("gradient_accumulation_steps"), 2)
    total = data.get("train_batch_size")
    if isinstance(total, int) and total != micro * accumulation:
        accumulation = fixed(data.get("gradient_accumulation_steps"), 1)
        micro = total // accumulation
    args = TrainingArguments(output_dir="/tmp/trident-unused", per_device_train_batch_size=micro,
                             gradient_accumulation_steps=accumulation, learning_rate=3e-5, weight_decay=0.01,
                             max_steps=100, warmup_steps=10, report_to=[])
    for section in ("fp16", "bf16"):  # set after construction: TrainingArguments checks for a GPU
        enabled = (data.get(section) or {}).get("enabled")
        if isinstance(enabled, bool):
            setattr(args, section, enabled)
    return args


MODEL = SimpleNamespace(config=SimpleNamespace(hidden_size=64))
