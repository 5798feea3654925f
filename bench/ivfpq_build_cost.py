"""What the IVF-PQ build of `sleuth index --faiss ivfpq --embeddings F --shards S --keep-vectors` costs,
phase by phase, on this machine (issue 24: is the 21M build feasible within a lease on 16 cores?).

It runs the phases of `sleuth.retrieval.sharded.build_sharded_faiss` on N synthetic unit vectors
(a mixture of Gaussian clusters, float16 on disk like `encode_docstore`'s file) with the nlist that
bench/retrieval_scale.py picks for N (power of 2 near 4 sqrt(N)) and its default training sample
(64 x nlist): copy the embeddings into the index's float16 vectors file, train the coarse quantizer
and the product quantizer, add every vector in chunks. Faiss costs depend on N, nlist and the
dimension, not on what the vectors mean, so synthetic vectors time the real build.

`--device` picks the build path (`sleuth.retrieval.ivf_build`; several run one after the other):
`cpu` is faiss alone; `torch-cpu` / `cuda[:N]` train the coarse quantizer with torch k-means and
assign every vector with torch, faiss only training the PQ and encoding the codes. For the assisted
path the add phase is also split into its parts, each timed alone over all N vectors: the list
assignment (torch) and faiss's `add_core` with those lists (PQ codes; wall and CPU seconds, since
the CPU seconds per million vectors are what scales to other core counts).

    OMP_NUM_THREADS=2 PYTHONPATH=src python bench/ivfpq_build_cost.py --sizes 200000 1000000 --threads 2
    OMP_NUM_THREADS=2 PYTHONPATH=src python bench/ivfpq_build_cost.py --sizes 200000 --device cpu torch-cpu
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from _common import out_path, write_json
from sleuth.retrieval.dense import faiss_params, new_faiss_index
from sleuth.retrieval.ivf_build import TORCH_CPU, IvfBuilder, assigned_chunks
from sleuth.retrieval.sharded import default_train_sample, exact_rerank, merge_topk

SPLIT_ROWS = 1 << 20


def nlist_for(n: int) -> int:
    """bench/retrieval_scale.py's default."""
    return max(16, min(65536, 1 << round(math.log2(4 * n**0.5))))


def write_vectors(path: Path, n: int, dim: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((4096, dim)).astype(np.float32)
    out = np.memmap(path, dtype=np.float16, mode="w+", shape=(n, dim))
    for start in range(0, n, 65536):
        rows = min(65536, n - start)
        v = centers[rng.integers(0, len(centers), rows)] + 0.7 * rng.standard_normal(
            (rows, dim), dtype=np.float32
        )
        out[start : start + rows] = v / np.linalg.norm(v, axis=1, keepdims=True)
    out.flush()


def measure(n: int, device: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import faiss

    dim, pq_m, shards = args.dim, args.pq_m, args.shards
    params = faiss_params("ivfpq", nlist=args.nlist or nlist_for(n), m=pq_m, nbits=8, nprobe=32)
    src = work / f"emb-{n}.f16"
    if not src.exists():
        write_vectors(src, n, dim)
    embeddings = np.memmap(src, dtype=np.float16, mode="r", shape=(n, dim))
    builder = IvfBuilder(device, seed=0)
    t0 = time.perf_counter()
    # Phase 1, as build_sharded_faiss does with an embeddings file: float32 chunks into the float16 spool.
    spool = np.memmap(work / "vectors.f16", dtype=np.float16, mode="w+", shape=(n, dim))
    for start in range(0, n, 65536):
        spool[start : start + 65536] = np.asarray(embeddings[start : start + 65536], dtype=np.float32)
    spool.flush()
    t1 = builder.clock("copy", t0)
    template = new_faiss_index(dim, params, n)
    n_train = min(n, args.train_sample or default_train_sample(params))
    sample = np.sort(np.random.default_rng(0).choice(n, size=n_train, replace=False))
    sample_vectors = spool[sample].astype(np.float32)
    builder.clock("sample", t1)
    builder.train(template, sample_vectors)
    del sample_vectors
    bounds = np.linspace(0, n, shards + 1).astype(int)
    for s in range(shards):
        index = faiss.clone_index(template)
        builder.fill(index, spool, int(bounds[s]), int(bounds[s + 1]))
        started = time.perf_counter()
        faiss.write_index(index, str(work / f"shard-{s}.faiss"))
        builder.clock("write", started)
        del index
    total = time.perf_counter() - t0
    record = builder.record()
    row = {
        "vectors": n,
        "dim": dim,
        "nlist": params["nlist"],
        "pq_m": pq_m,
        "train_sample": n_train,
        "shards": shards,
        "path": record["path"],
        "device": record["device"],
        **{f"{k}_seconds": round(v, 2) for k, v in record["seconds"].items()},
        "total_seconds": round(total, 2),
    }
    row.update(recall_at_10(work, spool, bounds))
    if builder.assisted:
        row["kmeans"] = record["kmeans"]
        row.update(split_add(template, spool, builder))
    for f in work.iterdir():
        if f != src:
            f.unlink()
    return row


def recall_at_10(work: Path, spool: np.ndarray, bounds: np.ndarray, queries: int = 200) -> dict[str, float]:
    """Recall@10 against exact inner-product search over the same vectors, for queries near stored vectors:
    IVF-PQ alone (nprobe 32) and with its 64 candidates re-scored exactly (the 21M serving setup)."""
    import faiss

    rng = np.random.default_rng(1)
    q = spool[np.sort(rng.choice(len(spool), queries, replace=False))].astype(np.float32)
    q += 0.05 * rng.standard_normal(q.shape, dtype=np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    best_s, best_i = np.full((queries, 10), -np.inf, np.float32), np.full((queries, 10), -1, np.int64)
    for start in range(0, len(spool), 65536):
        scores = q @ np.asarray(spool[start : start + 65536], dtype=np.float32).T
        ids = np.broadcast_to(np.arange(start, start + scores.shape[1]), scores.shape)
        best_s, best_i = merge_topk([best_s, scores], [best_i, ids], 10)
    parts = []
    for s in range(len(bounds) - 1):
        index = faiss.read_index(str(work / f"shard-{s}.faiss"))
        index.nprobe = 32
        scores, ids = index.search(q, 64)
        parts.append((scores, np.where(ids >= 0, ids + bounds[s], -1)))
    _, candidates = merge_topk([p[0] for p in parts], [p[1] for p in parts], 64)
    _, reranked = exact_rerank(spool, q, candidates, 10)

    def overlap(got: np.ndarray) -> float:
        return round(float(np.mean([len(set(g) & set(e)) / 10 for g, e in zip(got, best_i, strict=True)])), 4)

    return {
        "recall_at_10_nprobe32": overlap(candidates[:, :10]),
        "recall_at_10_nprobe32_rerank64": overlap(reranked),
    }


def split_add(template: Any, spool: np.ndarray, builder: IvfBuilder) -> dict[str, float]:
    """The assisted add phase's two parts, each alone over the first SPLIT_ROWS vectors (held in RAM):
    torch's list assignment (with the float16 read and float32 conversion), and faiss's add_core with
    those lists (the PQ codes)."""
    import faiss
    import torch

    n = min(len(spool), SPLIT_ROWS)
    ivf = faiss.extract_index_ivf(template)
    centroids = torch.as_tensor(ivf.quantizer.reconstruct_n(0, ivf.nlist))
    centroids = centroids.to("cpu" if builder.device == TORCH_CPU else builder.device)
    t0 = time.perf_counter()
    chunks = list(assigned_chunks(spool, 0, n, centroids, builder.device))
    assign_seconds = time.perf_counter() - t0
    index = faiss.clone_index(template)
    ivf = faiss.extract_index_ivf(index)
    t0, c0 = time.perf_counter(), time.process_time()
    for rows, labels in chunks:
        ivf.add_core(len(rows), faiss.swig_ptr(rows), None, faiss.swig_ptr(labels))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "split_rows": n,
        "assign_only_seconds": round(assign_seconds, 2),
        "add_core_only_seconds": round(wall, 2),
        "add_core_only_cpu_seconds": round(cpu, 2),
        "add_core_cpu_seconds_per_million": round(cpu / n * 1e6, 2),
        "assign_seconds_per_million": round(assign_seconds / n * 1e6, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[200_000, 1_000_000])
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--pq-m", type=int, default=48)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument(
        "--nlist", type=int, default=None, help="Default: retrieval_scale.py's choice for each size."
    )
    p.add_argument(
        "--train-sample", type=int, default=None, help="Default: 64 x nlist (the build's default)."
    )
    p.add_argument(
        "--device",
        nargs="+",
        default=["cpu"],
        help="Build paths to time, in turn: cpu (faiss alone), torch-cpu, cuda[:N], auto.",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import faiss
    import torch

    faiss.omp_set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ivfpq-cost-") as tmp:
        for n in args.sizes:
            for device in args.device:
                rows.append(measure(n, device, args, Path(tmp)))
                print(rows[-1], flush=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    result = {
        "bench": "ivfpq_build_cost",
        "threads": args.threads,
        "gpu": gpu,
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_after": os.getloadavg(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
    }
    write_json(out_path(args.out, "ivfpq_build_cost.json"), result)


if __name__ == "__main__":
    main()
