"""Issue 24: the exact re-rank's cost of reading candidate vectors, memory-mapped and released vs positional reads.

A 21M x 384 float16 vectors file (a sparse file by default: its holes read as zero pages from the page cache, so
the cost is that of page-cache reads, as on a warm server) and 256 queries a batch with `depth` random candidate
rows each, scored by `sleuth.retrieval.sharded.exact_scores`:
- `map+release`: the rows read through a read-only map, then `MappedFile.release` (what a server did after every
  re-rank before `RowFile`: each fault maps 16 neighbouring pages, which the release unmaps again);
- `rowfile`: `sleuth.retrieval.mapped.RowFile`, one pread a row, nothing mapped.
Also the process's mapped-file pages (RssFile) one batch leaves behind without a release.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/rerank_read_cost.py [--rows 21000000] [--file PATH]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from _common import environment, out_path, write_json  # type: ignore[import-not-found]
from sleuth.retrieval.mapped import MappedFile, RowFile
from sleuth.retrieval.sharded import exact_scores


def rss_file_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=21_000_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--depths", type=int, nargs="+", default=[64, 256])
    parser.add_argument(
        "--batches", type=int, default=8, help="timed batches per setting (the first 3 are warm-up)"
    )
    parser.add_argument(
        "--file", type=Path, help="an existing float16 vectors file (default: a sparse temp file)"
    )
    parser.add_argument(
        "--out", help="the JSON to write (default $OUT or bench/results/rerank_read_cost_cpu.json)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.file or Path(tmp) / "vectors.f16"
        if args.file is None:
            with open(path, "wb") as handle:
                handle.truncate(args.rows * args.dim * 2)
        shape = (args.rows, args.dim)
        mapped = MappedFile(path)
        array, rows_file = mapped.array(np.float16, shape), RowFile(path, np.float16, shape)
        rng = np.random.default_rng(0)
        queries = rng.standard_normal((256, args.dim)).astype(np.float32)
        rows_file[np.arange(4)]  # compiles the read loop before timing
        results = []
        for depth in args.depths:
            for name in ("map+release", "rowfile"):
                times, left = [], []
                for _ in range(args.batches):
                    candidates = rng.integers(0, args.rows, (256, depth))
                    before = rss_file_mib()
                    start = time.perf_counter()
                    exact_scores(rows_file if name == "rowfile" else array, queries, candidates)
                    left.append(rss_file_mib() - before)
                    if name == "map+release":
                        mapped.release()
                    times.append(time.perf_counter() - start)
                timed = times[3:] or times
                results.append(
                    {
                        "depth": depth,
                        "path": name,
                        "ms_per_batch_median": 1000 * float(np.median(timed)),
                        "rows_per_batch": 256 * depth,
                        "mapped_mib_left_per_batch": float(np.median(left)),
                    }
                )
    print(f"{'depth':>6} {'path':>12} {'ms / 256 queries':>17} {'RssFile MiB a batch maps':>25}")
    for r in results:
        print(
            f"{r['depth']:>6} {r['path']:>12} {r['ms_per_batch_median']:>17.1f} {r['mapped_mib_left_per_batch']:>25.0f}"
        )
    write_json(
        out_path(args.out, "rerank_read_cost_cpu.json"),
        {
            "bench": "rerank_read_cost",
            "environment": environment("cpu"),
            "rows": args.rows,
            "dim": args.dim,
            "sparse_file": args.file is None,
            "omp_threads": os.environ.get("OMP_NUM_THREADS"),
            "load_average": os.getloadavg(),
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
