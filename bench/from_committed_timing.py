"""Issue 42 item 5: how long one committed arm's evaluation takes on this CPU, as `sleuth reproduce --from-committed`
runs it (the gpu profile's budgets), in float32 or in bf16 (`sleuth.llm.hf.cpu_dtype`). Prints one JSON line.

    sleuth synth --out W --passages 2000 --questions 300 --seed 0 && sleuth index W/corpus.jsonl --out W/bm25
    PYTHONPATH=src python bench/from_committed_timing.py --world W --dtype bfloat16   (then --dtype float32)

Measured on the 2-core box (2026-11-29, bench/results/from_committed_cpu_dtype.json): checkpoints/r_search on 30
questions, 236.6 s in float32, 127.6 s in bf16 (1.85x).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import sleuth.api as sl
from sleuth.agent.searcher import load_searcher
from sleuth.llm.hf import cpu_dtype


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", required=True, type=Path, help="a `sleuth synth` world with its bm25 index")
    p.add_argument("--checkpoint", default=str(Path(__file__).parents[1] / "checkpoints" / "r_search"))
    p.add_argument("--method", default="r-search")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--questions", type=int, default=32)
    p.add_argument("--out", type=Path, default=Path("runs/from_committed_timing"))
    args = p.parse_args()
    with cpu_dtype(None if args.dtype == "float32" else args.dtype):
        generator = load_searcher(args.checkpoint, device="cpu").generator
        start = time.perf_counter()
        summary = sl.evaluate(
            [args.method], str(args.world / "test.jsonl"), retriever=str(args.world / "bm25"), model=generator,
            out_dir=args.out / args.dtype, limit=args.questions, batch_size=128, max_new_tokens=128,
            answer_max_new_tokens=24, top_k=3, max_turns=4, max_response_tokens=2048, max_obs_tokens=384,
        )  # fmt: skip
        seconds = time.perf_counter() - start
    overall = summary["methods"][args.method]["overall"]
    row = {"dtype": args.dtype, "threads": torch.get_num_threads(), "seconds": round(seconds, 1)}
    row.update(
        {k: overall.get(k) for k in ("n", "em", "f1", "retrieval_count", "input_tokens", "output_tokens")}
    )
    print(json.dumps(row))


if __name__ == "__main__":
    main()
