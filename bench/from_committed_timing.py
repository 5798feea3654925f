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

from sleuth.agent.registry import get_method
from sleuth.agent.searcher import load_searcher
from sleuth.claims.profiles import GPU_PIPELINE
from sleuth.claims.steps import eval_config
from sleuth.data.formats import read_qa_jsonl
from sleuth.eval.harness import evaluate
from sleuth.llm.hf import cpu_dtype


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", required=True, type=Path, help="a `sleuth synth` world with its bm25 index")
    p.add_argument("--checkpoint", default=str(Path(__file__).parents[1] / "checkpoints" / "r_search"))
    p.add_argument("--method", default="r_search")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--questions", type=int, default=32)
    p.add_argument("--out", type=Path, default=Path("runs/from_committed_timing"))
    args = p.parse_args()
    display = get_method(args.method).display_name
    config = eval_config(GPU_PIPELINE, args.method, args.checkpoint)  # the budgets a gpu claim evaluates with
    questions = read_qa_jsonl(args.world / "test.jsonl")[: args.questions]
    with cpu_dtype(None if args.dtype == "float32" else args.dtype):
        generator = load_searcher(args.checkpoint, device="cpu").generator
        start = time.perf_counter()
        summary = evaluate(
            [display], questions, args.world / "bm25", generator, out_dir=args.out / args.dtype, config=config
        )
        seconds = time.perf_counter() - start
    overall = summary["methods"][display]["overall"]
    row = {"dtype": args.dtype, "threads": torch.get_num_threads(), "seconds": round(seconds, 1)}
    row.update(
        {k: overall.get(k) for k in ("n", "em", "f1", "retrieval_count", "input_tokens", "output_tokens")}
    )
    print(json.dumps(row))


if __name__ == "__main__":
    main()
