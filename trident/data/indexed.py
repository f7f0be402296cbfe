"""Tokenized documents on disk: a `.bin` token array and an `.idx` index, Megatron-LM's layout.

The files are interchangeable with Megatron-LM's `IndexedDataset` (`megatron/core/datasets/
indexed_dataset.py`) and the many tools that read it:

    <prefix>.bin   every document's token ids back to back, in the index's dtype, no header
    <prefix>.idx   little-endian:
                     9 bytes   magic b"MMIDIDX\\x00\\x00"
                     uint64    version (1)
                     uint8     dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                               6 float64, 7 float32, 8 uint16)
                     uint64    S, the number of sequences
                     uint64    D, the number of entries of the document index
                     int32[S]  tokens per sequence
                     int64[S]  byte offset of each sequence in the .bin
                     int64[D]  document index: sequences [doc[i], doc[i + 1]) form document i

trident writes one sequence per document (the document index is 0, 1, ..., S), so "document"
and "sequence" coincide; reading accepts any file of this layout, and trident's samples treat
each sequence as a document, as Megatron-LM's GPTDataset does. Reading maps both files and
copies nothing: `dataset[i]` is a NumPy view into the page cache.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                                6: np.float64, 7: np.float32, 8: np.uint16}
_CODE_OF = {np.dtype(t): code for code, t in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count


class IndexedDataError(ValueError):
    """A `.bin`/`.idx` pair that cannot be read as it is; the message names the file."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The dtype Megatron-LM picks for a vocabulary: uint16 below 65,500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def data_files(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """(`prefix.bin`, `prefix.idx`)."""
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


class IndexedDataset:
    """Read-only view of a `.bin`/`.idx` pair; item i is document i's tokens (a NumPy view).

    Any token dtype of the layout reads as stored; `get(i, offset, length)` returns part of a
    document without touching the rest. Construction checks the header and that the `.bin` is
    as long as the index says, so a truncated or foreign file fails here, not mid-run.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = data_files(prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path} does not exist; an indexed dataset is a pair "
                                        f"<prefix>.bin + <prefix>.idx written by `trident data prepare` "
                                        f"(or Megatron-LM's preprocess_data.py); pass the prefix without "
                                        f"the extension")
        self._read_index()
        self._check_bin()
        self._contiguous: bool | None = None
        if self.num_tokens:
            # a plain ndarray view of the mapping: slicing a np.memmap costs several times more
            self._tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r",
                                     shape=(self.bin_path.stat().st_size // self.dtype.itemsize,)).view(np.ndarray)
        else:
            self._tokens = np.zeros(0, dtype=self.dtype)

    def _read_index(self) -> None:
        raw = np.memmap(self.idx_path, dtype=np.uint8, mode="r") if self.idx_path.stat().st_size else b""
        if len(raw) < _HEADER.size:
            raise IndexedDataError(f"{self.idx_path} is {len(raw)} bytes, shorter than the {_HEADER.size}-byte "
                                   f"header of an index; the file is truncated or not an index. Prepare "
                                   f"the data again with `trident data prepare`")
        magic, version, code, n_seq, n_doc = _HEADER.unpack(bytes(raw[:_HEADER.size]))
        if magic != MAGIC:
            raise IndexedDataError(f"{self.idx_path} starts with {magic!r}, not the index magic {MAGIC!r}: "
                                   f"it is not a Megatron-style .idx file. Prepare the data with "
                                   f"`trident data prepare`")
        if version != VERSION:
            raise IndexedDataError(f"{self.idx_path} is index version {version}; trident reads version "
                                   f"{VERSION} (Megatron-LM's MMIDIDX layout). Prepare the data again with "
                                   f"`trident data prepare`, or convert it with the tool that wrote it")
        if code not in DTYPE_CODES:
            raise IndexedDataError(f"{self.idx_path} has token dtype code {code}; known codes are "
                                   f"{sorted(DTYPE_CODES)} ({', '.join(np.dtype(t).name for t in DTYPE_CODES.values())})")
        expected = _HEADER.size + n_seq * (4 + 8) + n_doc * 8
        if len(raw) < expected:
            raise IndexedDataError(f"{self.idx_path} is {len(raw)} bytes but its header ({n_seq} sequences, "
                                   f"{n_doc} document entries) needs {expected}: the file is truncated. "
                                   f"Prepare the data again")
        self.dtype = np.dtype(DTYPE_CODES[code])
        offset = _HEADER.size
        self.sizes = np.frombuffer(raw, dtype=np.int32, count=n_seq, offset=offset)
        offset += self.sizes.nbytes
        self.pointers = np.frombuffer(raw, dtype=np.int64, count=n_seq, offset=offset)
        offset += self.pointers.nbytes
        self.document_indices = np.frombuffer(raw, dtype=np.int64, count=n_doc, offset=offset)
        self._raw_index = raw  # keeps the mapping alive for the views above

    def _check_bin(self) -> None:
        n = len(self.sizes)
        self.num_tokens = int(self.sizes.sum(dtype=np.int64))
        needed = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if n else 0
        have = self.bin_path.stat().st_size
        if have < needed:
            raise IndexedDataError(f"{self.bin_path} is {have:,} bytes but {self.idx_path.name} indexes "
                                   f"{n:,} documents ending at byte {needed:,}: the .bin is truncated "
                                   f"(an interrupted copy or write?). Copy it again or re-run "
                                   f"`trident data prepare`")
        if have % self.dtype.itemsize:
            raise IndexedDataError(f"{self.bin_path} is {have:,} bytes, not a whole number of "
                                   f"{self.dtype.name} tokens; the .bin does not belong to {self.idx_path.name}")

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def contiguous(self) -> bool:
        """Documents lie back to back in the .bin (always so for trident's and Megatron's writers)."""
        if self._contiguous is None:
            expected = np.zeros(len(self.sizes), dtype=np.int64)
            np.cumsum(self.sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=expected[1:])
            self._contiguous = bool(np.array_equal(expected, self.pointers))
        return self._contiguous

    def read_span(self, index: int, offset: int, count: int) -> np.ndarray:
        """Up to `count` tokens from token `offset` of document `index` on, running into the
        documents after it: one slice of the mapping (needs `contiguous`)."""
        start = int(self.pointers[index]) // self.dtype.itemsize + offset
        return self._tokens[start:start + count]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of document `index` (to its end when length is None)."""
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"document {index} out of range: {self.idx_path} holds {n} documents")
        index %= n
        size = int(self.sizes[index])
        stop = size if length is None else min(size, offset + length)
        start = int(self.pointers[index]) // self.dtype.itemsize
        return self._tokens[start + offset:start + stop]

    @property
    def num_documents(self) -> int:
        return max(len(self.document_indices) - 1, 0)

    def fingerprint(self) -> str:
        """What identifies the data cheaply: paths, sizes and modification times of both files."""
        parts = []
        for path in (self.idx_path, self.bin_path):
            st = path.stat()
            parts.append(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}")
        return "|".join(parts)

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}: {len(self):,} documents, {self.num_tokens:,} tokens, "
                f"{self.dtype.name})")


class IndexedDatasetWriter:
    """Append documents to `<prefix>.bin`, then `finalize()` writes the `.idx`.

    Both files are written under temporary names and renamed at the end, so a reader never sees
    half a dataset and an interrupted run leaves no pair that looks complete.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"token dtype {self.dtype} has no code in the index layout; use one of "
                             f"{', '.join(np.dtype(t).name for t in DTYPE_CODES.values())}")
        self.bin_path, self.idx_path = data_files(prefix)
        self._tmp_bin = self.bin_path.with_name(self.bin_path.name + ".tmp")
        self._bin = open(self._tmp_bin, "wb")
        self._sizes: list[np.ndarray] = []
        self.num_tokens = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Documents given as one concatenated token array and the length of each."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != len(tokens):
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {len(tokens)} tokens were given")
        if len(lengths) and int(lengths.max()) > np.iinfo(np.int32).max:
            raise ValueError("a document longer than 2**31 - 1 tokens does not fit the index's int32 sizes")
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._sizes.append(lengths.astype(np.int32))
        self.num_tokens += len(tokens)

    def add_document(self, tokens: np.ndarray | list[int]) -> None:
        tokens = np.asarray(tokens)
        self.add_documents(tokens, np.array([len(tokens)]))

    def finalize(self) -> None:
        self._bin.close()
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes):
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.arange(len(sizes) + 1, dtype=np.int64)
        tmp_idx = self.idx_path.with_name(self.idx_path.name + ".tmp")
        with open(tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(sizes), len(documents)))
            f.write(sizes.tobytes())
            f.write(pointers.tobytes())
            f.write(documents.tobytes())
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(tmp_idx, self.idx_path)

    def abort(self) -> None:
        """Close and remove the partial files (after an error)."""
        self._bin.close()
        self._tmp_bin.unlink(missing_ok=True)


def write_indexed_dataset(prefix: str | os.PathLike, documents: list, dtype: np.dtype | type) -> IndexedDataset:
    """Write a small list of token lists as `<prefix>.bin/.idx` and open it (tests, tools)."""
    writer = IndexedDatasetWriter(prefix, dtype)
    for doc in documents:
        writer.add_document(doc)
    writer.finalize()
    return IndexedDataset(prefix)
