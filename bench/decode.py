"""Decode efficiency of sleuth's decode engine against the memory-bandwidth bound, and what fits.

    # CPU check (tiny model, seconds):
    PYTHONPATH=src python bench/decode.py --models tiny --batches 4 --context 32 --new-tokens 8
    # GPU: the papers' shapes with random weights
    PYTHONPATH=src python bench/decode.py --models random:qwen2.5-0.5b random:qwen2.5-3b random:qwen2.5-7b \
        --batches 64 128 --context 1024 --new-tokens 256

Per (model, batch): the model is built (bf16 on CUDA), copied into a `DecodeEngine`, and the transformers
model is freed, so memory is the engine's alone. Each row prefills `batch` random prompts of `--context`
tokens, then decodes `--new-tokens` tokens (sampling at temperature 1, no stop), once untimed (graph
capture) and once timed with device events around the decode steps only.

Bytes per step (the bound): every weight matrix once (the input embedding is gathered, not streamed,
unless tied to the output layer) plus the live keys and values of every row (context + tokens so far).
`of HBM bound` = (bytes / peak bandwidth) / measured step time; `--bandwidth-gbs` defaults to the card's
datasheet figure (H100 SXM 3350, H200 4800). The KV pool, peak memory and the largest batch of
`--capacity-tokens` tokens per row that fits the card (from the free memory after the weights) are
reported with their arithmetic. Prints a table and writes JSON (`--out`, else $OUT/, else bench/results/).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def timed_run(
    engine: Any, prompts: list[list[int]], args: argparse.Namespace, device: str
) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of one call: prefill + first token, then the decode steps."""
    steps = args.new_tokens - 1
    start = _common.timer(device)
    state, _, _ = engine.start(prompts, args.new_tokens, temperature=1.0, seed=args.seed)
    prefill = _common.timer(device) - start
    begin = _common.timer(device)
    done = 0
    while done < steps:
        k = min(args.sync_every, steps - done)
        tokens, _ = engine.steps(state, k)
        tokens.cpu()  # the host reads each chunk, as the generator does
        done += k
    return prefill, _common.timer(device) - begin


def measure(spec: str, batch: int, args: argparse.Namespace, device: str, dtype: str) -> dict[str, Any]:
    import torch

    from sleuth.llm.decode_engine import DecodeEngine

    model, _, info = _common.build_model(spec, args.tokenizer, device, dtype)
    t0 = time.perf_counter()
    engine = DecodeEngine(model, max_batch_size=batch)
    copy_s = time.perf_counter() - t0
    del model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, engine.vocab, (args.context,), generator=gen).tolist() for _ in range(batch)]
    steps = args.new_tokens - 1

    warm = time.perf_counter()
    timed_run(engine, prompts, args, device)
    warmup_s = time.perf_counter() - warm
    prefill_s, decode_s = timed_run(engine, prompts, args, device)
    kv_token = engine.kv_bytes_per_token()
    weight_bytes = engine.weight_bytes - (
        0 if engine.lm_head is engine.embed else engine.embed.numel() * engine.embed.element_size()
    )
    mean_live = args.context + (args.new_tokens + 1) / 2
    step_bytes = weight_bytes + batch * mean_live * kv_token
    step_s = decode_s / steps
    row: dict[str, Any] = {
        "model": spec,
        "params": info["params"],
        "batch": batch,
        "context": args.context,
        "new_tokens": args.new_tokens,
        "engine_copy_s": round(copy_s, 2),
        "warmup_s": round(warmup_s, 2),
        "capture_s": round(engine.capture_seconds, 2),
        "prefill_s": round(prefill_s, 3),
        "decode_s": round(decode_s, 3),
        "steps_per_s": round(1 / step_s, 1),
        "tokens_per_s": round(batch / step_s, 1),
        "weight_bytes_per_step": weight_bytes,
        "kv_bytes_per_token": kv_token,
        "bytes_per_step": int(step_bytes),
        "achieved_gbs": round(step_bytes / step_s / 1e9, 1),
        "hbm_fraction": _common.hbm_fraction(step_bytes, step_s, args.bandwidth_gbs),
        "kv_pool_gib": round(2 * engine.pool_k.numel() * engine.pool_k.element_size() / 2**30, 2),
    }
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        row["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        row["card_total_gib"] = round(total / 2**30, 1)
        engine.release()
        gc.collect()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        # what the KV pool could take: free memory after the weights, less 10% for activations and graphs
        room = 0.9 * free
        row["capacity_tokens_per_row"] = args.capacity_tokens
        row["max_batch_at_capacity"] = int(room // (args.capacity_tokens * kv_token))
        row["capacity_arithmetic"] = (
            f"0.9 x {free / 2**30:.1f} GiB free after weights / ({args.capacity_tokens} "
            f"tokens x {kv_token} B/token)"
        )
    del engine
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny"])
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[4])
    p.add_argument("--context", type=int, default=512, help="prompt tokens per row")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--sync-every", type=int, default=8)
    p.add_argument(
        "--capacity-tokens", type=int, default=4096, help="tokens per row for the fits-in-memory column"
    )
    p.add_argument("--bandwidth-gbs", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = _common.pick_device(args.device)
    dtype = _common.pick_dtype(args.dtype, device)
    env = _common.environment(device)
    if args.bandwidth_gbs is None and device.startswith("cuda"):
        args.bandwidth_gbs = _common.default_bandwidth_gbs(env["card"])
    out = _common.out_path(args.out, f"decode_{device.split(':')[0]}.json")
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    for spec in args.models:
        for batch in args.batches:
            print(f"{spec} batch {batch} ...", flush=True)
            try:
                row = measure(spec, batch, args, device, dtype)
            except Exception as err:  # noqa: BLE001 - one failing row must not lose the others
                import traceback

                traceback.print_exc()
                row = {
                    "model": spec,
                    "batch": batch,
                    "status": f"failed: {type(err).__name__}: {str(err)[:300]}",
                }
                gc.collect()
            rows.append(row)
            print({k: v for k, v in row.items() if k != "capacity_arithmetic"}, flush=True)
            result = {
                "bench": "decode",
                "environment": env,
                "settings": vars(args) | {"dtype": dtype},
                "rows": rows,
                "date": time.strftime("%Y-%m-%d"),
                "command": " ".join(["bench/decode.py", *(argv or sys.argv[1:])]),
            }
            _common.write_json(out, result)
    columns = [
        ("model", "model"),
        ("batch", "batch"),
        ("context", "ctx"),
        ("steps_per_s", "steps/s"),
        ("tokens_per_s", "tok/s"),
        ("achieved_gbs", "GB/s"),
        ("hbm_fraction", "of HBM bound"),
        ("prefill_s", "prefill s"),
        ("capture_s", "capture s"),
        ("kv_pool_gib", "KV GiB"),
        ("peak_allocated_gib", "peak GiB"),
        ("max_batch_at_capacity", "max batch @cap"),
        ("status", "status"),
    ]
    _common.print_table(
        "sleuth decode engine vs the HBM bound",
        columns,
        rows,
        [
            f"{env['card']} | {args.bandwidth_gbs} GB/s | {args.new_tokens} new tokens, sync every "
            f"{args.sync_every}"
        ],
    )
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
