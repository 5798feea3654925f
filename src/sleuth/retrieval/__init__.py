"""Retrieval: BM25 (bm25s), dense (sentence-transformers + FAISS), hybrid RRF, over a memory-mapped docstore."""

from sleuth.retrieval.base import Hit, Retriever, format_docs
from sleuth.retrieval.bm25 import BM25Retriever
from sleuth.retrieval.dense import DenseRetriever
from sleuth.retrieval.docstore import DocStore
from sleuth.retrieval.encoders import Encoder, EncoderConfig
from sleuth.retrieval.hybrid import HybridRetriever, rrf_fuse
from sleuth.retrieval.index import build_index, load_hybrid, load_retriever, read_manifest

__all__ = [
    "BM25Retriever",
    "DenseRetriever",
    "DocStore",
    "Encoder",
    "EncoderConfig",
    "Hit",
    "HybridRetriever",
    "Retriever",
    "build_index",
    "format_docs",
    "load_hybrid",
    "load_retriever",
    "read_manifest",
    "rrf_fuse",
]
