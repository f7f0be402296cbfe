"""`trident data prepare`: text, JSON lines or Parquet -> tokenized `.bin`/`.idx` shards.

Each input file becomes one shard `OUT/<name>.bin/.idx` (Megatron-LM's layout, see
`indexed.py`). What a document is depends on the input:

    .txt, .txt.gz          one document per line (the newline kept, blank lines skipped); with a
                           tokenizer that never merges across a newline (GPT-2-style byte-level
                           BPE) the documents concatenated are the file's own token stream
    .jsonl, .json(.gz)     one JSON object per line; the document is its `key` field
    .parquet               one row per document; the document is its `key` column

The main process reads documents and cuts them into chunks of `CHUNK_DOCS`; worker processes
tokenize the chunks (each with a single-threaded tokenizer) and the main process writes them in
input order. Chunks do not depend on the number of workers, so the shards are byte-identical
for any `--workers`.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import itertools
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
from tokenizers import Tokenizer

from trident.data.indexed import IndexedDatasetWriter, token_dtype

CHUNK_DOCS = 512
EOD_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
TEXT_SUFFIXES = (".txt", ".txt.gz")
JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)
METADATA_FILE = "prepare.json"


@dataclass
class PrepareSummary:
    """What `prepare` wrote: one prefix per input, with counts and timing."""

    prefixes: list[str] = field(default_factory=list)
    documents: int = 0
    tokens: int = 0
    input_bytes: int = 0
    seconds: float = 0.0

    @property
    def mb_per_s(self) -> float:
        return self.input_bytes / 1e6 / max(self.seconds, 1e-9)

    def describe(self) -> str:
        return (f"prepared {len(self.prefixes)} shard(s): {self.documents:,} documents, {self.tokens:,} tokens "
                f"from {self.input_bytes / 1e6:,.1f} MB of text in {self.seconds:.1f} s "
                f"({self.mb_per_s:.2f} MB/s, {self.tokens / max(self.seconds, 1e-9):,.0f} tokens/s)")


# -- tokenizer ------------------------------------------------------------------------------------

def resolve_tokenizer(spec: str | None) -> Tokenizer:
    """A `tokenizers` tokenizer from: None or "bundled" (trident's KJV tokenizer), a
    `tokenizer.json` file, a folder holding one, or a `transformers` fast tokenizer name/folder."""
    from trident.data.tokenizer import load_tokenizer

    if spec in (None, "bundled"):
        return load_tokenizer()
    path = Path(spec)
    if path.is_file():
        return load_tokenizer(str(path))
    if (path / "tokenizer.json").is_file():
        return load_tokenizer(str(path / "tokenizer.json"))
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise FileNotFoundError(f"tokenizer {spec!r} is not a tokenizer.json file or a folder holding one, "
                                f"and `transformers` (needed for other tokenizers) is not installed") from None
    try:
        hf = AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"tokenizer {spec!r} is not a tokenizer.json file, a folder holding one, nor "
                                f"a transformers tokenizer that loads ({err})") from None
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"tokenizer {spec!r} is a slow (Python) transformers tokenizer; `trident data prepare` "
                         f"needs a fast one (a tokenizer.json); save it with use_fast=True")
    return backend


def eod_id(tokenizer: Tokenizer, name: str | None = None) -> int:
    """The end-of-document token id: `name` when given (tokenizers whose end-of-text token is
    called something else, e.g. `<|eot_id|>`), else the first of `EOD_NAMES` in the vocabulary."""
    if name is not None:
        token = tokenizer.token_to_id(name)
        if token is None:
            raise ValueError(f"--eod-token {name!r} is not in the tokenizer's vocabulary "
                             f"({tokenizer.get_vocab_size(with_added_tokens=True):,} tokens); give a token it has")
        return token
    for name in EOD_NAMES:
        token = tokenizer.token_to_id(name)
        if token is not None:
            return token
    raise ValueError(f"--append-eod: the tokenizer has none of the end-of-document tokens {EOD_NAMES}; "
                     f"name the tokenizer's own with --eod-token TEXT, or prepare without --append-eod")


# -- reading documents -------------------------------------------------------------------------

def _suffix(path: Path) -> str:
    name = path.name.lower()
    for suffix in TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES:
        if name.endswith(suffix):
            return suffix
    raise ValueError(f"input {path} has an unknown type; give .txt, .txt.gz (one document per line), "
                     f".jsonl, .json, .jsonl.gz (one JSON object per line, text under --key) or .parquet "
                     f"(text in column --key)")


def shard_name(path: Path) -> str:
    name = path.name
    return name[:len(name) - len(_suffix(path))]


def _open_text(path: Path) -> io.TextIOBase:
    if path.name.lower().endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def read_documents(path: Path, key: str = "text") -> Iterator[str]:
    """The documents of one input file, in order."""
    suffix = _suffix(path)
    if suffix in TEXT_SUFFIXES:
        with _open_text(path) as f:
            for line in f:
                if line.strip():
                    yield line
    elif suffix in JSON_SUFFIXES:
        with _open_text(path) as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}, line {number}: not valid JSON ({err}); JSON-lines input needs "
                                     f"one object per line") from None
                if not isinstance(record, dict) or key not in record:
                    found = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(f"{path}, line {number}: no field {key!r} (found {found}); pass the "
                                     f"field holding the text with --key")
                if not isinstance(record[key], str):
                    raise ValueError(f"{path}, line {number}: field {key!r} is a "
                                     f"{type(record[key]).__name__}, not a string")
                yield record[key]
    else:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(f"reading {path} needs pyarrow: pip install 'trident[data]' (or pyarrow)") from None
        table = pq.ParquetFile(path)
        if key not in table.schema_arrow.names:
            raise ValueError(f"{path}: no column {key!r} (columns: {table.schema_arrow.names}); pass the text "
                             f"column with --key")
        for batch in table.iter_batches(columns=[key], batch_size=CHUNK_DOCS):
            for text in batch.column(0).to_pylist():
                if text:
                    yield text


def _chunks(documents: Iterator[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for doc in documents:
        chunk.append(doc)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# -- tokenizing (runs in the workers) ------------------------------------------------------------

_worker_tokenizer: Tokenizer | None = None
_worker_eod: int | None = None


def _init_worker(tokenizer_json: str, eod: int | None) -> None:
    # One thread per worker process: --workers N is the parallelism, not N x the tokenizer's pool.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    global _worker_tokenizer, _worker_eod
    _worker_tokenizer = Tokenizer.from_str(tokenizer_json)
    _worker_eod = eod


def _encode_chunk(docs: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens of all documents back to back, tokens per document, UTF-8 bytes read)."""
    encodings = _worker_tokenizer.encode_batch(docs, add_special_tokens=False)
    ids = [e.ids + [_worker_eod] if _worker_eod is not None else e.ids for e in encodings]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
    return tokens, lengths, sum(len(d.encode("utf-8")) for d in docs)


# -- the command ---------------------------------------------------------------------------------

class _Progress:
    """Documents/s, tokens/s and MB read, on one redrawn line (a terminal) or every few seconds."""

    def __init__(self, enabled: bool, stream=None, every_s: float = 5.0):
        self.enabled, self.stream, self.every_s = enabled, stream or sys.stderr, every_s
        self.start = self.last = time.perf_counter()
        self.tty = enabled and self.stream.isatty()

    def update(self, name: str, docs: int, tokens: int, nbytes: int, final: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not final and now - self.last < (0.2 if self.tty else self.every_s)):
            return
        self.last = now
        dt = max(now - self.start, 1e-9)
        line = (f"prepare {name}: {docs:,} docs ({docs / dt:,.0f}/s) | {tokens:,} tokens ({tokens / dt:,.0f}/s) "
                f"| {nbytes / 1e6:,.1f} MB ({nbytes / 1e6 / dt:.2f} MB/s)")
        self.stream.write(("\r" + line + ("\n" if final else "")) if self.tty else line + "\n")
        self.stream.flush()


def prepare(inputs: list[str | os.PathLike], tokenizer: str | Tokenizer | None, out: str | os.PathLike,
            workers: int = 1, append_eod: bool = False, key: str = "text", progress: bool = True,
            eod_token: str | None = None) -> PrepareSummary:
    """Tokenize `inputs` into `out/<name>.bin/.idx`, one shard per input; see the module docstring."""
    if workers < 1:
        raise ValueError(f"workers={workers}: give at least 1 worker process")
    if not inputs:
        raise ValueError("no input files given")
    paths = [Path(p) for p in inputs]
    names: dict[str, Path] = {}
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"input {path} does not exist or is not a file")
        name = shard_name(path)
        if name in names:
            raise ValueError(f"inputs {names[name]} and {path} would both be written as shard {name!r}; "
                             f"rename one of them")
        names[name] = path
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else resolve_tokenizer(tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if eod_token is not None and not append_eod:
        raise ValueError(f"--eod-token {eod_token!r} only applies with --append-eod; add --append-eod")
    eod = eod_id(tok, eod_token) if append_eod else None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = PrepareSummary()
    start = time.perf_counter()
    bar = _Progress(progress)
    # fork: the workers need only the tokenizer, and start in milliseconds
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tok.to_str(), eod)) as pool:
        for name, path in names.items():
            _prepare_one(pool, path, out / name, token_dtype(vocab), key, bar, summary)
    summary.seconds = time.perf_counter() - start
    bar.update("total", summary.documents, summary.tokens, summary.input_bytes, final=True)
    _write_metadata(out, tok, vocab, eod, key, paths, summary)
    return summary


def _prepare_one(pool, path: Path, prefix: Path, dtype: np.dtype, key: str, bar: _Progress,
                 summary: PrepareSummary) -> None:
    """One input -> one shard; the workers tokenize chunks, this process writes them in order."""
    writer = IndexedDatasetWriter(prefix, dtype)
    docs = tokens = nbytes = 0
    try:
        for ids, lengths, size in pool.imap(_encode_chunk, _chunks(read_documents(path, key), CHUNK_DOCS)):
            writer.add_documents(ids, lengths)
            docs, tokens, nbytes = docs + len(lengths), tokens + len(ids), nbytes + size
            bar.update(prefix.name, summary.documents + docs, summary.tokens + tokens, summary.input_bytes + nbytes)
        if docs == 0:
            blank = ", or has only blank lines" if _suffix(path) in TEXT_SUFFIXES else ""
            raise ValueError(f"input {path} has no documents (it is empty{blank}); remove it from the inputs")
    except BaseException:
        writer.abort()
        raise
    writer.finalize()
    summary.prefixes.append(str(prefix))
    summary.documents += docs
    summary.tokens += tokens
    summary.input_bytes += nbytes


def tokenizer_hash(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()[:16]


def _write_metadata(out: Path, tok: Tokenizer, vocab: int, eod: int | None, key: str, paths: list[Path],
                    summary: PrepareSummary) -> None:
    """`prepare.json`: what made the shards, so a reader can check the vocabulary."""
    meta = {"tokenizer_sha256_16": tokenizer_hash(tok), "vocab_size": vocab, "eod_id": eod, "key": key,
            "inputs": [str(p) for p in paths], "shards": [Path(p).name for p in summary.prefixes],
            "documents": summary.documents, "tokens": summary.tokens}
    tmp = out / (METADATA_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out / METADATA_FILE)
