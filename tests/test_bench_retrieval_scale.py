"""bench/retrieval_scale.py (issue 24): the BM25 stages end to end at a tiny size, the report, and the
memory sampler against a known allocation. (The dense stages and bench/retrieval_21m.sh were run end to
end by hand at 20,000 passages; encoding on a CPU makes them too slow for the suite.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SRC = Path(__file__).resolve().parent.parent / "src"
sys.path.insert(0, str(BENCH))

import retrieval_scale  # noqa: E402  (bench/ is not a package)
from sleuth.data.formats import Passage  # noqa: E402
from sleuth.retrieval.docstore import DocStore  # noqa: E402
from sleuth.retrieval.sharded import exact_scores  # noqa: E402


def test_peak_memory_sees_an_allocation() -> None:
    with retrieval_scale.PeakMemory() as mem:
        block = np.ones(64 * 2**20 // 8)  # 64 MiB, touched
        block.sum()
    now = retrieval_scale.tree_memory(os.getpid())
    del block
    assert mem.peak["anon"] >= 60 * 2**20
    assert mem.peak["rss"] >= mem.peak["anon"] and now["rss"] > 0


def test_bm25_stages_and_report_end_to_end(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    common = [
        "--work",
        str(tmp_path / "w"),
        "--size",
        "3000",
        "--world-passages",
        "300",
        "--questions",
        "60",
        "--workers",
        "2",
        "--shard-docs",
        "1000",
        "--batch-requests",
        "2",
        "--batch-clients",
        "2",
        "--latency-seconds",
        "1",
        "--recall-questions",
        "20",
    ]
    for stage in ("synth", "bm25-build", "bm25-serve"):
        subprocess.run(
            [sys.executable, str(BENCH / "retrieval_scale.py"), stage, *common],
            env=env,
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
        )
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH / "retrieval_scale.py"),
            "report",
            *common,
            "--out",
            str(tmp_path / "r.json"),
        ],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    assert "BM25 serve" in out.stdout and "cold start" in out.stdout
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["missing_stages"] == ["encode", "ivfpq-build", "dense-serve"]
    assert result["machine"]["cpus"] == os.cpu_count()
    synth, build, serve = (result["stages"][s] for s in ("synth", "bm25-build", "bm25-serve"))
    assert synth["passages"] == 3000 and synth["corpus_bytes"] > 3000 * 300
    assert build["passages"] == 3000 and build["index_bytes"] > 0 and build["peak_anon_bytes"] > 0
    assert build["peak_rss_bytes"] >= build["peak_anon_bytes"]
    assert serve["cold_start_seconds"] > 0 and serve["qps_batch256_one_client"] > 0
    assert serve["latency_p99_ms"] >= serve["latency_p50_ms"] > 0
    assert serve["gold_recall_at_5_single_hop"] > 0.5 and serve["recall_questions"] > 0
    for record in (synth, build, serve):
        assert record["command"] and record["date"] and len(record["load_average_before"]) == 3


def test_dense_stages_reuse_the_bm25_docstore_end_to_end(tmp_path: Path, one_layer_minilm: str) -> None:
    """Dense over the whole corpus (the default): encode reads the BM25 build's docstore with two CPU
    worker processes, the IVF-PQ build links it after the corpus file is deleted (as the 21M driver
    does; its k-means and list assignment by torch, as on a GPU), and the server answers from it. No
    sample corpus or second docstore is written. (The encoder is MiniLM cut to one layer, through the
    bench's SLEUTH_ENCODER: the stages' plumbing is under test, and encoding is most of their time.)"""
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "SLEUTH_ENCODER": one_layer_minilm}
    work = tmp_path / "w"
    common = [
        "--work",
        str(work),
        "--size",
        "500",
        "--world-passages",
        "200",
        "--questions",
        "40",
        "--workers",
        "1",
        "--shard-docs",
        "1000",
        "--batch-requests",
        "1",
        "--batch-clients",
        "1",
        "--latency-seconds",
        "1",
        "--recall-questions",
        "10",
        "--devices",
        "cpu,cpu",
        "--nlist",
        "16",
        "--shards",
        "2",
        "--nprobe",
        "16",
        "--ivf-device",
        "torch-cpu",
        "--sweep-nprobe",
        "1",
        "16",
    ]

    def stage(name: str) -> None:
        subprocess.run(
            [sys.executable, str(BENCH / "retrieval_scale.py"), name, *common],
            env=env,
            check=True,
            capture_output=True,
            text=True,
            timeout=400,
        )

    for name in ("synth", "bm25-build"):
        stage(name)
    (work / "world" / "corpus.jsonl").unlink()
    for name in ("encode", "ivfpq-build", "dense-serve"):
        stage(name)
    encode, build, serve = (
        json.loads((work / "stages" / f"{s}.json").read_text())
        for s in ("encode", "ivfpq-build", "dense-serve")
    )
    assert encode["passages"] == 500 and encode["sample"] is False and encode["devices"] == ["cpu", "cpu"]
    assert encode["docstore"] == str(work / "bm25" / "docstore") and encode["passages_per_second"] > 0
    assert (work / "dense" / "embeddings.f16").stat().st_size == 500 * 384 * 2
    assert (
        not (work / "dense" / "corpus.jsonl").exists() and not (work / "dense" / "docstore-encode").exists()
    )
    assert build["docstore_reused"] is True and build["passages"] == 500 and build["shards"] == 2
    assert build["ivf_build"]["path"] == "torch-assisted" and build["ivf_build"]["seconds"]["add"] >= 0
    inodes = {(work / d / "docstore" / "strings.bin").stat().st_ino for d in ("bm25", "ivf")}
    assert len(inodes) == 1
    assert serve["recall_at_5_vs_exact"] >= 0.8 and serve["gold_recall_at_5_single_hop"] > 0
    assert serve["sample"] is False
    # the in-process sweep at the served nprobe finds what the server found (same index, other path)
    assert [r["nprobe"] for r in serve["nprobe_sweep"]] == [1, 16]
    assert serve["nprobe_sweep"][1]["recall_at_5_vs_exact"] == serve["recall_at_5_vs_exact"]
    assert all(r["search_qps_in_process"] > 0 for r in serve["nprobe_sweep"])


def test_dense_sample_cuts_a_corpus_and_the_whole_corpus_needs_the_bm25_docstore(tmp_path: Path) -> None:
    """--dense-size below the corpus cuts the first N passages into their own corpus and docstore; the
    default (whole corpus) reads the BM25 build's docstore and says to run bm25-build when it is missing."""
    work = tmp_path / "w"
    (work / "world").mkdir(parents=True)
    (work / "stages").mkdir()
    (work / "world" / "corpus.jsonl").write_text(
        "".join(json.dumps({"id": f"d{i}", "contents": f'"T{i}"\nword{i} text'}) + "\n" for i in range(50))
    )
    (work / "stages" / "synth.json").write_text(json.dumps({"passages": 50}))
    sample = retrieval_scale._encode_docstore(
        retrieval_scale.parse_args(["encode", "--work", str(work), "--dense-size", "20"])
    )
    assert sample.num_docs == 20 and sample.ids([0, 19]) == ["d0", "d19"]
    assert retrieval_scale.count_lines(work / "dense" / "corpus.jsonl") == 20
    for size in ([], ["--dense-size", "50"], ["--dense-size", "80"]):
        args = retrieval_scale.parse_args(["encode", "--work", str(work), *size])
        assert retrieval_scale._dense_corpus(args) == (None, 50)
        with pytest.raises(SystemExit, match="run bm25-build or docstore-build first"):
            retrieval_scale._encode_docstore(args)


def test_dense_only_run_builds_the_bm25_docstore_without_bm25_and_reports_bm25_as_skipped(
    tmp_path: Path, one_layer_minilm: str
) -> None:
    """The SKIP_BM25=1 path of bench/retrieval_21m.sh: docstore-build writes the same docstore files the
    BM25 build writes (same ids, titles, texts at the same rows: byte-identical), the dense stages run from
    it after the corpus is deleted, and the report lists the BM25 stages as skipped, none as missing.
    (MiniLM cut to one layer encodes, as in the test above.)"""
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "SLEUTH_ENCODER": one_layer_minilm}
    work, bm25_work = tmp_path / "w", tmp_path / "bm25"
    common = [
        "--size",
        "400",
        "--world-passages",
        "200",
        "--questions",
        "40",
        "--workers",
        "2",
        "--shard-docs",
        "1000",
        "--batch-requests",
        "1",
        "--batch-clients",
        "1",
        "--latency-seconds",
        "1",
        "--recall-questions",
        "10",
        "--devices",
        "cpu",
        "--nlist",
        "16",
        "--shards",
        "2",
        "--nprobe",
        "16",
    ]

    def stage(name: str, where: Path = work, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(BENCH / "retrieval_scale.py"), name, "--work", str(where), *common, *extra],
            env=env,
            check=True,
            capture_output=True,
            text=True,
            timeout=400,
        )

    stage("synth")
    stage("docstore-build")
    (bm25_work / "world").mkdir(parents=True)
    (bm25_work / "world" / "corpus.jsonl").write_bytes((work / "world" / "corpus.jsonl").read_bytes())
    stage("bm25-build", bm25_work)
    for name in ("strings.bin", "offsets.npy", "docstore.json"):
        ours = (work / "docstore" / "docstore" / name).read_bytes()
        assert ours == (bm25_work / "bm25" / "docstore" / name).read_bytes(), name
    for name in ("bm25-build", "bm25-serve"):
        (work / "stages" / f"{name}.skipped").write_text("SKIP_BM25=1\n")
    (work / "world" / "corpus.jsonl").unlink()
    for name in ("encode", "ivfpq-build", "dense-serve"):
        stage(name)
    out = stage("report", work, "--out", str(tmp_path / "r.json"))
    encode = json.loads((work / "stages" / "encode.json").read_text())
    assert encode["docstore"] == str(work / "docstore" / "docstore") and encode["passages"] == 400
    build = json.loads((work / "stages" / "ivfpq-build.json").read_text())
    assert build["docstore_reused"] is True and build["ivf_build"]["requested"] == "auto"
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["missing_stages"] == []
    assert result["skipped_stages"] == {"bm25-build": "SKIP_BM25=1", "bm25-serve": "SKIP_BM25=1"}
    assert set(result["stages"]) == {"synth", "docstore-build", "encode", "ivfpq-build", "dense-serve"}
    assert "docstore build" in out.stdout and re.search(
        r"^bm25-build +skipped: SKIP_BM25=1$", out.stdout, re.M
    )
    assert result["stages"]["dense-serve"]["recall_at_5_vs_exact"] >= 0.8
    # one served worker's batch, phase by phase: every phase timed, the total their sum
    phases = result["stages"]["dense-serve"]["served_batch_phases"]
    assert set(phases["phase_ms"]) == {"encode", "scan", "rerank", "docstore", "json"}
    assert phases["phase_ms"]["encode"] > 0 and phases["phase_ms"]["scan"] > 0
    assert phases["total_ms"] == pytest.approx(sum(phases["phase_ms"].values()), abs=0.2)


def test_pss_counts_a_page_shared_by_two_processes_once(tmp_path: Path) -> None:
    """A server's workers map the same index files: summed RSS counts each shared page once per process,
    summed PSS once in all."""
    data = tmp_path / "shared.bin"
    data.write_bytes(b"\x01" * (32 * 2**20))
    mapper = (
        "import mmap, sys, time\n"
        "f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
        "total = sum(m[i] for i in range(0, len(m), 4096))\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    # the parent maps the file, then starts a child that maps it too
    parent_code = (
        "import subprocess, sys\n"
        f"child = subprocess.Popen([sys.executable, '-c', {mapper!r}, sys.argv[1]], stdout=subprocess.PIPE)\n"
        "child.stdout.readline()\n"
        f"exec({mapper!r})\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent_code, str(data)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        memory = retrieval_scale.tree_memory(proc.pid, pss=True)
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
    mib = 2**20
    assert memory["rss"] >= 64 * mib  # both processes' 32 MiB of mapped pages
    # PSS: the 32 MiB once, plus both interpreters' own memory (well under 32 MiB more than one copy)
    assert 32 * mib <= memory["pss"] <= memory["rss"] - 24 * mib
    # the mapped file is not anonymous memory; the two interpreters' heaps are
    assert memory["processes"] == 2 and 0 < memory["pss_anon"] <= memory["pss"] - 32 * mib


def test_tie_aware_recall_counts_a_passage_tied_with_the_exact_fifth() -> None:
    """Exact top-6 scores .9 .8 .7 .6 .5 .5 (rows 0-5): ranks 5 and 6 tie. A search returning row 5
    instead of row 4 has set overlap 4/5 but tie-aware recall 5/5; one returning row 9 (exact score
    0.49, more than 1e-3 below the 5th) gets 4/5 either way; one within 1e-3 (0.4995) counts."""
    exact_s = np.array([[0.9, 0.8, 0.7, 0.6, 0.5, 0.5]] * 3, np.float32)
    exact_r = np.array([[0, 1, 2, 3, 4, 5]] * 3)
    found = np.array([[0, 1, 2, 3, 5], [0, 1, 2, 3, 9], [0, 1, 2, 3, 9]])
    found_s = np.array(
        [[0.9, 0.8, 0.7, 0.6, 0.5], [0.9, 0.8, 0.7, 0.6, 0.49], [0.9, 0.8, 0.7, 0.6, 0.4995]], np.float32
    )
    for q in range(3):
        overlap, tie_aware = retrieval_scale.recall_vs_exact(
            found[q : q + 1], found_s[q : q + 1], exact_r[q : q + 1], exact_s[q : q + 1]
        )
        assert overlap == pytest.approx(0.8)
        assert tie_aware == pytest.approx([1.0, 0.8, 1.0][q])
    overlap, tie_aware = retrieval_scale.recall_vs_exact(found, found_s, exact_r, exact_s)
    assert overlap == pytest.approx(0.8) and tie_aware == pytest.approx((1.0 + 0.8 + 1.0) / 3)
    # a missing result (-1) counts for neither, whatever score sits beside it
    missing = np.array([[0, 1, 2, 3, -1]])
    assert retrieval_scale.recall_vs_exact(missing, np.full((1, 5), 1.0), exact_r[:1], exact_s[:1]) == (
        pytest.approx(0.8),
        pytest.approx(0.8),
    )
    # the 6th exact score is within 1e-3 of the 5th for every query here, for none when it is 0.49
    assert retrieval_scale.exact_ties(exact_s) == 1.0
    assert retrieval_scale.exact_ties(np.array([[0.9, 0.8, 0.7, 0.6, 0.5, 0.49]])) == 0.0


def test_exact_scores_and_rows_of_ids_recompute_what_a_search_returned(tmp_path: Path) -> None:
    """The exact score of a returned row is recomputed from the stored float16 vectors (-inf for -1), and
    served passage ids map back to docstore rows (padded with -1 where a query got fewer hits)."""
    vectors = np.array([[1, 0], [0, 1], [0.5, 0.5]], np.float16)
    q = np.array([[2.0, 1.0], [0.0, 3.0]], np.float32)
    got = exact_scores(vectors, q, np.array([[0, 2], [1, -1]]))  # sleuth's, which the bench calls
    assert got[0].tolist() == [2.0, 1.5] and got[1, 0] == 3.0 and got[1, 1] == -np.inf

    class Store:  # ids are row numbers, as in every synthetic corpus
        num_docs = 3

        def ids(self, rows):
            return [str(r) for r in rows]

    assert retrieval_scale.rows_of_ids(Store(), [["2", "0"], ["1"]]).tolist() == [[2, 0], [1, -1]]

    named = DocStore.build(
        [Passage(id=i, title=i, text=i) for i in "abc"], tmp_path / "docstore"
    )  # other ids
    assert retrieval_scale.rows_of_ids(named, [["c", "zz"], ["a"]]).tolist() == [[2, -1], [0, -1]]


def test_batched_clients_default_to_the_server_workers(tmp_path: Path) -> None:
    """The batched q/s keeps every server worker busy unless --batch-clients says otherwise."""
    args = retrieval_scale.parse_args(["dense-serve", "--work", str(tmp_path), "--server-workers", "8"])
    assert args.batch_clients == 8
    args = retrieval_scale.parse_args(
        ["dense-serve", "--work", str(tmp_path), "--server-workers", "8", "--batch-clients", "3"]
    )
    assert args.batch_clients == 3
    assert retrieval_scale.parse_args(["dense-serve", "--work", str(tmp_path)]).batch_clients == 1
