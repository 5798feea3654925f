"""Throughput of the HTTP retrieval path vs calling the retriever in-process.

Runs the server in a child process (so client and server do not share a GIL) and measures:
  - in-process `search` at batch 256,
  - HTTP with RemoteRetriever at batch 256 (one client, and 4 concurrent batches),
  - single-query latency p50 over HTTP,
  - 64 concurrent single-query clients (the micro-batching case: agent rollouts).
Retrievers: `fake` (returns fixed ~600-char passages, near-zero search cost: the HTTP overhead
ceiling) and `bm25` (a real bm25s index over a synthetic 20k-passage corpus).

    python bench/bench_retrieval_server.py [--kinds fake bm25] [--out bench/results/retrieval_server.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import free_port, wait_up
from sleuth.retrieval.base import Hit

WORDS = [f"w{i}" for i in range(5000)]


class FakeRetriever:
    """k fixed-size passages per query; the cost of building Hits only."""

    kind = "fake"
    num_docs = 1000

    def __init__(self) -> None:
        rng = random.Random(0)
        self.passages = [
            (str(i), f"Title {i}", " ".join(rng.choices(WORDS, k=94))) for i in range(self.num_docs)
        ]

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        out = []
        for qi, _ in enumerate(queries):
            base = (qi * 7) % (self.num_docs - k)
            out.append([Hit(*self.passages[base + j], score=float(k - j)) for j in range(k)])
        return out


def synthetic_corpus(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    weights = [1.0 / (r + 1) for r in range(len(WORDS))]  # Zipf-like term frequencies
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            text = " ".join(rng.choices(WORDS, weights=weights, k=94))
            f.write(json.dumps({"id": str(i), "contents": f'"Doc {i}"\n{text}'}) + "\n")


def make_queries(n: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS[:2000], k=6)) for _ in range(n)]


def load(kind: str, index_dir: Path | None):
    if kind == "fake":
        return FakeRetriever()
    from sleuth.retrieval import load_retriever

    return load_retriever(index_dir)


def serve_child(kind: str, index_dir: str | None, port: int, batch_wait_ms: float) -> None:
    import uvicorn

    from sleuth.retrieval.server import create_app

    retriever = load(kind, Path(index_dir) if index_dir else None)
    retriever.search(["warm up the jit"], 3)
    app = create_app(retriever, batch_wait_ms=batch_wait_ms)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def qps(fn, n_queries: int, repeats: int) -> float:
    fn()  # warm
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return n_queries * repeats / (time.perf_counter() - t)


async def concurrent_single(url: str, queries: list[str], clients: int, k: int) -> float:
    """`clients` keep-alive connections each sending one query per request.

    Raw HTTP/1.1 over asyncio streams: httpx's async client costs ~4 ms of CPU per request here,
    which would measure the load generator instead of the server.
    """
    host, port = url.removeprefix("http://").split(":")
    it = iter(queries)

    async def worker() -> int:
        reader, writer = await asyncio.open_connection(host, int(port))
        n = 0
        try:
            for q in it:
                body = json.dumps({"queries": [q], "topk": k, "return_scores": True}).encode()
                writer.write(
                    b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                )
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(head[:100])
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                json.loads(await reader.readexactly(length))
                n += 1
        finally:
            writer.close()
        return n

    t = time.perf_counter()
    done = sum(await asyncio.gather(*(worker() for _ in range(clients))))
    return done / (time.perf_counter() - t)


def bench_kind(kind: str, index_dir: Path | None, k: int, batch_wait_ms: float) -> dict:
    from sleuth.retrieval.client import RemoteRetriever

    queries = make_queries(4096)
    retriever = load(kind, index_dir)
    retriever.search(["warm up the jit"], k)
    batch = queries[:256]
    res: dict = {"kind": kind, "k": k, "batch_wait_ms": batch_wait_ms}
    res["inproc_qps_b256"] = qps(lambda: retriever.search(batch, k), 256, 8)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        __file__,
        "--_serve",
        kind,
        "--_port",
        str(port),
        "--batch-wait-ms",
        str(batch_wait_ms),
    ]
    if index_dir:
        cmd += ["--_index", str(index_dir)]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_up(url, proc)
        with RemoteRetriever(url, batch_size=256, concurrency=1) as remote:
            res["http_qps_b256"] = qps(lambda: remote.search(batch, k), 256, 8)
            lat = []
            for q in queries[:200]:
                t = time.perf_counter()
                remote.search([q], k)
                lat.append(time.perf_counter() - t)
            res["http_single_p50_ms"] = 1000 * statistics.median(lat)
        with RemoteRetriever(url, batch_size=256, concurrency=4) as remote:
            res["http_qps_4x256_concurrent"] = qps(lambda: remote.search(queries[:1024], k), 1024, 3)
        import httpx

        before = httpx.get(f"{url}/health").json()["stats"]
        res["http_qps_64_single_clients"] = asyncio.run(concurrent_single(url, queries[:2048], 64, k))
        after = httpx.get(f"{url}/health").json()["stats"]
        # How well micro-batching merged the single-query requests.
        res["single_clients_requests_per_search_call"] = (after["requests"] - before["requests"] - 1) / max(
            1, after["search_calls"] - before["search_calls"]
        )
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", nargs="+", default=["fake", "bm25"])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--batch-wait-ms", type=float, default=2.0)
    ap.add_argument("--out", default="bench/results/retrieval_server.json")
    ap.add_argument("--_serve")
    ap.add_argument("--_port", type=int)
    ap.add_argument("--_index")
    args = ap.parse_args()
    if args._serve:
        serve_child(args._serve, args._index, args._port, args.batch_wait_ms)
        return

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        index_dir = None
        if "bm25" in args.kinds:
            from sleuth.retrieval import build_index

            corpus = Path(tmp) / "corpus.jsonl"
            synthetic_corpus(corpus, args.docs)
            index_dir = Path(tmp) / "index"
            build_index(corpus, "bm25", index_dir, show_progress=False)
        for kind in args.kinds:
            rows.append(bench_kind(kind, index_dir if kind == "bm25" else None, args.k, args.batch_wait_ms))

    cols = [
        "inproc_qps_b256",
        "http_qps_b256",
        "http_qps_4x256_concurrent",
        "http_qps_64_single_clients",
        "http_single_p50_ms",
        "single_clients_requests_per_search_call",
    ]
    short = [
        "inproc q/s b256",
        "http q/s b256",
        "http q/s 4x256",
        "http q/s 64x1",
        "http p50 ms (1q)",
        "reqs/call 64x1",
    ]
    print(f"{'kind':6} " + " ".join(f"{c:>17}" for c in short))
    for r in rows:
        print(f"{r['kind']:6} " + " ".join(f"{r[c]:>17.1f}" for c in cols))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"k": args.k, "docs": args.docs, "cpus": os.cpu_count(), "rows": rows}, indent=2) + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
