"""Sharded dense indexes: contiguous FAISS shards searched in parallel and merged, IVF-PQ at scale.

The encoder is not under test here, so a deterministic hashing encoder (an `Encoder` subclass with
no model) stands in for MiniLM; one CLI test uses the real embedded MiniLM.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from serve_helpers import free_port, wait_for_health
from sleuth.errors import ConfigError, IndexMismatchError
from sleuth.retrieval import (
    DenseRetriever,
    Encoder,
    EncoderConfig,
    build_index,
    load_retriever,
    read_manifest,
)
from sleuth.retrieval.docstore import DocStore
from sleuth.retrieval.index import encode_docstore
from sleuth.retrieval.mapped import RowFile
from sleuth.retrieval.sharded import ShardedDenseRetriever, exact_rerank, merge_topk, shard_ranges

DIM = 32


class HashEncoder(Encoder):
    """Bag of words: each token maps to a fixed pseudo-random unit vector (crc32-seeded); rows normalised."""

    def __init__(self, dim: int = DIM):
        self.config = EncoderConfig(name="test-hash-encoder", batch_size=64)
        self.dim = dim
        self._cache: dict[str, np.ndarray] = {}

    def _token(self, token: str) -> np.ndarray:
        if token not in self._cache:
            v = np.random.default_rng(zlib.crc32(token.encode())).standard_normal(self.dim)
            self._cache[token] = (v / np.linalg.norm(v)).astype(np.float32)
        return self._cache[token]

    def _encode(self, texts: list[str], prefix: str, show_progress: bool = False) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), np.float32)
        for i, text in enumerate(texts):
            for tok in (prefix + text).lower().replace('"', " ").split():
                out[i] += self._token(tok)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.where(norms == 0, 1, norms)


def _write_corpus(path: Path, n: int, seed: int, words_per_doc: int = 12) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    vocab = [f"w{i}" for i in range(400)]
    docs = [list(rng.choice(vocab, size=words_per_doc, replace=False)) for _ in range(n)]
    with path.open("w", encoding="utf-8") as f:
        for i, words in enumerate(docs):
            f.write(json.dumps({"id": f"doc-{i}", "contents": f'"T{i}"\n' + " ".join(words)}) + "\n")
    return docs


@pytest.fixture(scope="module")
def encoder() -> HashEncoder:
    return HashEncoder()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[str]]]:
    path = tmp_path_factory.mktemp("sharded") / "corpus.jsonl"
    return path, _write_corpus(path, 203, seed=1)


@pytest.fixture(scope="module")
def queries(world: tuple[Path, list[list[str]]]) -> list[str]:
    rng = np.random.default_rng(7)
    docs = world[1]
    # Half of a document's words: its own document should score highest, the rest rank by overlap.
    return [
        " ".join(rng.choice(docs[i], size=6, replace=False)) for i in rng.choice(len(docs), 24, replace=False)
    ]


@pytest.fixture(scope="module")
def flat_dir(world: tuple[Path, list[list[str]]], encoder: HashEncoder) -> Path:
    out = world[0].parent / "flat"
    build_index(world[0], "dense", out, encoder=encoder, show_progress=False)
    return out


@pytest.fixture(scope="module")
def sharded_dir(world: tuple[Path, list[list[str]]], encoder: HashEncoder) -> Path:
    out = world[0].parent / "sharded3"
    build_index(world[0], "dense", out, encoder=encoder, shards=3, show_progress=False)
    return out


def test_shard_ranges_tile_the_rows() -> None:
    assert shard_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert shard_ranges(5, 1) == [(0, 5)]
    with pytest.raises(ConfigError, match="cannot split 2 passages into 3 shards"):
        shard_ranges(2, 3)
    with pytest.raises(ConfigError, match="positive integer"):
        shard_ranges(10, 0)


def test_merge_topk_hand_example() -> None:
    # Shard A holds rows 0-2, shard B rows 10-12; B found only one row for query 1 (-1 padding).
    a_scores = np.array([[0.9, 0.5], [0.4, 0.3]], np.float32)
    a_ids = np.array([[2, 0], [1, 2]])
    b_scores = np.array([[0.7, 0.5], [0.8, 0.0]], np.float32)
    b_ids = np.array([[11, 10], [12, -1]])
    scores, ids = merge_topk([a_scores, b_scores], [a_ids, b_ids], 3)
    # Query 0: 0.9 (2), 0.7 (11), then a 0.5 tie between rows 0 and 10: the lower id wins.
    assert ids.tolist() == [[2, 11, 0], [12, 1, 2]]
    np.testing.assert_allclose(scores, [[0.9, 0.7, 0.5], [0.8, 0.4, 0.3]])
    # Asking for more than exists pads with -1 / -inf.
    scores, ids = merge_topk([b_scores[1:]], [b_ids[1:]], 2)
    assert ids.tolist() == [[12, -1]] and scores[0, 1] == -np.inf


def test_sharded_flat_equals_unsharded_flat(
    flat_dir: Path, sharded_dir: Path, encoder: HashEncoder, queries: list[str]
) -> None:
    manifest = read_manifest(sharded_dir)
    assert manifest["kind"] == "dense"
    assert [(s["start"], s["end"]) for s in manifest["shards"]] == [(0, 68), (68, 136), (136, 203)]
    assert all((sharded_dir / s["file"]).is_file() for s in manifest["shards"])
    assert not (sharded_dir / "faiss.index").exists()

    flat = load_retriever(flat_dir, encoder=encoder)
    assert isinstance(flat, DenseRetriever)
    for threads in (1, 3):
        sharded = load_retriever(sharded_dir, encoder=encoder, threads=threads)
        assert isinstance(sharded, ShardedDenseRetriever) and sharded.parallel == min(threads, 3)
        # 24 queries take faiss' BLAS path, 1 query its per-query loop; both must agree with one index.
        for batch in (queries, queries[:1]):
            expected = flat.search(batch, 10)
            got = sharded.search(batch, 10)
            assert [[h.doc_id for h in q] for q in got] == [[h.doc_id for h in q] for q in expected]
            for g, e in zip(got, expected, strict=True):
                np.testing.assert_allclose([h.score for h in g], [h.score for h in e], rtol=1e-5, atol=1e-6)
                assert [(h.title, h.text) for h in g] == [(h.title, h.text) for h in e]
        sharded.close()


def test_global_ids_match_brute_force(
    world: tuple[Path, list[list[str]]], sharded_dir: Path, encoder: HashEncoder, queries: list[str]
) -> None:
    """Independent reference: numpy inner products over the whole corpus."""
    docs = world[1]
    passages = encoder.encode_passages([f'"T{i}"\n' + " ".join(w) for i, w in enumerate(docs)])
    q = encoder.encode_queries(queries)
    expected = np.argsort(-(q @ passages.T), axis=1, kind="stable")[:, :5]
    r = load_retriever(sharded_dir, encoder=encoder)
    rows, _ = r.search_indices(queries, 5)
    assert [list(x) for x in rows] == expected.tolist()
    # k beyond the corpus returns every passage once.
    hits = r.search(queries[:2], 500)
    assert [len(h) for h in hits] == [203, 203]
    assert len({h.doc_id for h in hits[0]}) == 203


def test_shards_are_memory_mapped(sharded_dir: Path, encoder: HashEncoder) -> None:
    retriever = load_retriever(sharded_dir, encoder=encoder)
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps (Linux) to see memory mappings")
    mapped = maps.read_text()
    for spec in read_manifest(sharded_dir)["shards"]:
        assert str((sharded_dir / spec["file"]).resolve()) in mapped
    assert retriever.search(["w1"], 1)  # still usable, and alive while the maps were read


def test_exact_rerank_matches_numpy() -> None:
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((50, 8)).astype(np.float16)
    queries = rng.standard_normal((2, 8)).astype(np.float32)
    candidates = np.array([[5, 17, 3, 40, -1], [0, 1, 2, 3, 4]])
    scores, ids = exact_rerank(vectors, queries, candidates, 3)
    for qi in range(2):
        cand = [c for c in candidates[qi] if c >= 0]
        exact = {c: float(vectors[c].astype(np.float32) @ queries[qi]) for c in cand}
        best = sorted(cand, key=lambda c: -exact[c])[:3]
        assert ids[qi].tolist() == best
        np.testing.assert_allclose(scores[qi], [exact[c] for c in best], rtol=1e-5)


def test_exact_rerank_over_several_query_chunks_matches_brute_force() -> None:
    """37 queries: chunks of 16, 16 and 5 (and of 1, and all at once) give the brute-force best rows."""
    rng = np.random.default_rng(4)
    vectors = rng.standard_normal((300, 12)).astype(np.float16)
    queries = rng.standard_normal((37, 12)).astype(np.float32)
    candidates = np.stack(
        [rng.choice(300, 20, replace=False) for _ in range(37)]
    )  # distinct, as merged shards give
    candidates[5, 10:] = -1  # a query with fewer candidates
    brute = vectors.astype(np.float32) @ queries.T  # (rows, queries)
    for chunk in (16, 1, 64):
        scores, ids = exact_rerank(vectors, queries, candidates, 4, chunk=chunk)
        for qi in range(37):
            cand = [int(c) for c in candidates[qi] if c >= 0]
            best = sorted(set(cand), key=lambda c: (-brute[c, qi], c))[:4]
            assert ids[qi].tolist() == best, (chunk, qi)
            np.testing.assert_allclose(scores[qi], brute[best, qi], rtol=1e-5)


def test_ivfpq_sharded_end_to_end_reports_recall(
    tmp_path: Path, encoder: HashEncoder, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "big.jsonl"
    docs = _write_corpus(corpus, 2000, seed=5, words_per_doc=10)
    rng = np.random.default_rng(11)
    picked = rng.choice(len(docs), 100, replace=False)
    queries = [" ".join(rng.choice(docs[i], size=5, replace=False)) for i in picked]
    import faiss

    build_index(corpus, "dense", tmp_path / "flat", encoder=encoder, show_progress=False)
    faiss.omp_set_num_threads(1)
    manifest = build_index(
        corpus,
        "dense",
        tmp_path / "ivf",
        encoder=encoder,
        threads=2,  # faiss trains and adds with the build's threads, whatever it had before
        faiss="ivfpq",
        nlist=16,
        m=8,
        nbits=6,
        nprobe=4,
        shards=2,
        train_sample=800,
        keep_vectors=True,
        show_progress=False,
    )
    assert manifest["train_sample"] == 800
    assert faiss.omp_get_max_threads() == 2
    faiss.omp_set_num_threads(1)
    assert manifest["vectors"] == {"file": "vectors.f16", "dtype": "float16", "shape": [2000, DIM]}
    assert (tmp_path / "ivf" / "vectors.f16").stat().st_size == 2000 * DIM * 2
    assert not (tmp_path / "ivf" / "vectors.tmp.f16").exists()

    exact = load_retriever(tmp_path / "flat", encoder=encoder).search(queries, 10)
    exact_ids = [{h.doc_id for h in q} for q in exact]

    def recall(**load: object) -> float:
        got = load_retriever(tmp_path / "ivf", encoder=encoder, **load).search(queries, 10)
        return float(
            np.mean([len({h.doc_id for h in g} & e) / 10 for g, e in zip(got, exact_ids, strict=True)])
        )

    pq_only = recall(rerank=0, nprobe=4)
    full_probe = recall(rerank=0, nprobe=16)
    reranked = recall(rerank=100, nprobe=16)
    with capsys.disabled():
        print(
            f"\nivfpq recall@10 vs flat: nprobe 4 {pq_only:.2f}, nprobe 16 {full_probe:.2f}, +rerank 100 {reranked:.2f}"
        )
    # Probing all 16 lists leaves only PQ error, which exact re-scoring of 100 candidates removes.
    assert reranked >= full_probe and reranked > 0.9
    assert full_probe >= pq_only > 0.1


def test_sharded_errors(
    world: tuple[Path, list[list[str]]], sharded_dir: Path, encoder: HashEncoder, tmp_path: Path
) -> None:
    corpus = world[0]
    with pytest.raises(ConfigError, match="train_sample applies to ivfpq"):
        build_index(
            corpus, "dense", tmp_path / "a", encoder=encoder, shards=2, train_sample=100, show_progress=False
        )
    with pytest.raises(ConfigError, match="cannot split 203 passages into 500 shards"):
        build_index(corpus, "dense", tmp_path / "b", encoder=encoder, shards=500, show_progress=False)
    with pytest.raises(ConfigError, match="train_sample=10 is too small"):
        build_index(
            corpus,
            "dense",
            tmp_path / "c",
            encoder=encoder,
            faiss="ivfpq",
            nlist=4,
            m=8,
            nbits=4,
            train_sample=10,
            show_progress=False,
        )
    with pytest.raises(ConfigError, match="keep_vectors"):
        load_retriever(sharded_dir, encoder=encoder, rerank=10)
    import faiss

    if not hasattr(faiss, "StandardGpuResources"):
        with pytest.raises(ConfigError, match="no GPU support"):
            load_retriever(sharded_dir, encoder=encoder, gpus=[0])
    with pytest.raises(ConfigError, match="needs a sharded dense index"):
        build_index(corpus, "dense", tmp_path / "plain", encoder=encoder, show_progress=False)
        load_retriever(tmp_path / "plain", encoder=encoder, rerank=10)
    # A manifest whose shard ranges no longer tile the corpus is refused.
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(sharded_dir, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["shards"][1]["start"] = 60
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IndexMismatchError, match="do not tile"):
        load_retriever(broken, encoder=encoder)


def test_cli_builds_sharded_index_with_minilm(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from sleuth.cli import app

    corpus = tmp_path / "c.jsonl"
    texts = [
        ("Volcano", "Molten rock and gases escape through a rupture in the crust."),
        ("Piano", "Felt hammers strike strings when the keys are pressed."),
        ("Coffee", "A drink brewed from roasted seeds of the Coffea plant."),
        ("Tsunami", "Large ocean waves caused by an undersea earthquake."),
        ("Bicycle", "Two wheels, pedals and a frame."),
    ]
    corpus.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "contents": f'"{t}"\n{x}'}) + "\n" for i, (t, x) in enumerate(texts)
        ),
        encoding="utf-8",
    )
    out = tmp_path / "idx"
    res = CliRunner().invoke(
        app, ["index", str(corpus), "--kind", "dense", "--shards", "2", "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert "shards" in res.output and "[0, 3), [3, 5)" in res.output
    manifest = read_manifest(out)
    assert manifest["encoder"]["dim"] == 384 and len(manifest["shards"]) == 2
    assert (
        CliRunner()
        .invoke(app, ["index", str(corpus), "--kind", "dense", "--shards", "9", "--out", str(tmp_path / "x")])
        .exit_code
        == 2
    )


# --------------------------------------------------------------------------- serve-retriever --workers N


def test_serve_retriever_workers_share_one_address(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from sleuth.retrieval.client import RemoteRetriever
    from sleuth.retrieval.server_commands import WORKER_PID_HEADER

    corpus = tmp_path / "c.jsonl"
    docs = _write_corpus(corpus, 40, seed=2)
    build_index(corpus, "bm25", tmp_path / "bm25", show_progress=False)
    local = load_retriever(tmp_path / "bm25")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "sleuth.cli", "serve-retriever", "--index", str(tmp_path / "bm25")]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--workers", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_health(proc, url)

        queries = [" ".join(words[:4]) for words in docs] * 2
        with RemoteRetriever(url, batch_size=4, concurrency=8) as remote:
            got = remote.search(queries, 3)
        expected = local.search(queries, 3)
        assert [[h.doc_id for h in q] for q in got] == [[h.doc_id for h in q] for q in expected]

        # Fresh connections, several at a time: the kernel hands them to whichever worker is free.
        def worker_pid(_: int) -> str:
            return httpx.get(f"{url}/health", timeout=5, headers={"Connection": "close"}).headers[
                WORKER_PID_HEADER
            ]

        pids: set[str] = set()
        with ThreadPoolExecutor(8) as pool:
            for _ in range(20):
                pids |= set(pool.map(worker_pid, range(16)))
                if len(pids) >= 2:
                    break
        assert len(pids) == 2 and str(proc.pid) not in pids
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0
    assert f"{url}/retrieve" in out and "2 worker processes" in out
    for pid in pids:  # the supervisor stops and reaps its workers
        assert not Path(f"/proc/{pid}").exists()


def test_ivfpq_rerank_recall_at_5_from_precomputed_embeddings(tmp_path: Path, encoder: HashEncoder) -> None:
    """Issue 24's dense path: embeddings encoded once to a float16 file (as on a GPU), an IVF-PQ index
    built from it probing half of its lists (bag-of-random-words vectors do not cluster: a hard case for IVF), candidates re-scored from the memory-mapped float16
    vectors: recall@5 against exact (Flat) search >= 0.9, and well above IVF-PQ without re-ranking."""
    corpus = tmp_path / "big.jsonl"
    docs = _write_corpus(corpus, 3000, seed=8, words_per_doc=10)
    rng = np.random.default_rng(3)
    queries = [
        " ".join(rng.choice(docs[i], size=4, replace=False))
        for i in rng.choice(len(docs), 150, replace=False)
    ]
    build_index(corpus, "dense", tmp_path / "flat", encoder=encoder, show_progress=False)
    store = DocStore(tmp_path / "flat" / "docstore")
    assert encode_docstore(store, tmp_path / "emb.f16", encoder, chunk=700) == 3000
    stored = np.memmap(tmp_path / "emb.f16", dtype=np.float16, mode="r", shape=(3000, DIM))
    np.testing.assert_allclose(
        stored[:5], encoder.encode_passages([f'"{t}"\n{x}' for _, t, x in store.get(range(5))]), atol=1e-3
    )
    build_index(
        corpus,
        "dense",
        tmp_path / "ivf",
        encoder=encoder,
        faiss="ivfpq",
        nlist=32,
        m=8,
        nbits=6,
        nprobe=16,
        shards=3,
        keep_vectors=True,
        embeddings=str(tmp_path / "emb.f16"),
        show_progress=False,
    )
    assert read_manifest(tmp_path / "ivf")["embeddings"] == str((tmp_path / "emb.f16").resolve())
    ivf = load_retriever(tmp_path / "ivf", encoder=encoder)
    # the vectors are read row by row from the file (positional reads), never loaded or mapped whole
    assert isinstance(ivf.vectors, RowFile) and ivf.rerank == 64
    np.testing.assert_array_equal(ivf.vectors[np.array([0, 2999, 17])], stored[[0, 2999, 17]])
    exact = load_retriever(tmp_path / "flat", encoder=encoder).search(queries, 5)

    def recall(hits: list) -> float:
        return float(
            np.mean(
                [
                    len({h.doc_id for h in g} & {h.doc_id for h in e}) / 5
                    for g, e in zip(hits, exact, strict=True)
                ]
            )
        )

    reranked = recall(ivf.search(queries, 5))
    pq_only = recall(load_retriever(tmp_path / "ivf", encoder=encoder, rerank=0).search(queries, 5))
    assert reranked >= 0.9, (reranked, pq_only)
    assert reranked > pq_only + 0.1, (reranked, pq_only)
    with pytest.raises(IndexMismatchError, match="float16"):
        build_index(
            corpus,
            "dense",
            tmp_path / "bad",
            encoder=HashEncoder(dim=16),
            faiss="flat",
            shards=1,
            embeddings=str(tmp_path / "emb.f16"),
            show_progress=False,
        )


def test_dense_index_reuses_another_index_docstore(
    tmp_path: Path, world: tuple[Path, list[list[str]]], queries: list[str], encoder: HashEncoder
) -> None:
    """Issue 24: at 21M the IVF-PQ build links the BM25 build's docstore (no second 15 GB pass, and the
    corpus file may be gone); the index searches exactly as one built from the corpus."""
    corpus, _ = world
    build_index(corpus, "bm25", tmp_path / "bm25", show_progress=False)
    linked = build_index(
        None,
        "dense",
        tmp_path / "linked",
        encoder=encoder,
        docstore_from=tmp_path / "bm25",
        show_progress=False,
    )
    fresh = build_index(corpus, "dense", tmp_path / "fresh", encoder=encoder, show_progress=False)
    assert linked["corpus_fingerprint"] == fresh["corpus_fingerprint"] and linked["num_docs"] == 203
    assert linked["corpus_path"] == fresh["corpus_path"]
    strings = [tmp_path / d / "docstore" / "strings.bin" for d in ("bm25", "linked")]
    assert strings[0].stat().st_ino == strings[1].stat().st_ino  # a hard link, not a copy
    got = load_retriever(tmp_path / "linked", corpus, encoder=encoder).search(queries, 5)
    want = load_retriever(tmp_path / "fresh", encoder=encoder).search(queries, 5)
    assert [[(h.doc_id, h.text) for h in q] for q in got] == [[(h.doc_id, h.text) for h in q] for q in want]
    other = tmp_path / "other.jsonl"
    _write_corpus(other, 50, seed=2)
    with pytest.raises(IndexMismatchError, match="a different file"):
        build_index(
            other,
            "dense",
            tmp_path / "bad",
            encoder=encoder,
            docstore_from=tmp_path / "bm25",
            show_progress=False,
        )
    with pytest.raises(ConfigError, match="needs a corpus file, or docstore_from"):
        build_index(None, "dense", tmp_path / "bad", encoder=encoder, show_progress=False)
    with pytest.raises(IndexMismatchError, match="not a complete sleuth index"):
        (tmp_path / "half").mkdir()
        build_index(
            None,
            "dense",
            tmp_path / "bad",
            encoder=encoder,
            docstore_from=tmp_path / "half",
            show_progress=False,
        )
    assert not (tmp_path / "bad").exists()


def test_precomputed_embeddings_are_linked_as_the_kept_vectors(
    tmp_path: Path, encoder: HashEncoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 21M the embeddings file is 16 GB: the IVF-PQ build hard-links it as the index's float16 vectors
    instead of writing a second copy, and searches exactly as a build that writes the copy (the fallback
    where no hard link can be made)."""
    corpus = tmp_path / "c.jsonl"
    docs = _write_corpus(corpus, 600, seed=4, words_per_doc=10)
    build_index(corpus, "dense", tmp_path / "flat", encoder=encoder, show_progress=False)
    emb = tmp_path / "emb.f16"
    encode_docstore(DocStore(tmp_path / "flat" / "docstore"), emb, encoder, chunk=256)
    before = emb.read_bytes()
    opts = dict(
        encoder=encoder,
        faiss="ivfpq",
        nlist=8,
        m=8,
        nbits=6,
        nprobe=4,
        shards=2,
        keep_vectors=True,
        embeddings=str(emb),
        show_progress=False,
    )
    build_index(corpus, "dense", tmp_path / "linked", **opts)
    assert read_manifest(tmp_path / "linked")["vectors_source"] == "linked"
    assert (tmp_path / "linked" / "vectors.f16").stat().st_ino == emb.stat().st_ino
    monkeypatch.setattr(
        "sleuth.retrieval.sharded.os.link", lambda *a: (_ for _ in ()).throw(OSError("EXDEV"))
    )
    build_index(corpus, "dense", tmp_path / "written", **opts)
    assert read_manifest(tmp_path / "written")["vectors_source"] == "written"
    assert (tmp_path / "written" / "vectors.f16").read_bytes() == emb.read_bytes()
    queries = [" ".join(d[:3]) for d in docs[:40]]
    got = [
        [h.doc_id for h in hs]
        for hs in load_retriever(tmp_path / "linked", encoder=encoder).search(queries, 5)
    ]
    want = [
        [h.doc_id for h in hs]
        for hs in load_retriever(tmp_path / "written", encoder=encoder).search(queries, 5)
    ]
    assert got == want
    assert emb.read_bytes() == before  # the source is read, never written


def test_4bit_ivfpq_is_written_in_the_fast_scan_layout(tmp_path: Path, encoder: HashEncoder) -> None:
    """Issue 24's throughput: `nbits` 4 stores the codes in faiss's fast-scan layout. The conversion keeps
    the codes (a plain 4-bit IVF-PQ over the same training finds the same candidates, scores within the
    fast scan's 8-bit look-up tables), and the sharded build re-ranked from the float16 vectors recalls
    the exact top 5 as the 8-bit codes do."""
    import faiss

    from sleuth.retrieval.dense import faiss_params, new_faiss_index, searchable_index

    rng = np.random.default_rng(4)
    x = rng.standard_normal((4000, DIM)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    params = faiss_params("ivfpq", nlist=16, m=16, nbits=4, nprobe=4)
    plain = new_faiss_index(DIM, params, len(x))
    faiss.omp_set_num_threads(1)
    plain.train(x)
    plain.add(x)
    fast = searchable_index(plain, params)
    assert isinstance(fast, faiss.IndexIVFPQFastScan) and fast.ntotal == 4000 and fast.nprobe == 4
    assert searchable_index(plain, faiss_params("ivfpq", nlist=16, m=16, nbits=8, nprobe=4)) is plain
    want_scores, want_ids = plain.search(x[:200], 10)
    got_scores, got_ids = fast.search(x[:200], 10)
    overlap = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got_ids, want_ids, strict=True)])
    assert overlap >= 0.9, overlap
    same = got_ids == want_ids
    np.testing.assert_allclose(got_scores[same], want_scores[same], atol=0.02)

    corpus = tmp_path / "big.jsonl"
    docs = _write_corpus(corpus, 3000, seed=8, words_per_doc=10)
    queries = [
        " ".join(rng.choice(docs[i], size=4, replace=False))
        for i in rng.choice(len(docs), 150, replace=False)
    ]
    build_index(corpus, "dense", tmp_path / "flat", encoder=encoder, show_progress=False)
    exact = load_retriever(tmp_path / "flat", encoder=encoder).search(queries, 5)
    recalls = {}
    for nbits, m in ((8, 8), (4, 16)):  # the same 8 bytes a code
        out = tmp_path / f"ivf{nbits}"
        build_index(
            corpus,
            "dense",
            out,
            encoder=encoder,
            faiss="ivfpq",
            nlist=32,
            m=m,
            nbits=nbits,
            nprobe=16,
            shards=2,
            keep_vectors=True,
            show_progress=False,
        )
        shard = faiss.read_index(str(out / "shards" / "shard-000.faiss"))
        assert isinstance(faiss.downcast_index(shard), faiss.IndexIVFPQFastScan) == (nbits == 4)
        got = load_retriever(out, encoder=encoder, rerank=64).search(queries, 5)
        recalls[nbits] = float(
            np.mean(
                [
                    len({h.doc_id for h in g} & {h.doc_id for h in e}) / 5
                    for g, e in zip(got, exact, strict=True)
                ]
            )
        )
    assert recalls[4] >= 0.9 and recalls[4] >= recalls[8] - 0.05, recalls


def test_nprobe_above_nlist_probes_every_list(tmp_path: Path, encoder: HashEncoder) -> None:
    """faiss's IVF-PQ fast scan returns garbage for nprobe > nlist (one id for every hit, scores ~2e31); sleuth
    probes at most every list, so a small index served with a large --nprobe (serve-retriever's 64 on a
    16-list index) answers as with nprobe = nlist, for 4- and 8-bit codes, one index or shards."""
    import faiss

    from sleuth.retrieval.dense import faiss_params, new_faiss_index, searchable_index, set_nprobe

    rng = np.random.default_rng(5)
    x = rng.standard_normal((2000, DIM)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    faiss.omp_set_num_threads(1)
    for nbits, m in ((4, 16), (8, 8)):
        params = faiss_params("ivfpq", nlist=16, m=m, nbits=nbits, nprobe=64)
        plain = new_faiss_index(DIM, params, len(x))
        plain.train(x)
        plain.add(x)
        index = searchable_index(plain, params)
        assert faiss.extract_index_ivf(index).nprobe == 16
        want = index.search(x[:50], 5)
        set_nprobe(index, 1000)
        got = index.search(x[:50], 5)
        np.testing.assert_array_equal(got[1], want[1])
        assert np.mean(got[1][:, 0] == np.arange(50)) >= 0.9, nbits  # each vector finds itself
    corpus = tmp_path / "c.jsonl"
    docs = _write_corpus(corpus, 600, seed=3, words_per_doc=10)
    queries = [" ".join(rng.choice(docs[i], size=4, replace=False)) for i in range(0, 600, 20)]
    build_index(
        corpus,
        "dense",
        tmp_path / "ivf",
        encoder=encoder,
        faiss="ivfpq",
        nlist=8,
        m=16,
        nbits=4,
        nprobe=4,
        shards=2,
        keep_vectors=True,
        show_progress=False,
    )
    every = [
        [h.doc_id for h in hs]
        for hs in load_retriever(tmp_path / "ivf", encoder=encoder, nprobe=8).search(queries, 5)
    ]
    above = load_retriever(tmp_path / "ivf", encoder=encoder, nprobe=64)
    assert [[h.doc_id for h in hs] for hs in above.search(queries, 5)] == every
    above.set_search_params(nprobe=65)
    assert [[h.doc_id for h in hs] for hs in above.search(queries, 5)] == every
