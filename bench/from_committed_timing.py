"""Issue 42 item 5: how long one committed arm's evaluation takes on this CPU, as `sleuth reproduce --from-committed`
runs it (the gpu profile's budgets), in float32 or in bf16 (`sleuth.llm.hf.cpu_dtype`), with sleuth's decode engine
(`--cache engine`, what the check uses: each turn prefills only its new tokens) or the dynamic cache (`--cache
dynamic`, the check before: every turn's whole context encoded again). Prints one JSON line; `--against DIR` adds
how many responses equal those of an earlier run's predictions (DIR: its --out/<dtype>-<cache>).

    sleuth synth --out W --passages 2000 --questions 300 --seed 0 && sleuth index W/corpus.jsonl --out W/bm25
    PYTHONPATH=src python bench/from_committed_timing.py --world W --cache dynamic --questions 30
    PYTHONPATH=src python bench/from_committed_timing.py --world W --questions 30 --against runs/from_committed_timing/bfloat16-dynamic

Measured on the 2-core box (2026-11-29, bench/results/from_committed_cpu_dtype.json): checkpoints/r_search on 30
questions with the dynamic cache, 236.6 s in float32, 127.6 s in bf16 (1.85x); the engine:
bench/results/from_committed_cpu_engine.json. Run it with OMP_WAIT_POLICY=PASSIVE, as `check_committed` sets it before
torch loads (this script loads torch on import): spinning OpenMP threads made both r_search arms 594-611 s instead of 469 s.
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
from sleuth.llm.hf import cpu_cache, cpu_dtype


def responses(predictions: Path) -> dict[str, str]:
    """Question id -> the decoded response (policy turns and inserted documents) of a predictions file."""
    rows = (json.loads(line) for line in predictions.read_text().splitlines() if line.strip())
    return {r["id"]: r["trajectory"]["response_text"] for r in rows}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", required=True, type=Path, help="a `sleuth synth` world with its bm25 index")
    p.add_argument("--checkpoint", default=str(Path(__file__).parents[1] / "checkpoints" / "r_search"))
    p.add_argument("--method", default="r_search")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--questions", type=int, default=32)
    p.add_argument("--cache", default="engine", choices=["engine", "dynamic"])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--against", type=Path, help="an earlier run's output folder: count the equal responses")
    p.add_argument("--out", type=Path, default=Path("runs/from_committed_timing"))
    p.add_argument(
        "--arms",
        type=int,
        default=1,
        help="evaluate the checkpoint this many times in one process, each loaded again, as the check evaluates a "
        "claim's decisive arms one after the other (2: r_search's two arms); seconds then count the loads too",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    display = get_method(args.method).display_name
    config = eval_config(GPU_PIPELINE, args.method, args.checkpoint)  # the budgets a gpu claim evaluates with
    questions = read_qa_jsonl(args.world / "test.jsonl")[: args.questions]
    out = args.out / f"{args.dtype}-{args.cache}"
    total_start = time.perf_counter()
    with cpu_dtype(None if args.dtype == "float32" else args.dtype), cpu_cache(args.cache):
        for arm in range(args.arms):
            generator = load_searcher(args.checkpoint, device="cpu").generator
            start, cpu_start = time.perf_counter(), time.process_time()
            arm_out = out if arm == 0 else out.with_name(f"{out.name}-arm{arm + 1}")
            summary = evaluate(
                [display], questions, args.world / "bm25", generator, out_dir=arm_out, config=config
            )
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    total_seconds = time.perf_counter() - total_start
    overall = summary["methods"][display]["overall"]
    row = {"dtype": args.dtype, "cache": generator.cache_kind, "threads": torch.get_num_threads()}
    row.update({"seconds": round(seconds, 1), "cpu_seconds": round(cpu_seconds, 1)})  # the last arm's
    if args.arms > 1:
        row.update({"arms": args.arms, "all_arms_seconds": round(total_seconds, 1)})
    row.update(
        {k: overall.get(k) for k in ("n", "em", "f1", "retrieval_count", "input_tokens", "output_tokens")}
    )
    if args.against is not None:
        here = responses(out / display / "predictions.jsonl")
        there = responses(args.against / display / "predictions.jsonl")
        row["against"] = str(args.against)
        row["same_response"] = sum(here[i] == there.get(i) for i in here)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
