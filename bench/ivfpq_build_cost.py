"""What the IVF-PQ build of `sleuth index --faiss ivfpq --embeddings F --shards S --keep-vectors` costs,
phase by phase, on this machine (issue 24: is the 21M build feasible within a lease on 16 cores?).

It runs the phases of `sleuth.retrieval.sharded.build_sharded_faiss` on N synthetic unit vectors
(a mixture of Gaussian clusters, float16 on disk like `encode_docstore`'s file) with the nlist that
bench/retrieval_scale.py picks for N (power of 2 near 4 sqrt(N)) and its default training sample
(64 x nlist): copy the embeddings into the index's float16 vectors file, train the coarse quantizer
and the product quantizer, add every vector in chunks. Faiss costs depend on N, nlist and the
dimension, not on what the vectors mean, so synthetic vectors time the real build.

    OMP_NUM_THREADS=2 PYTHONPATH=src python bench/ivfpq_build_cost.py --sizes 200000 1000000 --threads 2
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
from sleuth.retrieval.sharded import ADD_CHUNK, default_train_sample


def nlist_for(n: int) -> int:
    """bench/retrieval_scale.py's default."""
    return max(16, min(65536, 1 << round(math.log2(4 * n**0.5))))


def write_vectors(path: Path, n: int, dim: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((4096, dim)).astype(np.float32)
    out = np.memmap(path, dtype=np.float16, mode="w+", shape=(n, dim))
    for start in range(0, n, 65536):
        rows = min(65536, n - start)
        v = centers[rng.integers(0, len(centers), rows)] + 0.7 * rng.standard_normal((rows, dim), dtype=np.float32)
        out[start : start + rows] = v / np.linalg.norm(v, axis=1, keepdims=True)
    out.flush()


def measure(n: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import faiss

    dim, pq_m, shards = args.dim, args.pq_m, args.shards
    params = faiss_params("ivfpq", nlist=args.nlist or nlist_for(n), m=pq_m, nbits=8, nprobe=32)
    src = work / f"emb-{n}.f16"
    write_vectors(src, n, dim)
    embeddings = np.memmap(src, dtype=np.float16, mode="r", shape=(n, dim))
    t0 = time.perf_counter()
    # Phase 1, as build_sharded_faiss does with an embeddings file: float32 chunks into the float16 spool.
    spool = np.memmap(work / "vectors.f16", dtype=np.float16, mode="w+", shape=(n, dim))
    for start in range(0, n, 65536):
        spool[start : start + 65536] = np.asarray(embeddings[start : start + 65536], dtype=np.float32)
    spool.flush()
    t1 = time.perf_counter()
    template = new_faiss_index(dim, params, n)
    n_train = min(n, args.train_sample or default_train_sample(params))
    sample = np.sort(np.random.default_rng(0).choice(n, size=n_train, replace=False))
    template.train(spool[sample].astype(np.float32))
    t2 = time.perf_counter()
    bounds = np.linspace(0, n, shards + 1).astype(int)
    for s in range(shards):
        index = faiss.clone_index(template)
        for start in range(bounds[s], bounds[s + 1], ADD_CHUNK):
            index.add(np.ascontiguousarray(spool[start : min(start + ADD_CHUNK, bounds[s + 1])], dtype=np.float32))
        faiss.write_index(index, str(work / f"shard-{s}.faiss"))
        del index
    t3 = time.perf_counter()
    for f in work.iterdir():
        f.unlink()
    return {"vectors": n, "dim": dim, "nlist": params["nlist"], "pq_m": pq_m, "train_sample": n_train,
            "shards": shards, "copy_seconds": round(t1 - t0, 2), "train_seconds": round(t2 - t1, 2),
            "add_seconds": round(t3 - t2, 2), "total_seconds": round(t3 - t0, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[200_000, 1_000_000])
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--pq-m", type=int, default=48)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--nlist", type=int, default=None, help="Default: retrieval_scale.py's choice for each size.")
    p.add_argument("--train-sample", type=int, default=None, help="Default: 64 x nlist (the build's default).")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import faiss

    faiss.omp_set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ivfpq-cost-") as tmp:
        for n in args.sizes:
            rows.append(measure(n, args, Path(tmp)))
            print(rows[-1], flush=True)
    result = {"bench": "ivfpq_build_cost", "threads": args.threads, "cpu": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "load_average_after": os.getloadavg(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "rows": rows}
    write_json(out_path(args.out, "ivfpq_build_cost.json"), result)


if __name__ == "__main__":
    main()
