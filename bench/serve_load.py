"""Loopback load test of the searcher HTTP API (`sleuth serve-searcher`), bounded in count and time.

    OMP_NUM_THREADS=2 python bench/serve_load.py                      # tiny random model, s3 loop
    OMP_NUM_THREADS=2 python bench/serve_load.py --model smollm2-135m-instruct --requests 60

A server is started in-process (uvicorn in a thread, a free 127.0.0.1 port) over a synthetic
corpus with a BM25 index, then three phases run with httpx:
- `sequential`: one request at a time (no batching possible): the unbatched baseline;
- `concurrent`: `--concurrency` clients in parallel: requests share batched rollouts;
- `mixed-bad`: as `concurrent`, but every `--bad-every`-th request is malformed on purpose
  (empty question, too long, wrong types, out-of-range top_k/max_turns, unknown field). Those must
  get 4xx and are counted separately; every other request must still succeed.
Each phase stops at its request count or its time limit, whichever comes first. Latency is per
request, client side. Prints a table and writes JSON (bench/results/serve_load.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BAD_BODIES: list[dict[str, Any]] = [
    {"question": ""},
    {"question": "x" * 5000},
    {"question": 17},
    {"question": "who?", "top_k": 0},
    {"question": "who?", "max_turns": "3"},
    {"question": "who?", "max_turns": 1000},
    {"question": "who?", "topk": 3},
]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


async def run_phase(
    base: str,
    questions: list[str],
    *,
    name: str,
    requests: int,
    duration_s: float,
    concurrency: int,
    bad_every: int = 0,
    max_turns: int | None = None,
) -> dict[str, Any]:
    import httpx

    latencies: list[float] = []
    batch_sizes: list[int] = []
    counts = {"ok": 0, "expected_4xx": 0, "unexpected_4xx": 0, "failed": 0}
    failures: list[str] = []
    issued = 0
    deadline = time.perf_counter() + duration_s

    def next_body() -> tuple[dict[str, Any], bool] | None:
        nonlocal issued
        if issued >= requests or time.perf_counter() >= deadline:
            return None
        i = issued
        issued += 1
        if bad_every and i % bad_every == bad_every - 1:
            return BAD_BODIES[(i // bad_every) % len(BAD_BODIES)], True
        body: dict[str, Any] = {"question": questions[i % len(questions)]}
        if max_turns is not None:
            body["max_turns"] = max_turns
        return body, False

    async def client_loop(client: httpx.AsyncClient) -> None:
        while (item := next_body()) is not None:
            body, bad = item
            start = time.perf_counter()
            try:
                r = await client.post(f"{base}/search", json=body)
                status = r.status_code
            except httpx.HTTPError as err:
                status, r = -1, None
                failures.append(f"{type(err).__name__}: {err}")
            elapsed = time.perf_counter() - start
            if bad:
                if 400 <= status < 500:
                    counts["expected_4xx"] += 1
                else:
                    counts["failed"] += 1
                    failures.append(f"bad request {body!r} got {status}")
                continue
            if status == 200 and r is not None:
                counts["ok"] += 1
                latencies.append(elapsed)
                batch_sizes.append(r.json()["batch_size"])
            elif 400 <= status < 500:
                counts["unexpected_4xx"] += 1
                failures.append(f"good request got {status}: {r.text[:200] if r is not None else ''}")
            else:
                counts["failed"] += 1
                failures.append(f"good request got {status}: {r.text[:200] if r is not None else ''}")

    before = (await _health(base))["stats"]
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    wall = time.perf_counter() - started
    after = (await _health(base))["stats"]
    return {
        "phase": name,
        "concurrency": concurrency,
        "requests": issued,
        **counts,
        "wall_s": round(wall, 3),
        "throughput_rps": round(counts["ok"] / wall, 3) if wall > 0 else 0.0,
        "p50_s": round(percentile(latencies, 50), 4) if latencies else None,
        "p95_s": round(percentile(latencies, 95), 4) if latencies else None,
        "mean_batch_size": round(statistics.fmean(batch_sizes), 2) if batch_sizes else None,
        "rollouts": after["rollouts"] - before["rollouts"],
        "generate_calls": after["generate_calls"] - before["generate_calls"],
        "failure_examples": failures[:5],
    }


async def _health(base: str) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(timeout=30) as client:
        return (await client.get(f"{base}/health")).json()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="tiny", help="searcher model: tiny (default) or smollm2-135m-instruct"
    )
    parser.add_argument("--loop", default="s3")
    parser.add_argument("--requests", type=int, default=200, help="requests per concurrent phase")
    parser.add_argument("--duration-s", type=float, default=60.0, help="time limit per phase")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--sequential-requests", type=int, default=20)
    parser.add_argument(
        "--bad-every", type=int, default=4, help="mixed phase: every N-th request is malformed"
    )
    # Small budgets by default: the tiny model's 512-token vocabulary makes an s3 prompt ~1.6k tokens.
    parser.add_argument("--max-turns", type=int, default=1)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--max-new-tokens-per-turn", type=int, default=16)
    parser.add_argument("--max-response-tokens", type=int, default=128)
    parser.add_argument("--max-obs-tokens", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--batch-wait-ms", type=float, default=10.0)
    parser.add_argument(
        "--device", default=None, help="torch device of the searcher (default: cuda if available)"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    from sleuth.data.formats import load_qa
    from sleuth.data.synth import generate_world, write_world
    from sleuth.retrieval import build_index
    from sleuth.serve.loading import ServiceSpec, build_service
    from sleuth.serve.searcher_server import create_app
    from sleuth.serve.service import ServeLimits
    from sleuth.serve.threaded import serve_in_thread

    with tempfile.TemporaryDirectory(prefix="sleuth-serve-bench-") as tmp:
        world = Path(tmp)
        write_world(generate_world(2000, 300, hops=(1, 2), seed=0), world)
        build_index(world / "corpus.jsonl", "bm25", world / "bm25")
        questions = [ex.question for ex in load_qa(world / "train.jsonl")]
        t0 = time.perf_counter()
        service = build_service(
            ServiceSpec(
                model=args.model,
                loop=args.loop,
                loop_options={"max_turns": args.max_turns, "top_k": args.top_k},
                index=world / "bm25",
                limits=ServeLimits(max_batch=args.max_batch, batch_wait_ms=args.batch_wait_ms, timeout_s=300),
                max_new_tokens_per_turn=args.max_new_tokens_per_turn,
                max_obs_tokens=args.max_obs_tokens,
                max_response_tokens=args.max_response_tokens,
                device=args.device,
            )
        )
        load_s = time.perf_counter() - t0
        phases = []
        with serve_in_thread(create_app(service)) as base:
            # one untimed request: first-call costs (kernel compilation, allocator warm-up)
            asyncio.run(run_phase(base, questions, name="warmup", requests=2, duration_s=60, concurrency=1))
            for spec in (
                dict(name="sequential", requests=args.sequential_requests, concurrency=1),
                dict(name="concurrent", requests=args.requests, concurrency=args.concurrency),
                dict(
                    name="mixed-bad",
                    requests=args.requests,
                    concurrency=args.concurrency,
                    bad_every=args.bad_every,
                ),
            ):
                phases.append(asyncio.run(run_phase(base, questions, duration_s=args.duration_s, **spec)))
            health = asyncio.run(_health(base))
        service.close()

    header = (
        f"{'phase':<11} {'conc':>4} {'reqs':>5} {'ok':>5} {'4xx(bad)':>8} {'failed':>6} "
        f"{'req/s':>7} {'p50 s':>7} {'p95 s':>7} {'batch':>6} {'rollouts':>8}"
    )
    device = str(getattr(service.generator.inner, "device", "?"))
    print(
        f"searcher {args.model} on {device} / {args.loop}, max_turns {args.max_turns}, top_k {args.top_k}, "
        f"{args.max_new_tokens_per_turn} "
        f"tokens/turn, torch threads {torch.get_num_threads()}, model load {load_s:.1f} s"
    )
    print(header)
    print("-" * len(header))
    for p in phases:
        print(
            f"{p['phase']:<11} {p['concurrency']:>4} {p['requests']:>5} {p['ok']:>5} {p['expected_4xx']:>8} "
            f"{p['failed'] + p['unexpected_4xx']:>6} {p['throughput_rps']:>7.2f} {p['p50_s'] or 0:>7.3f} "
            f"{p['p95_s'] or 0:>7.3f} {p['mean_batch_size'] or 0:>6.2f} {p['rollouts']:>8}"
        )
    result = {
        "bench": "serve_load",
        "model": args.model,
        "loop": args.loop,
        "config": vars(args),
        "platform": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "device": device,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch_threads": torch.get_num_threads(),
        },
        "model_load_s": round(load_s, 2),
        "phases": phases,
        "server_stats": health["stats"],
    }
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / "serve_load.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    bad = sum(p["failed"] + p["unexpected_4xx"] for p in phases)
    if bad:
        print(f"FAILED: {bad} requests failed that should not have", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
