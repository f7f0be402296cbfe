"""Which configs of tests/data/deepspeed_configs/ DeepSpeed itself accepts (bench venv only).

    .venv-bench/bin/python bench/ds_config_corpus.py

Parses every corpus file with DeepSpeed's own `DeepSpeedConfig` in a one-process gloo world
(world size 1, so the batch-size triangle is checked as on one GPU), as it is and, for files with
Hugging Face "auto" values, after filling them as the Trainer would (`trident.config.fill_auto`
with the same TrainingArguments the test uses), and writes
`tests/data/deepspeed_configs/deepspeed_verdicts.json`: file -> {"accepted": bool, "error": str,
"accepted_after_fill": bool | null}. tests/unit/test_deepspeed_corpus.py reads it to compare
trident's verdicts with DeepSpeed's.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29731"), RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0")

import torch.distributed as dist  # noqa: E402
from deepspeed.runtime.config import DeepSpeedConfig  # noqa: E402

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "deepspeed_configs"


def _verdict(source) -> tuple[bool, str]:
    try:
        DeepSpeedConfig(source if isinstance(source, dict) else str(source))
        return True, ""
    except Exception as err:  # noqa: BLE001 - any refusal is a verdict
        return False, f"{type(err).__name__}: {str(err)[:300]}"


def main() -> None:
    dist.init_process_group("gloo", rank=0, world_size=1)
    sys.path.insert(0, str(CORPUS.parents[2]))
    from tests.unit.deepspeed_corpus_args import MODEL, training_args  # what the test fills with

    from trident.config import fill_auto
    from trident.config.hf_auto import auto_paths

    verdicts = {}
    for path in sorted(CORPUS.glob("*.json")):
        if path.name in ("SOURCES.json", "deepspeed_verdicts.json"):
            continue
        accepted, error = _verdict(path)
        verdicts[path.name] = {"accepted": accepted, "error": error, "accepted_after_fill": None}
        data = json.loads(path.read_text())
        if auto_paths(data):
            try:
                filled = fill_auto(data, training_args(data), model=MODEL)
            except Exception:  # noqa: BLE001 - a config the Trainer itself would refuse
                continue
            verdicts[path.name]["accepted_after_fill"] = _verdict(filled)[0]
    (CORPUS / "deepspeed_verdicts.json").write_text(json.dumps(verdicts, indent=1) + "\n")
    accepted = sum(v["accepted"] for v in verdicts.values())
    filled = sum(bool(v["accepted"] or v["accepted_after_fill"]) for v in verdicts.values())
    print(f"DeepSpeed accepts {accepted} of {len(verdicts)} corpus configs as they are, {filled} with the "
          "Hugging Face \"auto\" values filled", file=sys.stderr)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
