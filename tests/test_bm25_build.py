"""Sharded, bounded-memory BM25 build (issue 24): the files equal bm25s' single-pass build, search
from the memory-mapped result equals search from bm25s' own index, memory does not grow with the
corpus, and a server starts from the memory-mapped index."""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from sleuth.cli import app
from sleuth.data.formats import Passage, iter_corpus, write_corpus
from sleuth.data.synth import generate_world, write_world
from sleuth.errors import ConfigError, IndexMismatchError
from sleuth.retrieval._bm25_kernel import token_weight_bounds
from sleuth.retrieval.bm25 import TOKEN_BOUNDS_FILE, BM25Retriever, build_bm25
from sleuth.retrieval.bm25_build import build_bm25_sharded
from sleuth.retrieval.docstore import DocStore
from sleuth.retrieval.index import build_index, load_retriever
from sleuth.retrieval.server_commands import build_serving_app

ARRAYS = ("data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy")


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("world24")
    world = generate_world(300, 80, hops=(1, 2), seed=3)
    write_world(world, out, corpus_size=3000)
    # An empty passage and one of stopwords only: bm25s gives them the empty token.
    extra = [Passage(id="empty", title="", text=""), Passage(id="stops", title="", text="the of and")]
    lines = list(iter_corpus(out / "corpus.jsonl")) + extra
    write_corpus(out / "corpus.jsonl", lines)
    return out


@pytest.fixture(scope="module")
def docstore(world_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> DocStore:
    return DocStore.build(iter_corpus(world_dir / "corpus.jsonl"), tmp_path_factory.mktemp("ds") / "docstore")


def _reference(docstore: DocStore, out: Path, **params) -> Path:
    texts = (f"{title}\n{text}" for batch in docstore.iter_batches(4096) for _, title, text in batch)
    build_bm25(texts, docstore.num_docs, out, show_progress=False, **params)
    return out


@pytest.mark.parametrize(
    ("params", "shard_docs", "workers"),
    [
        ({}, 700, 2),
        ({"method": "robertson", "k1": 1.2, "b": 0.75}, 1000, 1),
        ({"method": "atire"}, 3002, 1),
        ({"stemmer": None}, 450, 1),
    ],
)
def test_sharded_files_equal_bm25s_build(
    docstore: DocStore, tmp_path: Path, params, shard_docs, workers
) -> None:
    ref = _reference(docstore, tmp_path / "ref", **params)
    build_bm25_sharded(docstore, tmp_path / "sharded", shard_docs=shard_docs, workers=workers, **params)
    for name in ARRAYS:
        a, b = np.load(ref / name), np.load(tmp_path / "sharded" / name)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
    for name in ("params.index.json", "vocab.index.json", "stopwords.tokenizer.json"):
        assert (ref / name).read_text() == (tmp_path / "sharded" / name).read_text(), name
    assert not (tmp_path / "sharded" / "build.tmp").exists()


def test_search_from_sharded_build_equals_bm25s_index(world_dir: Path, tmp_path: Path) -> None:
    corpus = world_dir / "corpus.jsonl"
    build_index(corpus, "bm25", tmp_path / "sharded", show_progress=False, shard_docs=500, workers=2)
    # The same index directory with bm25s' own files (its tokenizer lists every word) as the reference.
    shutil.copytree(tmp_path / "sharded", tmp_path / "ref")
    shutil.rmtree(tmp_path / "ref" / "bm25")
    _reference(DocStore(tmp_path / "ref" / "docstore"), tmp_path / "ref" / "bm25")
    assert not (tmp_path / "ref" / "bm25" / TOKEN_BOUNDS_FILE).exists()
    questions = [
        json.loads(line)["question"] for line in (world_dir / "train.jsonl").read_text().splitlines()
    ]
    queries = questions + ["", "the of", "Born", "unseenword zzqx", "was born in"]
    got = load_retriever(tmp_path / "sharded").search(queries, 10)
    want = load_retriever(tmp_path / "ref").search(queries, 10)
    assert got == want
    assert sum(len(h) for h in got) > 5 * len(questions)
    manifest = json.loads((tmp_path / "sharded" / "manifest.json").read_text())
    assert manifest["bm25_build"] == {"shard_docs": 500, "workers": 2}


def test_served_index_is_memory_mapped_and_bounds_come_from_the_build(
    world_dir: Path, tmp_path: Path
) -> None:
    build_index(world_dir / "corpus.jsonl", "bm25", tmp_path / "idx", show_progress=False, shard_docs=800)
    retriever = load_retriever(tmp_path / "idx")
    scores = retriever.model.scores
    assert all(isinstance(scores[k], np.memmap) for k in ("data", "indices", "indptr"))
    # the docstore's strings are not read in: positional reads from the open file (a map where there is no pread)
    store = retriever.docstore
    assert store._fd >= 0 if hasattr(os, "pread") else isinstance(store._strings.obj, mmap.mmap)
    # The kernel's bounds are read from the build's file at load, not computed by scanning the matrix.
    assert retriever._token_bounds is not None
    upper, magnitude, _ = token_weight_bounds(scores["data"], scores["indices"], scores["indptr"])
    np.testing.assert_array_equal(retriever._token_bounds[0], upper)
    np.testing.assert_array_equal(retriever._token_bounds[1], magnitude)
    served = build_serving_app({"index": str(tmp_path / "idx")})
    with TestClient(served) as client:
        body = client.post("/retrieve", json={"queries": ["Where was it born?"], "topk": 3}).json()
    assert len(body["result"][0]) == 3


def test_bad_build_options(docstore: DocStore, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="shard_docs"):
        build_bm25_sharded(docstore, tmp_path / "a", shard_docs=0)
    with pytest.raises(ConfigError, match="workers"):
        build_bm25_sharded(docstore, tmp_path / "b", workers=0)
    (tmp_path / "bounds").mkdir()
    build_bm25_sharded(docstore, tmp_path / "bounds", shard_docs=2000)
    np.save(tmp_path / "bounds" / TOKEN_BOUNDS_FILE, np.zeros((2, 3)))

    with pytest.raises(IndexMismatchError, match="token_bounds"):
        BM25Retriever(tmp_path / "bounds", docstore)


_PEAK = textwrap.dedent(
    """
    import sys
    import threading
    from sleuth.retrieval.bm25 import build_bm25
    from sleuth.retrieval.bm25_build import build_bm25_sharded
    from sleuth.retrieval.docstore import DocStore

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1])  # KiB

    store = DocStore(sys.argv[1])
    # Warm up (imports, numba kernels, allocator arenas) on 500 passages so only the build's data counts.
    from sleuth.data.formats import Passage
    warm = DocStore.build((Passage(i, t, x) for i, t, x in store.get(range(500))), sys.argv[2] + ".ds")
    build_bm25_sharded(warm, sys.argv[2] + ".w1", shard_docs=1000)
    build_bm25((f"{t}\\n{x}" for _, t, x in warm.get(range(500))), 500, sys.argv[2] + ".w2", show_progress=False)
    # Anonymous memory only: the memory-mapped docstore and index files the build reads and writes
    # are page cache (file-backed), which the kernel can drop, so they count in RSS but not here.
    before = status("RssAnon")
    peak = [before]
    done = threading.Event()

    def sample():
        while not done.wait(0.002):
            peak[0] = max(peak[0], status("RssAnon"))

    sampler = threading.Thread(target=sample)
    sampler.start()
    if sys.argv[3] == "sharded":
        build_bm25_sharded(store, sys.argv[2], shard_docs=1000, workers=1)
    else:
        texts = (f"{t}\\n{x}" for b in store.iter_batches(4096) for _, t, x in b)
        build_bm25(texts, store.num_docs, sys.argv[2], show_progress=False)
    done.set()
    sampler.join()
    print(max(peak[0], status("RssAnon")) - before)
    """
)


def test_peak_memory_does_not_grow_with_the_corpus(tmp_path: Path) -> None:
    """Peak anonymous memory added by a build of 4,000 vs 32,000 passages (same 1,000-passage shards):
    the sharded build's stays flat (one shard at a time), bm25s' single pass grows with its token lists."""
    world = generate_world(200, 0, hops=(1, 1), seed=1)
    peaks: dict[tuple[str, int], int] = {}
    for size in (4000, 32000):
        write_world(world, tmp_path / f"w{size}", corpus_size=size)
        store = DocStore.build(iter_corpus(tmp_path / f"w{size}" / "corpus.jsonl"), tmp_path / f"ds{size}")
        for how in ("sharded", "bm25s"):
            out = subprocess.run(
                [sys.executable, "-c", _PEAK, str(store.directory), str(tmp_path / f"{how}{size}"), how],
                capture_output=True,
                text=True,
                check=True,
            )
            peaks[how, size] = int(out.stdout.split()[-1])  # KiB above the build's start
    sharded_growth = peaks["sharded", 32000] - peaks["sharded", 4000]
    bm25s_growth = peaks["bm25s", 32000] - peaks["bm25s", 4000]
    assert bm25s_growth > 30_000, peaks  # the measurement sees growth: bm25s' token lists
    assert sharded_growth < bm25s_growth / 5, peaks


def test_cli_index_with_workers_and_shards(world_dir: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        [
            "index",
            str(world_dir / "corpus.jsonl"),
            "--out",
            str(tmp_path / "i"),
            "--workers",
            "2",
            "--shard-docs",
            "1000",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "shard_docs=1000" in result.output
    bad = CliRunner().invoke(
        app, ["index", str(world_dir / "corpus.jsonl"), "--out", str(tmp_path / "j"), "--workers", "0"]
    )
    assert bad.exit_code == 2 and "workers" in bad.output
