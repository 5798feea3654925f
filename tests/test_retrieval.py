"""Retrieval core: docstore, BM25, RRF fusion, index manifests, CLI (dense is in test_retrieval_dense.py)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from sleuth.data.formats import Passage, write_corpus
from sleuth.errors import ConfigError, IndexMismatchError
from sleuth.retrieval import (
    BM25Retriever,
    DocStore,
    Hit,
    HybridRetriever,
    Retriever,
    build_index,
    load_hybrid,
    load_retriever,
    read_manifest,
    rrf_fuse,
)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- docstore


def test_docstore_round_trip_unicode_and_empty(tmp_path: Path) -> None:
    passages = [
        Passage("a", "Plain", "simple text"),
        Passage("ü-2", "Ünïcode ✓", "Καλημέρα κόσμε — 日本語 🎉 \u0000 nul"),
        Passage("empty", "", ""),
        Passage("title-only", "Only a title", ""),
        Passage("99", "Newline\ttitle", "line one\nline two"),
    ]
    store = DocStore.build(passages, tmp_path / "ds")
    assert len(store) == 5
    reopened = DocStore(tmp_path / "ds")
    # Out of order and repeated indices come back in the order asked.
    got = reopened.get(np.array([4, 1, 2, 1, 0, 3]))
    want = [passages[i] for i in [4, 1, 2, 1, 0, 3]]
    assert got == [(p.id, p.title, p.text) for p in want]
    assert reopened.ids([3, 0]) == ["title-only", "a"]
    assert reopened.get(np.zeros(0, dtype=np.int64)) == []
    assert [row for batch in reopened.iter_batches(2) for row in batch] == [
        (p.id, p.title, p.text) for p in passages
    ]


def test_docstore_errors(tmp_path: Path) -> None:
    store = DocStore.build([Passage("a", "t", "x"), Passage("b", "u", "y")], tmp_path / "ds")
    with pytest.raises(IndexError, match="out of range"):
        store.get([2])
    with pytest.raises(IndexError, match="out of range"):
        store.get([-1])
    empty = DocStore.build([], tmp_path / "empty")
    assert len(empty) == 0 and empty.get([]) == []
    # A truncated strings file is detected on open rather than returning garbage.
    with open(tmp_path / "ds" / "strings.bin", "r+b") as f:
        f.truncate(2)
    with pytest.raises(IndexMismatchError, match="corrupt"):
        DocStore(tmp_path / "ds")
    with pytest.raises(IndexMismatchError, match="not a docstore"):
        DocStore(tmp_path / "nowhere")


# --------------------------------------------------------------------------- BM25


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("small")
    return write_jsonl(
        d / "corpus.jsonl",
        [
            {"id": "cat", "contents": '"Cats"\nThe domestic cat is a small carnivorous mammal that purrs.'},
            {
                "id": "eiffel",
                "contents": '"Eiffel Tower"\nA wrought-iron lattice tower in Paris, built in 1889.',
            },
            {"id": "photo", "contents": '"Photosynthesis"\nPlants convert sunlight and water into glucose.'},
            {
                "id": "zorblat",
                "contents": '"Zorblat River"\nThe Zorblat flows north through Quenville marshes.',
            },
            {"id": "uni", "contents": '"Ünïcode"\nΚαλημέρα κόσμε 日本語 🎉'},
            {"id": "empty", "contents": '"Empty"'},
        ],
    )


@pytest.fixture(scope="module")
def bm25_dir(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bm25idx") / "idx"
    build_index(small_corpus, "bm25", out, show_progress=False)
    return out


def test_bm25_finds_exact_key_terms(bm25_dir: Path) -> None:
    r = load_retriever(bm25_dir)
    assert isinstance(r, BM25Retriever) and isinstance(r, Retriever)
    results = r.search(["Quenville marshes", "wrought iron lattice", "purring cats", "xyzzy plugh"], 3)
    assert results[0][0].doc_id == "zorblat"
    assert results[0][0].title == "Zorblat River"
    assert results[1][0].doc_id == "eiffel"
    # Stemming: "purring"/"cats" match "purrs"/"cat".
    assert results[2][0].doc_id == "cat"
    # No shared term: no hits, rather than arbitrary zero-score passages.
    assert results[3] == []
    for hits in results:
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)


def test_bm25_scores_match_hand_computed(tmp_path: Path) -> None:
    corpus = write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"id": "d0", "title": "", "text": "apple banana"},
            {"id": "d1", "title": "", "text": "apple cherry cherry"},
            {"id": "d2", "title": "", "text": "banana"},
        ],
    )
    build_index(corpus, "bm25", tmp_path / "idx", show_progress=False, k1=0.9, b=0.4)
    hits = load_retriever(tmp_path / "idx").search(["cherry", "apple banana"], 3)

    # Lucene BM25: idf = ln(1 + (N - df + .5) / (df + .5)), tf part = tf / (tf + k1 (1 - b + b dl / avgdl)).
    # N = 3, doc lengths 2, 3, 1 -> avgdl 2.
    def term(tf: int, df: int, dl: int) -> float:
        return math.log(1 + (3 - df + 0.5) / (df + 0.5)) * tf / (tf + 0.9 * (1 - 0.4 + 0.4 * dl / 2))

    assert [h.doc_id for h in hits[0]] == ["d1"]
    assert hits[0][0].score == pytest.approx(term(2, 1, 3), rel=1e-5)  # = 0.63690
    assert hits[0][0].score == pytest.approx(0.63690, abs=1e-4)
    scores = {h.doc_id: h.score for h in hits[1]}
    assert scores["d0"] == pytest.approx(term(1, 2, 2) + term(1, 2, 2), rel=1e-5)
    assert scores["d1"] == pytest.approx(term(1, 2, 3), rel=1e-5)
    assert scores["d2"] == pytest.approx(term(1, 2, 1), rel=1e-5)
    assert [h.doc_id for h in hits[1]] == ["d0", "d2", "d1"]


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    synth = pytest.importorskip("sleuth.data.synth")
    out = tmp_path_factory.mktemp("world")
    synth.write_world(synth.generate_world(400, 80, hops=(1, 1), seed=3), out)
    return out


@pytest.fixture(scope="module")
def world_bm25(world_dir: Path) -> Path:
    build_index(world_dir / "corpus.jsonl", "bm25", world_dir / "bm25", show_progress=False)
    return world_dir / "bm25"


def test_bm25_kernel_matches_bm25s_reference(world_dir: Path, world_bm25: Path) -> None:
    """The cached numba top-k kernel returns bm25s' own retrieve() scores."""
    r = load_retriever(world_bm25)
    questions = [
        json.loads(line)["question"]
        for line in (world_dir / "train.jsonl").read_text(encoding="utf-8").splitlines()
    ][:40]
    token_ids = r._tokenize(questions)
    # bm25s loaded on its own with its numpy backend is the reference (its numba one recompiles per process).
    import bm25s

    reference = bm25s.BM25.load(str(world_bm25 / "bm25"), show_progress=False, backend="numpy")
    ref_docs, ref_scores = reference.retrieve(token_ids, k=10, show_progress=False, backend_selection="numpy")
    rows, scores = r.search_indices(questions, 10)
    for q in range(len(questions)):
        n = len(rows[q])
        positive = ref_scores[q] > 0
        assert n == int(positive.sum())
        np.testing.assert_allclose(scores[q], ref_scores[q][:n], rtol=1e-6)
        # Equal scores may be ordered differently; compare the sets of passages above the cut.
        strict = scores[q] > (scores[q][-1] if n else 0)
        assert set(rows[q][strict].tolist()) == set(ref_docs[q][:n][strict].tolist())


def test_bm25_threads_give_same_results(world_dir: Path, world_bm25: Path) -> None:
    questions = [
        json.loads(line)["question"]
        for line in (world_dir / "train.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    one = load_retriever(world_bm25, threads=1).search(questions, 5)
    two = load_retriever(world_bm25, threads=2).search(questions, 5)
    assert one == two


def test_bm25_recall_on_synthetic_world(world_dir: Path, world_bm25: Path) -> None:
    r = load_retriever(world_bm25, corpus=world_dir / "corpus.jsonl")
    examples = [
        json.loads(line) for line in (world_dir / "train.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    results = r.search([e["question"] for e in examples], 5)
    found = [
        bool({h.doc_id for h in hits} & set(e["metadata"]["supporting_ids"]))
        for e, hits in zip(examples, results, strict=True)
    ]
    # Single-hop questions name their subject entity, whose passage BM25 should rank in the top 5.
    assert sum(found) / len(found) >= 0.8, f"recall@5 {sum(found) / len(found):.2f}"


def test_save_load_round_trip_identical(bm25_dir: Path, tmp_path: Path) -> None:
    queries = ["Quenville marshes", "tower Paris", "glucose", "cats", "Καλημέρα"]
    before = load_retriever(bm25_dir).search(queries, 4)
    moved = tmp_path / "moved"
    shutil.copytree(bm25_dir, moved)
    after = load_retriever(moved).search(queries, 4)
    assert before == after
    assert after[4][0].doc_id == "uni"


def test_k_larger_than_corpus_and_bad_inputs(bm25_dir: Path, tmp_path: Path) -> None:
    r = load_retriever(bm25_dir)
    assert len(r.search(["the tower cat plants zorblat"], 100)[0]) == 4
    with pytest.raises(ValueError, match="k must be a positive integer"):
        r.search(["cats"], 0)
    with pytest.raises(ValueError, match="k must be a positive integer"):
        r.search(["cats"], -3)
    with pytest.raises(ValueError, match="empty list of queries"):
        r.search([], 3)
    with pytest.raises(TypeError, match="not a single string"):
        r.search("cats", 3)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_retriever(tmp_path / "missing")
    with pytest.raises(ConfigError, match="unknown index kind"):
        build_index(bm25_dir / "x.jsonl", "sparse", tmp_path / "o")
    with pytest.raises(ConfigError, match="unknown parameter"):
        build_index(bm25_dir / "x.jsonl", "bm25", tmp_path / "o", nlist=3)


# --------------------------------------------------------------------------- manifest


def test_manifest_contents(bm25_dir: Path, small_corpus: Path) -> None:
    m = read_manifest(bm25_dir)
    assert m["kind"] == "bm25"
    assert m["num_docs"] == 6
    assert m["corpus_path"] == str(small_corpus.resolve())
    assert m["corpus_fingerprint"].startswith("sha256:")
    assert m["bm25"]["k1"] == 0.9 and m["bm25"]["stemmer"] == "english"
    assert m["sleuth_version"] and m["created"]


def test_manifest_mismatch_refused(bm25_dir: Path, small_corpus: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.jsonl"
    other.write_text(small_corpus.read_text(encoding="utf-8").replace("purrs", "meows"), encoding="utf-8")
    load_retriever(bm25_dir, corpus=small_corpus)  # the right corpus is accepted
    with pytest.raises(IndexMismatchError) as err:
        load_retriever(bm25_dir, corpus=other)
    msg = str(err.value)
    assert str(other) in msg and str(small_corpus.resolve()) in msg and "sleuth index" in msg


def test_missing_or_corrupt_manifest(bm25_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(bm25_dir, broken)
    (broken / "manifest.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(IndexMismatchError, match="corrupt manifest"):
        load_retriever(broken)
    (broken / "manifest.json").unlink()
    with pytest.raises(IndexMismatchError, match="not a complete sleuth index"):
        load_retriever(broken)


def test_build_refuses_to_overwrite(bm25_dir: Path, small_corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(FileExistsError, match="--overwrite"):
        build_index(small_corpus, "bm25", bm25_dir, show_progress=False)
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a sleuth index"):
        build_index(small_corpus, "bm25", stranger, overwrite=True, show_progress=False)
    assert (stranger / "notes.txt").exists()


def test_bad_corpus_record_names_line(tmp_path: Path) -> None:
    from sleuth.errors import DataFormatError

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "contents": "ok"}\n{"contents": "no id"}\n', encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"bad.jsonl:2"):
        build_index(bad, "bm25", tmp_path / "idx", show_progress=False)


# --------------------------------------------------------------------------- hybrid


class ListRetriever:
    """Returns fixed ranked lists (one per query)."""

    def __init__(self, ranked: list[list[str]]):
        self.ranked = ranked
        self.calls: list[int] = []

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        self.calls.append(k)
        return [[Hit(d, f"T{d}", f"text {d}", 1.0) for d in self.ranked[i][:k]] for i in range(len(queries))]


def test_rrf_fusion_order_hand_computed() -> None:
    a = ListRetriever([["A", "B", "C", "D"]])
    b = ListRetriever([["C", "A", "E"]])
    fused = HybridRetriever([a, b], rrf_k=60).search(["q"], 5)[0]
    # A: 1/61 + 1/62 = 0.032522; C: 1/63 + 1/61 = 0.032266; B: 1/62 = 0.016129;
    # E: 1/63 = 0.015873; D: 1/64 = 0.015625.
    assert [h.doc_id for h in fused] == ["A", "C", "B", "E", "D"]
    assert fused[0].score == pytest.approx(1 / 61 + 1 / 62)
    assert fused[1].score == pytest.approx(0.032266, abs=1e-6)
    assert fused[4].score == pytest.approx(1 / 64)
    assert fused[0].title == "TA" and fused[0].text == "text A"
    # Each retriever is asked for more than k so near-misses can be fused.
    assert a.calls == [20] and b.calls == [20]


def test_rrf_weights_and_ties() -> None:
    lists = [
        [Hit("A", "", "", 0), Hit("B", "", "", 0)],
        [Hit("B", "", "", 0), Hit("A", "", "", 0)],
    ]
    # Equal weights: A and B tie (1/61 + 1/62 each); the first-seen (A) stays first.
    assert [h.doc_id for h in rrf_fuse(lists, [1, 1], 60, 2)] == ["A", "B"]
    # Weight 3 on the second list: B = 3/61 + 1/62 > A = 1/61 + 3/62.
    fused = rrf_fuse(lists, [1, 3], 60, 2)
    assert [h.doc_id for h in fused] == ["B", "A"]
    assert fused[0].score == pytest.approx(3 / 61 + 1 / 62)
    with pytest.raises(ValueError, match="weights"):
        HybridRetriever([ListRetriever([[]])], weights=[1, 2])
    with pytest.raises(ValueError, match="k must be"):
        HybridRetriever([ListRetriever([[]])]).search(["q"], 0)


def test_load_hybrid_checks_corpora(bm25_dir: Path, tmp_path: Path) -> None:
    other_corpus = write_jsonl(tmp_path / "o.jsonl", [{"id": "x", "contents": '"X"\nsomething else'}])
    build_index(other_corpus, "bm25", tmp_path / "other", show_progress=False)
    with pytest.raises(IndexMismatchError, match="different corpora"):
        load_hybrid([bm25_dir, tmp_path / "other"])
    copy = tmp_path / "copy"
    shutil.copytree(bm25_dir, copy)
    hybrid = load_hybrid([bm25_dir, copy])
    hits = hybrid.search(["Quenville marshes"], 2)[0]
    assert hits[0].doc_id == "zorblat"
    assert hits[0].score == pytest.approx(2 / 61)


# --------------------------------------------------------------------------- CLI


def test_cli_index_and_search(small_corpus: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from sleuth.cli import app

    runner = CliRunner()
    out = tmp_path / "cli-idx"
    res = runner.invoke(app, ["index", str(small_corpus), "--kind", "bm25", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "passages" in res.output and read_manifest(out)["num_docs"] == 6
    res = runner.invoke(app, ["search", str(out), "Quenville marshes", "-k", "2"])
    assert res.exit_code == 0, res.output
    assert "zorblat" in res.output and "Zorblat River" in res.output
    assert runner.invoke(app, ["search", str(tmp_path / "nope"), "q"]).exit_code == 2
    assert runner.invoke(app, ["search", str(out), "q", "-k", "0"]).exit_code == 2
    assert (
        runner.invoke(app, ["index", str(tmp_path / "no.jsonl"), "--out", str(tmp_path / "x")]).exit_code == 2
    )
    res = runner.invoke(app, ["index", str(small_corpus), "--kind", "sparse", "--out", str(tmp_path / "y")])
    assert res.exit_code == 2 and "--kind" in res.output
    # Rebuilding into an existing index without --overwrite is refused.
    assert runner.invoke(app, ["index", str(small_corpus), "--out", str(out)]).exit_code == 2


def test_write_corpus_then_index(tmp_path: Path) -> None:
    """A corpus written by sleuth.data.formats.write_corpus indexes with titles split out."""
    write_corpus(
        tmp_path / "c.jsonl", [Passage("p1", "Moon", "Earth's natural satellite"), Passage("p2", "Sun", "")]
    )
    build_index(tmp_path / "c.jsonl", "bm25", tmp_path / "idx", show_progress=False)
    hits = load_retriever(tmp_path / "idx").search(["natural satellite", "sun"], 1)
    assert (hits[0][0].doc_id, hits[0][0].title, hits[0][0].text) == (
        "p1",
        "Moon",
        "Earth's natural satellite",
    )
    assert hits[1][0].doc_id == "p2" and hits[1][0].text == ""


def _import_bm25s_with_fake_jax(tmp_path, env_extra: dict[str, str]) -> dict:
    """Import sleuth's BM25 module in a fresh interpreter where `jax` is a stub that records the
    environment it saw and answers bm25s's import-time `jax.lax.top_k` call."""
    import json
    import os
    import subprocess
    import sys

    pkg = tmp_path / "fakejax" / "jax"
    pkg.mkdir(parents=True)
    record = tmp_path / "seen.json"
    (pkg / "__init__.py").write_text(
        "import json, os\n"
        f"json.dump({{k: os.environ.get(k) for k in ('JAX_PLATFORMS', 'XLA_PYTHON_CLIENT_PREALLOCATE')}}, "
        f"open({str(record)!r}, 'w'))\n"
        "from . import lax\n"
    )
    (pkg / "lax.py").write_text("def top_k(x, k):\n    return x[:k], list(range(k))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_PYTHON_CLIENT_PREALLOCATE")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "fakejax"), *sys.path])
    env.update(env_extra)
    code = "from sleuth.retrieval.bm25 import import_bm25s; import_bm25s()"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    return json.loads(record.read_text())


def test_bm25s_import_keeps_jax_off_the_gpu(tmp_path):
    # bm25s calls jax at import time; a CUDA JAX would then grab 75% of the GPU (the trainer's OOM)
    seen = _import_bm25s_with_fake_jax(tmp_path, {})
    assert seen == {"JAX_PLATFORMS": "cpu", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def test_bm25s_import_respects_a_users_jax_platform(tmp_path):
    seen = _import_bm25s_with_fake_jax(tmp_path, {"JAX_PLATFORMS": "cuda"})
    assert seen == {"JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
