"""`trident data prepare` and the `.bin`/`.idx` reader: round trip, Megatron's byte layout,
worker-count independence, and one clear error (naming the file) per kind of bad input."""

from __future__ import annotations

import gzip
import json
import struct

import numpy as np
import pytest

from trident.cli.main import main as trident_main
from trident.config import ConfigError, load_config
from trident.data import prepare as prepare_mod
from trident.data.blend import BlendedDataset
from trident.data.indexed import IndexedDataError, IndexedDataset, write_indexed_dataset
from trident.data.prepare import prepare
from trident.data.samples import DocumentCorpus, GPTWindows
from trident.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _lines(n: int) -> list[str]:
    words = ["light", "darkness", "waters", "firmament", "heaven", "earth", "naïve café —", "42"]
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(1 + i % 11)) + f" {i}.\n" for i in range(n)]


def test_round_trip_text_jsonl_parquet(tmp_path, tokenizer):
    lines = _lines(300)
    (tmp_path / "a.txt").write_text("".join(lines[:100]) + "\n   \n")  # blank lines are not documents
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        for line in lines[100:200]:
            f.write(json.dumps({"body": line, "id": 1}) + "\n")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": lines[200:]}), tmp_path / "c.parquet")

    summary = prepare([tmp_path / "a.txt"], tokenizer, tmp_path / "out", progress=False)
    summary_kv = prepare([tmp_path / "b.jsonl.gz", tmp_path / "c.parquet"], tokenizer, tmp_path / "out",
                         key="body", append_eod=True, progress=False)
    assert summary.documents + summary_kv.documents == 300
    eod = tokenizer.token_to_id("<|endoftext|>")
    for name, docs, extra in (("a", lines[:100], []), ("b", lines[100:200], [eod]), ("c", lines[200:], [eod])):
        ds = IndexedDataset(tmp_path / "out" / name)
        assert len(ds) == len(docs) and ds.dtype == np.uint16
        for i, doc in enumerate(docs):
            assert ds[i].tolist() == tokenizer.encode(doc, add_special_tokens=False).ids + extra
    meta = json.loads((tmp_path / "out" / "prepare.json").read_text())
    assert meta["vocab_size"] == 4096


def test_several_workers_write_the_bytes_of_one(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(prepare_mod, "CHUNK_DOCS", 16)  # 300 documents -> 19 chunks over the workers
    (tmp_path / "t.txt").write_text("".join(_lines(300)))
    prepare([tmp_path / "t.txt"], tokenizer, tmp_path / "one", workers=1, progress=False)
    prepare([tmp_path / "t.txt"], tokenizer, tmp_path / "two", workers=2, append_eod=False, progress=False)
    for ext in (".bin", ".idx"):
        assert (tmp_path / "one" / f"t{ext}").read_bytes() == (tmp_path / "two" / f"t{ext}").read_bytes()


def test_idx_is_megatrons_layout(tmp_path):
    docs = [[5, 6, 7], [1], [65535, 0]]
    write_indexed_dataset(tmp_path / "m", docs, np.uint16)
    raw = (tmp_path / "m.idx").read_bytes()
    magic, version, code, n_seq, n_doc = struct.unpack("<9sQBQQ", raw[:34])
    assert (magic, version, code, n_seq, n_doc) == (b"MMIDIDX\x00\x00", 1, 8, 3, 4)
    sizes = np.frombuffer(raw, np.int32, 3, 34)
    pointers = np.frombuffer(raw, np.int64, 3, 34 + 12)
    doc_idx = np.frombuffer(raw, np.int64, 4, 34 + 12 + 24)
    assert sizes.tolist() == [3, 1, 2] and pointers.tolist() == [0, 6, 8] and doc_idx.tolist() == [0, 1, 2, 3]
    assert len(raw) == 34 + 12 * 3 + 8 * 4
    assert np.frombuffer((tmp_path / "m.bin").read_bytes(), np.uint16).tolist() == [5, 6, 7, 1, 65535, 0]
    ds = IndexedDataset(tmp_path / "m")
    assert ds.get(0, 1, 1).tolist() == [6] and ds[2].tolist() == [65535, 0] and ds.num_documents == 3


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32, np.int64, np.uint16])
def test_any_token_dtype_reads_as_stored(tmp_path, dtype):
    ds = write_indexed_dataset(tmp_path / "d", [[1, 2, 3], [4, 5]], dtype)
    assert ds.dtype == np.dtype(dtype) and ds[1].tolist() == [4, 5]


# ---------------------------------------------------------------- bad input: one clear error each

def test_truncated_bin_names_the_file(tmp_path):
    write_indexed_dataset(tmp_path / "x", [[1, 2, 3, 4], [5, 6]], np.uint16)
    path = tmp_path / "x.bin"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(IndexedDataError, match=rf"{path}.*truncated.*prepare"):
        IndexedDataset(tmp_path / "x")


def test_idx_of_another_version_names_the_file(tmp_path):
    write_indexed_dataset(tmp_path / "v", [[1, 2]], np.uint16)
    path = tmp_path / "v.idx"
    raw = bytearray(path.read_bytes())
    raw[9:17] = struct.pack("<Q", 2)
    path.write_bytes(bytes(raw))
    with pytest.raises(IndexedDataError, match=rf"{path} is index version 2; trident reads version 1"):
        IndexedDataset(tmp_path / "v")
    path.write_bytes(b"NOTANIDX!" + bytes(raw[9:]))
    with pytest.raises(IndexedDataError, match=rf"{path} starts with .* not the index magic"):
        IndexedDataset(tmp_path / "v")


def test_token_id_beyond_the_vocabulary_names_the_file(tmp_path):
    write_indexed_dataset(tmp_path / "big", [list(range(20)), [3, 4096, 5] * 10], np.uint16)
    windows = GPTWindows(DocumentCorpus(str(tmp_path / "big"), vocab_size=4096), seq_len=8)
    windows[0]  # ids 0..8 are fine
    with pytest.raises(IndexedDataError, match=rf"{tmp_path / 'big.bin'}: document 1 holds token id 4096, "
                                               rf"outside the model's vocabulary \[0, 4096\)"):
        [windows[i] for i in range(len(windows))]


def test_empty_input_file_names_the_file(tmp_path, tokenizer):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=rf"input {tmp_path / 'empty.jsonl'} has no documents"):
        prepare([tmp_path / "empty.jsonl"], tokenizer, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "empty.bin").exists()  # nothing half-written is left
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_missing_json_key_names_file_and_line(tmp_path, tokenizer):
    (tmp_path / "k.jsonl").write_text('{"text": "a"}\n{"content": "b"}\n')
    with pytest.raises(ValueError, match=rf"{tmp_path / 'k.jsonl'}, line 2: no field 'text'.*--key"):
        prepare([tmp_path / "k.jsonl"], tokenizer, tmp_path / "out", progress=False)


@pytest.mark.parametrize("weights", [[0, 0], [1, -1], [float("nan"), 1]])
def test_weights_not_summing_to_a_positive_number(tmp_path, weights):
    a = write_indexed_dataset(tmp_path / "a", [[1, 2, 3]], np.uint16)
    with pytest.raises(ValueError, match=r"blend weights .* for first, second must be finite, non-negative "
                                         r"and sum to a positive number"):
        BlendedDataset(weights, [a, a], names=["first", "second"])
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"data": {"paths": ["first", "second"], "weights": weights}}))
    with pytest.raises(ConfigError, match=r"data: weights \[.*\] must be non-negative and sum to a positive number"):
        load_config(str(cfg))


def test_cli_prepare_and_its_errors(tmp_path, capsys):
    (tmp_path / "doc.txt").write_text("In the beginning.\nAnd the earth.\n")
    assert trident_main(["data", "prepare", str(tmp_path / "doc.txt"), "--tokenizer", "bundled",
                         "--out", str(tmp_path / "o"), "--append-eod"]) == 0
    assert "2 documents" in capsys.readouterr().out
    assert len(IndexedDataset(tmp_path / "o" / "doc")) == 2
    assert trident_main(["data", "inspect", str(tmp_path / "o")]) == 0
    assert "2 documents" in capsys.readouterr().out
    (tmp_path / "none.txt").write_text("\n\n")
    assert trident_main(["data", "prepare", str(tmp_path / "none.txt"), "--tokenizer", "bundled",
                         "--out", str(tmp_path / "o")]) == 1
    assert f"{tmp_path / 'none.txt'} has no documents" in capsys.readouterr().err


def test_a_text_dataset_is_prepared_once_into_the_cache(tmp_path, tokenizer):
    from trident.data.build import prepared_text_dir
    text = tmp_path / "story.txt"
    text.write_text("".join(_lines(50)))
    folder = prepared_text_dir(str(text), tokenizer, cache_dir=tmp_path / "cache", workers=1)
    assert folder.parent == tmp_path / "cache" and (folder / "story.idx").is_file()
    stamp = (folder / "story.bin").stat().st_mtime_ns
    assert prepared_text_dir(str(text), tokenizer, cache_dir=tmp_path / "cache") == folder
    assert (folder / "story.bin").stat().st_mtime_ns == stamp  # reused, not rewritten
    ids = np.concatenate([IndexedDataset(folder / "story")[i] for i in range(50)]).tolist()
    assert ids == tokenizer.encode("".join(_lines(50))).ids  # documents concatenated = the file's stream
    text.write_text("".join(_lines(51)))  # other text: another folder
    assert prepared_text_dir(str(text), tokenizer, cache_dir=tmp_path / "cache", create=False) != folder


def test_shards_of_another_tokenizer_are_refused(tmp_path, tokenizer):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from trident.config.schema import DataConfig
    from trident.data.build import build_loader
    (tmp_path / "t.txt").write_text("".join(_lines(40)))
    other = Tokenizer(models.WordLevel({"[UNK]": 0, "light": 1}, unk_token="[UNK]"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    prepare([tmp_path / "t.txt"], other, tmp_path / "out", progress=False)
    kwargs = dict(seq_len=4, vocab_size=4096, micro_batch_size=2, dp_rank=0, dp_size=1, seed=0,
                  paths=[str(tmp_path / "out")])
    with pytest.raises(ValueError, match=rf"{tmp_path / 'out' / 'prepare.json'}: the shards in .* were tokenized "
                                         rf"with another tokenizer"):
        build_loader(DataConfig(), tokenizer=tokenizer, **kwargs)
    next(build_loader(DataConfig(), tokenizer=other, **kwargs))


def test_eod_token_names_the_end_of_text_token(tmp_path, tokenizer, capsys):
    """--eod-token for a tokenizer whose end-of-text token has another name; clear error if absent."""
    (tmp_path / "doc.txt").write_text("In the beginning.\nAnd the earth.\n")
    name = next(t for t in tokenizer.get_vocab(with_added_tokens=True) if t not in prepare_mod.EOD_NAMES)
    want = tokenizer.token_to_id(name)
    assert trident_main(["data", "prepare", str(tmp_path / "doc.txt"), "--tokenizer", "bundled",
                         "--out", str(tmp_path / "o"), "--append-eod", "--eod-token", name]) == 0
    ds = IndexedDataset(tmp_path / "o" / "doc")
    assert [int(ds[i][-1]) for i in range(len(ds))] == [want, want]
    assert trident_main(["data", "prepare", str(tmp_path / "doc.txt"), "--tokenizer", "bundled",
                         "--out", str(tmp_path / "p"), "--append-eod", "--eod-token", "<|no such token|>"]) == 1
    err = capsys.readouterr().err
    assert "--eod-token '<|no such token|>' is not in the tokenizer's vocabulary" in err
    with pytest.raises(ValueError, match="only applies with --append-eod"):
        prepare([tmp_path / "doc.txt"], tokenizer, tmp_path / "q", eod_token=name, progress=False)
