"""Sample kinds and batching: GPT windows, packed rows with document masks (trained exactly like
the documents one by one), length-bucketed batches under a token budget, and the loader's
position with worker processes reading ahead."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trident.config.schema import DataConfig
from trident.data.blend import BlendedDataset
from trident.data.build import build_loader
from trident.data.datasets import TokenDataset
from trident.data.indexed import write_indexed_dataset
from trident.data.loader import FixedBatches, TokenBudgetBatches, TridentDataLoader, collate
from trident.data.samples import DocumentCorpus, Documents, GPTWindows, PackedDocuments
from trident.models.gpt import GPT, GPTConfig

VOCAB = 64
DOC_LENGTHS = [5, 9, 3, 12, 7, 30, 2, 16, 1, 11, 6, 8]


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, VOCAB, n).tolist() for n in DOC_LENGTHS]
    write_indexed_dataset(tmp_path / "docs", docs, np.uint16)
    return DocumentCorpus(str(tmp_path / "docs"), vocab_size=VOCAB), docs


def test_windows_are_the_concatenated_stream_cut_like_token_dataset(corpus):
    c, docs = corpus
    stream = torch.tensor([t for d in docs for t in d])
    windows, old = GPTWindows(c, seq_len=10), TokenDataset(stream, seq_len=10)
    assert len(windows) == len(old)
    for i in range(len(old)):
        x, y = old[i]
        assert windows[i]["input_ids"].tolist() == x.tolist() and windows[i]["labels"].tolist() == y.tolist()


def test_packed_rows_hold_every_document_once_with_restarting_positions(corpus):
    c, docs = corpus
    packed = PackedDocuments(c, seq_len=16)
    seen = []
    for row in range(len(packed)):
        s = packed[row]
        for k in s["doc_ids"].unique().tolist():
            at = (s["doc_ids"] == k).nonzero().flatten()
            if s["input_ids"][at].eq(0).all() and k == s["doc_ids"].max():
                continue  # padding
            assert s["position_ids"][at].tolist() == list(range(len(at)))
            assert s["labels"][at[-1]] == -100  # no target across the document boundary
            seen.append(s["input_ids"][at].tolist())
    pieces = [d[i:i + 16] for d in docs for i in range(0, len(d), 16)]  # the 30-token document is split
    assert seen == pieces
    assert 0 < packed.padding_share < 0.5


def _tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=32, n_layer=2, n_head=2, d_model=32, dropout=0.0))


def test_packed_with_masks_equals_unpacked_losses_and_gradients(corpus):
    c, _ = corpus
    model = _tiny_gpt()
    params = [p for p in model.parameters()]
    packed = PackedDocuments(c, seq_len=32)
    batch = collate([packed[i] for i in range(len(packed))])
    logits = model(batch["input_ids"], position_ids=batch["position_ids"], doc_ids=batch["doc_ids"])
    per_token = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    per_token = per_token.view_as(batch["labels"])
    compared = 0
    for row in range(batch["input_ids"].shape[0]):
        for k in batch["doc_ids"][row].unique().tolist():
            at = (batch["doc_ids"][row] == k).nonzero().flatten()
            tokens = batch["input_ids"][row, at]
            if (batch["labels"][row, at] == -100).all():
                continue  # padding, or a one-token document: nothing to predict
            packed_loss = per_token[row, at[:-1]].mean()
            packed_grads = torch.autograd.grad(packed_loss, params, retain_graph=True)
            alone = model(tokens[None, :-1], tokens[None, 1:])
            alone_grads = torch.autograd.grad(alone, params)
            assert abs(packed_loss.item() - alone.item()) < 1e-5, f"row {row} document {k}"
            for p, a, name in zip(packed_grads, alone_grads, [n for n, _ in model.named_parameters()]):
                assert (p - a).abs().max().item() < 1e-5, f"row {row} document {k}: {name}"
            compared += 1
    assert compared == sum(1 for n in DOC_LENGTHS if n >= 2)  # every document with a target
    # and the model's own mean loss over the packed batch is the token-weighted mean of the documents
    mean = model(batch["input_ids"], batch["labels"], position_ids=batch["position_ids"], doc_ids=batch["doc_ids"])
    assert abs(mean.item() - per_token[batch["labels"] != -100].mean().item()) < 1e-6


def test_bucketed_batches_respect_the_token_budget_and_report_padding(corpus):
    c, docs = corpus
    blend = BlendedDataset([1], [Documents(c, seq_len=12)], shuffle=False)
    units = TokenBudgetBatches(blend, max_tokens=24, dp_rank=0, dp_size=1, seed=0, window=len(blend))
    batches = units.window_batches(0)
    assert sorted(p for b in batches for p in b) == list(range(len(blend)))  # each sample once
    lengths = blend.sample_lengths(np.arange(len(blend)))
    for b in batches:
        assert len(b) * max(lengths[b]) <= 24
        out = collate([blend[p] for p in b])
        assert out["tokens"] == len(b) * max(lengths[b])
        assert out["pad_tokens"] == sum(max(lengths[b]) - lengths[b])
        assert (out["labels"] == -100).sum().item() == out["pad_tokens"]
    assert len(Documents(c, seq_len=12)) == sum(1 for n in DOC_LENGTHS if n >= 2)  # one-token docs dropped


@pytest.mark.parametrize("bucketing", [False, True])
def test_loader_position_is_exact_with_workers_reading_ahead(corpus, bucketing):
    c, _ = corpus
    prefix = c.shards[0].prefix
    cfg = DataConfig(paths=[prefix], num_workers=1, bucketing=bucketing, val_fraction=0.0,
                     max_tokens_per_batch=24 if bucketing else None)
    kwargs = dict(seq_len=8, vocab_size=VOCAB, micro_batch_size=2, dp_size=1, dp_rank=0, seed=5, paths=[prefix])
    loader = build_loader(cfg, **kwargs)
    first = [next(loader)["input_ids"].tolist() for _ in range(7)]
    state = loader.state_dict()  # the worker has prefetched batches 8, 9, ...: they must not count
    rest = [next(loader)["input_ids"].tolist() for _ in range(3)]
    loader.close()
    again = build_loader(cfg.model_copy(update={"num_workers": 0}), **kwargs)
    assert [next(again)["input_ids"].tolist() for _ in range(7)] == first
    resumed = build_loader(cfg, **kwargs)
    resumed.load_state_dict(state)
    assert [next(resumed)["input_ids"].tolist() for _ in range(3)] == rest
    resumed.close()
    if not bucketing:
        assert state["cursor"] == 7 * 2


def test_resume_refuses_other_data(corpus, tmp_path):
    c, _ = corpus
    blend = BlendedDataset([1], [GPTWindows(c, seq_len=8)], seed=1)
    loader = TridentDataLoader(blend, FixedBatches(2, 0, 1))
    next(loader)
    state = loader.state_dict()
    other = TridentDataLoader(BlendedDataset([1], [GPTWindows(c, seq_len=8)], seed=2), FixedBatches(2, 0, 1))
    with pytest.raises(ValueError, match="taken on other data or settings"):
        other.load_state_dict(state)

