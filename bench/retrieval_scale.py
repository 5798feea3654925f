"""Retrieval at Wikipedia size (issue 24): a synthetic corpus grown with distractors, BM25 and dense
IVF-PQ indexes built with bounded memory, each served by `sleuth serve-retriever` and measured.

Stages (each writes WORK/stages/<stage>.json when done; `report` merges them, prints a table and
writes the result JSON):

    python bench/retrieval_scale.py synth       --work W --size 2000000 --workers 2
    python bench/retrieval_scale.py docstore-build --work W --workers 2   # dense only: no BM25 build
    python bench/retrieval_scale.py bm25-build  --work W --workers 2
    python bench/retrieval_scale.py bm25-serve  --work W --threads 2
    python bench/retrieval_scale.py encode      --work W [--dense-size 20000] [--devices all]
    python bench/retrieval_scale.py ivfpq-build --work W --nlist 1024 --pq-m 48 [--ivf-device auto]
    python bench/retrieval_scale.py dense-serve --work W --threads 2
    python bench/retrieval_scale.py report      --work W [--out results/retrieval_scale.json]
    python bench/retrieval_scale.py all         --work W --size 20000 --dense-size 2000   # every stage

Measured: build time, peak memory of the build (all its processes: RSS, and anonymous memory, the
part the kernel cannot drop; memory-mapped files count in RSS only), index size on disk, cold
start of the server (process start to a healthy /health, after its warm-up search), q/s at
batch 256 (one client, and `--batch-clients` at once: by default one per server worker, the
server's saturated rate), p50/p99 latency of one-query requests at concurrency 16, the server's
resident memory after the load, recall@5 of the gold passage (single-hop questions), and for dense
recall@5 against exact search over the same vectors, both as set overlap and tie-aware
(ann-benchmarks' k-NN recall: a returned passage counts when its exact score is within 1e-3 of the
exact 5th one).
The dense index covers the whole corpus by default: the encode stage then reads the BM25 build's
docstore (no second pass over the corpus) with one worker process per device
(`sleuth.retrieval.bulk_encode`, resumable), and the IVF-PQ build links that docstore. With
`--dense-size N` it covers the first N passages (the world's gold passages come first), a sample
recorded as such in its JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from _common import free_port, out_path, wait_up, write_json

BATCH = 256
K = 5
STAGES = ("synth", "docstore-build", "bm25-build", "bm25-serve", "encode", "ivfpq-build", "dense-serve")
# A stage the driver left out on purpose (bench/retrieval_21m.sh SKIP_BM25=1) has WORK/stages/<stage>.skipped
# holding the reason; the report lists it as skipped, not missing.
SKIPPED = ".skipped"
# Tie-aware recall against exact search counts a returned passage whose exact inner product is within
# TIE_EPS of the exact k-th one (ann-benchmarks' k-NN recall: k-th true distance + 1e-3).
TIE_EPS = 1e-3


# ---------------------------------------------------------------------------------------------------
# Measuring


def _proc_kib(pid: int, key: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _pss_kib(pid: int, key: str = "Pss") -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def tree_memory(pid: int, pss: bool = False) -> dict[str, int]:
    """RSS and anonymous RSS (bytes) summed over a process and its descendants; with `pss`, also their
    proportional set size, its anonymous part (`pss_anon`) and the number of processes (`processes`).
    Summed RSS counts a page every worker maps (the memory-mapped index, docstore and vectors of a
    multi-worker server) once per worker, and so does summed anonymous RSS for the pages pre-forked
    workers share copy-on-write with their supervisor (the index read into the heap, torch, the encoder):
    the tree is the supervisor plus its forked workers, and each of them reports those pages as its own.
    PSS splits each shared page among the processes that map it, so its sum is the memory the service
    occupies, and `pss_anon` the anonymous memory (slower to read: sampled only on demand)."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return {"rss": 0, "anon": 0, **({"pss": 0, "pss_anon": 0, "processes": 0} if pss else {})}
    memory = {
        "rss": sum(_proc_kib(p.pid, "VmRSS") for p in procs) * 1024,
        "anon": sum(_proc_kib(p.pid, "RssAnon") for p in procs) * 1024,
    }
    if pss:
        memory["pss"] = sum(_pss_kib(p.pid) for p in procs) * 1024
        memory["pss_anon"] = sum(_pss_kib(p.pid, "Pss_Anon") for p in procs) * 1024
        memory["processes"] = len(procs)
    return memory


class PeakMemory:
    """Samples `tree_memory(pid)` every 50 ms in a thread; `.peak` holds the largest of each."""

    def __init__(self, pid: int | None = None):
        self.pid = pid or os.getpid()
        self.peak = {"rss": 0, "anon": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            now = tree_memory(self.pid)
            self.peak = {k: max(self.peak[k], now[k]) for k in now}
            if self._stop.wait(0.05):
                return

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 24), b""))


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def drop_page_cache() -> bool:
    """Drop the OS page cache (root only) so a cold start reads its files from disk; False if not allowed."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def machine() -> dict[str, Any]:
    cpu = platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = _meminfo_kib("MemTotal") * 1024
    gpu = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        gpu = out.stdout.strip() or None
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_bytes": mem,
        "gpu": gpu,
        "host": platform.node(),
        "python": platform.python_version(),
    }


def _meminfo_kib(key: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def stage_record(
    name: str, args: argparse.Namespace, t0: float, load0: tuple[float, ...], **fields: Any
) -> dict:
    return {
        "stage": name,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_seconds": round(time.perf_counter() - t0, 2),
        "load_average_before": [round(x, 2) for x in load0],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        **fields,
    }


def save_stage(work: Path, record: dict[str, Any]) -> None:
    write_json(work / "stages" / f"{record['stage']}.json", record)
    print(json.dumps(record, indent=1, default=str), flush=True)


# ---------------------------------------------------------------------------------------------------
# Stages


def stage_synth(args: argparse.Namespace) -> dict[str, Any]:
    from sleuth.data.synth import generate_world, write_world

    t0, load0 = time.perf_counter(), os.getloadavg()
    world_passages = min(args.world_passages, args.size)
    with PeakMemory() as mem:
        world = generate_world(world_passages, args.questions, hops=(1, 3), seed=args.seed)
        write_world(world, args.work / "world", corpus_size=args.size, workers=args.workers)
    corpus = args.work / "world" / "corpus.jsonl"
    seconds = time.perf_counter() - t0
    return stage_record(
        "synth",
        args,
        t0,
        load0,
        passages=args.size,
        world_passages=world_passages,
        questions=args.questions,
        workers=args.workers,
        seconds=round(seconds, 2),
        passages_per_second=round(args.size / seconds),
        corpus_bytes=corpus.stat().st_size,
        peak_rss_bytes=mem.peak["rss"],
        peak_anon_bytes=mem.peak["anon"],
    )


def stage_docstore_build(args: argparse.Namespace) -> dict[str, Any]:
    """The dense stages' docstore without a BM25 index (WORK/docstore, kind "docstore"), `--workers` processes;
    the same files the BM25 build's docstore pass writes (tests/test_retrieval_docstore_build.py)."""
    from sleuth.retrieval.docstore_build import build_docstore_index

    t0, load0 = time.perf_counter(), os.getloadavg()
    out = args.work / "docstore"
    with PeakMemory() as mem:
        manifest = build_docstore_index(args.work / "world" / "corpus.jsonl", out, args.workers)
    return stage_record(
        "docstore-build",
        args,
        t0,
        load0,
        passages=manifest["num_docs"],
        workers=args.workers,
        seconds=round(time.perf_counter() - t0, 2),
        peak_rss_bytes=mem.peak["rss"],
        peak_anon_bytes=mem.peak["anon"],
        docstore_bytes=dir_bytes(out / "docstore"),
    )


def whole_corpus_source(args: argparse.Namespace) -> Path:
    """The directory whose docstore the whole-corpus dense stages read: the BM25 index if it was built, else
    the docstore-only build (a dense-only run)."""
    for name in ("bm25", "docstore"):
        if (args.work / name / "manifest.json").exists():
            return args.work / name
    raise SystemExit(
        "the dense index covers the whole corpus, so it reuses a docstore of it: run bm25-build "
        "or docstore-build first (or pass --dense-size N for a sample)"
    )


def stage_bm25_build(args: argparse.Namespace) -> dict[str, Any]:
    from sleuth.retrieval.index import build_index

    t0, load0 = time.perf_counter(), os.getloadavg()
    out = args.work / "bm25"
    with PeakMemory() as mem:
        manifest = build_index(
            args.work / "world" / "corpus.jsonl",
            "bm25",
            out,
            overwrite=True,
            show_progress=False,
            workers=args.workers,
            shard_docs=args.shard_docs,
        )
    return stage_record(
        "bm25-build",
        args,
        t0,
        load0,
        passages=manifest["num_docs"],
        workers=args.workers,
        shard_docs=args.shard_docs,
        seconds=round(time.perf_counter() - t0, 2),
        peak_rss_bytes=mem.peak["rss"],
        peak_anon_bytes=mem.peak["anon"],
        index_bytes=dir_bytes(out / "bm25"),
        docstore_bytes=dir_bytes(out / "docstore"),
    )


def _questions(work: Path) -> list[dict[str, Any]]:
    rows = []
    for split in ("train", "dev", "test"):
        path = work / "world" / f"{split}.jsonl"
        if path.exists():
            rows += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return rows


async def _latencies(url: str, queries: list[str], concurrency: int, seconds: float) -> list[float]:
    import httpx

    out: list[float] = []
    deadline = time.perf_counter() + seconds
    counter = iter(range(10**9))

    async def client_loop(client: httpx.AsyncClient) -> None:
        while time.perf_counter() < deadline:
            q = queries[next(counter) % len(queries)]
            t = time.perf_counter()
            r = await client.post(f"{url}/retrieve", json={"queries": [q], "topk": K, "return_scores": False})
            r.raise_for_status()
            out.append(time.perf_counter() - t)

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return out


def _batched_qps(url: str, queries: list[str], requests: int, clients: int) -> float:
    import httpx

    batches = [[queries[(i * BATCH + j) % len(queries)] for j in range(BATCH)] for i in range(requests)]

    async def run() -> float:
        todo = iter(batches)
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as client:

            async def loop() -> None:
                for batch in todo:
                    r = await client.post(
                        f"{url}/retrieve", json={"queries": batch, "topk": K, "return_scores": False}
                    )
                    r.raise_for_status()

            t = time.perf_counter()
            await asyncio.gather(*(loop() for _ in range(clients)))
            return len(batches) * BATCH / (time.perf_counter() - t)

    return asyncio.run(run())


def _retrieve(url: str, queries: list[str]) -> list[list[dict]]:
    import httpx

    out: list[list[dict]] = []
    with httpx.Client(timeout=600) as client:
        for i in range(0, len(queries), BATCH):
            r = client.post(
                f"{url}/retrieve", json={"queries": queries[i : i + BATCH], "topk": K, "return_scores": True}
            )
            r.raise_for_status()
            out += r.json()["result"]
    return out


def _hit_id(hit: dict) -> str:
    return str(hit.get("id") or hit.get("document", {}).get("id"))


def serve_and_measure(
    args: argparse.Namespace, index: Path, name: str, covered: set[str] | None = None
) -> tuple[dict[str, Any], list, list]:
    """Start serve-retriever on `index`, measure it, stop it; returns (fields, single-hop questions, their hits).

    `covered`: the passage ids the index holds (a dense sample); recall counts only questions whose gold
    passage is among them."""
    questions = _questions(args.work)
    texts = [q["question"] for q in questions]
    dropped = drop_page_cache() if args.drop_cache else False
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = args.work / f"{name}-server.log"
    cmd = [
        sys.executable,
        "-m",
        "sleuth.cli",
        "serve-retriever",
        "--index",
        str(index),
        "--port",
        str(port),
        "--threads",
        str(args.threads),
        "--worker-threads",
        str(args.worker_threads),
        "--workers",
        str(args.server_workers),
    ]
    if (
        name == "dense"
    ):  # the served search settings (else the index's nprobe and the library's re-rank depth)
        cmd += [
            *(["--nprobe", str(args.serve_nprobe)] if args.serve_nprobe else []),
            *(["--rerank", str(args.serve_rerank)] if args.serve_rerank is not None else []),
        ]
    t0 = time.perf_counter()
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        wait_up(url, proc, timeout=args.start_timeout, log=log)
        cold_start = time.perf_counter() - t0
        memory_started = tree_memory(proc.pid, pss=True)
        singles = [
            q
            for q in questions
            if q.get("metadata", {}).get("hops") == 1
            and (covered is None or str(q["metadata"]["supporting_ids"][0]) in covered)
        ][: args.recall_questions]
        hits = _retrieve(url, [q["question"] for q in singles])
        gold = [str(q["metadata"]["supporting_ids"][0]) for q in singles]
        gold_recall = float(
            np.mean([g in {_hit_id(h) for h in hs} for g, hs in zip(gold, hits, strict=True)])
        )
        one_client = _batched_qps(url, texts, args.batch_requests, 1)
        many_clients = _batched_qps(url, texts, args.batch_requests, args.batch_clients)
        lat = asyncio.run(_latencies(url, texts, 16, args.latency_seconds))
        memory_loaded = tree_memory(proc.pid, pss=True)
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if proc.poll() is None:
            proc.kill()
    fields = {
        "server_command": " ".join(cmd[1:]),
        "page_cache_dropped_before_start": dropped,
        "cold_start_seconds": round(cold_start, 2),
        "rss_after_start_bytes": memory_started["rss"],
        "anon_after_start_bytes": memory_started["anon"],
        "rss_after_load_bytes": memory_loaded["rss"],
        "anon_after_load_bytes": memory_loaded["anon"],
        "pss_after_start_bytes": memory_started["pss"],
        "pss_after_load_bytes": memory_loaded["pss"],
        # anon_*: summed anonymous RSS, which counts pages pre-forked workers share once per process;
        # pss_anon_*: the same memory with each shared page split among its processes (counted once)
        "pss_anon_after_start_bytes": memory_started["pss_anon"],
        "pss_anon_after_load_bytes": memory_loaded["pss_anon"],
        "server_processes": memory_loaded["processes"],  # supervisor + workers (pre-fork), or uvicorn's
        "qps_batch256_one_client": round(one_client, 1),
        f"qps_batch256_{args.batch_clients}_clients": round(many_clients, 1),
        "batch_clients": args.batch_clients,
        "latency_concurrency16_requests": len(lat),
        "latency_p50_ms": round(float(np.percentile(lat, 50)) * 1000, 2),
        "latency_p99_ms": round(float(np.percentile(lat, 99)) * 1000, 2),
        "qps_concurrency16_single_queries": round(len(lat) / args.latency_seconds, 1),
        "gold_recall_at_5_single_hop": round(gold_recall, 4),
        "recall_questions": len(singles),
    }
    return fields, singles, hits


def stage_bm25_serve(args: argparse.Namespace) -> dict[str, Any]:
    t0, load0 = time.perf_counter(), os.getloadavg()
    fields, _, _ = serve_and_measure(args, args.work / "bm25", "bm25")
    return stage_record("bm25-serve", args, t0, load0, **fields)


def _corpus_passages(args: argparse.Namespace) -> int:
    synth = args.work / "stages" / "synth.json"
    # The driver may delete the big corpus once the BM25 docstore holds its texts: synth.json has its size.
    return (
        json.loads(synth.read_text())["passages"]
        if synth.exists()
        else count_lines(args.work / "world" / "corpus.jsonl")
    )


def _dense_is_whole_corpus(args: argparse.Namespace) -> bool:
    return args.dense_size is None or args.dense_size >= _corpus_passages(args)


def _dense_corpus(args: argparse.Namespace) -> tuple[Path | None, int]:
    """The first --dense-size passages as their own corpus file; (None, corpus size) when the dense
    index covers the whole corpus (no copy: the encoder and the IVF-PQ build reuse the BM25 docstore)."""
    if _dense_is_whole_corpus(args):
        return None, _corpus_passages(args)
    src = args.work / "world" / "corpus.jsonl"
    dst = args.work / "dense" / "corpus.jsonl"
    dst.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    if not dst.exists():
        tmp = dst.with_suffix(".tmp")
        with open(src, "rb") as f, open(tmp, "wb") as g:
            for line in f:
                if n == args.dense_size:
                    break
                g.write(line)
                n += 1
        tmp.rename(dst)
    return dst, count_lines(dst)


def _encoder(device: str | None):
    from sleuth.retrieval.encoders import Encoder, EncoderConfig

    enc = Encoder(
        EncoderConfig(name=os.environ.get("SLEUTH_ENCODER", "minilm"), batch_size=512 if device else 64),
        device=device,
    )
    if device and device.startswith("cuda"):
        enc.model.half()  # fp16 on the GPU: the vectors are stored as float16 anyway
    return enc


def _encode_docstore(args: argparse.Namespace):
    """The docstore the dense index covers: the BM25 build's (or the docstore-only build's) when it is the
    whole corpus (no second pass over 21M passages), else one of the cut sample (kept between reruns)."""
    from sleuth.retrieval.docstore import DocStore
    from sleuth.retrieval.docstore_build import build_docstore_parallel

    corpus, _ = _dense_corpus(args)
    if corpus is None:
        return DocStore(whole_corpus_source(args) / "docstore")
    directory = args.work / "dense" / "docstore-encode"
    if (directory / "docstore.json").exists():
        return DocStore(directory)
    return build_docstore_parallel(corpus, directory, args.workers)


def stage_encode(args: argparse.Namespace) -> dict[str, Any]:
    from sleuth.retrieval.bulk_encode import EncodePlan, encode_docstore_parallel, parse_devices
    from sleuth.retrieval.encoders import EncoderConfig

    t0, load0 = time.perf_counter(), os.getloadavg()
    devices = parse_devices(args.devices)
    store = _encode_docstore(args)
    on_gpu = devices[0].startswith("cuda")
    config = EncoderConfig(
        name=os.environ.get("SLEUTH_ENCODER", "minilm"),
        batch_size=args.encode_batch or (512 if on_gpu else 64),
    )
    out = args.work / "dense" / "embeddings.f16"
    out.parent.mkdir(parents=True, exist_ok=True)
    run = encode_docstore_parallel(
        store, out, config, devices, EncodePlan(chunk=args.encode_chunk, procs_per_gpu=args.procs_per_gpu)
    )
    rows, total = run["rows"], _corpus_passages(args)
    return stage_record(
        "encode",
        args,
        t0,
        load0,
        passages=rows,
        corpus_passages=total,
        sample=rows < total,
        note=(f"dense covers the first {rows:,} of {total:,} passages (a sample: --dense-size)")
        if rows < total
        else "dense covers the whole corpus",
        docstore=str(store.directory),
        encoder=config.name,
        batch_size=config.batch_size,
        dim=run["dim"],
        devices=devices,
        workers=run["workers"],
        fp16=on_gpu,
        chunk=args.encode_chunk,
        seconds=run["seconds"],
        encode_seconds=run["encode_seconds"],
        resumed_ranges=run["resumed_ranges"],
        passages_per_second=run["passages_per_second"],
    )


def stage_ivfpq_build(args: argparse.Namespace) -> dict[str, Any]:
    from sleuth.retrieval.index import build_index

    t0, load0 = time.perf_counter(), os.getloadavg()
    corpus, n = _dense_corpus(args)
    nlist = args.nlist or max(16, min(65536, 1 << round(math.log2(4 * n**0.5))))
    # The whole corpus: the index links the BM25 (or docstore-only) build's docstore (the corpus file may be
    # deleted by now).
    source = {"docstore_from": whole_corpus_source(args)} if corpus is None else {}
    with PeakMemory() as mem:
        manifest = build_index(
            corpus,
            "dense",
            args.work / "ivf",
            overwrite=True,
            show_progress=False,
            threads=args.threads,
            encoder=_encoder(None).config.name,
            faiss="ivfpq",
            nlist=nlist,
            m=args.pq_m,
            nbits=args.pq_nbits,
            nprobe=args.nprobe,
            shards=args.shards,
            keep_vectors=True,
            ivf_device=args.ivf_device,
            embeddings=str(args.work / "dense" / "embeddings.f16"),
            **source,
            **({"train_sample": args.train_sample} if args.train_sample else {}),
        )
    return stage_record(
        "ivfpq-build",
        args,
        t0,
        load0,
        passages=manifest["num_docs"],
        faiss=manifest["faiss"],
        threads=args.threads,
        shards=len(manifest["shards"]),
        train_sample=manifest.get("train_sample"),
        docstore_reused=corpus is None,
        ivf_build=manifest.get("ivf_build"),
        seconds=round(time.perf_counter() - t0, 2),
        peak_rss_bytes=mem.peak["rss"],
        peak_anon_bytes=mem.peak["anon"],
        faiss_bytes=dir_bytes(args.work / "ivf" / "shards"),
        vectors_bytes=(args.work / "ivf" / "vectors.f16").stat().st_size,
        docstore_bytes=dir_bytes(args.work / "ivf" / "docstore"),
    )


def _stored_vectors(args: argparse.Namespace) -> np.ndarray:
    manifest = json.loads((args.work / "ivf" / "manifest.json").read_text())
    return np.memmap(
        args.work / "ivf" / "vectors.f16",
        dtype=np.float16,
        mode="r",
        shape=tuple(manifest["vectors"]["shape"]),
    )


def exact_search(args: argparse.Namespace, q: np.ndarray, k: int = K + 1) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top-`k` (scores, rows) of the float32 query vectors `q` over every stored vector
    (chunked); k = K + 1 by default, so the report can tell how often ranks K and K+1 tie."""
    from sleuth.retrieval.sharded import merge_topk

    vectors = _stored_vectors(args)
    best_s = np.full((len(q), k), -np.inf, np.float32)
    best_i = np.full((len(q), k), -1, np.int64)
    for start in range(0, vectors.shape[0], 262144):
        block = np.asarray(vectors[start : start + 262144], dtype=np.float32)
        scores = q @ block.T
        kk = min(k, block.shape[0])
        top = np.argpartition(-scores, kk - 1, axis=1)[:, :kk]
        best_s, best_i = merge_topk([best_s, np.take_along_axis(scores, top, 1)], [best_i, top + start], k)
    return best_s, best_i


def recall_vs_exact(
    found_rows: np.ndarray,
    found_scores: np.ndarray,
    exact_rows: np.ndarray,
    exact_scores_: np.ndarray,
    k: int = K,
    eps: float = TIE_EPS,
) -> tuple[float, float]:
    """(set overlap, tie-aware) recall@k of a search against exact search, averaged over queries.

    Set overlap: the share of the exact top-k rows returned. Tie-aware (ann-benchmarks' k-NN recall): a
    returned row counts when its exact score (`found_scores`, recomputed from the vectors) is at least the
    k-th exact score - `eps`, so a passage tied with the exact k-th one counts whichever of them a search
    keeps; it is never below set overlap when `found_scores` are exact. Rows are (queries, >= k); -1 = none."""
    found_rows, exact_rows = np.asarray(found_rows)[:, :k], np.asarray(exact_rows)[:, :k]
    overlap = [
        len(set(f[f >= 0].tolist()) & set(e[e >= 0].tolist())) / k
        for f, e in zip(found_rows, exact_rows, strict=True)
    ]
    kth = np.asarray(exact_scores_, dtype=np.float32)[:, k - 1 : k]
    hits = (np.asarray(found_scores)[:, :k] >= kth - eps) & (found_rows >= 0)
    return float(np.mean(overlap)), float(np.mean(hits.sum(axis=1) / k))


def rows_of_ids(store: Any, ids: list[list[str]]) -> np.ndarray:
    """Docstore rows of passage ids (ragged lists padded with -1). A corpus whose ids are the row numbers
    (every synthetic corpus) needs no id map; any other builds the docstore's (see DocStore.get_by_ids)."""
    width = max((len(r) for r in ids), default=0)
    out = np.full((len(ids), max(width, 1)), -1, np.int64)
    flat = [i for r in ids for i in r]
    guess = [int(i) if i.isdigit() and int(i) < store.num_docs else -1 for i in flat]
    if all(g >= 0 for g in guess) and store.ids(guess) == flat:
        rows = guess
    else:
        rows = [-1 if r is None else r for r in store.rows(flat)]
    it = iter(rows)
    for q, r in enumerate(ids):
        for j in range(len(r)):
            out[q, j] = next(it)
    return out


def exact_ties(exact_s: np.ndarray, k: int = K, eps: float = TIE_EPS) -> float:
    """Share of queries whose exact (k+1)-th score is within `eps` of the k-th: set overlap with exact
    search is then arbitrary for that query, whichever tied passage each search keeps."""
    return float(np.mean(exact_s[:, k] >= exact_s[:, k - 1] - eps))


def nprobe_sweep(
    args: argparse.Namespace, vectors: np.ndarray, exact: tuple[np.ndarray, np.ndarray]
) -> list[dict[str, Any]]:
    """The index searched in this process at each --sweep-nprobe x --sweep-rerank for the float32 query
    `vectors`: recall@5 against exact search (set overlap and tie-aware) and the search's own q/s (queries
    encoded beforehand, batches of 256, re-ranking included): the recall / speed trade-off a user picks
    nprobe and the re-rank depth from, and whether one setting meets both targets where the served one
    did not."""
    from sleuth.retrieval import load_retriever
    from sleuth.retrieval.sharded import exact_scores

    cores = len(os.sched_getaffinity(0))
    retriever = load_retriever(args.work / "ivf", threads=cores)
    stored = _stored_vectors(args)
    rows = []
    for rerank in args.sweep_rerank or [retriever.rerank]:
        retriever.rerank = rerank
        for nprobe in args.sweep_nprobe:
            retriever.set_search_params(nprobe=nprobe)
            retriever.search_vectors(vectors[:256], K)  # warm-up: touches the probed lists once
            t0 = time.perf_counter()
            found = np.concatenate(
                [retriever.search_vectors(vectors[i : i + 256], K)[1] for i in range(0, len(vectors), 256)]
            )
            seconds = time.perf_counter() - t0
            overlap, tie_aware = recall_vs_exact(
                found, exact_scores(stored, vectors, found), exact[1], exact[0]
            )
            rows.append(
                {
                    "nprobe": nprobe,
                    "rerank": rerank,
                    "recall_at_5_vs_exact": round(overlap, 4),
                    "recall_at_5_vs_exact_tie_aware": round(tie_aware, 4),
                    "search_qps_in_process": round(len(vectors) / seconds, 1),
                    "threads": cores,
                }
            )
    retriever.close()
    return rows


def served_batch_phases(args: argparse.Namespace, questions: list[str], batches: int = 4) -> dict[str, Any]:
    """Where one server worker's 256-query batch goes: the index loaded in this process with the served
    settings (--threads, nprobe, re-rank depth) and each phase of a request timed on its own (median ms over
    `batches` batches after a warm-up): query encoding, the IVF-PQ scan, the exact re-rank, the docstore
    lookups and the response's JSON. Their sum is a worker's CPU time a batch but for HTTP; the cores over it
    bound the batched q/s the server can reach with every core busy."""
    import torch

    from sleuth.retrieval import load_retriever
    from sleuth.retrieval._common import hits_from_rows
    from sleuth.retrieval.server import encode_result

    torch.set_num_threads(args.threads)  # as each server worker (serve-retriever --threads)
    retriever = load_retriever(
        args.work / "ivf",
        threads=args.threads,
        rerank=served_rerank(args),
        **({"nprobe": args.serve_nprobe} if args.serve_nprobe else {}),
    )
    depth = retriever.rerank
    times: dict[str, list[float]] = {k: [] for k in ("encode", "scan", "rerank", "docstore", "json")}
    for b in range(batches + 1):
        batch = [questions[(b * 256 + i) % len(questions)] for i in range(256)]
        t0 = time.perf_counter()
        vectors = retriever.encoder.encode_queries(batch)
        t1 = time.perf_counter()
        retriever.rerank = 0
        retriever.search_vectors(vectors, max(K, depth))
        t2 = time.perf_counter()
        retriever.rerank = depth
        scores, rows = retriever.search_vectors(vectors, K)
        t3 = time.perf_counter()
        hits = hits_from_rows(
            retriever.docstore,
            [r[r >= 0] for r in rows],
            [s[r >= 0] for s, r in zip(scores, rows, strict=True)],
        )
        t4 = time.perf_counter()
        encode_result(hits, True)
        t5 = time.perf_counter()
        if b:  # the first batch warms the probed lists, the encoder and the reads
            for key, seconds in zip(
                times, (t1 - t0, t2 - t1, (t3 - t2) - (t2 - t1), t4 - t3, t5 - t4), strict=True
            ):
                times[key].append(seconds)
    retriever.close()
    ms = {key: round(1000 * float(np.median(v)), 1) for key, v in times.items()}
    total = sum(ms.values())
    cores = len(os.sched_getaffinity(0))
    return {
        "threads": args.threads,
        "rerank": depth,
        "batches": batches,
        "phase_ms": ms,
        "total_ms": round(total, 1),
        "qps_bound_all_cores": round(cores * 256 / (args.threads * total / 1000), 1),
        "cores": cores,
        "note": "median ms a 256-query batch per phase (scan: IVF-PQ search alone; rerank: the search with the "
        "exact re-rank minus the scan); qps_bound_all_cores: cores x 256 / (threads x total), "
        "a worker's threads counted busy for the whole batch",
    }


def served_rerank(args: argparse.Namespace) -> int:
    from sleuth.retrieval.sharded import DEFAULT_RERANK

    return DEFAULT_RERANK if args.serve_rerank is None else args.serve_rerank


def stage_dense_serve(args: argparse.Namespace) -> dict[str, Any]:
    t0, load0 = time.perf_counter(), os.getloadavg()
    from sleuth.retrieval.docstore import DocStore
    from sleuth.retrieval.sharded import exact_scores

    store = DocStore(args.work / "ivf" / "docstore")
    # A sample covers only some gold passages; the whole corpus covers all (no 21M-id set in memory).
    covered = (
        None
        if store.num_docs >= _corpus_passages(args)
        else {
            i
            for start in range(0, store.num_docs, 65536)
            for i in store.ids(range(start, min(start + 65536, store.num_docs)))
        }
    )
    fields, singles, hits = serve_and_measure(args, args.work / "ivf", "dense", covered)
    # encoded once, for the exact search and the sweep (the server encodes its own)
    query_vectors = _encoder(None).encode_queries([q["question"] for q in singles]).astype(np.float32)
    exact = exact_search(args, query_vectors)
    served = rows_of_ids(store, [[_hit_id(h) for h in hs] for hs in hits])
    overlap, tie_aware = recall_vs_exact(
        served, exact_scores(_stored_vectors(args), query_vectors, served), exact[1], exact[0]
    )
    encode = (
        json.loads((args.work / "stages" / "encode.json").read_text())
        if (args.work / "stages" / "encode.json").exists()
        else {}
    )
    sweep = nprobe_sweep(args, query_vectors, exact) if args.sweep_nprobe else []
    phases = served_batch_phases(args, [q["question"] for q in _questions(args.work)])
    return stage_record(
        "dense-serve",
        args,
        t0,
        load0,
        **fields,
        recall_at_5_vs_exact=round(overlap, 4),
        recall_at_5_vs_exact_tie_aware=round(tie_aware, 4),
        tie_eps=TIE_EPS,
        exact_ties_at_5=round(exact_ties(exact[0]), 4),
        exact_questions=len(exact[0]),
        nprobe=args.serve_nprobe or args.nprobe,
        rerank=served_rerank(args),
        nprobe_sweep=sweep,
        served_batch_phases=phases,
        sample=encode.get("sample"),
        note=encode.get("note"),
    )


# ---------------------------------------------------------------------------------------------------
# Report


def report(args: argparse.Namespace) -> dict[str, Any]:
    stages, skipped = {}, {}
    for name in STAGES:
        path = args.work / "stages" / f"{name}.json"
        if path.exists():
            stages[name] = json.loads(path.read_text())
        elif (args.work / "stages" / f"{name}{SKIPPED}").exists():
            skipped[name] = (args.work / "stages" / f"{name}{SKIPPED}").read_text().strip()
    # The docstore-only build is needed only when no BM25 build wrote the docstore.
    not_needed = {"docstore-build"} if "bm25-build" in stages else set()
    result = {
        "bench": "retrieval_scale",
        "machine": machine(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "stages": stages,
        "skipped_stages": skipped,
        "missing_stages": [s for s in STAGES if s not in stages and s not in skipped and s not in not_needed],
    }
    path = out_path(args.out, "retrieval_scale.json")
    write_json(path, result)
    print_table(result)
    print(f"wrote {path}")
    return result


def _gb(n: Any) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GB" if n >= 2**30 else f"{n / 2**20:.1f} MB"


def print_table(result: dict[str, Any]) -> None:
    s = result["stages"]
    rows: list[tuple[str, str]] = [
        (
            "machine",
            f"{result['machine']['cpu']} x{result['machine']['cpus']}, "
            f"{_gb(result['machine']['memory_bytes'])}, GPU {result['machine']['gpu']}",
        )
    ]
    if "synth" in s:
        x = s["synth"]
        rows += [
            (
                "corpus",
                f"{x['passages']:,} passages, {_gb(x['corpus_bytes'])}, {x['seconds']} s "
                f"({x['workers']} workers), peak anon {_gb(x['peak_anon_bytes'])}",
            )
        ]
    if "docstore-build" in s:
        x = s["docstore-build"]
        rows += [
            (
                "docstore build",
                f"{x['passages']:,} passages, {x['seconds']} s ({x['workers']} workers), "
                f"peak RSS {_gb(x['peak_rss_bytes'])} (anon {_gb(x['peak_anon_bytes'])}), "
                f"docstore {_gb(x['docstore_bytes'])}",
            )
        ]
    for key, label in (("bm25-build", "BM25 build"), ("ivfpq-build", "IVF-PQ build")):
        if key in s:
            x = s[key]
            size = x.get("index_bytes", x.get("faiss_bytes"))
            rows += [
                (
                    label,
                    f"{x['passages']:,} passages, {x['seconds']} s, peak RSS {_gb(x['peak_rss_bytes'])} "
                    f"(anon {_gb(x['peak_anon_bytes'])}), index {_gb(size)}",
                )
            ]
    if "encode" in s:
        x = s["encode"]
        rows += [
            (
                "encode",
                f"{x['passages']:,} passages on {','.join(x['devices'])} ({x['workers']} processes), "
                f"{x['passages_per_second']:,} /s, {x['seconds']} s" + (" (sample)" if x["sample"] else ""),
            )
        ]
    for key, label in (("bm25-serve", "BM25 serve"), ("dense-serve", "IVF-PQ serve")):
        if key in s:
            x = s[key]
            many = next(v for k, v in x.items() if k.startswith("qps_batch256_") and k.endswith("_clients"))
            text = (
                f"cold start {x['cold_start_seconds']} s, q/s@256 {x['qps_batch256_one_client']:,} "
                f"({many:,} with {x['batch_clients']} clients), p50/p99@16 {x['latency_p50_ms']}/"
                f"{x['latency_p99_ms']} ms, RSS {_gb(x['rss_after_load_bytes'])} (anon "
                f"{_gb(x['anon_after_load_bytes'])}"
                + (f", PSS {_gb(x['pss_after_load_bytes'])}" if "pss_after_load_bytes" in x else "")
                + (
                    f", anon PSS {_gb(x['pss_anon_after_load_bytes'])}"
                    if "pss_anon_after_load_bytes" in x
                    else ""
                )
                + f"), gold R@5 {x['gold_recall_at_5_single_hop']}"
            )
            if "recall_at_5_vs_exact" in x:
                text += f", R@5 vs exact {x['recall_at_5_vs_exact']}"
                if "recall_at_5_vs_exact_tie_aware" in x:
                    text += (
                        f" (tie-aware {x['recall_at_5_vs_exact_tie_aware']}; exact 6th within {x['tie_eps']} "
                        f"of the 5th for {x['exact_ties_at_5']:.0%} of queries)"
                    )
            if x.get("nprobe_sweep"):
                text += "; nprobe[/rerank]: R@5 vs exact[/tie-aware], search q/s: " + ", ".join(
                    f"{r['nprobe']}"
                    + (f"/{r['rerank']}" if "rerank" in r else "")
                    + f": {r['recall_at_5_vs_exact']}"
                    + (
                        f"/{r['recall_at_5_vs_exact_tie_aware']}"
                        if "recall_at_5_vs_exact_tie_aware" in r
                        else ""
                    )
                    + f", {r['search_qps_in_process']:,}"
                    for r in x["nprobe_sweep"]
                )
            rows += [(label, text)]
    rows += [(name, f"skipped: {why}") for name, why in result.get("skipped_stages", {}).items()]
    width = max(len(r[0]) for r in rows)
    print("\n".join(f"{a:<{width}}  {b}" for a, b in rows))


# ---------------------------------------------------------------------------------------------------


RUNNERS = {
    "synth": stage_synth,
    "docstore-build": stage_docstore_build,
    "bm25-build": stage_bm25_build,
    "bm25-serve": stage_bm25_serve,
    "encode": stage_encode,
    "ivfpq-build": stage_ivfpq_build,
    "dense-serve": stage_dense_serve,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "stage",
        choices=[*STAGES, "dense-corpus", "report", "all"],
        help="dense-corpus: only cut the dense sample's corpus (so the full corpus can be deleted)",
    )
    p.add_argument("--work", type=Path, required=True, help="Work folder (corpus, indexes, stages/*.json).")
    p.add_argument(
        "--out", default=None, help="Result JSON (default $OUT/ or bench/results/retrieval_scale.json)."
    )
    p.add_argument("--size", type=int, default=2_000_000, help="Corpus passages (world + distractors).")
    p.add_argument("--world-passages", type=int, default=20_000, help="The world's own passages (gold).")
    p.add_argument("--questions", type=int, default=2_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="Processes for synth, the docstore and the BM25 build.",
    )
    p.add_argument("--shard-docs", type=int, default=250_000)
    p.add_argument(
        "--threads", type=int, default=1, help="serve-retriever --threads (and IVF-PQ build threads)."
    )
    p.add_argument("--worker-threads", type=int, default=1, help="serve-retriever --worker-threads.")
    p.add_argument("--server-workers", type=int, default=1, help="serve-retriever --workers (processes).")
    p.add_argument(
        "--batch-requests", type=int, default=40, help="Requests of 256 queries per q/s measurement."
    )
    p.add_argument(
        "--batch-clients",
        type=int,
        default=None,
        help="Clients sending batches of 256 at once for the batched q/s (default: --server-workers, "
        "so every server worker is busy: the server's saturated rate; one client is measured too).",
    )
    p.add_argument("--latency-seconds", type=float, default=20.0)
    p.add_argument("--recall-questions", type=int, default=500)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument(
        "--drop-cache", action="store_true", help="Drop the page cache before each server start (root)."
    )
    p.add_argument(
        "--dense-size",
        type=int,
        default=None,
        help="Passages the dense index covers (the first N; default: the whole corpus, which reuses "
        "the BM25 build's docstore).",
    )
    p.add_argument(
        "--devices",
        "--device",
        dest="devices",
        default="cpu",
        help="Encode stage: 'all' (one process per visible GPU), 'cuda:0,cuda:1', or 'cpu' / 'cpu,cpu'.",
    )
    p.add_argument(
        "--encode-batch", type=int, default=None, help="Encoder batch (default 512 on GPUs, 64 on CPU)."
    )
    p.add_argument(
        "--procs-per-gpu",
        type=int,
        default=None,
        help="Encode stage: worker processes per GPU (default: cores / GPUs).",
    )
    p.add_argument(
        "--encode-chunk",
        type=int,
        default=16384,
        help="Passages a worker reads and sorts by length at a time.",
    )
    p.add_argument("--nlist", type=int, default=None, help="IVF lists (default: power of 2 near 4 sqrt(N)).")
    p.add_argument("--pq-m", type=int, default=48)
    p.add_argument(
        "--pq-nbits",
        type=int,
        choices=(4, 8),
        default=8,
        help="Bits per PQ code; 4 stores the codes in faiss's fast-scan layout (SIMD scan: pair it with "
        "twice --pq-m for the same bytes a vector).",
    )
    p.add_argument(
        "--train-sample",
        type=int,
        default=None,
        help="IVF-PQ training vectors (default 64 x nlist; training time grows with it x nlist).",
    )
    p.add_argument("--nprobe", type=int, default=32)
    p.add_argument(
        "--serve-nprobe",
        type=int,
        default=None,
        help="dense-serve: serve-retriever --nprobe (default: the index's, --nprobe at build time)",
    )
    p.add_argument(
        "--serve-rerank",
        type=int,
        default=None,
        help="dense-serve: serve-retriever --rerank, exact re-rank depth (default: the library's, 64)",
    )
    p.add_argument(
        "--sweep-nprobe",
        type=int,
        nargs="*",
        default=[16, 32, 64, 128],
        help="dense-serve: also search in process at each of these nprobe values (recall@5 vs exact, q/s)",
    )
    p.add_argument(
        "--sweep-rerank",
        type=int,
        nargs="*",
        default=[],
        help="dense-serve: the sweep's exact re-rank depths (candidates per query; default: the served "
        "one, sleuth.retrieval.sharded.DEFAULT_RERANK); each runs every --sweep-nprobe value",
    )
    p.add_argument(
        "--ivf-device",
        default="auto",
        help="IVF-PQ build: where the coarse k-means and list assignment run (auto: a GPU when torch "
        "sees one; cpu: faiss alone; torch-cpu; cuda[:N]). Phase seconds go in the stage JSON.",
    )
    p.add_argument("--shards", type=int, default=1)
    args = p.parse_args(argv)
    for name in (
        "size",
        "workers",
        "shard_docs",
        "threads",
        "worker_threads",
        "server_workers",
        "batch_requests",
        "batch_clients",
        "recall_questions",
        "dense_size",
        "pq_m",
        "nprobe",
        "shards",
        "encode_batch",
        "encode_chunk",
        "procs_per_gpu",
        "train_sample",
    ):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.sweep_nprobe):
        p.error(f"--sweep-nprobe values must be >= 1, got {args.sweep_nprobe}")
    if (
        args.serve_nprobe is not None
        and args.serve_nprobe < 1
        or args.serve_rerank is not None
        and args.serve_rerank < 0
    ):
        p.error(
            f"--serve-nprobe must be >= 1 and --serve-rerank >= 0, got {args.serve_nprobe}, {args.serve_rerank}"
        )
    if any(n < 0 for n in args.sweep_rerank):
        p.error(f"--sweep-rerank values must be >= 0, got {args.sweep_rerank}")
    if args.batch_clients is None:
        args.batch_clients = args.server_workers
    args.work.mkdir(parents=True, exist_ok=True)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.stage == "report":
        report(args)
        return
    if args.stage == "dense-corpus":
        print(_dense_corpus(args))
        return
    # `all` builds BM25, whose build writes the docstore: the docstore-only stage is for dense-only runs.
    for name in [s for s in STAGES if s != "docstore-build"] if args.stage == "all" else [args.stage]:
        save_stage(args.work, RUNNERS[name](args))
    if args.stage == "all":
        report(args)


if __name__ == "__main__":
    main()
