"""Data for training: tokenized `.bin`/`.idx` shards (Megatron-LM's layout) and how they are
prepared, blended, packed, bucketed and loaded per data-parallel rank with an exact, resumable
position; plus the bundled KJV corpus and its tokenizer, and the older in-memory token windows."""

from trident.data.blend import BlendedDataset
from trident.data.datasets import TokenDataset, load_text_dataset, load_tokens
from trident.data.indexed import IndexedDataError, IndexedDataset, IndexedDatasetWriter
from trident.data.loader import TridentDataLoader
from trident.data.sampler import DistributedSampler
from trident.data.samples import DocumentCorpus, Documents, GPTWindows, PackedDocuments
from trident.data.tokenizer import bundled_corpus_text, encode_corpus, load_tokenizer

__all__ = [
    "BlendedDataset",
    "DistributedSampler",
    "DocumentCorpus",
    "Documents",
    "GPTWindows",
    "IndexedDataError",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "PackedDocuments",
    "TokenDataset",
    "TridentDataLoader",
    "bundled_corpus_text",
    "encode_corpus",
    "load_text_dataset",
    "load_tokenizer",
    "load_tokens",
]
