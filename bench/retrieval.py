"""Retrieval benchmark on a synthetic world: sleuth BM25 / dense / HTTP server vs rank_bm25 (and pyserini).

    OMP_NUM_THREADS=1 python bench/retrieval.py --passages 200000 --dense-passages 10000 --threads 1

Measures build time, index size on disk, RSS growth from loading the index (and running the
queries), p50 single-query latency, batched throughput (batch 256) and recall@5 (a supporting
passage in the top 5; single-hop questions, so the one supporting passage is the first hop).
Dense runs on its own, smaller world (`--dense-passages`): encoding on a CPU runs at ~22
passages/s, so a 200k dense build is a GPU job. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

BATCH = 256
K = 5


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def make_world(n_passages: int, n_questions: int, out: Path, seed: int) -> tuple[Path, list[dict]]:
    from sleuth.data.synth import generate_world, write_world

    if not (out / "corpus.jsonl").exists():
        write_world(
            generate_world(n_passages, n_questions, hops=(1, 1), seed=seed), out, splits=(1.0, 0.0, 0.0)
        )
    questions = [json.loads(line) for line in (out / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    return out / "corpus.jsonl", questions


def recall_at_k(results: list[list[Any]], questions: list[dict], get_id=lambda h: h.doc_id) -> float:
    found = 0
    for hits, q in zip(results, questions, strict=True):
        gold = set(q["metadata"]["supporting_ids"][:1])
        found += bool({get_id(h) for h in hits[:K]} & gold)
    return found / max(1, len(questions))


def measure_search(search, questions: list[dict], n_single: int) -> dict[str, float]:
    """p50 single-query latency, batched q/s, recall@5 for `search(list[str], k)`."""
    texts = [q["question"] for q in questions]
    search(texts[:2], K)  # warm-up (JIT, caches, connections)
    lat = []
    for t in texts[:n_single]:
        t0 = time.perf_counter()
        search([t], K)
        lat.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    results: list = []
    for i in range(0, len(texts), BATCH):
        results.extend(search(texts[i : i + BATCH], K))
    elapsed = time.perf_counter() - t0
    return {
        "p50_ms": statistics.median(lat) * 1000,
        "qps_batch256": len(texts) / elapsed,
        "recall@5": recall_at_k(results, questions),
        "n_queries": len(texts),
    }


def bench_sleuth(
    kind: str, corpus: Path, questions: list[dict], work: Path, threads: int, n_single: int, **params
):
    from sleuth.retrieval import build_index, load_retriever

    out = work / f"idx-{kind}{'-' + params['faiss'] if 'faiss' in params else ''}"
    t0 = time.perf_counter()
    build_index(corpus, kind, out, overwrite=True, show_progress=False, threads=threads, **params)
    build_s = time.perf_counter() - t0
    gc.collect()
    rss0 = rss_bytes()
    retriever = load_retriever(out, threads=threads)
    row = measure_search(retriever.search, questions, n_single)
    row.update(build_s=build_s, index_bytes=dir_size(out), rss_delta_bytes=rss_bytes() - rss0)
    return row, retriever


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_server(retriever, questions: list[dict], n_single: int) -> dict[str, Any] | None:
    try:
        from sleuth.retrieval.client import RemoteRetriever
        from sleuth.retrieval.server import create_app
    except ImportError as err:
        print(f"server row skipped: {err}", file=sys.stderr)
        return None
    import uvicorn

    port = free_port()
    config = uvicorn.Config(
        create_app(retriever, max_queries=BATCH), host="127.0.0.1", port=port, log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    try:
        client = RemoteRetriever(f"http://127.0.0.1:{port}")
        row = measure_search(client.search, questions, n_single)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    return row


def bench_rank_bm25(corpus: Path, questions: list[dict], n_queries: int) -> dict[str, Any]:
    """rank_bm25 (pure Python, ~1 q/s at 200k): timed on a few queries only."""
    import Stemmer
    from rank_bm25 import BM25Okapi

    from sleuth.data.formats import iter_corpus
    from sleuth.retrieval.bm25 import import_bm25s

    bm25s = import_bm25s()

    stem = Stemmer.Stemmer("english")
    gc.collect()
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    ids, texts = [], []
    for p in iter_corpus(corpus):
        ids.append(p.id)
        texts.append(f"{p.title}\n{p.text}")
    tokens = bm25s.tokenize(texts, stopwords="en", stemmer=stem, return_ids=False, show_progress=False)
    del texts
    model = BM25Okapi(tokens)
    build_s = time.perf_counter() - t0
    sample = questions[:n_queries]
    lat, results = [], []
    for q in sample:
        qt = bm25s.tokenize(
            [q["question"]], stopwords="en", stemmer=stem, return_ids=False, show_progress=False
        )[0]
        t1 = time.perf_counter()
        scores = model.get_scores(qt)
        top = sorted(range(len(scores)), key=lambda i: -scores[i])[:K]
        lat.append(time.perf_counter() - t1)
        results.append([ids[i] for i in top])
    p50 = statistics.median(lat)
    return {
        "build_s": build_s,
        "index_bytes": None,
        "rss_delta_bytes": rss_bytes() - rss0,
        "p50_ms": p50 * 1000,
        "qps_batch256": 1 / statistics.mean(lat),  # no batch API: one query at a time
        "recall@5": recall_at_k(results, sample, get_id=lambda h: h),
        "n_queries": len(sample),
    }


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "RAM only"
    return f"{n / 2**20:,.0f} MB"


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="retrieval benchmark")
    for col in (
        "system",
        "passages",
        "build",
        "index size",
        "RSS delta",
        "p50 (1 query)",
        "q/s batch 256",
        "R@5",
        "n q",
    ):
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in rows:
        if r.get("skipped"):
            table.add_row(r["system"], "", "", "", "", "", "", "", r["skipped"])
            continue
        table.add_row(
            r["system"],
            f"{r['passages']:,}",
            f"{r['build_s']:.1f} s" if r.get("build_s") is not None else "(same index)",
            fmt_bytes(r.get("index_bytes")) if r.get("build_s") is not None else "",
            fmt_bytes(r.get("rss_delta_bytes")) if r.get("rss_delta_bytes") is not None else "",
            f"{r['p50_ms']:.2f} ms",
            f"{r['qps_batch256']:,.1f}",
            f"{r['recall@5']:.3f}",
            str(r["n_queries"]),
        )
    Console(width=170).print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passages", type=int, default=200_000, help="BM25 corpus size")
    ap.add_argument(
        "--dense-passages", type=int, default=10_000, help="dense corpus size (CPU encoding is slow)"
    )
    ap.add_argument("--questions", type=int, default=1000)
    ap.add_argument("--single", type=int, default=200, help="queries timed one at a time for p50")
    ap.add_argument("--threads", type=int, default=1, choices=[1, 2])
    ap.add_argument("--rank-bm25-queries", type=int, default=5)
    ap.add_argument("--faiss", default="flat", choices=["flat", "hnsw", "ivfpq"])
    ap.add_argument(
        "--skip", nargs="*", default=[], choices=["bm25", "dense", "server", "rank_bm25", "pyserini"]
    )
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/sleuth-bench-retrieval"))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "retrieval.json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    args.workdir.mkdir(parents=True, exist_ok=True)
    corpus, questions = make_world(
        args.passages, args.questions, args.workdir / f"world-{args.passages}", args.seed
    )
    rows: list[dict[str, Any]] = []

    def add(system: str, passages: int, row: dict | None, note: str = "") -> None:
        if row is None:
            rows.append({"system": system, "skipped": note})
        else:
            rows.append({"system": system, "passages": passages, **row})
        print(f"done: {system}", file=sys.stderr, flush=True)

    bm25 = None
    if "bm25" not in args.skip:
        row, bm25 = bench_sleuth("bm25", corpus, questions, args.workdir, args.threads, args.single)
        add("sleuth BM25 (bm25s + numba top-k, mmap)", args.passages, row)
    if "server" not in args.skip and bm25 is not None:
        row = bench_server(bm25, questions, args.single)
        if row is not None:
            row.update(build_s=None)
        add("sleuth server: BM25 via HTTP", args.passages, row, "server/client not available")
    if "dense" not in args.skip:
        dcorpus, dquestions = make_world(
            args.dense_passages,
            min(args.questions, args.dense_passages // 4),
            args.workdir / f"world-{args.dense_passages}",
            args.seed,
        )
        row, _ = bench_sleuth(
            "dense",
            dcorpus,
            dquestions,
            args.workdir,
            args.threads,
            args.single,
            encoder="minilm",
            faiss=args.faiss,
        )
        add(f"sleuth dense MiniLM + faiss {args.faiss} (smaller corpus)", args.dense_passages, row)
    if "rank_bm25" not in args.skip:
        add(
            "rank_bm25 BM25Okapi (few queries)",
            args.passages,
            bench_rank_bm25(corpus, questions, args.rank_bm25_queries),
        )
    if "pyserini" not in args.skip:
        try:
            import pyserini  # noqa: F401

            add("pyserini", args.passages, None, "importable but not wired in")
        except ImportError:
            add("pyserini", args.passages, None, "not installed (needs Java 21)")

    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "threads": args.threads},
        "params": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": rows,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
