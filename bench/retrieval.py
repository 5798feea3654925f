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
import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import RESULTS, free_port, require_positive, wait_up, write_json
from pyserini_seed_server import PyseriniUnavailable, SeedSearcher, load_pyserini
from sleuth.retrieval.base import Hit

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


def span_queries(corpus: Path, n: int, seed: int, span: int = 8, drop: int = 2) -> list[dict]:
    """Queries cut from random passages: `span` consecutive words of the text with `drop` of them
    removed; gold = the source passage. Harder than the synthetic questions (templated sentences recur
    across passages), so recall@5 separates rankers."""
    import random

    from sleuth.data.formats import iter_corpus

    passages = [(p.id, p.text.split()) for p in iter_corpus(corpus)]
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        doc_id, words = passages[rng.randrange(len(passages))]
        if len(words) < span:
            continue
        start = rng.randrange(len(words) - span + 1)
        kept = sorted(rng.sample(range(start, start + span), span - drop))
        out.append(
            {
                "question": " ".join(words[i] for i in kept),
                "set": "passage spans",
                "metadata": {"supporting_ids": [doc_id]},
            }
        )
    return out


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


def bench_pyserini(corpus: Path, questions: list[dict], work: Path, n_single: int) -> dict[str, Any]:
    """pyserini `batch_search` (1 Java thread) with the seeds' passage lookup, in the main table's columns."""
    out = work / "idx-lucene"
    build_s = build_lucene_index(corpus, out, threads=1)
    gc.collect()
    rss0 = rss_bytes()
    searcher = SeedSearcher(out, "batch", threads=1)

    def search(queries: list[str], k: int) -> list[list[Hit]]:
        return [
            [Hit(d["id"], d["title"], d["text"], s) for d, s in zip(docs, scores, strict=True)]
            for docs, scores in searcher.search(queries, k)
        ]

    row = measure_search(search, questions, n_single)
    row.update(build_s=build_s, index_bytes=dir_size(out), rss_delta_bytes=rss_bytes() - rss0)
    return row


# ---------------------------------------------------------------------------------------------------
# sleuth vs the seeds' pyserini path (--vs-pyserini): same corpus, same queries, in-process and HTTP

GOAL_VS_SERIAL = 5.0  # sleuth's server vs the seeds' one-query-at-a-time pyserini path
GOAL_VS_BATCH = 2.0  # sleuth's server vs pyserini batch_search
EQUAL_RECALL = 0.02  # recall@5 within this (absolute) counts as equal


@dataclass
class SearchPath:
    """One way to answer queries: `search(queries)` -> top-K passage ids per query."""

    name: str
    surface: str  # "in-process" or "HTTP"
    threads: str  # search threads, for the table
    search: Callable[[list[str]], list[list[str]]]
    cpu_seconds: Callable[[], float] = time.process_time  # CPU time of whoever does the work
    qps: list[float] = field(default_factory=list)
    cpu_ms_per_query: list[float] = field(default_factory=list)
    ids: list[list[str]] | None = None
    recall: dict[str, float] = field(default_factory=dict)  # by query set, and "all"
    p50_ms: float | None = None
    server_threads: int | None = None


def build_lucene_index(corpus: Path, out: Path, threads: int) -> float:
    """Build with pyserini's indexer in a child process (its JVM exits with it); seconds, JVM start included."""
    script = Path(__file__).with_name("pyserini_seed_server.py")
    t0 = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            "--build-index",
            "--corpus",
            str(corpus),
            "--index",
            str(out),
            "--threads",
            str(threads),
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"Lucene indexing of {corpus} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - t0


class HttpSearch:
    """The same client for every server: one POST /retrieve per call, Search-R1's request body."""

    def __init__(self, url: str, k: int):
        import httpx

        self.client = httpx.Client(base_url=url, timeout=300)
        self.k = k

    def __call__(self, queries: list[str]) -> list[list[str]]:
        resp = self.client.post("/retrieve", json={"queries": queries, "topk": self.k, "return_scores": True})
        resp.raise_for_status()
        return [[item["document"]["id"] for item in hits] for hits in resp.json()["result"]]


def start_server(cmd: list[str], url: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    wait_up(url, proc, timeout=300, log=log)
    return proc


def process_cpu(pid: int) -> Callable[[], float]:
    import psutil

    proc = psutil.Process(pid)

    def seconds() -> float:
        t = proc.cpu_times()
        return t.user + t.system

    return seconds


def timed_pass(path: SearchPath, texts: list[str], chunk: int) -> tuple[float, float, list[list[str]]]:
    """(wall seconds, CPU seconds of the searching process, ids) for all `texts` in calls of `chunk`."""
    ids: list[list[str]] = []
    cpu0 = path.cpu_seconds()
    t0 = time.perf_counter()
    for i in range(0, len(texts), chunk):
        ids.extend(path.search(texts[i : i + chunk]))
    return time.perf_counter() - t0, path.cpu_seconds() - cpu0, ids


def recall_of_ids(ids: list[list[str]], questions: list[dict]) -> float:
    return recall_at_k(ids, questions, get_id=lambda doc_id: doc_id)


def goal(sleuth: SearchPath, base: SearchPath | None, target: float) -> dict[str, Any]:
    """sleuth's median q/s over `base`'s, and whether that meets `target` at equal (or better) recall@5."""
    if base is None or not base.qps:
        return {"vs": None, "target": target, "status": "unmeasured (pyserini not installed)"}
    ratio = statistics.median(sleuth.qps) / statistics.median(base.qps)
    met = ratio >= target and sleuth.recall["all"] >= base.recall["all"] - EQUAL_RECALL
    return {
        "vs": base.name,
        "target": target,
        "speedup": ratio,
        "recall_sleuth": sleuth.recall["all"],
        "recall_base": base.recall["all"],
        "recall_equal_within": EQUAL_RECALL,
        "status": "met" if met else "not met",
    }


def compare_with_pyserini(args: argparse.Namespace, corpus: Path, questions: list[dict]) -> dict[str, Any]:
    from sleuth.retrieval import build_index, load_retriever

    questions = [{**q, "set": "questions"} for q in questions]
    questions += span_queries(corpus, args.span_queries, args.seed)
    texts = [q["question"] for q in questions]
    work = args.workdir / f"vs-pyserini-{args.passages}"
    work.mkdir(parents=True, exist_ok=True)
    builds: dict[str, Any] = {}
    t0 = time.perf_counter()
    build_index(corpus, "bm25", work / "idx-bm25", overwrite=True, show_progress=False, threads=1)
    builds["sleuth_bm25"] = {"build_s": time.perf_counter() - t0, "index_bytes": dir_size(work / "idx-bm25")}
    retriever = load_retriever(work / "idx-bm25", threads=1)

    def sleuth_ids(queries: list[str]) -> list[list[str]]:
        return [[h.doc_id for h in hits] for hits in retriever.search(queries, K)]

    paths: list[SearchPath] = [SearchPath("sleuth BM25Retriever.search", "in-process", "1", sleuth_ids)]
    servers: list[subprocess.Popen] = []
    pyserini_info: dict[str, Any] = {}
    missing = ""
    try:
        loaded = load_pyserini()
        pyserini_info = {"pyserini": loaded["version"], "java": loaded["java"]}
        builds["lucene"] = {"build_s": build_lucene_index(corpus, work / "idx-lucene", threads=1)}
        builds["lucene"]["index_bytes"] = dir_size(work / "idx-lucene")
    except (PyseriniUnavailable, RuntimeError) as err:
        missing = f"not installed: {err}" if isinstance(err, PyseriniUnavailable) else str(err)
        print(f"pyserini rows skipped: {missing}", file=sys.stderr)
    if not missing:
        serial = SeedSearcher(work / "idx-lucene", "serial")
        batch = SeedSearcher(work / "idx-lucene", "batch", threads=args.pyserini_threads)

        def passage_ids(searcher: SeedSearcher) -> Callable[[list[str]], list[list[str]]]:
            return lambda queries: [[d["id"] for d in docs] for docs, _ in searcher.search(queries, K)]

        lucene = serial.searcher

        def lucene_ids_serial(queries: list[str]) -> list[list[str]]:
            return [[h.docid for h in lucene.search(q, K)] for q in queries]

        def lucene_ids_batch(queries: list[str]) -> list[list[str]]:
            found = lucene.batch_search(
                queries, [str(i) for i in range(len(queries))], K, args.pyserini_threads
            )
            return [[h.docid for h in found[str(i)]] for i in range(len(queries))]

        jt = str(args.pyserini_threads)
        paths += [
            SearchPath(
                "pyserini search, 1 query at a time + passage lookup (seeds)",
                "in-process",
                "1",
                passage_ids(serial),
            ),
            SearchPath("pyserini batch_search + passage lookup", "in-process", jt, passage_ids(batch)),
            SearchPath("pyserini search, 1 query at a time, ids only", "in-process", "1", lucene_ids_serial),
            SearchPath("pyserini batch_search, ids only", "in-process", jt, lucene_ids_batch),
        ]
    try:
        http_paths = []
        # As shipped (holds a request up to 2 ms, only when concurrent requests are expected), and with
        # holding off altogether: for this one sequential client the two should match.
        for name, wait_ms in (
            ("sleuth serve-retriever", "2"),
            ("sleuth serve-retriever --batch-wait-ms 0", "0"),
        ):
            port = free_port()
            cmd = [
                sys.executable,
                "-c",
                "from sleuth.cli import main; main()",
                "serve-retriever",
                "--index",
                str(work / "idx-bm25"),
                "--port",
                str(port),
                "--threads",
                "1",
                "--worker-threads",
                "1",
                "--batch-wait-ms",
                wait_ms,
            ]
            servers.append(
                start_server(cmd, f"http://127.0.0.1:{port}", work / f"sleuth-server-wait{wait_ms}.log")
            )
            http_paths.append(
                SearchPath(
                    name, "HTTP", "1", HttpSearch(f"http://127.0.0.1:{port}", K), process_cpu(servers[-1].pid)
                )
            )
        if not missing:
            script = str(Path(__file__).with_name("pyserini_seed_server.py"))
            for mode, name, threads in (
                ("serial", "seed server: pyserini 1 query at a time (Search-R1)", "1"),
                ("batch", "seed server, batch_search instead", jt),
            ):
                port = free_port()
                cmd = [
                    sys.executable,
                    script,
                    "--index",
                    str(work / "idx-lucene"),
                    "--port",
                    str(port),
                    "--mode",
                    mode,
                    "--threads",
                    str(args.pyserini_threads),
                ]
                servers.append(start_server(cmd, f"http://127.0.0.1:{port}", work / f"seed-{mode}.log"))
                http_paths.append(
                    SearchPath(
                        name,
                        "HTTP",
                        threads,
                        HttpSearch(f"http://127.0.0.1:{port}", K),
                        process_cpu(servers[-1].pid),
                    )
                )
        paths += http_paths
        measure_paths(paths, texts, args.repeats, args.single)
        import psutil

        for path, proc in zip(http_paths, servers, strict=True):
            path.server_threads = psutil.Process(proc.pid).num_threads()
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(timeout=30)

    sets = sorted({q["set"] for q in questions})
    for path in paths:
        path.recall = {"all": recall_of_ids(path.ids, questions)}
        for name in sets:
            chosen = [i for i, q in enumerate(questions) if q["set"] == name]
            path.recall[name] = recall_of_ids([path.ids[i] for i in chosen], [questions[i] for i in chosen])
    by_name = {p.name: p for p in paths}
    sleuth_http, sleuth_inproc = by_name["sleuth serve-retriever"], by_name["sleuth BM25Retriever.search"]
    goals = {
        "http_vs_seed_serial": goal(
            sleuth_http, by_name.get("seed server: pyserini 1 query at a time (Search-R1)"), GOAL_VS_SERIAL
        ),
        "http_vs_seed_batch_search": goal(
            sleuth_http, by_name.get("seed server, batch_search instead"), GOAL_VS_BATCH
        ),
        "inprocess_vs_serial": goal(
            sleuth_inproc,
            by_name.get("pyserini search, 1 query at a time + passage lookup (seeds)"),
            GOAL_VS_SERIAL,
        ),
        "inprocess_vs_batch_search": goal(
            sleuth_inproc, by_name.get("pyserini batch_search + passage lookup"), GOAL_VS_BATCH
        ),
    }
    rows = [path_row(p, len(questions)) for p in paths]
    if missing:
        rows.append({"system": "pyserini (4 in-process paths, 2 seed-server paths)", "skipped": missing})
    return {"rows": rows, "goals": goals, "builds": builds, **pyserini_info}


def measure_paths(paths: list[SearchPath], texts: list[str], repeats: int, n_single: int) -> None:
    """Interleaved repeats (every path once per round), so load from other users hits all paths alike."""
    for path in paths:  # one untimed pass each: numba and JVM JIT compilation, connections, page cache
        timed_pass(path, texts, BATCH)
    for rnd in range(repeats):
        for path in paths:
            wall, cpu, ids = timed_pass(path, texts, BATCH)
            path.qps.append(len(texts) / wall)
            path.cpu_ms_per_query.append(1000 * cpu / len(texts))
            if path.ids is None:
                path.ids = ids
            elif ids != path.ids:
                raise RuntimeError(f"{path.name}: results changed between repeats")
        print(f"round {rnd + 1}/{repeats} done", file=sys.stderr, flush=True)
    for path in paths:
        lat = []
        for t in texts[:n_single]:
            t0 = time.perf_counter()
            path.search([t])
            lat.append(time.perf_counter() - t0)
        path.p50_ms = 1000 * statistics.median(lat)


def path_row(path: SearchPath, n_queries: int) -> dict[str, Any]:
    return {
        "system": path.name,
        "surface": path.surface,
        "search_threads": path.threads,
        "server_process_threads": path.server_threads,
        "qps_median": statistics.median(path.qps),
        "qps_min": min(path.qps),
        "qps_max": max(path.qps),
        "qps_runs": path.qps,
        "cpu_ms_per_query_median": statistics.median(path.cpu_ms_per_query),
        "cpu_measured": "server process" if path.surface == "HTTP" else "bench process (all threads)",
        "p50_ms_one_query": path.p50_ms,
        "recall@5": path.recall["all"],
        "recall@5_by_set": path.recall,
        "n_queries": n_queries,
        "batch": BATCH,
    }


def print_comparison(result: dict[str, Any], passages: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"BM25, {passages:,} passages: sleuth vs pyserini (median of repeats)")
    for col in (
        "path",
        "where",
        "search thr.",
        "q/s (batch 256) [min-max]",
        "CPU ms/q",
        "p50 1 query",
        "R@5",
        "R@5 questions",
        "R@5 spans",
    ):
        table.add_column(col, justify="left" if col in ("path", "where") else "right")
    for r in result["rows"]:
        if r.get("skipped"):
            table.add_row(r["system"], "", "", r["skipped"], "", "", "", "", "")
            continue
        by_set = r["recall@5_by_set"]
        table.add_row(
            r["system"],
            r["surface"],
            r["search_threads"],
            f"{r['qps_median']:,.0f} [{r['qps_min']:,.0f}-{r['qps_max']:,.0f}]",
            f"{r['cpu_ms_per_query_median']:.3f}",
            f"{r['p50_ms_one_query']:.2f} ms",
            f"{r['recall@5']:.3f}",
            f"{by_set.get('questions', float('nan')):.3f}",
            f"{by_set.get('passage spans', float('nan')):.3f}",
        )
    console = Console(width=170)
    console.print(table)
    for name, g in result["goals"].items():
        if g.get("speedup") is None:
            console.print(f"  {name}: {g['status']}")
        else:
            console.print(
                f"  {name}: {g['speedup']:.1f}x vs {g['vs']} (target {g['target']:.0f}x), "
                f"R@5 {g['recall_sleuth']:.3f} vs {g['recall_base']:.3f} -> {g['status']}"
            )


def machine(threads: int) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "host": platform.node(),
        "python": platform.python_version(),
        "threads": threads,
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
    ap.add_argument(
        "--out",
        type=Path,
        help="JSON output (default bench/results/retrieval.json, or "
        "retrieval_pyserini.json with --vs-pyserini)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--vs-pyserini",
        action="store_true",
        help="only the sleuth vs pyserini comparison: in-process and over HTTP, serial and batched",
    )
    ap.add_argument(
        "--repeats", type=int, default=5, help="--vs-pyserini: timed passes per path (median reported)"
    )
    ap.add_argument(
        "--span-queries",
        type=int,
        default=1000,
        help="--vs-pyserini: passage-span queries added to the questions",
    )
    ap.add_argument("--pyserini-threads", type=int, default=1, help="Java threads in pyserini batch_search")
    args = ap.parse_args()
    require_positive(args, "passages", "questions", "single", "repeats", "pyserini_threads")
    if args.out is None:
        args.out = RESULTS / ("retrieval_pyserini.json" if args.vs_pyserini else "retrieval.json")

    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    args.workdir.mkdir(parents=True, exist_ok=True)
    corpus, questions = make_world(
        args.passages, args.questions, args.workdir / f"world-{args.passages}", args.seed
    )
    if args.vs_pyserini:
        result = compare_with_pyserini(args, corpus, questions)
        print_comparison(result, args.passages)
        write_json(
            args.out,
            {
                "machine": machine(args.threads),
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")},
                "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "params": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "corpus": {
                    "passages": args.passages,
                    "k": K,
                    "queries": {
                        "questions": f"{len(questions)} single-hop synthetic questions, gold metadata.supporting_ids[0]",
                        "passage spans": f"{args.span_queries} spans of 8 words less 2 from random passages, gold the "
                        "source passage",
                    },
                },
                **result,
            },
        )
        print(f"wrote {args.out}")
        return
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
        name = "pyserini batch_search (Lucene, 1 thread) + passage lookup"
        try:
            add(name, args.passages, bench_pyserini(corpus, questions, args.workdir, args.single))
        except (PyseriniUnavailable, RuntimeError) as err:
            add(
                name,
                args.passages,
                None,
                f"not installed: {err}" if isinstance(err, PyseriniUnavailable) else str(err),
            )

    print_table(rows)
    payload = {
        "machine": machine(args.threads),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "params": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": rows,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    write_json(args.out, payload)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
