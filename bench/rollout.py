"""Agent rollout throughput: sleuth's batched engine next to a one-at-a-time `model.generate` loop.

    # CPU check (tiny model, seconds):
    PYTHONPATH=src python bench/rollout.py --model tiny --batch 4 --turns 2 --new-tokens 16
    # GPU: random-weight Qwen2.5-0.5B shape, Qwen3 tokenizer, several engine modes in one run:
    PYTHONPATH=src python bench/rollout.py --model random:qwen2.5-0.5b --batch 64 --turns 3 --new-tokens 64 \
        --modes dynamic static --baseline-trajectories 4

Workload: `--batch` questions of a synthetic world, a Search-R1 loop with exactly `--turns` generation
rounds of at most `--new-tokens` tokens each (no forced extra answer turn), BM25 retrieval over
`--passages` passages. Both paths use the same questions, prompt template, stop strings
(</search>, </answer>), sampling (temperature 1, full vocabulary) and retriever. Random weights never
write a stop string or a valid action, so every turn runs the full budget and ends with the
invalid-action feedback being inserted; `--ignore-eos` (default for random:*) also rules out an
early EOS (engine: no EOS ids; baseline: min_new_tokens). Rates are computed from the tokens that
were actually generated, so rows stay comparable when a real model stops early.

- engine rows: `sleuth.agent.engine.rollout` with `HFGenerator(cache=..., compile=...)`, all
  trajectories batched; one untimed warm-up rollout first (pays for compilation).
- baseline row: what older forks do; per trajectory, per turn: decode the whole text so far,
  re-tokenise it, `model.generate` one sequence (default dynamic cache), decode, parse, append
  documents/feedback as text. Slow, so it runs on `--baseline-trajectories` trajectories; its rates
  are per trajectory run sequentially.

Decode steps/s counts batched forward passes inside `generate` (prefill counted as one step).
HBM bound: each step must read the weights plus the KV cache of every active row; the fraction is
(minimum bytes read / peak bandwidth) / measured generate time (`--bandwidth-gbs`, default from the
card name: H100 SXM 3350, H200 4800). Prints a table and writes JSON (`--out`, else $OUT/, else
bench/results/).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

MODES = ("dynamic", "static", "static+compile", "engine")


class DecodeLedger:
    """Per `generate` call: rows, decode steps, tokens, seconds and the minimum bytes it had to read."""

    def __init__(self, model_info: dict[str, Any]):
        self.weight_bytes = model_info["weight_bytes_per_step"]
        self.kv_per_token = model_info["kv_bytes_per_token"]
        self.calls: list[dict[str, Any]] = []

    def record(self, width: int, row_tokens: list[int], seconds: float) -> None:
        self.calls.append(
            {
                "rows": len(row_tokens),
                "steps": max(row_tokens, default=0),
                "tokens": sum(row_tokens),
                "seconds": seconds,
                "bytes": _common.decode_call_bytes(self.weight_bytes, self.kv_per_token, width, row_tokens),
            }
        )

    def totals(self) -> dict[str, float]:
        sums = {key: sum(c[key] for c in self.calls) for key in ("steps", "tokens", "seconds", "bytes")}
        return sums | {"calls": len(self.calls)}


class CountingGenerator:
    """A Generator that forwards to `inner` and books every call in a DecodeLedger."""

    def __init__(self, inner: Any, device: str, ledger: DecodeLedger):
        self.inner = inner
        self.tokenizer = inner.tokenizer
        self.device = device
        self.ledger = ledger

    def generate(self, batch, stop=None, params=None):
        start = _common.timer(self.device)
        gens = self.inner.generate(batch, stop, params)
        seconds = _common.timer(self.device) - start
        self.ledger.record(max(len(p) for p in batch), [len(g.token_ids) for g in gens], seconds)
        return gens


# ---------------------------------------------------------------------------------------------------
# sleuth's engine


def run_engine(
    mode: str,
    model: Any,
    tokenizer: Any,
    model_info: dict[str, Any],
    examples: list,
    retriever: Any,
    args: argparse.Namespace,
    device: str,
    sync_every: int = 8,
    profile: bool = False,
) -> dict[str, Any]:
    from sleuth.agent import get_loop
    from sleuth.agent.engine import RolloutBudget, rollout
    from sleuth.llm.base import SamplingParams
    from sleuth.llm.hf import HFGenerator

    cache = {"dynamic": "dynamic", "engine": "engine"}.get(mode, "static")
    gen = HFGenerator(
        model,
        tokenizer=tokenizer,
        cache=cache,
        compile=mode == "static+compile",
        max_batch_size=args.batch,
        sync_every=sync_every,
        grouped_decode_attention=args.grouped_decode_attention,
    )
    if args.ignore_eos:
        gen.eos_token_ids = frozenset()
    if cache == "engine":
        gen.engine.reuse_prefixes = not args.no_prefix_reuse
        splits_before = dict(gen.engine.splits_used)
    ledger = DecodeLedger(model_info)
    counting = CountingGenerator(gen, device, ledger)
    loop = get_loop("search_r1", max_turns=args.turns, forced_final_answer=False)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0, seed=args.seed)
    kwargs = dict(
        n=1,
        budget=RolloutBudget(
            max_obs_tokens=args.max_obs_tokens,
            max_response_tokens=args.turns * (args.new_tokens + args.max_obs_tokens) + 64,
        ),
    )

    warm = time.perf_counter()
    rollout(loop, counting, retriever, examples, replace(params, seed=args.seed + 1), **kwargs)
    warmup_s = time.perf_counter() - warm
    ledger.calls.clear()
    gen.prefill_seconds = 0.0
    reused_before = gen.engine.reused_tokens if cache == "engine" else 0

    profiler = _profiler(device) if profile else contextlib.nullcontext()
    with profiler:
        start = _common.timer(device)
        trajs = rollout(loop, counting, retriever, examples, params, **kwargs)
        wall = _common.timer(device) - start
    totals = ledger.totals()
    policy_tokens = sum(sum(t.loss_mask) for t in trajs)
    label = (
        f"sleuth engine ({mode}{'' if cache == 'dynamic' else f', sync every {sync_every}'}"
        f"{', grouped decode attention' if gen.grouped_decode_attention else ''}"
        f"{', cuDNN SDPA off' if args.no_cudnn_sdpa else ''})"
    )
    row = rates(label, len(trajs), policy_tokens, wall, totals, args)
    if profile:
        row["profile"] = profile_summary(profiler, wall)
    row.update(
        mode=mode,
        cache=cache,
        compile=mode == "static+compile",
        sync_every=sync_every,
        batch=len(trajs),
        grouped_decode_attention=gen.grouped_decode_attention,
        cudnn_sdpa=not args.no_cudnn_sdpa,
        warmup_s=round(warmup_s, 2),
        graph_failures=getattr(gen, "graph_failures", 0),
        # the engine's prefills (prompt forward + first token) inside generate; the rest is decode steps
        # and the host's stop checks
        prefill_s=round(gen.prefill_seconds, 6) if cache == "engine" else None,
        prefill_share_of_generate=(
            gen.prefill_seconds / row["generate_s"] if cache == "engine" and row["generate_s"] else None
        ),
        # prompt tokens whose keys/values a turn took over from the row's previous turn instead of
        # prefilling them again (the engine's prefix reuse; --no-prefix-reuse turns it off)
        prefix_reuse=cache == "engine" and not args.no_prefix_reuse,
        reused_prompt_tokens=gen.engine.reused_tokens - reused_before if cache == "engine" else None,
        # the decode step's kernels (SLEUTH_FUSED_DECODE, SLEUTH_FUSED_MLP, SLEUTH_ATTENTION_SPLITS,
        # SLEUTH_SAMPLE_CHUNK) and the attention splits the timed rollout's decodes used
        decode_kernels=_decode_kernels(gen.engine, splits_before) if cache == "engine" else None,
        turns_mean=sum(t.num_turns for t in trajs) / len(trajs),
        retrievals=sum(t.retrieval_count for t in trajs),
        finish_reasons=_counts(r for t in trajs for r in t.generation_finish_reasons),
    )
    del gen, counting, ledger
    return row


def _decode_kernels(engine: Any, splits_before: dict[int, int]) -> dict[str, Any]:
    from sleuth.llm import fused_kernels

    used = {str(k): n - splits_before.get(k, 0) for k, n in sorted(engine.splits_used.items())}
    return fused_kernels.settings() | {
        "attention_splits_used": {k: n for k, n in used.items() if n},
        "triton": fused_kernels.triton_enabled(engine.embed),
    }  # else the references


def _profiler(device: str) -> Any:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    return profile(activities=activities)


def profile_summary(prof: Any, wall: float, top: int = 12) -> dict[str, Any]:
    """What the device waits for: device time over wall time, and where host and device time go.

    The profiler's ranges (a compiled graph's `## Call CompiledFxGraph ##`) carry the device time of the
    kernels inside them as well, so `device_busy_fraction` counts those kernels twice and can exceed 1:
    read the kernel rows of `top_device_ops` for the split."""
    events = prof.key_averages()

    def device_us(e: Any) -> float:
        return float(
            getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0) or 0.0
        )

    kernel_us = sum(device_us(e) for e in events)
    by_host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    by_device = sorted(events, key=device_us, reverse=True)[:top]
    return {
        "device_busy_fraction": round(kernel_us / 1e6 / wall, 4) if wall else None,
        "device_kernel_s": round(kernel_us / 1e6, 3),
        "wall_s": round(wall, 3),
        "top_host_ops": [
            {"name": e.key, "self_cpu_s": round(e.self_cpu_time_total / 1e6, 4), "calls": e.count}
            for e in by_host
        ],
        "top_device_ops": [
            {"name": e.key, "self_device_s": round(device_us(e) / 1e6, 4), "calls": e.count}
            for e in by_device
            if device_us(e) > 0
        ],
    }


# ---------------------------------------------------------------------------------------------------
# the baseline: text in, text out, one sequence at a time


def run_baseline(
    model: Any,
    tokenizer: Any,
    model_info: dict[str, Any],
    examples: list,
    retriever: Any,
    args: argparse.Namespace,
    device: str,
) -> dict[str, Any]:
    import torch

    from sleuth.agent.base import first_action
    from sleuth.agent.search_r1 import SEARCH_R1_INVALID_ACTION, SEARCH_R1_USER_TEMPLATE
    from sleuth.retrieval.base import format_docs

    ledger = DecodeLedger(model_info)
    stops = ["</search>", "</answer>"]
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos

    def generate(text: str, warmup: bool = False) -> str:
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids.to(device)
        budget = 2 if warmup else args.new_tokens
        kwargs: dict[str, Any] = dict(
            max_new_tokens=budget,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            pad_token_id=pad,
            stop_strings=stops,
            tokenizer=tokenizer,
        )
        if args.ignore_eos:
            kwargs["min_new_tokens"] = budget
        start = _common.timer(device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        seconds = _common.timer(device) - start
        new = out[0, ids.shape[1] :].tolist()
        if not warmup:
            ledger.record(ids.shape[1], [len(new)], seconds)
        if new and new[-1] == eos:
            new = new[:-1]
        return tokenizer.decode(new, skip_special_tokens=False)

    def one_trajectory(question: str) -> dict[str, Any]:
        messages = [{"role": "user", "content": SEARCH_R1_USER_TEMPLATE.format(question=question.strip())}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        turns = retrievals = 0
        for _ in range(args.turns):
            turn = generate(text)
            text += turn
            turns += 1
            action = first_action(turn, ("search", "answer"))
            if action is not None and action[0] == "answer":
                break
            if action is not None and action[1].strip():
                hits = retriever.search([action[1].strip()], 3)[0]
                retrievals += 1
                body = tokenizer.decode(
                    tokenizer.encode(format_docs(hits).strip(), add_special_tokens=False)[
                        : args.max_obs_tokens
                    ]
                )
                text += f"\n\n<information>{body}</information>\n\n"
            else:
                text += SEARCH_R1_INVALID_ACTION
        return {"turns": turns, "retrievals": retrievals}

    torch.manual_seed(args.seed)
    generate("warm-up", warmup=True)  # CUDA/cuBLAS initialisation is not part of the loop's cost
    chosen = examples[: args.baseline_trajectories]
    start = _common.timer(device)
    results = [one_trajectory(ex.question) for ex in chosen]
    wall = _common.timer(device) - start
    totals = ledger.totals()
    row = rates(
        "baseline: sequential model.generate (dynamic cache, re-tokenised text)",
        len(chosen),
        int(totals["tokens"]),
        wall,
        totals,
        args,
    )
    row.update(
        mode="baseline",
        cache="dynamic (HF default)",
        compile=False,
        batch=1,
        turns_mean=sum(r["turns"] for r in results) / max(1, len(results)),
        retrievals=sum(r["retrievals"] for r in results),
    )
    return row


# ---------------------------------------------------------------------------------------------------


def rates(
    label: str,
    trajectories: int,
    tokens: int,
    wall: float,
    totals: dict[str, float],
    args: argparse.Namespace,
) -> dict[str, Any]:
    gen_s = totals["seconds"]
    return {
        "path": label,
        "status": "ok",
        "trajectories": trajectories,
        "wall_s": round(wall, 6),
        "generated_tokens": int(tokens),
        "tokens_per_trajectory": tokens / max(1, trajectories),
        "trajectories_per_s": trajectories / wall,
        "tokens_per_s": tokens / wall,
        "generate_calls": int(totals["calls"]),
        "generate_s": round(gen_s, 6),
        "generate_share": gen_s / wall if wall else None,
        "decode_steps": int(totals["steps"]),
        "decode_steps_per_s": totals["steps"] / gen_s if gen_s else None,
        "min_bytes_read": totals["bytes"],
        "achieved_gbs": totals["bytes"] / gen_s / 1e9 if gen_s else None,
        "hbm_fraction": _common.hbm_fraction(totals["bytes"], gen_s, args.bandwidth_gbs),
    }


def _counts(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[str(item)] = out.get(str(item), 0) + 1
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default="tiny",
        help="tiny | smollm2-135m-instruct | DIR | random:qwen2.5-0.5b | "
        "random:qwen2.5-1.5b | random:qwen-tiny",
    )
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer dir (default for random:*: .models/qwen3-tokenizer)"
    )
    p.add_argument("--device", default=None, help="cuda if available, else cpu")
    p.add_argument("--dtype", default=None, help="bf16 on cuda, fp32 on cpu by default")
    p.add_argument("--batch", type=int, default=8, help="trajectories rolled out together by the engine")
    p.add_argument("--turns", type=int, default=3, help="generation rounds per trajectory")
    p.add_argument("--new-tokens", type=int, default=64, help="max new tokens per turn")
    p.add_argument(
        "--max-obs-tokens", type=int, default=256, help="inserted documents are cut to this many tokens"
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=None,
        choices=MODES,
        help="engine modes to run (default: the one --cache/--compile name)",
    )
    p.add_argument(
        "--cache",
        choices=("static", "dynamic"),
        default=None,
        help="engine KV cache (default static on cuda, dynamic on cpu)",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile the static-cache decode step")
    p.add_argument("--baseline-trajectories", type=int, default=2, help="0 skips the sequential baseline")
    p.add_argument("--passages", type=int, default=2000, help="synthetic world size for the BM25 retriever")
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="never stop at EOS (default: on for random:* models, off otherwise)",
    )
    p.add_argument(
        "--bandwidth-gbs",
        type=float,
        default=None,
        help="peak memory bandwidth for the HBM bound (default from the card name)",
    )
    p.add_argument(
        "--sync-every",
        type=int,
        nargs="+",
        default=[8],
        help="static modes: decode steps between two reads of the sampled tokens (1 = every step); "
        "one row per value",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="torch.profiler over the timed rollout of the last engine row: device busy share, top ops",
    )
    p.add_argument(
        "--grouped-decode-attention",
        action="store_true",
        help="decode steps attend each key/value head once (sleuth.llm.attention) instead of "
        "transformers' per-query-head copy of the cache",
    )
    p.add_argument(
        "--no-cudnn-sdpa",
        action="store_true",
        help="turn PyTorch's cuDNN attention backend off (its flash / memory-efficient kernels serve)",
    )
    p.add_argument(
        "--no-prefix-reuse",
        action="store_true",
        help="engine: prefill every turn's whole prompt again instead of reusing the keys/values of the "
        "row's previous turn (the comparison row for the prefix reuse)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", default=None, help="JSON path (default $OUT/rollout_<device>.json or bench/results/)"
    )
    args = p.parse_args(argv)
    _common.require_positive(args, "batch", "turns", "new_tokens", "max_obs_tokens", "passages")
    if args.baseline_trajectories < 0:
        raise SystemExit("--baseline-trajectories must be >= 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    device = _common.pick_device(args.device)
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    dtype = _common.pick_dtype(args.dtype, device)
    if args.ignore_eos is None:
        args.ignore_eos = args.model.startswith("random:")
    if args.modes is None:
        cache = args.cache or ("static" if device.startswith("cuda") else "dynamic")
        if args.compile and cache != "static":
            raise SystemExit("--compile needs --cache static")
        args.modes = ["static+compile" if args.compile else cache]
    env = _common.environment(device)
    if args.bandwidth_gbs is None and device.startswith("cuda"):
        args.bandwidth_gbs = _common.default_bandwidth_gbs(env["card"])
    print(
        f"device: {env['card']} ({device}), torch {env['torch']}, transformers {env['transformers']}, "
        f"bandwidth {args.bandwidth_gbs} GB/s",
        flush=True,
    )

    t0 = time.perf_counter()
    model, tokenizer, model_info = _common.build_model(args.model, args.tokenizer, device, dtype)
    model_init_s = time.perf_counter() - t0
    print(
        f"model: {model_info['source']}, {model_info['params'] / 1e6:.1f}M params, {dtype} "
        f"({model_init_s:.1f} s)",
        flush=True,
    )

    from sleuth.retrieval.index import load_retriever

    with tempfile.TemporaryDirectory(prefix="sleuth-bench-rollout-") as tmp:
        t0 = time.perf_counter()
        world = _common.build_world(
            Path(tmp) / "world", args.passages, max(args.batch, args.baseline_trajectories)
        )
        retriever = load_retriever(world["index"])
        examples = [world["examples"][i % len(world["examples"])] for i in range(args.batch)]
        world_s = time.perf_counter() - t0
        print(
            f"world: {args.passages} passages, {len(world['examples'])} train questions, BM25 ({world_s:.1f} s)",
            flush=True,
        )

        rows: list[dict[str, Any]] = []
        timings = {"model_init_s": round(model_init_s, 2), "world_and_index_s": round(world_s, 2)}
        out = _common.out_path(args.out, f"rollout_{device.split(':')[0]}.json")
        jobs = [
            (f"sleuth engine ({mode})", mode, sync)
            for mode in args.modes
            for sync in (args.sync_every if mode != "dynamic" else [1])
        ]
        if args.baseline_trajectories:
            jobs.append(("baseline", "baseline", 1))
        last_engine = max((i for i, job in enumerate(jobs) if job[1] != "baseline"), default=-1)
        for i, (label, mode, sync) in enumerate(jobs):
            what = (
                f"{args.baseline_trajectories} trajectories one at a time"
                if mode == "baseline"
                else f"warm-up + timed rollout of {args.batch} trajectories"
            )
            print(f"{label}: {what} ...", flush=True)
            try:
                if mode == "baseline":
                    row = run_baseline(model, tokenizer, model_info, examples, retriever, args, device)
                else:
                    row = run_engine(
                        mode,
                        model,
                        tokenizer,
                        model_info,
                        examples,
                        retriever,
                        args,
                        device,
                        sync_every=sync,
                        profile=args.profile and i == last_engine,
                    )
                _report_row(row)
            except Exception as err:  # noqa: BLE001 - one failing mode must not lose the other rows
                import traceback

                traceback.print_exc()
                row = {
                    "path": label,
                    "mode": mode,
                    "status": f"failed: {type(err).__name__}: {str(err)[:300]}",
                }
            rows.append(row)
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            # Written after every row, so a command cut short still returns what finished.
            _common.write_json(out, assemble(args, env, model_info, timings, rows, device, dtype))

    result = assemble(args, env, model_info, timings, rows, device, dtype)
    columns = [
        ("path", "path"),
        ("status", "status"),
        ("trajectories", "traj"),
        ("wall_s", "wall s"),
        ("trajectories_per_s", "traj/s"),
        ("tokens_per_s", "gen tok/s"),
        ("tokens_per_trajectory", "tok/traj"),
        ("turns_mean", "turns"),
        ("decode_steps_per_s", "steps/s"),
        ("generate_share", "in generate"),
        ("achieved_gbs", "GB/s"),
        ("hbm_fraction", "of HBM bound"),
        ("speedup_tokens_per_s_vs_baseline", "x baseline"),
    ]
    notes = [
        f"{env['card']} | {args.model} ({dtype}) | batch {args.batch}, {args.turns} turns x {args.new_tokens} "
        f"new tokens, ignore_eos={args.ignore_eos}",
        "baseline rates are for its trajectories run one after another (per-trajectory rates)",
        "steps/s and GB/s are over time inside generate; HBM bound = weights + live KV per step "
        f"at {args.bandwidth_gbs} GB/s",
    ]
    _common.print_table("sleuth rollout engine vs sequential model.generate", columns, rows, notes)
    _common.write_json(out, result)
    print(f"wrote {out}")
    return result


def assemble(
    args: argparse.Namespace,
    env: dict[str, Any],
    model_info: dict[str, Any],
    timings: dict[str, float],
    rows: list[dict[str, Any]],
    device: str,
    dtype: str,
) -> dict[str, Any]:
    baseline = next((r for r in rows if r["mode"] == "baseline" and r.get("tokens_per_s")), None)
    for row in rows:
        if baseline and row is not baseline and row.get("tokens_per_s"):
            row["speedup_tokens_per_s_vs_baseline"] = row["tokens_per_s"] / baseline["tokens_per_s"]
    return {
        "bench": "rollout",
        "environment": env,
        "model": model_info,
        "settings": dict(vars(args))
        | {
            "device": device,
            "dtype": dtype,
            "loop": "search_r1",
            "forced_final_answer": False,
            "temperature": 1.0,
            "top_p": 1.0,
        },
        "timings": timings,
        "rows": rows,
        "modules_loaded": _common.watched_modules_loaded(),
    }


def _report_row(row: dict[str, Any]) -> None:
    print(
        f"  {row['path']}: {row['trajectories_per_s']:.3f} traj/s, {row['tokens_per_s']:.1f} tok/s, "
        f"{row['tokens_per_trajectory']:.1f} tok/traj, {row['wall_s']:.2f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
