"""RL step time and GPU memory on 1 vs N GPUs: `sleuth train` under torchrun, DDP or FSDP2.

    # on a 2-GPU machine: random-weight Qwen2.5-1.5B shape with the Qwen3 tokenizer
    PYTHONPATH=src python bench/scale_step.py --model random:qwen2.5-1.5b --gpus 1 2 --parallel ddp fsdp
    # CPU check (gloo, tiny model, 1 vs 2 processes)
    PYTHONPATH=src python bench/scale_step.py --model tiny --device cpu --gpus 1 2 --prompts 2 --n 2 --new-tokens 8

Every row trains the same recipe as bench/train_step.py (Search-R1 loop, GRPO, full fine-tuning, fp32
master weights with bf16 autocast on CUDA) with the same *global* batch: `--prompts` x `--n`
trajectories per step, split over the ranks (each rank rolls out its share of the prompt groups and
the gradients are averaged), so a row with 2 GPUs does the same work per step as the 1-GPU row.
Each configuration is a fresh `python -m torch.distributed.run --standalone --nproc_per_node G -m
sleuth.cli train RECIPE` process; the step times and memory come from the run's own metrics.jsonl
(time/step, memory/peak_allocated_gib and memory/device_in_use_gib, both means over ranks), the
first `--warmup-steps` steps excluded. Checkpoints are off (save_every=0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import train_step  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:qwen2.5-1.5b", help="as bench/train_step.py --model")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer dir for random:* (default .models/qwen3-tokenizer)"
    )
    p.add_argument("--device", default=None, help="cuda if available, else cpu (gloo)")
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2], help="process counts to compare")
    p.add_argument(
        "--parallel",
        nargs="+",
        choices=("ddp", "fsdp"),
        default=["ddp"],
        help="data-parallel wrappers for the multi-process rows (1 process always runs plain)",
    )
    add_step_options(
        p, prompts=8, n=4, turns=2, new_tokens=64, max_obs_tokens=256, steps=3, micro=8, passages=2000
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="static KV cache + compiled decode step in rollouts (not for FSDP rows)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=900, help="seconds allowed per configuration")
    p.add_argument(
        "--out", default=None, help="JSON path (default $OUT/scale_step_<device>.json or bench/results/)"
    )
    args = p.parse_args(argv)
    _common.require_positive(args, "prompts", "turns", "new_tokens", "steps", "micro")
    if args.n < 2:
        raise SystemExit(f"--n must be >= 2, got {args.n}")
    for g in args.gpus:
        if g < 1 or args.prompts % g:
            raise SystemExit(
                f"--gpus {g}: each process count must divide --prompts {args.prompts} "
                "(prompt groups are never split across ranks)"
            )
    return args


def add_step_options(
    p: argparse.ArgumentParser,
    *,
    prompts: int,
    n: int,
    turns: int,
    new_tokens: int,
    max_obs_tokens: int,
    steps: int,
    micro: int,
    passages: int,
) -> None:
    """The RL step's shape, shared by this bench and bench/paper_scale.py (defaults differ)."""
    p.add_argument("--prompts", type=int, default=prompts, help="prompts per step (global)")
    p.add_argument("--n", type=int, default=n)
    p.add_argument("--turns", type=int, default=turns)
    p.add_argument("--new-tokens", type=int, default=new_tokens)
    p.add_argument("--max-obs-tokens", type=int, default=max_obs_tokens)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--micro", type=int, default=micro, help="trajectories per forward/backward on each rank")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--passages", type=int, default=passages)


def torchrun_train(
    recipe: dict[str, Any],
    work: Path,
    name: str,
    gpus: int,
    timeout: int,
    pythonpath: list[str] | None = None,
) -> tuple[int | None, list[dict[str, Any]], Path, float]:
    """`sleuth train` of `recipe` as `torch.distributed.run --nproc_per_node gpus`; returns (exit code or None on
    time-out, the run's metrics.jsonl rows, the log path, wall seconds)."""
    recipe_path = work / f"{name}.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={gpus}",
        "-m",
        "sleuth.cli",
        "train",
        str(recipe_path),
    ]
    env = dict(os.environ)
    paths = [
        str(_common.REPO / "src"),
        *(pythonpath or []),
        *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []),
    ]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("OMP_NUM_THREADS", "1")
    log_path = work / f"{name}.log"
    start = time.perf_counter()
    try:
        with open(log_path, "w") as log:
            code = subprocess.run(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
    except subprocess.TimeoutExpired:
        code = None
    wall = time.perf_counter() - start
    metrics_path = Path(recipe["trainer"]["out_dir"]) / "metrics.jsonl"
    lines = (
        [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
        if metrics_path.exists()
        else []
    )
    print(f"{name}: exit {code}, {len(lines)} steps logged in {wall:.0f} s", flush=True)
    return code, lines, log_path, wall


def require_gpus(device: str, gpus: list[int]) -> None:
    """Exit with one line when a CUDA run asks for more processes than the machine has GPUs."""
    if device.startswith("cuda"):
        import torch

        have = torch.cuda.device_count()
        if max(gpus) > have:
            raise SystemExit(f"--gpus {max(gpus)}: this machine has {have} GPU(s)")


def configurations(args: argparse.Namespace) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    for g in args.gpus:
        for parallel in ["ddp"] if g == 1 else args.parallel:
            if (g, parallel) not in out:
                out.append((g, parallel))
    return out


def run_config(
    args: argparse.Namespace, shared: dict[str, Any], work: Path, device: str, gpus: int, parallel: str
) -> dict[str, Any]:
    name = f"{gpus}x-{parallel}"
    out_dir = work / name
    per_rank = args.prompts * args.n // gpus
    micro_args = argparse.Namespace(**{**vars(args), "micro": min(args.micro, per_rank)})
    # FSDP rollouts decode through the sharded model (no bf16 rollout copy): no compiled step there
    compiled = args.compile and not (gpus > 1 and parallel == "fsdp")
    recipe = train_step.bench_recipe(
        micro_args,
        shared,
        out_dir,
        device,
        cache="static" if compiled else "dynamic",
        compiled=compiled,
        parallel=parallel,
    )
    row: dict[str, Any] = {
        "gpus": gpus,
        "parallel": parallel if gpus > 1 else "none (1 process)",
        "trajectories_per_rank": per_rank,
        "compiled_decoding": compiled,
    }
    code, lines, log_path, row["wall_s"] = torchrun_train(recipe, work, name, gpus, args.timeout)
    tail = log_path.read_text(errors="replace").splitlines()[-20:]
    measured = [m for m in lines if m["step"] > args.warmup_steps]
    print(f"{name}: exit {code}, {len(lines)} steps logged in {row['wall_s']:.0f} s", flush=True)
    if code != 0 or not measured:
        row["status"] = (
            "timed out" if code is None else f"failed (exit {code})" if code else "no measured steps"
        )
        row["log_tail"] = tail
        print("\n".join("    " + line for line in tail), flush=True)
        return row

    def mean(key: str) -> float | None:
        vals = [m[key] for m in measured if key in m]
        return sum(vals) / len(vals) if vals else None

    def peak(key: str) -> float | None:  # GPU memory keys only exist on CUDA
        return max((m[key] for m in measured if key in m), default=None)

    row.update(
        status="ok",
        measured_steps=len(measured),
        step_s=mean("time/step"),
        rollout_s=mean("time/rollout"),
        reward_s=mean("time/reward"),
        update_s=mean("time/update"),
        policy_tokens_per_s=mean("tokens/policy_per_s"),
        peak_allocated_gib_per_gpu=peak("memory/peak_allocated_gib"),
        device_in_use_gib_per_gpu=peak("memory/device_in_use_gib"),
    )
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = _common.pick_device(args.device)
    env = _common.environment(device)
    require_gpus(device, args.gpus)
    print(f"device: {env['card']} ({device}), torch {env['torch']}", flush=True)
    out = _common.out_path(args.out, f"scale_step_{device.split(':')[0]}.json")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sleuth-bench-scale-") as tmp:
        work = Path(tmp)
        shared = train_step.prepare(args, work, device)
        if device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
        for gpus, parallel in configurations(args):
            rows.append(run_config(args, shared, work, device, gpus, parallel))
            one = next((r for r in rows if r["gpus"] == 1 and r.get("step_s")), None)
            for r in rows:
                if one and r.get("step_s"):
                    r["speedup_vs_1"] = one["step_s"] / r["step_s"]
            result = {
                "bench": "scale_step",
                "environment": env,
                "model": shared["model"],
                "settings": vars(args)
                | {"device": device, "global_trajectories_per_step": args.prompts * args.n},
                "rows": rows,
            }
            _common.write_json(out, result)  # after every configuration: a cut-short run keeps its rows
    columns = [
        ("gpus", "GPUs"),
        ("parallel", "wrapper"),
        ("status", "status"),
        ("step_s", "step s"),
        ("rollout_s", "rollout s"),
        ("update_s", "update s"),
        ("speedup_vs_1", "x vs 1"),
        ("peak_allocated_gib_per_gpu", "peak GiB/GPU"),
        ("device_in_use_gib_per_gpu", "in use GiB/GPU"),
    ]
    notes = [
        f"{env['card']} | {args.model} | {args.prompts} prompts x {args.n} samples per step (global), "
        f"{args.turns} turn(s) x {args.new_tokens} tokens, compile {args.compile}",
        f"means over {args.steps} steps after {args.warmup_steps} warm-up step(s)",
    ]
    _common.print_table("RL step on 1 vs N processes", columns, rows, notes)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
