"""From the config's `data` section to this rank's loader.

`source_paths` says where the prepared shards are: `data.paths` as given, or else `data.dataset`
(the bundled corpus, or a text file) prepared once with `trident data prepare`'s code into
`~/.cache/trident/data/<name>-<hash>/`, the hash covering the text and the tokenizer.
`build_loader` opens the shards, builds the sample kind (`data.packing`, `data.bucketing`), the
blend (`data.weights`) and the batching, for one dp rank.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer

from trident.data.blend import BlendedDataset
from trident.data.loader import FixedBatches, TokenBudgetBatches, TridentDataLoader
from trident.data.prepare import METADATA_FILE, prepare, tokenizer_hash
from trident.data.samples import DocumentCorpus, Documents, GPTWindows, PackedDocuments, resolve_prefixes
from trident.data.tokenizer import BUNDLED_CORPUS
from trident.monitor.log import logger

DEFAULT_DATA_CACHE = Path.home() / ".cache" / "trident" / "data"


def prepared_text_dir(text: str | None, tokenizer: Tokenizer, cache_dir: str | Path | None = None,
                      create: bool = True, workers: int = 2) -> Path:
    """Shards of the bundled corpus (`text=None`) or of a text file, prepared on first use.

    Returns the folder; with `create=False` only says where it would be (another rank prepares).
    """
    source = BUNDLED_CORPUS if text is None else Path(text)
    if not source.is_file():
        raise FileNotFoundError(f"data.dataset {text!r} is not a file; give a UTF-8 text file (one document per "
                                f"line), \"kjv\" for the bundled corpus, or prepared shards in data.paths")
    digest = hashlib.sha256(source.read_bytes())
    digest.update(tokenizer_hash(tokenizer).encode())
    name = source.name.split(".")[0]
    folder = Path(cache_dir or DEFAULT_DATA_CACHE) / f"{name}-{digest.hexdigest()[:16]}"
    if create and not (folder / f"{name}.idx").is_file():
        logger.info("preparing %s into %s (once; later runs reuse it)", source, folder)
        summary = prepare([source], tokenizer, folder, workers=workers)
        logger.info(summary.describe())
    return folder


def check_tokenizer(paths: list[str], tokenizer: Tokenizer) -> None:
    """Refuse shards whose `prepare.json` names another tokenizer than the one training uses."""
    mine = tokenizer_hash(tokenizer)
    for path in paths:
        folder = Path(path) if Path(path).is_dir() else Path(path).parent
        meta_file = folder / METADATA_FILE
        if not meta_file.is_file():
            continue  # shards from another tool: the per-sample vocabulary check still applies
        meta = json.loads(meta_file.read_text())
        if meta.get("tokenizer_sha256_16") not in (None, mine):
            raise ValueError(f"{meta_file}: the shards in {folder} were tokenized with another tokenizer (sha256 "
                             f"{meta['tokenizer_sha256_16']}, vocabulary {meta.get('vocab_size')}) than data.tokenizer "
                             f"(sha256 {mine}, vocabulary {tokenizer.get_vocab_size()}); prepare them again with "
                             f"`trident data prepare --tokenizer <data.tokenizer>` or set data.tokenizer to theirs")


def build_loader(data, *, seq_len: int, vocab_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int, paths: list[str], split: str = "train",
                 tokenizer: Tokenizer | None = None) -> TridentDataLoader:
    """This rank's loader for the `data` config section over the shard folders/prefixes `paths`
    (checked against `tokenizer` when given)."""
    if tokenizer is not None:
        check_tokenizer(paths, tokenizer)
    kind = PackedDocuments if data.packing else Documents if data.bucketing else GPTWindows
    train_share = 1.0 - data.val_fraction
    doc_range = (0.0, train_share) if split == "train" else (train_share, 1.0)
    datasets = [kind(DocumentCorpus(resolve_prefixes(p), vocab_size, doc_range), seq_len) for p in paths]
    weights = data.weights if data.weights is not None else [len(d) for d in datasets]
    cache = Path(datasets[0].corpus.shards[0].prefix).parent / ".trident-cache"
    blend = BlendedDataset(weights, datasets, seed=seed, shuffle=data.shuffle, names=[str(p) for p in paths],
                           cache_dir=cache)
    if data.packing:
        logger.info("packing: %d rows of %d tokens, %.1f%% padding", sum(len(d) for d in datasets), seq_len,
                    100 * sum(d.padding_share * len(d) for d in datasets) / max(sum(len(d) for d in datasets), 1))
    if data.bucketing:
        budget = data.max_tokens_per_batch or micro_batch_size * seq_len
        if budget < seq_len:
            raise ValueError(f"data.max_tokens_per_batch = {budget} is below data.seq_len = {seq_len}: the longest "
                             f"sample would not fit a batch; raise it to at least {seq_len}")
        units = TokenBudgetBatches(blend, budget, dp_rank, dp_size, seed)
    else:
        units = FixedBatches(micro_batch_size, dp_rank, dp_size)
    return TridentDataLoader(blend, units, num_workers=data.num_workers)
