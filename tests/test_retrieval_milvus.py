"""Milvus backend against a local milvus-lite engine (skipped when milvus-lite/pymilvus are missing).

The encoder is not under test: a deterministic hashing encoder (an `Encoder` subclass with no model)
gives vectors whose exact top-k numpy can compute independently.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pymilvus", reason="the Milvus backend needs pymilvus (pip install pymilvus)")
pytest.importorskip("milvus_lite", reason="local Milvus tests need milvus-lite (pip install milvus-lite)")

from sleuth.errors import ConfigError, IndexMismatchError, ServiceError  # noqa: E402
from sleuth.retrieval.base import Retriever  # noqa: E402
from sleuth.retrieval.dense import passage_text  # noqa: E402
from sleuth.retrieval.encoders import Encoder, EncoderConfig  # noqa: E402
from sleuth.retrieval.milvus import MilvusBuild, MilvusRetriever, MilvusSearch, connect, index_corpus  # noqa: E402

DIM = 32
N_DOCS = 60


class HashEncoder(Encoder):
    """Bag of words: each token maps to a fixed pseudo-random unit vector (crc32-seeded); rows normalised."""

    def __init__(self, name: str = "test-hash-encoder"):
        self.config = EncoderConfig(name=name, batch_size=64)
        self.dim = DIM

    def _encode(self, texts: list[str], prefix: str, show_progress: bool = False) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), np.float32)
        for i, text in enumerate(texts):
            for tok in (prefix + text).lower().replace('"', " ").split():
                v = np.random.default_rng(zlib.crc32(tok.encode())).standard_normal(self.dim)
                out[i] += v / np.linalg.norm(v)
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)


def _docs() -> list[tuple[str, str, str]]:
    rng = np.random.default_rng(4)
    vocab = [f"w{i}" for i in range(150)]
    docs = []
    for i in range(N_DOCS):
        words = " ".join(rng.choice(vocab, size=8, replace=False))
        title = "" if i % 10 == 9 else f"Title {i}"  # some untitled passages
        docs.append((f"doc-{i}", title, f"{words} unique{i} naïve"))
    return docs


@pytest.fixture(scope="module")
def encoder() -> HashEncoder:
    return HashEncoder()


@pytest.fixture(scope="module")
def milvus_db(tmp_path_factory: pytest.TempPathFactory, encoder: HashEncoder) -> tuple[str, Path, dict]:
    root = tmp_path_factory.mktemp("milvus")
    corpus = root / "corpus.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"id": d, "contents": f'"{t}"\n{x}'} if t else {"id": d, "title": "", "text": x})
            + "\n"
            for d, t, x in _docs()
        ),
        encoding="utf-8",
    )
    uri = str(root / "milvus.db")
    try:
        connect(uri).close()
    except ServiceError as err:  # pragma: no cover - depends on the machine
        pytest.skip(f"the local Milvus engine (milvus-lite) could not start here: {err}")
    stats = index_corpus(corpus, uri, "passages", encoder, MilvusBuild(batch=16))
    return uri, corpus, stats


def test_index_corpus_reports_counts(milvus_db: tuple[str, Path, dict]) -> None:
    _, _, stats = milvus_db
    assert stats["num_docs"] == N_DOCS and stats["dim"] == DIM and stats["bm25"] is True
    assert stats["index"]["index_type"] == "AUTOINDEX" and stats["passages_per_second"] > 0


def test_dense_search_matches_numpy_and_returns_stored_fields(
    milvus_db: tuple[str, Path, dict], encoder: HashEncoder
) -> None:
    uri = milvus_db[0]
    docs = _docs()
    passages = encoder.encode_passages([passage_text(t, x) for _, t, x in docs])
    queries = [" ".join(docs[i][2].split()[:4]) for i in (0, 9, 17, 42)]
    expected = np.argsort(-(encoder.encode_queries(queries) @ passages.T), axis=1, kind="stable")[:, :5]
    with MilvusRetriever(uri, "passages", encoder) as r:
        assert isinstance(r, Retriever) and r.num_docs == N_DOCS
        hits = r.search(queries, 5)
    assert [[h.doc_id for h in q] for q in hits] == [[docs[i][0] for i in row] for row in expected]
    for q_hits, row in zip(hits, expected, strict=True):
        for h, i in zip(q_hits, row, strict=True):
            assert (h.title, h.text) == (docs[i][1], docs[i][2])  # untitled and non-ASCII passages round-trip
    exact_scores = np.sort(encoder.encode_queries(queries[:1]) @ passages.T)[0][::-1][:5]
    np.testing.assert_allclose([h.score for h in hits[0]], exact_scores, rtol=1e-4)


def test_bm25_full_text_search(milvus_db: tuple[str, Path, dict]) -> None:
    uri = milvus_db[0]
    # No encoder needed for BM25; each "uniqueN" term occurs in exactly one passage.
    with MilvusRetriever(uri, "passages", search=MilvusSearch(mode="bm25")) as r:
        assert r.encoder is None
        hits = r.search(["unique7", "unique13 unique31", "Title 5"], 3)
    assert hits[0][0].doc_id == "doc-7"
    assert {h.doc_id for h in hits[1][:2]} == {"doc-13", "doc-31"}
    # Titles are BM25-indexed too ("5" occurs only in doc-5's title).
    assert hits[2][0].doc_id == "doc-5"
    for q in hits:
        scores = [h.score for h in q]
        assert all(s > 0 for s in scores) and scores == sorted(scores, reverse=True)


def test_hybrid_search_is_rrf_of_dense_and_bm25(
    milvus_db: tuple[str, Path, dict], encoder: HashEncoder
) -> None:
    uri = milvus_db[0]
    docs = _docs()
    query = " ".join(docs[23][2].split()[:3]) + " unique23"
    with MilvusRetriever(uri, "passages", encoder, MilvusSearch(mode="hybrid", rrf_k=60)) as r:
        fused = r.search([query], 4)[0]
    with MilvusRetriever(uri, "passages", encoder) as r:
        dense = r.search([query], 4)[0]
    with MilvusRetriever(uri, "passages", search=MilvusSearch(mode="bm25")) as r:
        bm25 = r.search([query], 4)[0]
    # Reference RRF: score(d) = sum over lists of 1 / (60 + rank), ranks from 1.
    expected: dict[str, float] = {}
    for hits in (dense, bm25):
        for rank, h in enumerate(hits, start=1):
            expected[h.doc_id] = expected.get(h.doc_id, 0.0) + 1.0 / (60 + rank)
    assert dense[0].doc_id == bm25[0].doc_id == fused[0].doc_id == "doc-23"
    np.testing.assert_allclose(fused[0].score, 2 / 61, rtol=1e-5)
    for h in fused:
        np.testing.assert_allclose(h.score, expected[h.doc_id], rtol=1e-5)
    np.testing.assert_allclose(
        [h.score for h in fused], sorted(expected.values(), reverse=True)[:4], rtol=1e-5
    )


def test_batches_larger_than_max_batch(milvus_db: tuple[str, Path, dict], encoder: HashEncoder) -> None:
    uri = milvus_db[0]
    queries = [f"unique{i}" for i in range(N_DOCS)]
    with MilvusRetriever(uri, "passages", encoder, MilvusSearch(mode="bm25", max_batch=7)) as r:
        hits = r.search(queries, 1)
    assert [h[0].doc_id for h in hits] == [f"doc-{i}" for i in range(N_DOCS)]


def test_errors_name_the_problem(
    milvus_db: tuple[str, Path, dict], encoder: HashEncoder, tmp_path: Path
) -> None:
    uri, corpus, _ = milvus_db
    with pytest.raises(IndexMismatchError, match="'nope' does not exist"):
        MilvusRetriever(uri, "nope", encoder)
    with pytest.raises(IndexMismatchError, match="name='test-hash-encoder'"):
        MilvusRetriever(uri, "passages", HashEncoder("other-encoder"))
    with pytest.raises(ConfigError, match="unknown Milvus search mode"):
        MilvusRetriever(uri, "passages", encoder, MilvusSearch(mode="sparse"))
    with pytest.raises(ConfigError, match="already exists"):
        index_corpus(corpus, uri, "passages", encoder)
    with MilvusRetriever(uri, "passages", encoder) as r, pytest.raises(ValueError, match="k must be"):
        r.search(["x"], 0)
    long_corpus = tmp_path / "long.jsonl"
    long_corpus.write_text(json.dumps({"id": "big", "contents": '"' + "T" * 5000 + '"\nshort'}) + "\n")
    with pytest.raises(ConfigError, match="'big' has a title of 5000 bytes"):
        index_corpus(long_corpus, uri, "long", encoder)
