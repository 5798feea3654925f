"""Dense retrieval with the embedded all-MiniLM-L6-v2 (loaded once for the module, offline)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from sleuth.errors import ConfigError, IndexMismatchError
from sleuth.retrieval import DenseRetriever, Encoder, EncoderConfig, build_index, load_hybrid, load_retriever
from sleuth.retrieval.dense import passage_text

PASSAGES = [
    ("p0", "Photosynthesis", "Green plants turn sunlight, water and carbon dioxide into sugar and oxygen."),
    ("p1", "Eiffel Tower", "A wrought-iron lattice tower on the Champ de Mars in Paris, completed in 1889."),
    ("p2", "Domestic cat", "The cat is a small carnivorous mammal often kept as a household pet."),
    ("p3", "Volcano", "A rupture in a planet's crust through which molten rock and gases escape."),
    ("p4", "Bicycle", "A pedal-driven vehicle with two wheels attached to a frame, one behind the other."),
    ("p5", "Coffee", "A brewed drink prepared from roasted seeds of the Coffea plant."),
    ("p6", "Great Wall", "Fortifications built across northern China to protect against nomadic raids."),
    ("p7", "Piano", "A keyboard instrument in which felt hammers strike strings."),
    ("p8", "Tsunami", "A series of large ocean waves usually caused by an undersea earthquake."),
    ("p9", "Penicillin", "An antibiotic discovered by Alexander Fleming that kills bacteria."),
]


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return Encoder(EncoderConfig(name="minilm", batch_size=32))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dense") / "corpus.jsonl"
    path.write_text(
        "".join(json.dumps({"id": i, "contents": f'"{t}"\n{x}'}) + "\n" for i, t, x in PASSAGES),
        encoding="utf-8",
    )
    return path


@pytest.fixture(scope="module")
def flat_dir(corpus: Path, encoder: Encoder) -> Path:
    out = corpus.parent / "flat"
    build_index(corpus, "dense", out, encoder=encoder, show_progress=False)
    return out


def test_dense_finds_paraphrase(flat_dir: Path, encoder: Encoder) -> None:
    r = load_retriever(flat_dir, encoder=encoder)
    assert isinstance(r, DenseRetriever)
    hits = r.search(
        [
            "How do leaves make food from light?",
            "What medicine fights infections caused by germs?",
            "giant sea waves after a quake under the ocean",
            "musical instrument with keys and hammers",
        ],
        3,
    )
    assert [h[0].doc_id for h in hits] == ["p0", "p9", "p8", "p7"]
    assert hits[0][0].title == "Photosynthesis"


def test_flat_matches_bruteforce_and_batch_equals_single(flat_dir: Path, encoder: Encoder) -> None:
    r = load_retriever(flat_dir, encoder=encoder)
    # 20 queries >= the batch size where the BLAS path is switched on.
    queries = [f"{t} {w}" for _, t, _ in PASSAGES for w in ("history", "facts")]
    batched = r.search(queries, 4)
    passages = encoder.encode_passages([passage_text(t, x) for _, t, x in PASSAGES])
    sims = encoder.encode_queries(queries) @ passages.T
    for q, hits in enumerate(batched):
        want = np.argsort(-sims[q], kind="stable")[:4]
        assert [h.doc_id for h in hits] == [PASSAGES[i][0] for i in want]
        np.testing.assert_allclose([h.score for h in hits], sims[q][want], rtol=1e-4, atol=1e-5)
        # One query alone takes faiss' non-BLAS path: same passages, scores equal up to rounding.
        single = r.search([queries[q]], 4)[0]
        assert [h.doc_id for h in single] == [h.doc_id for h in hits]
        np.testing.assert_allclose([h.score for h in single], [h.score for h in hits], rtol=1e-5, atol=1e-6)


def test_prefixes_are_applied_and_recorded(corpus: Path, encoder: Encoder, tmp_path: Path) -> None:
    e5 = Encoder(
        EncoderConfig(name="minilm", query_prefix="query: ", passage_prefix="passage: "), model=encoder.model
    )
    raw = encoder.model.encode(["query: volcano"], normalize_embeddings=True)
    np.testing.assert_allclose(e5.encode_queries(["volcano"]), raw, rtol=1e-5, atol=1e-6)
    assert not np.allclose(encoder.encode_queries(["volcano"]), raw, atol=1e-3)
    manifest = build_index(corpus, "dense", tmp_path / "e5", encoder=e5, show_progress=False)
    assert manifest["encoder"]["query_prefix"] == "query: "
    assert manifest["encoder"]["passage_prefix"] == "passage: "
    assert manifest["encoder"]["dim"] == 384
    assert manifest["faiss"] == {"type": "flat"}
    # Loading with an encoder that lacks the prefixes the index was built with is refused.
    with pytest.raises(IndexMismatchError, match="query_prefix"):
        load_retriever(tmp_path / "e5", encoder=encoder)
    assert load_retriever(tmp_path / "e5", encoder=e5).search(["molten rock"], 1)[0][0].doc_id == "p3"


def test_dense_save_load_round_trip(flat_dir: Path, encoder: Encoder, tmp_path: Path) -> None:
    queries = ["bike with pedals", "roasted seeds drink", "wall in China"]
    before = load_retriever(flat_dir, encoder=encoder).search(queries, 3)
    shutil.copytree(flat_dir, tmp_path / "copy")
    after = load_retriever(tmp_path / "copy", encoder=encoder).search(queries, 3)
    assert before == after
    assert [h[0].doc_id for h in after] == ["p4", "p5", "p6"]


def test_hnsw_and_ivfpq(corpus: Path, flat_dir: Path, encoder: Encoder, tmp_path: Path) -> None:
    import faiss

    queries = ["bike with pedals", "roasted seeds drink", "wall in China", "pet animal"]
    exact = load_retriever(flat_dir, encoder=encoder).search(queries, 1)
    m = build_index(
        corpus, "dense", tmp_path / "hnsw", encoder=encoder, faiss="hnsw", M=8, show_progress=False
    )
    assert m["faiss"] == {"type": "hnsw", "M": 8, "ef_construction": 200, "ef_search": 128}
    hnsw = load_retriever(tmp_path / "hnsw", encoder=encoder, ef_search=32)
    assert faiss.downcast_index(hnsw.index).hnsw.efSearch == 32
    assert [h[0].doc_id for h in hnsw.search(queries, 1)] == [h[0].doc_id for h in exact]

    m = build_index(
        corpus,
        "dense",
        tmp_path / "ivf",
        encoder=encoder,
        faiss="ivfpq",
        nlist=2,
        m=8,
        nbits=3,
        show_progress=False,
    )
    assert m["faiss"]["type"] == "ivfpq" and m["faiss"]["nprobe"] == 16
    ivf = load_retriever(tmp_path / "ivf", encoder=encoder, nprobe=2)
    assert faiss.extract_index_ivf(ivf.index).nprobe == 2
    results = ivf.search(queries, 10)
    # Probing every list returns every passage, so the exact top-1 is always among them.
    for hits, best in zip(results, exact, strict=True):
        assert len(hits) == len(PASSAGES)
        assert best[0].doc_id in {h.doc_id for h in hits}


def test_dense_config_errors(corpus: Path, encoder: Encoder, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown faiss index type"):
        build_index(corpus, "dense", tmp_path / "a", encoder=encoder, faiss="annoy", show_progress=False)
    with pytest.raises(ConfigError, match="must divide"):
        build_index(
            corpus, "dense", tmp_path / "b", encoder=encoder, faiss="ivfpq", nlist=2, m=7, show_progress=False
        )
    with pytest.raises(ConfigError, match="needs at least"):
        build_index(
            corpus, "dense", tmp_path / "c", encoder=encoder, faiss="ivfpq", nlist=64, show_progress=False
        )
    with pytest.raises(ConfigError, match="takes parameters"):
        build_index(
            corpus, "dense", tmp_path / "d", encoder=encoder, faiss="flat", nprobe=3, show_progress=False
        )
    with pytest.raises(ConfigError, match="cannot load encoder"):
        Encoder(EncoderConfig(name=str(tmp_path / "no-such-model")))


def test_hybrid_bm25_plus_dense(corpus: Path, flat_dir: Path, encoder: Encoder) -> None:
    bm25_dir = corpus.parent / "bm25"
    build_index(corpus, "bm25", bm25_dir, show_progress=False)
    hybrid = load_hybrid([bm25_dir, flat_dir], encoder=encoder)
    # Lexical match for one query, paraphrase for the other: fusion keeps both winners first.
    hits = hybrid.search(["Alexander Fleming", "giant sea waves after a quake under the ocean"], 2)
    assert hits[0][0].doc_id == "p9"
    assert hits[1][0].doc_id == "p8"


def test_encoder_serves_the_staged_reward_query_diversity(encoder: Encoder) -> None:
    """The retrieval encoder is what recipes name as `reward.encoder`: `encode` gives unit rows, and
    near-duplicate queries are more similar than unrelated ones (the staged reward's signal)."""
    vecs = encoder.encode(
        ["birthplace of Kvolm Ardent", "Kvolm Ardent birthplace", "founding year of Zvara Films"]
    )
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, rtol=1e-5)
    sims = vecs @ vecs.T
    assert sims[0, 1] > sims[0, 2] + 0.2


def test_queries_are_encoded_in_chunks_of_similar_token_counts_with_the_same_vectors(
    encoder: Encoder,
) -> None:
    """More queries than QUERY_CHUNK go to the model longest (in tokens) first, in chunks of at most
    QUERY_CHUNK, and come back in the caller's order with the vectors of one plain model call (1e-5)."""
    from sleuth.retrieval import encoders

    # made-up names: few characters but many word pieces, so character order is not token order
    names = ["Kvolm Ardent", "Zhaxtysby Dzexbraenia", "Ann", "Thvoukkoxwick Skralzaoshwick Faeskhaomholm"]
    queries = [f"Where was {names[i % 4]} born in year {1900 + i}?" for i in range(70)]
    queries[5] = "Who?"
    plain = encoder.model.encode(queries, batch_size=64, normalize_embeddings=True, convert_to_numpy=True)
    got = encoder.encode_queries(queries)
    np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-6)

    calls: list[list[str]] = []
    real = encoder._encode

    def spy(texts: list[str], prefix: str, show_progress: bool = False) -> np.ndarray:
        calls.append(list(texts))
        return real(texts, prefix, show_progress)

    encoder._encode = spy  # type: ignore[method-assign]
    try:
        encoder.encode_queries(queries)
        assert [len(c) for c in calls] == [32, 32, 6]  # 70 queries, QUERY_CHUNK = 32
        tokens = [[len(encoder.model.tokenizer(q)["input_ids"]) for q in c] for c in calls]
        flat = [n for c in tokens for n in c]
        assert flat == sorted(flat, reverse=True) and calls[-1][-1] == "Who?"
        calls.clear()
        encoder.encode_queries(queries[: encoders.QUERY_CHUNK])  # one chunk: one plain call, order kept
        assert calls == [queries[: encoders.QUERY_CHUNK]]
    finally:
        del encoder._encode
