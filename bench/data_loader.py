"""Data loading: trident's prepared shards against Hugging Face `datasets` (Arrow) and megatron-core.

Three measurements on the bundled KJV corpus (4.2 MB of text, 1.04M tokens) with the bundled
tokenizer, every system in rotating order per repeat, medians over the repeats:

1. prepare: text -> token shards, MB of text per second, `trident data prepare` with 1 and 2
   worker processes; beside it `datasets`' `load_dataset("text") + map(tokenize) + map(group)`
   with num_proc 1 and 2 (the run_clm recipe), the same tokenizer.
2. loader: samples/s of [8, 2048] micro-batches read in the training process (num_workers=0,
   so this is the read path itself): trident's loader (GPT windows over the shards, shuffled),
   `datasets` Arrow rows of 2049 tokens with `with_format("torch")` through a shuffling torch
   DataLoader, and megatron-core's GPTDataset over the same `.bin/.idx` files (it reads them:
   same layout), when megatron-core is installed.
3. share of a step: the demo model (4 layers, width 256, seq 128, micro-batch 8, AdamW, one
   thread like one of the demo's two ranks); time blocked in `next(loader)` against the whole
   step, with num_workers 0 (reads inline) and 1 (a worker reads ahead).

    python bench/data_loader.py [--repeats 3] [--samples 2000] [--steps 30]
"""

from __future__ import annotations

import argparse
import gzip
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from _common import rotated

SEQ = 2048
MICRO = 8


def _text_file(folder: Path) -> Path:
    from trident.data.tokenizer import BUNDLED_CORPUS
    path = folder / "kjv.txt"
    path.write_bytes(gzip.decompress(BUNDLED_CORPUS.read_bytes()))
    return path


# -- 1. prepare -----------------------------------------------------------------------------------

def prepare_trident(text: Path, out: Path, workers: int) -> float:
    from trident.data.prepare import prepare
    start = time.perf_counter()
    prepare([text], None, out, workers=workers, progress=False)
    return time.perf_counter() - start


def prepare_hf(text: Path, out: Path, workers: int) -> float:
    import datasets
    from trident.data.tokenizer import load_tokenizer
    tok = load_tokenizer()
    datasets.disable_progress_bars()

    def tokenize(batch):
        return {"input_ids": [e.ids for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}

    def group(batch):
        ids = [t for row in batch["input_ids"] for t in row]
        n = (len(ids) // (SEQ + 1)) * (SEQ + 1)
        return {"input_ids": [ids[i:i + SEQ + 1] for i in range(0, n, SEQ + 1)]}

    start = time.perf_counter()
    raw = datasets.load_dataset("text", data_files=str(text), split="train", keep_linebreaks=True,
                                cache_dir=str(out / "cache"))
    ids = raw.map(tokenize, batched=True, num_proc=workers if workers > 1 else None, remove_columns=["text"])
    grouped = ids.map(group, batched=True, batch_size=4000, num_proc=workers if workers > 1 else None)
    grouped.save_to_disk(str(out / "arrow"))
    return time.perf_counter() - start


# -- 2. loaders -----------------------------------------------------------------------------------

def trident_loader(prefix: str, seq: int, micro: int, workers: int):
    from trident.config.schema import DataConfig
    from trident.data.build import build_loader
    cfg = DataConfig(paths=[prefix], num_workers=workers, val_fraction=0.0)
    loader = build_loader(cfg, seq_len=seq, vocab_size=4096, micro_batch_size=micro, dp_rank=0, dp_size=1,
                          seed=1, paths=[prefix])
    return (lambda: next(loader)["input_ids"]), loader.close


def hf_loader(arrow: Path, micro: int):
    import datasets
    ds = datasets.load_from_disk(str(arrow)).with_format("torch")
    loader = torch.utils.data.DataLoader(ds, batch_size=micro, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(1))

    def endless():
        while True:
            yield from loader
    it = endless()
    return lambda: next(it)["input_ids"]


def megatron_loader(prefix: str, cache: Path, micro: int, samples: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
        from megatron.core.datasets.indexed_dataset import IndexedDataset
        from megatron.core.datasets.utils import Split

    class Tokenizer:  # what GPTDataset reads of a tokenizer
        vocab_size, eod, pad = 4096, 0, -1
        unique_identifiers = {"class": "kjv-bundled"}

    cfg = GPTDatasetConfig(random_seed=1, sequence_length=SEQ, split="100,0,0", tokenizer=Tokenizer(),
                           reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                           create_attention_mask=False, path_to_cache=str(cache))
    indexed = IndexedDataset(prefix)
    ds = GPTDataset(indexed, prefix, np.arange(len(indexed), dtype=np.int32), samples, Split.train, cfg)
    loader = torch.utils.data.DataLoader(ds, batch_size=micro, drop_last=True)

    def endless():
        while True:
            yield from loader
    it = endless()
    return lambda: next(it)["tokens"]


def samples_per_s(fetch, samples: int) -> float:
    fetch()  # first batch: opening files, building index caches
    start = time.perf_counter()
    for _ in range(samples // MICRO):
        batch = fetch()
    assert batch.shape == (MICRO, SEQ) or batch.shape == (MICRO, SEQ + 1), batch.shape
    return (samples // MICRO) * MICRO / (time.perf_counter() - start)


# -- 3. share of a demo step ----------------------------------------------------------------------

def step_share(prefix: str, workers: int, steps: int) -> tuple[float, float]:
    """(ms in next(loader) per step, ms per whole step) for the demo model."""
    from trident.models.gpt import GPT, GPT_PRESETS, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(**GPT_PRESETS["demo"], vocab_size=4096, dropout=0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    from trident.config.schema import DataConfig
    from trident.data.build import build_loader
    loader = build_loader(DataConfig(paths=[prefix], num_workers=workers, val_fraction=0.0), seq_len=128,
                          vocab_size=4096, micro_batch_size=8, dp_rank=0, dp_size=1, seed=1, paths=[prefix])
    waits, totals = [], []
    for i in range(steps + 3):
        start = time.perf_counter()
        batch = next(loader)
        got = time.perf_counter()
        loss = model(batch["input_ids"], batch["labels"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 3:
            waits.append(got - start)
            totals.append(time.perf_counter() - start)
    loader.close()
    return 1e3 * sum(waits) / steps, 1e3 * sum(totals) / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2000, help="samples read per loader measurement")
    parser.add_argument("--steps", type=int, default=30, help="demo-model steps per share measurement")
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        import megatron.core  # noqa: F401
        have_megatron = True
    except ImportError as err:
        have_megatron = False
        print(f"megatron-core not measured: {err} (pip install megatron-core; it needs no CUDA)")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text = _text_file(tmp)
        mb = text.stat().st_size / 1e6

        prep = {k: [] for k in ("trident w1", "trident w2", "datasets p1", "datasets p2")}
        for r in range(args.repeats):
            for name in rotated(list(prep), r):
                out = tmp / f"prep-{name.replace(' ', '-')}-{r}"
                tool, w = name.split()
                fn = prepare_trident if tool == "trident" else prepare_hf
                prep[name].append(fn(text, out, int(w[1])))
        prefix = str(tmp / "prep-trident-w1-0" / "kjv")
        arrow = tmp / "prep-datasets-p1-0" / "arrow"
        print(f"\n1. prepare {mb:.1f} MB of text (median of {args.repeats}; MB/s of text)")
        for name, times in prep.items():
            print(f"   {name:<13} {mb / statistics.median(times):6.2f} MB/s   ({statistics.median(times):.2f} s)")
        med = {k: statistics.median(v) for k, v in prep.items()}
        print(f"   trident 2 workers / 1 worker: {med['trident w1'] / med['trident w2']:.2f}x; "
              f"trident / datasets at 1: {med['datasets p1'] / med['trident w1']:.2f}x, "
              f"at 2: {med['datasets p2'] / med['trident w2']:.2f}x")

        makers = {"trident": lambda: trident_loader(prefix, SEQ, MICRO, 0)[0],
                  "datasets (Arrow)": lambda: hf_loader(arrow, MICRO)}
        if have_megatron:
            makers["megatron-core"] = lambda: megatron_loader(prefix, tmp / "mcore-cache", MICRO, args.samples + 64)
        rates = {k: [] for k in makers}
        for r in range(args.repeats):
            for name in rotated(list(makers), r):
                rates[name].append(samples_per_s(makers[name](), args.samples))
        print(f"\n2. loader, [{MICRO}, {SEQ}] batches read in the training process (num_workers=0), "
              f"median samples/s of {args.repeats}")
        base = statistics.median(rates["trident"])
        for name, values in rates.items():
            m = statistics.median(values)
            print(f"   {name:<17} {m:10,.0f} samples/s   trident / this: {base / m:.2f}x")

        shares = {0: [], 1: []}
        for r in range(args.repeats):
            for w in rotated([0, 1], r):
                shares[w].append(step_share(prefix, w, args.steps))
        print(f"\n3. loader share of a demo-model step (seq 128, micro 8, one thread), median of {args.repeats}")
        for w, values in shares.items():
            wait = statistics.median(v[0] for v in values)
            step = statistics.median(v[1] for v in values)
            print(f"   num_workers={w}: {wait:.3f} ms in next(loader) of a {step:.1f} ms step = {100 * wait / step:.2f}%")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
