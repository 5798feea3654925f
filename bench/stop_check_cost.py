"""Host time of the decode loop's stop-string check per chunk (issue 23): the generator reads `sync_every`
sampled tokens per row, then searches each row's decoded tail for its stop strings. Before, every token's
tail was decoded; `StopEndTokens` decodes only the tails ending in a token that may complete a stop. On a GPU
the device decodes the next chunk meanwhile, so host work above the device time of a chunk (8 steps of the
0.5B shape at batch 64: ~8.4 ms on an H100) idles the GPU.

    PYTHONPATH=src python bench/stop_check_cost.py [--tokenizer .models/qwen3-tokenizer] [--rows 64 --chunk 8]

Random token ids stand in for sampled ones (random weights write no stop strings either); the stops are
Search-R1's (</search>, </answer>). Prints a table and writes JSON (--out, else $OUT/, else bench/results/).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

STOPS = ["</search>", "</answer>"]


def load_tokenizer(path: str | None) -> Any:
    from transformers import AutoTokenizer

    if path and Path(path).exists():
        return AutoTokenizer.from_pretrained(path)
    from sleuth.llm.tiny import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tempfile.mkdtemp(prefix="stopcost")))


def time_chunks(tokenizer: Any, rows: int, chunk: int, chunks: int, filtered: bool, seed: int) -> float:
    from sleuth.llm.hf import HFGenerator, _Row
    from sleuth.llm.stops import StopEndTokens

    gen = HFGenerator.__new__(HFGenerator)  # only the host-side stop check: no model
    gen.tokenizer, gen.eos_token_ids = tokenizer, set()
    gen._stop_ends = StopEndTokens(tokenizer)
    if not filtered:
        gen._stop_ends.for_stops = lambda stops: None  # every token's tail decoded, as before
    gen._stop_ends.checks(STOPS, [0])  # the one-time vocabulary decode, timed separately
    rng = random.Random(seed)
    size = len(tokenizer)
    live = [_Row(index=i, prompt_ids=[0], stops=list(STOPS), window=10) for i in range(rows)]
    started = time.perf_counter()
    for _ in range(chunks):
        tokens = [[rng.randrange(size) for _ in range(chunk)] for _ in live]
        gen._accept_tokens(live, tokens, [[0.0] * chunk for _ in live], chunks * chunk + 1)
    return (time.perf_counter() - started) / chunks


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", default=str(_common.DEFAULT_TOKENIZER))
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument(
        "--chunk", type=int, default=8, help="tokens per row per check (the generator's sync_every)"
    )
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from sleuth.llm.stops import StopEndTokens

    tokenizer = load_tokenizer(args.tokenizer)
    started = time.perf_counter()
    StopEndTokens(tokenizer).for_stops(STOPS)
    vocabulary_s = time.perf_counter() - started
    rows = []
    for filtered in (False, True):
        per_chunk = [
            time_chunks(tokenizer, args.rows, args.chunk, args.chunks, filtered, seed)
            for seed in range(args.repeats)
        ]
        rows.append(
            {
                "path": "tails after tokens that may end a stop" if filtered else "tails after every token",
                "ms_per_chunk_median": round(1e3 * sorted(per_chunk)[len(per_chunk) // 2], 3),
                "ms_per_chunk_each": [round(1e3 * t, 3) for t in per_chunk],
            }
        )
    for r in rows:
        r["each"] = ", ".join(f"{t:.2f}" for t in r["ms_per_chunk_each"])
    _common.print_table(
        f"stop check per chunk: {args.rows} rows x {args.chunk} tokens, stops {STOPS}",
        [("path", "path"), ("ms_per_chunk_median", "ms per chunk (median)"), ("each", "each repeat")],
        rows,
        [
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')} ({len(tokenizer):,} ids): "
            f"one-time decode of the vocabulary {vocabulary_s:.2f} s"
        ],
    )
    for r in rows:
        del r["each"]
    result = {
        "bench": "stop_check_cost",
        "environment": _common.environment("cpu"),
        "settings": vars(args),
        "tokenizer_size": len(tokenizer),
        "vocabulary_decode_s": round(vocabulary_s, 3),
        "rows": rows,
    }
    out = _common.out_path(args.out, "stop_check_cost.json")
    _common.write_json(out, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
