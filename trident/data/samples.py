"""Training samples from tokenized documents: GPT windows, packed rows, or whole documents.

A `DocumentCorpus` is one or more `.bin`/`.idx` shards read as one list of documents (optionally
a contiguous range of them, for a train/validation split). Three sample kinds sit on top:

    GPTWindows      documents concatenated into one stream and cut into windows of seq_len + 1
                    tokens (input = first seq_len, labels = last seq_len); windows share only
                    their boundary token. Attention runs across document boundaries, as in
                    Megatron-LM's GPTDataset.
    PackedDocuments whole documents (longer ones split into seq_len pieces) placed next-fit into
                    rows of seq_len tokens, with `position_ids` restarting at 0 per document,
                    `doc_ids` for a block-diagonal attention mask, and label -100 at each
                    document's last token and on padding: a packed row trains exactly like its
                    documents one by one.
    Documents       one document per sample, truncated to seq_len + 1 tokens, variable length
                    (for length bucketing; the collate function pads).

Each kind's index (where every sample starts) is built once and cached as a `.npz` beside the
data, named by a hash of what it depends on (the shards' paths, sizes and times, the document
range, seq_len), so every rank and every later run loads it instead of rebuilding.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from trident.data.indexed import IndexedDataError, IndexedDataset
from trident.monitor.log import logger

IGNORE_INDEX = -100
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "trident" / "samples"


def resolve_prefixes(path: str | os.PathLike) -> list[str]:
    """A data path -> shard prefixes: `<prefix>` of a `.bin/.idx` pair, or a folder of pairs."""
    p = Path(path)
    if p.is_dir():
        prefixes = sorted(str(idx.with_suffix("")) for idx in p.glob("*.idx"))
        if not prefixes:
            raise FileNotFoundError(f"data path {p} is a folder with no .idx files; prepare data into it "
                                    f"with `trident data prepare INPUT... --out {p}`")
        return prefixes
    if Path(str(p) + ".idx").is_file():
        return [str(p)]
    if p.suffix in (".idx", ".bin") and p.with_suffix(".idx").is_file():
        return [str(p.with_suffix(""))]
    raise FileNotFoundError(f"data path {str(p)!r} is neither a folder of .bin/.idx shards nor the prefix of "
                            f"one ({p}.idx does not exist); prepare it with `trident data prepare`")


class DocumentCorpus:
    """Documents [start, stop) of the concatenated shards; `vocab_size` enables an id check."""

    def __init__(self, prefixes: list[str] | str, vocab_size: int | None = None,
                 doc_range: tuple[float, float] = (0.0, 1.0)):
        if isinstance(prefixes, (str, os.PathLike)):
            prefixes = resolve_prefixes(prefixes)
        self.shards = [IndexedDataset(p) for p in prefixes]
        counts = np.array([len(s) for s in self.shards], dtype=np.int64)
        self._shard_start = np.concatenate([[0], np.cumsum(counts)])
        total = int(self._shard_start[-1])
        lo, hi = doc_range
        self.start, self.stop = int(round(lo * total)), int(round(hi * total))
        self.lengths = np.concatenate([s.sizes for s in self.shards]).astype(np.int64)[self.start:self.stop] \
            if self.shards else np.zeros(0, dtype=np.int64)
        self.vocab_size = vocab_size
        if not len(self.lengths) or not self.lengths.sum():
            raise IndexedDataError(f"no tokens in documents [{self.start}, {self.stop}) of "
                                   f"{', '.join(prefixes)}; the data (or its split) is empty")

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def name(self) -> str:
        return self.shards[0].prefix if len(self.shards) == 1 else f"{Path(self.shards[0].prefix).parent}/*"

    def fingerprint(self) -> str:
        parts = [s.fingerprint() for s in self.shards] + [f"docs {self.start}:{self.stop}"]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]

    def _locate(self, doc: int) -> tuple[IndexedDataset, int]:
        index = self.start + doc
        k = int(np.searchsorted(self._shard_start, index, side="right")) - 1
        return self.shards[k], index - int(self._shard_start[k])

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of document `doc` (of this corpus's range), checked against the vocabulary."""
        shard, local = self._locate(doc)
        return self._checked(shard.get(local, offset, length), shard, local)

    def read(self, doc: int, offset: int, count: int) -> np.ndarray:
        """`count` tokens of the concatenated documents from token `offset` of `doc` on: one
        slice per shard crossed (documents are contiguous in a shard), else per document."""
        parts = []
        while count > 0:
            shard, local = self._locate(doc)
            if shard.contiguous:
                piece = shard.read_span(local, offset, count)
                self._checked(piece, shard, local, offset)
                doc += len(shard) - local  # the rest of this shard was read or is not needed
            else:
                piece = self.get(doc, offset, count)
                doc += 1
            parts.append(piece)
            count -= len(piece)
            offset = 0
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _checked(self, tokens: np.ndarray, shard: IndexedDataset, local: int, offset: int = 0) -> np.ndarray:
        if self.vocab_size is None or not len(tokens):
            return tokens
        info = np.iinfo(tokens.dtype) if tokens.dtype.kind in "iu" else None
        if info is not None and info.min >= 0 and info.max < self.vocab_size:
            return tokens  # the dtype cannot hold an id outside the vocabulary (uint16 under 65536)
        low, high = (0 if info is not None and info.min >= 0 else int(tokens.min())), int(tokens.max())
        if high >= self.vocab_size or low < 0:
            bad = high if high >= self.vocab_size else low
            where = offset + int(np.flatnonzero(tokens == bad)[0])  # tokens from the start of `local`
            doc = local + int(np.searchsorted(np.cumsum(shard.sizes[local:].astype(np.int64)), where, side="right"))
            raise IndexedDataError(f"{shard.bin_path}: document {doc} holds token id {bad}, outside the "
                                   f"model's vocabulary [0, {self.vocab_size}); the data was prepared with "
                                   f"another tokenizer. Prepare it with the tokenizer the model uses "
                                   f"(data.tokenizer), or size the model's vocabulary to match")
        return tokens


# -- the cached index ------------------------------------------------------------------------------

def cached_index(corpus: DocumentCorpus, kind: str, params: dict, build: Callable[[], dict[str, np.ndarray]],
                 cache_dir: str | None = None) -> dict[str, np.ndarray]:
    """Load `kind`'s index arrays from the cache, or build and store them (atomically)."""
    key = hashlib.sha256(f"{kind}|{corpus.fingerprint()}|{sorted(params.items())}".encode()).hexdigest()[:16]
    folders = [Path(cache_dir)] if cache_dir else [Path(corpus.shards[0].prefix).parent / ".trident-cache",
                                                     DEFAULT_CACHE_DIR]
    name = f"{Path(corpus.shards[0].prefix).name}-{kind}-{key}.npz"
    for folder in folders:
        if (folder / name).is_file():
            with np.load(folder / name) as data:
                return {k: data[k] for k in data.files}
    arrays = build()
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".npz.tmp")
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, folder / name)
            break
        except OSError as err:
            logger.info("could not cache the %s index in %s (%s)", kind, folder, err)
    return arrays


def _as_long(tokens: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(tokens.astype(np.int64))


# -- sample kinds ----------------------------------------------------------------------------------

class GPTWindows(torch.utils.data.Dataset):
    """Windows of seq_len + 1 tokens over the concatenated documents (see the module docstring)."""

    kind = "windows"

    def __init__(self, corpus: DocumentCorpus, seq_len: int, cache_dir: str | None = None):
        total = int(corpus.lengths.sum())
        if total < seq_len + 1:
            raise IndexedDataError(f"{corpus.name} has {total} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
                                   f"use more data or a shorter seq_len")
        self.corpus, self.seq_len = corpus, seq_len
        self.num_samples = (total - 1) // seq_len
        index = cached_index(corpus, self.kind, {"seq_len": seq_len}, self._build, cache_dir)
        self.sample_doc, self.sample_offset = index["doc"], index["offset"]

    def _build(self) -> dict[str, np.ndarray]:
        doc_start = np.concatenate([[0], np.cumsum(self.corpus.lengths)])
        starts = np.arange(self.num_samples, dtype=np.int64) * self.seq_len
        doc = np.searchsorted(doc_start, starts, side="right") - 1
        return {"doc": doc, "offset": starts - doc_start[doc]}

    def __len__(self) -> int:
        return self.num_samples

    def fingerprint(self) -> str:
        return f"{self.kind}:{self.corpus.fingerprint()}:{self.seq_len}"

    def sample_lengths(self, indices: np.ndarray) -> np.ndarray:
        return np.full(len(indices), self.seq_len, dtype=np.int64)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = _as_long(self.corpus.read(int(self.sample_doc[index]), int(self.sample_offset[index]),
                                           self.seq_len + 1))
        return {"input_ids": window[:-1], "labels": window[1:]}


class PackedDocuments(torch.utils.data.Dataset):
    """Whole documents packed next-fit into rows of seq_len tokens, with document masks."""

    kind = "packed"

    def __init__(self, corpus: DocumentCorpus, seq_len: int, cache_dir: str | None = None):
        self.corpus, self.seq_len = corpus, seq_len
        index = cached_index(corpus, self.kind, {"seq_len": seq_len}, self._build, cache_dir)
        self.pieces, self.row_start = index["pieces"], index["row_start"]
        used = int(self.pieces[:, 2].sum())
        self.padding_share = 1.0 - used / max(len(self) * seq_len, 1)

    def _build(self) -> dict[str, np.ndarray]:
        s, lengths = self.seq_len, self.corpus.lengths
        # a document longer than a row becomes pieces of seq_len tokens, each its own document
        n_pieces = -(-lengths // s)
        doc = np.repeat(np.arange(len(lengths), dtype=np.int64), n_pieces)
        first = np.concatenate([[0], np.cumsum(n_pieces)[:-1]])
        offset = (np.arange(len(doc), dtype=np.int64) - np.repeat(first, n_pieces)) * s
        length = np.minimum(lengths[doc] - offset, s)
        row_start, fill = [0], 0
        for i, n in enumerate(length.tolist()):
            if fill + n > s:
                row_start.append(i)
                fill = 0
            fill += n
        row_start.append(len(length))
        return {"pieces": np.stack([doc, offset, length], axis=1), "row_start": np.array(row_start, dtype=np.int64)}

    def __len__(self) -> int:
        return len(self.row_start) - 1

    def fingerprint(self) -> str:
        return f"{self.kind}:{self.corpus.fingerprint()}:{self.seq_len}"

    def sample_lengths(self, indices: np.ndarray) -> np.ndarray:
        return np.full(len(indices), self.seq_len, dtype=np.int64)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        s = self.seq_len
        lo, hi = int(self.row_start[index]), int(self.row_start[index + 1])
        doc, offset, _ = self.pieces[lo].tolist()
        lengths = self.pieces[lo:hi, 2]
        used = int(lengths.sum())
        # a row's pieces are consecutive in the stream: one read, then per-piece bookkeeping
        tokens = np.zeros(s, dtype=np.int64)
        tokens[:used] = self.corpus.read(doc, offset, used)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        doc_ids = np.full(s, hi - lo, dtype=np.int64)  # padding is a document of its own
        doc_ids[:used] = np.repeat(np.arange(hi - lo), lengths)
        position_ids = np.arange(s, dtype=np.int64)
        position_ids[:used] -= np.repeat(starts, lengths)
        position_ids[used:] -= used
        labels = np.full(s, IGNORE_INDEX, dtype=np.int64)
        labels[:used - 1] = tokens[1:used]
        labels[starts + lengths - 1] = IGNORE_INDEX  # no target across a document boundary
        return {"input_ids": torch.from_numpy(tokens), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(position_ids), "doc_ids": torch.from_numpy(doc_ids),
                "pad_tokens": s - used}


class Documents(torch.utils.data.Dataset):
    """One document per sample (at most seq_len + 1 tokens), for length bucketing."""

    kind = "documents"

    def __init__(self, corpus: DocumentCorpus, seq_len: int, cache_dir: str | None = None):
        self.corpus, self.seq_len = corpus, seq_len
        index = cached_index(corpus, self.kind, {"seq_len": seq_len}, self._build, cache_dir)
        self.docs = index["docs"]
        if not len(self.docs):
            raise IndexedDataError(f"{corpus.name}: no document has 2 or more tokens, so none has a target")

    def _build(self) -> dict[str, np.ndarray]:
        return {"docs": np.flatnonzero(self.corpus.lengths >= 2).astype(np.int64)}

    def __len__(self) -> int:
        return len(self.docs)

    def fingerprint(self) -> str:
        return f"{self.kind}:{self.corpus.fingerprint()}:{self.seq_len}"

    def sample_lengths(self, indices: np.ndarray) -> np.ndarray:
        """Input tokens of each sample: its document's length, capped at seq_len + 1, minus one."""
        return np.minimum(self.corpus.lengths[self.docs[indices]], self.seq_len + 1) - 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = _as_long(self.corpus.get(int(self.docs[index]), 0, self.seq_len + 1))
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}


SAMPLE_KINDS = {cls.kind: cls for cls in (GPTWindows, PackedDocuments, Documents)}
