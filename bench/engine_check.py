"""A real checkpoint decoded by sleuth's engine against the transformers static cache, on one GPU: greedy
tokens compared row by row (both also against fp32 through transformers' modules, the reference), and the wall
time of each path (`HFGenerator(cache="auto")` picks the engine).

    PYTHONPATH=src python bench/engine_check.py --model .models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --rows 128 --new-tokens 64

Prompts are the synthetic world's questions in the model's chat template (no world needed: fixed texts).
bf16 on both paths; a greedy tie can flip a token between two correct paths, so the row agreement is
reported, not asserted.
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone

import torch

from _common import out_path, write_json
from sleuth.llm.base import SamplingParams
from sleuth.llm.registry import load_generator

QUESTIONS = [
    "Who founded the {}?",
    "Where is the {} located?",
    "Who is the employer of the founder of the {}?",
    "In which year was the {} established?",
]
NAMES = ["Vrarnny Society", "Loukdzae Laboratories", "Brimmel Institute", "Oskarva Museum", "Tellune Archive"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    texts = [
        QUESTIONS[i % len(QUESTIONS)].format(NAMES[i % len(NAMES)]) + f" (case {i})" for i in range(args.rows)
    ]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)
    result: dict = {
        "bench": "engine_check",
        "model": args.model,
        "rows": args.rows,
        "new_tokens": args.new_tokens,
        "card": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "paths": {},
    }
    outputs = {}
    # fp32 through transformers' own modules is the reference both bf16 paths are compared with
    for cache, dtype in (("engine", "bfloat16"), ("static", "bfloat16"), ("dynamic", "float32")):
        gen = load_generator(args.model, cache=cache, dtype=dtype, max_batch_size=args.rows)
        prompts = [[{"role": "user", "content": t}] for t in texts]
        gen.generate(prompts[:8], None, params)  # warm-up: graphs / kernels
        start = time.perf_counter()
        outs = gen.generate(prompts, None, params)
        seconds = time.perf_counter() - start
        outputs[cache] = [o.token_ids for o in outs]
        tokens = sum(len(o.token_ids) for o in outs)
        result["paths"][cache] = {
            "seconds": round(seconds, 3),
            "generated_tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 1),
        }
        print(f"{cache}: {seconds:.2f} s, {tokens} tokens, {tokens / seconds:,.0f} tokens/s")
        del gen
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    for a_name, b_name in (("engine", "static"), ("engine", "dynamic"), ("static", "dynamic")):
        pairs = list(zip(outputs[a_name], outputs[b_name], strict=True))
        same = sum(a == b for a, b in pairs)
        prefix = [
            next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            for a, b in pairs
        ]
        result[f"{a_name}_vs_{b_name}"] = {
            "rows_identical": same,
            "mean_agreeing_prefix": sum(prefix) / len(prefix),
        }
        print(
            f"{a_name} vs {b_name}: identical rows {same}/{args.rows}; mean agreeing prefix "
            f"{sum(prefix) / len(prefix):.1f} tokens"
        )
    write_json(out_path(args.out, "engine_check.json"), result)
    return result


if __name__ == "__main__":
    main()
