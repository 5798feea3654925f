"""Speed and memory of the synthetic-world generator (`sleuth synth`).

Each size runs in a fresh child process so peak RSS is per size. Target: 200k passages
(generation + streamed write of all files) in under ~60 s on this machine.

    python bench/bench_synth.py [--sizes 10000 200000] [--questions-ratio 0.1] [--out bench/results/synth.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, sys, tempfile, time
from pathlib import Path
from sleuth.data.synth import generate_world, write_world
n, q = int(sys.argv[1]), int(sys.argv[2])
t0 = time.perf_counter()
world = generate_world(n, q, hops=(1, 4), seed=0)
t1 = time.perf_counter()
with tempfile.TemporaryDirectory() as d:
    write_world(world, d)
    t2 = time.perf_counter()
    size = (Path(d) / "corpus.jsonl").stat().st_size
print(json.dumps({"passages": n, "questions": q, "generate_s": t1 - t0, "write_s": t2 - t1,
                  "total_s": t2 - t0, "corpus_mb": size / 1e6,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 200_000])
    parser.add_argument("--questions-ratio", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=Path("bench/results/synth.json"))
    args = parser.parse_args()

    rows = []
    for n in args.sizes:
        q = max(1, int(n * args.questions_ratio))
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, str(n), str(q)], check=True, capture_output=True, text=True
        )
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))

    header = f"{'passages':>10} {'questions':>10} {'generate s':>11} {'write s':>8} {'total s':>8} {'corpus MB':>10} {'peak RSS MB':>12}"
    print(header)
    for r in rows:
        print(
            f"{r['passages']:>10,} {r['questions']:>10,} {r['generate_s']:>11.2f} {r['write_s']:>8.2f} "
            f"{r['total_s']:>8.2f} {r['corpus_mb']:>10.1f} {r['peak_rss_mb']:>12.0f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "synth", "results": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
