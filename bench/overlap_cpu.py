"""`trainer.overlap` on the CPU: the step time of `off`, `one_step` (the next step's rollout before the update, one
thread) and `one_step_async` (the same rollout on a background thread during the update), with the tiny model.

    PYTHONPATH=src OMP_NUM_THREADS=1 python bench/overlap_cpu.py --steps 6 --search-latency 0.05

On a CPU the tiny model's decode loop is Python holding the GIL, so the rollout and the update cannot run at once
unless the rollout waits on something that releases it; a retriever behind a network does, and
`--search-latency S` adds S seconds to every search call (a sleep: what a remote /retrieve round trip costs) so
the case where the two can overlap is measured. On a GPU the decode waits on the device, as the sleep does here;
bench/paper_scale.py --overlap one_step_async measures that. Per mode: the mean of time/step over the steps that
rolled out the next step during their update (`steady_step_s`; not the first, synchronous, nor the last), and the
means of time/rollout and time/update over the steps after the first.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests" / "plugins"))  # the test reward plugin
import _common  # noqa: E402

MODES = ("off", "one_step", "one_step_async")


class SlowRetriever:
    """A retriever whose every search call takes `latency` seconds more (sleeping releases the GIL)."""

    def __init__(self, inner: Any, latency: float) -> None:
        self.inner, self.latency = inner, latency

    def search(self, queries: list[str], k: int) -> Any:
        time.sleep(self.latency)
        return self.inner.search(queries, k)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def recipe(world: Path, out_dir: Path, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    return {
        "name": "overlap-cpu",
        "seed": 0,
        "model": {"policy": args.model, "dtype": "float32"},
        "data": {"train": str(world / "train.jsonl")},
        "retriever": {"index": str(world / "bm25")},
        "agent": {
            "loop": "search_r1_rehearsal",  # every turn ends in a search (bench/sleuth_rehearsal.py)
            "max_turns": args.turns,
            "max_new_tokens_per_turn": args.new_tokens,
            "max_response_tokens": args.turns * (args.new_tokens + 64),
            "max_obs_tokens": 64,
        },
        "plugins": ["sleuth_rehearsal", "sleuth_test_rewards"],
        "reward": {"name": "test_token_fraction"},
        "algorithm": {
            "name": "grpo",
            "n": args.n,
            "prompts_per_step": args.prompts,
            "minibatch_size": args.prompts * args.n,
            "micro_batch_size": args.prompts * args.n,
        },
        "optim": {"lr": 1e-3},
        "trainer": {"total_steps": args.steps, "save_every": 0, "out_dir": str(out_dir), "overlap": mode},
    }


def measure(world: Path, work: Path, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    from sleuth.rl import run as run_module
    from sleuth.rl.config import recipe_from_dict
    from sleuth.rl.trainer import train

    real = run_module.build_retriever
    run_module.build_retriever = lambda r: SlowRetriever(real(r), args.search_latency)
    try:
        train(recipe_from_dict(recipe(world, work / mode, args, mode)), console=Console(quiet=True))
    finally:
        run_module.build_retriever = real
    rows = [json.loads(line) for line in (work / mode / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    middle = rows[1:-1]  # each rolled the next step out (off: its own rollout) and updated
    return {
        "mode": mode,
        "steady_step_s": mean([r["time/step"] for r in middle]),
        "rollout_s": mean([r["time/rollout"] + r["time/reward"] for r in later]),
        "update_s": mean([r["time/update"] for r in later]),
        "overlap_wait_s": mean([r.get("time/overlap_wait", 0.0) for r in middle]),
        "staleness": [r.get("rollout/staleness") for r in rows],
        "final_loss": rows[-1].get("actor/pg_loss"),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--search-latency", type=float, default=0.0, help="seconds added to every search call")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument(
        "--repeats", type=int, default=1, help="run the modes in turn this many times (a shared box)"
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.steps < 3:
        raise SystemExit("--steps must be >= 3: the first step is synchronous and the last rolls nothing out")
    from sleuth.data.synth import generate_world, write_world
    from sleuth.retrieval import build_index

    with tempfile.TemporaryDirectory() as tmp:
        world = Path(tmp) / "world"
        write_world(generate_world(300, 60, hops=(1, 2), seed=0), world)
        build_index(world / "corpus.jsonl", "bm25", world / "bm25")
        rows = [
            {"repeat": i, **measure(world, Path(tmp) / str(i), args, mode)}
            for i in range(args.repeats)
            for mode in args.modes
        ]
    for row in rows:
        row["rollout_plus_update_s"] = row["rollout_s"] + row["update_s"]
        row["max_rollout_update_s"] = max(row["rollout_s"], row["update_s"])
    result = {
        "bench": "overlap_cpu",
        "environment": _common.environment("cpu"),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["bench/overlap_cpu.py", *(argv if argv is not None else sys.argv[1:])]),
        "settings": vars(args),
        "rows": rows,
    }
    for row in rows:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    if args.out:
        _common.write_json(Path(args.out), result)
    return result


if __name__ == "__main__":
    main()
