"""The paper-scale rehearsal: Search-R1's geometry with the papers' model shapes on 1, 2 and 4 GPUs.

    # on a 4-GPU machine: random-weight Qwen2.5-3B shape, LoRA, 1/2/4 GPUs (DDP); 7B full fine-tuning with FSDP2
    PYTHONPATH=src python bench/paper_scale.py --model random:qwen2.5-3b --lora --gpus 1 2 4 --prompts 32
    PYTHONPATH=src python bench/paper_scale.py --model random:qwen2.5-7b --gpus 4 --parallel fsdp --prompts 32
    # the overlap target on one GPU: the next step's rollout concurrent with this step's update
    PYTHONPATH=src python bench/paper_scale.py --model random:qwen2.5-3b --lora --gpus 1 --prompts-per-gpu 16 \
        --steps 3 --micro 16 --micro-tokens 16384 --gradient-checkpointing auto --overlap one_step_async
    # CPU check (gloo, tiny model)
    PYTHONPATH=src python bench/paper_scale.py --model tiny --device cpu --gpus 1 2 --prompts 2 --n 2 \
        --turns 2 --new-tokens 8 --max-obs-tokens 32 --steps 1

Geometry (Search-R1's training scripts): `--prompts` x n=5 trajectories per step, up to 4 turns of 500 new
tokens, top-3 passages per search inserted up to 500 observation tokens, GRPO. Random weights never write an
action, so every turn runs its full token budget and ends in a search whose query is the question
(bench/sleuth_rehearsal.py): retrieval, observation insertion and the growing context run as in a real run,
and every rollout is as long as the budget allows (a real run's turns stop earlier: an upper bound).

With `--prompts-per-gpu P` every configuration gives each GPU P prompts x n (weak scaling: G GPUs take G x P
prompts per step, as data-parallel RL adds GPUs to take a larger batch); without it every configuration takes
the same global `--prompts` (strong scaling). Each configuration is a fresh `python -m torch.distributed.run --nproc_per_node G -m sleuth.cli train` of the
same recipe with the same global batch; numbers come from the run's metrics.jsonl (means over the measured
steps, after `--warmup-steps`). Per row: step time split (rollout / reward / update), trajectories/s and
policy tokens/s per GPU, peak memory per GPU, one-time compile/capture seconds, and the hours that
1,000 steps of 512 prompts x 5 would take at the measured rate (trajectories/s is assumed to hold at 512
prompts: an estimate). Rows are written to the JSON after each configuration, and a rerun with the same
`--work` skips configurations already measured (a lost GPU lease loses at most the one in progress).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import _common  # noqa: E402
import scale_step  # noqa: E402
import train_step  # noqa: E402

PAPER_PROMPTS, PAPER_N, PAPER_STEPS = 512, 5, 1000
# Search-R1's trained (late) trajectory: 2-3 turns, ~118 generated tokens (48 a turn over 2.5 turns on average),
# ~690 passage tokens (460 per search over 1.5 searches on average); the prompt is the real template + question
SHAPES: dict[str, dict[str, Any]] = {
    "full": {},
    "search-r1-late": {"turns": 3, "new_tokens": 48, "max_obs_tokens": 460, "turns_drawn": [2, 3]},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:qwen2.5-3b")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--gpus", type=int, nargs="+", default=[1])
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument(
        "--lora", action="store_true", help="LoRA (r 64) on a bf16 base instead of full fine-tuning"
    )
    scale_step.add_step_options(
        p,
        prompts=32,
        n=PAPER_N,
        turns=4,
        new_tokens=500,
        max_obs_tokens=500,
        steps=2,
        micro=4,
        passages=20000,
    )
    p.add_argument(
        "--prompts-per-gpu",
        type=int,
        default=None,
        help="weak scaling: each configuration takes this many prompts per GPU (x n trajectories), so "
        "every GPU decodes the same batch whatever the count (default: --prompts for all, strong scaling)",
    )
    p.add_argument(
        "--gradient-checkpointing",
        default="true",
        choices=("true", "false", "auto", "selective", "full"),
        help="model.gradient_checkpointing (auto: chosen from the free memory and the token budget)",
    )
    p.add_argument(
        "--micro-tokens", type=int, default=None, help="algorithm.micro_batch_tokens (a token budget)"
    )
    p.add_argument(
        "--shape",
        default="full",
        choices=tuple(SHAPES),
        help="full: every turn runs its whole budget (an upper bound); search-r1-late: Search-R1's "
        "late-training trajectory (~154 prompt + ~118 generated + ~690 passage tokens, 2-3 turns, "
        "the turn count drawn per trajectory), to set beside the peers' published step times",
    )
    p.add_argument("--decoding", default="auto", choices=("auto", "engine", "static", "dynamic"))
    p.add_argument(
        "--overlap",
        default="off",
        choices=("off", "one_step", "one_step_async"),
        help="trainer.overlap: one_step_async rolls the next step out on a background thread (its own CUDA "
        "stream) while this step updates; the first step is synchronous, so measure with --warmup-steps >= 1",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=1500, help="seconds allowed per configuration")
    p.add_argument(
        "--work", default=None, help="work folder kept between runs (resume); default a temp folder"
    )
    p.add_argument("--out", default=None)
    p.add_argument(
        "--retriever-url",
        default=None,
        help="search a running /retrieve server (e.g. a 21M index's `sleuth serve-retriever`) instead of "
        "the bench world's BM25 index; rows then report the rollouts' retrieval share at that size",
    )
    p.add_argument(
        "--train",
        default=None,
        help="questions file (jsonl) for the prompts and scripted queries, e.g. the served index's world",
    )
    args = p.parse_args(argv)
    shape = {k: v for k, v in SHAPES[args.shape].items() if k != "turns_drawn"}
    vars(args).update(shape)  # the shape sets turns, new tokens per turn and the observation cap
    _common.require_positive(args, "prompts", "n", "turns", "new_tokens", "steps", "micro")
    if args.prompts_per_gpu is not None:
        _common.require_positive(args, "prompts_per_gpu")
    return args


def config_args(args: argparse.Namespace, gpus: int) -> argparse.Namespace:
    """The settings of one configuration: under weak scaling the global prompt count grows with the GPUs."""
    if args.prompts_per_gpu is None:
        return args
    return argparse.Namespace(**{**vars(args), "prompts": args.prompts_per_gpu * gpus})


def recipe_for(
    args: argparse.Namespace, shared: dict[str, Any], out_dir: Path, device: str, gpus: int
) -> dict:
    per_rank = args.prompts * args.n // gpus
    micro = argparse.Namespace(**{**vars(args), "micro": min(args.micro, per_rank)})
    recipe = train_step.bench_recipe(
        micro,
        shared,
        out_dir,
        device,
        cache=None if args.decoding == "auto" else args.decoding,
        compiled=None,
        parallel=args.parallel,
    )
    recipe["agent"]["loop"] = "search_r1_rehearsal"
    recipe["plugins"] = ["sleuth_rehearsal"]
    recipe["model"]["gradient_checkpointing"] = {"true": True, "false": False}.get(
        args.gradient_checkpointing, args.gradient_checkpointing
    )
    if args.micro_tokens is not None:
        recipe["algorithm"]["micro_batch_tokens"] = args.micro_tokens
    recipe["trainer"]["overlap"] = args.overlap
    drawn = SHAPES[args.shape].get("turns_drawn")
    if drawn:
        recipe["agent"].setdefault("options", {})["turns_drawn"] = drawn
    if args.retriever_url:
        recipe["retriever"] = {"url": args.retriever_url}
    if args.train:
        recipe["data"]["train"] = str(Path(args.train).resolve())
    if args.lora:
        recipe["model"]["lora"] = {
            "enabled": True,
            "r": 64,
            "alpha": 128,
            "dropout": 0.0,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        }
        recipe["optim"]["lr"] = 1e-5
    return recipe


def summarise(args: argparse.Namespace, lines: list[dict[str, Any]], gpus: int) -> dict[str, Any]:
    measured = [m for m in lines if m["step"] > args.warmup_steps]

    def mean(key: str) -> float | None:
        vals = [m[key] for m in measured if key in m]
        return sum(vals) / len(vals) if vals else None

    trajs = args.prompts * args.n
    step_s = mean("time/step")
    row = {
        "measured_steps": len(measured),
        "step_s": step_s,
        "rollout_s": mean("time/rollout"),
        "reward_s": mean("time/reward"),
        "update_s": mean("time/update"),
        # parts of update_s: tensors and advantages before the passes, the decode engine's weight refresh after
        "make_batch_s": mean("time/make_batch"),
        "weight_sync_s": mean("time/weight_sync"),
        # the passes themselves (forward + backward of every micro-batch), the first and slowest micro-batch, and
        # the clip + optimizer step: update_s minus these is what the update spends outside its passes
        "micro_batches_s": mean("time/micro_batches"),
        "micro_batch_s": mean("time/micro_batch"),
        "micro_batch_first_s": mean("time/micro_batch_first"),
        "micro_batch_max_s": mean("time/micro_batch_max"),
        "optimizer_s": mean("time/optimizer"),
        # time/retrieval: the rollout's seconds inside its retriever (part of rollout_s)
        "retrieval_s": mean("time/retrieval"),
        "retrieval_queries_per_step": mean("retrieval/queries"),
        "trajectories_per_step": trajs,
        "trajectories_per_s": trajs / step_s if step_s else None,
        "trajectories_per_s_per_gpu": trajs / step_s / gpus if step_s else None,
        "policy_tokens_per_s_per_gpu": (mean("tokens/policy_per_s") or 0) / gpus,
        "policy_tokens_per_trajectory": mean("response_length/policy_tokens"),
        "tokens_per_trajectory": mean("response_length/total_tokens"),
        "retrievals_per_trajectory": mean("retrieval_count"),
        # how the update ran and whether rollouts decoded the trainer's weights (issue 43)
        "checkpointed_layers": mean("memory/checkpointed_layers"),
        "update_packed": mean("update/packed"),
        "micro_batches_per_minibatch": mean("update/micro_batches"),
        "rollout_logprob_diff_mean": mean("rollout/logprob_diff_mean"),
        "rollout_logprob_diff_max": mean("rollout/logprob_diff_max"),
        # trainer.overlap: updates between the rollout's weights and the update's, and (one_step_async) how long
        # the update waited for the next step's background rollout; a step is then ~ update + that wait
        "staleness": mean("rollout/staleness"),
        "overlap_wait_s": mean("time/overlap_wait"),
        # the counter: every token of the rank's trajectories (prompt + response) / the update's seconds
        # (old/reference log-prob passes included)
        "update_tokens_per_s_per_gpu": (
            mean("update/tokens") / mean("time/update")
            if mean("update/tokens") and mean("time/update")
            else None
        ),
        "peak_allocated_gib_per_gpu": max(
            (m.get("memory/peak_allocated_gib", 0) for m in lines), default=None
        ),
        "device_in_use_gib_per_gpu": max((m.get("memory/device_in_use_gib", 0) for m in lines), default=None),
        "compile_s_total": sum(m.get("time/decode_compile", 0.0) for m in lines),
        # batches decoded eagerly after a failed graph capture (0 when every decode step ran as a CUDA graph)
        "decode_graph_failures": max((m.get("decode/graph_failures", 0) for m in lines), default=0),
    }
    row.update(update_mfu(args, row))
    # one_step_async: the steps that ran a background rollout (not the last: it has no next step to roll out)
    overlapped = [m["time/step"] for m in measured if "time/overlap_wait" in m]
    row["overlapped_step_s"] = sum(overlapped) / len(overlapped) if overlapped else None
    steady = row["overlapped_step_s"] or step_s
    if steady and row["update_s"] and row["rollout_s"] is not None:
        # the overlap target (issue 43): a step <= 1.1 x max(rollout, update), the two as the off row measures
        # them (under overlap each is slowed by the other); here within the row, 1 + min/max being no overlap
        row["step_over_max_rollout_update"] = steady / max(
            row["rollout_s"] + (row["reward_s"] or 0), row["update_s"]
        )
    if row["retrieval_s"] is not None and row["rollout_s"]:
        row["retrieval_share_of_rollout"] = row["retrieval_s"] / row["rollout_s"]
    if step_s:
        row["projected_hours_1000_steps_512_prompts"] = (
            PAPER_STEPS * PAPER_PROMPTS * PAPER_N / (trajs / step_s)
        ) / 3600
        row["projected_gpu_hours"] = row["projected_hours_1000_steps_512_prompts"] * gpus
    return row


def update_mfu(args: argparse.Namespace, row: dict[str, Any]) -> dict[str, Any]:
    """The update's model FLOPs utilisation by verl's counter (`perf/mfu/actor`): verl_flops over the rank's
    trajectories per update second, over the card's dense bf16 peak. Every trajectory is counted at the measured
    mean length (the rows' own lengths are not in the metrics), which undercounts the attention term of ragged
    lengths slightly."""
    arch = _common.RANDOM_ARCHS.get(args.model.removeprefix("random:"))
    length, tokens = row.get("tokens_per_trajectory"), row.get("update_tokens_per_s_per_gpu")
    peak = _common.default_bf16_tflops(getattr(args, "card", "") or "")
    if not (arch and length and tokens and peak):
        return {}
    rows = tokens / length  # trajectories updated per second on one GPU
    flops = _common.verl_flops(arch, [round(length)]) * rows
    return {"update_tflops_per_gpu_verl": flops / 1e12, "update_mfu_verl": flops / (peak * 1e12)}


def failure_excerpt(lines: list[str]) -> list[str]:
    """The child's exception (the cause; torchrun's own ChildFailedError report comes after it) with the
    frames above it, and the last lines."""
    cause = re.compile(r"^\s*[\w.]*(Error|Exception|Interrupt)\b.*:")
    first = next(
        (i for i, line in enumerate(lines) if cause.match(line) and "ChildFailedError" not in line), None
    )
    head = lines[max(0, first - 30) : first + 3] if first is not None else []
    return head + ["..."] + lines[-8:]


def run_config(args: argparse.Namespace, shared: dict[str, Any], work: Path, device: str, gpus: int) -> dict:
    args = config_args(args, gpus)
    mode = "lora" if args.lora else "full"
    name = (
        f"{gpus}x-{args.parallel if gpus > 1 else 'single'}-{mode}"
        + ("" if args.shape == "full" else f"-{args.shape}")
        + ("" if args.overlap == "off" else f"-{args.overlap}")
    )
    done = work / f"{name}.done.json"
    if done.exists():
        print(f"{name}: measured before, kept ({done})", flush=True)
        return json.loads(done.read_text())
    out_dir = work / name
    recipe = recipe_for(args, shared, out_dir, device, gpus)
    row: dict[str, Any] = {
        "config": name,
        "model": args.model,
        "gpus": gpus,
        "parallel": args.parallel if gpus > 1 else "none",
        "finetune": mode,
        "prompts_per_step": args.prompts,
        "n": args.n,
        "scaling": "strong" if args.prompts_per_gpu is None else "weak",
        "shape": args.shape,
        "overlap": args.overlap,
        "turns": args.turns,
        "new_tokens_per_turn": args.new_tokens,
        "max_obs_tokens": args.max_obs_tokens,
        "recipe": recipe,
    }
    code, lines, log_path, wall = scale_step.torchrun_train(
        recipe, work, name, gpus, args.timeout, [str(BENCH)]
    )
    row["wall_s"] = round(wall, 1)
    if code != 0 or not any(m["step"] > args.warmup_steps for m in lines):
        row["status"] = (
            "timed out" if code is None else f"failed (exit {code})" if code else "no measured steps"
        )
        row["log_tail"] = failure_excerpt(log_path.read_text(errors="replace").splitlines())
        row.update(summarise(args, lines, gpus) if lines else {})
        print("\n".join("    " + line for line in row["log_tail"]), flush=True)
        return row
    row.update(status="ok", **summarise(args, lines, gpus))
    done.write_text(json.dumps(row, indent=1))
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = _common.pick_device(args.device)
    env = _common.environment(device)
    args.card = env.get("card", "")
    scale_step.require_gpus(device, args.gpus)
    tag = f"{args.model.split(':')[-1]}_{'lora' if args.lora else 'full'}_{args.parallel}" + (
        "" if args.shape == "full" else f"_{args.shape.replace('-', '_')}"
    )
    out = _common.out_path(args.out, f"paper_scale_{tag}.json")
    work = (
        Path(args.work) if args.work else Path(os.environ.get("TMPDIR", "/tmp")) / f"sleuth-paper-scale-{tag}"
    )
    work.mkdir(parents=True, exist_ok=True)
    shared_path = work / "shared.json"
    if shared_path.exists():
        shared = json.loads(shared_path.read_text())
    else:
        shared = train_step.prepare(config_args(args, max(args.gpus)), work, device)
        shared_path.write_text(json.dumps(shared))
    print(f"model dir {shared['model_dir']}, world {shared['train']}", flush=True)
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    for gpus in args.gpus:
        rows.append(run_config(args, shared, work, device, gpus))
        one = next((r for r in rows if r["gpus"] == min(args.gpus) and r.get("trajectories_per_s")), None)
        for r in rows:
            if one and r.get("trajectories_per_s"):
                r["speedup_vs_fewest_gpus"] = r["trajectories_per_s"] / one["trajectories_per_s"]
        result = {
            "bench": "paper_scale",
            "environment": env,
            "model": shared["model"],
            "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(["bench/paper_scale.py", *(argv if argv is not None else sys.argv[1:])]),
            "settings": vars(args) | {"device": device},
            "rows": rows,
            "note": "random weights: every turn runs its full budget and ends in a scripted search",
        }
        _common.write_json(out, result)
    columns = [
        ("config", "config"),
        ("status", "status"),
        ("step_s", "step s"),
        ("rollout_s", "rollout s"),
        ("reward_s", "reward s"),
        ("update_s", "update s"),
        ("overlap_wait_s", "overlap wait s"),
        ("overlapped_step_s", "overlapped step s"),
        ("step_over_max_rollout_update", "step / max(roll, upd)"),
        ("update_tokens_per_s_per_gpu", "update tok/s/GPU"),
        ("update_mfu_verl", "update MFU (verl)"),
        ("retrieval_s", "retrieval s"),
        ("trajectories_per_s", "traj/s"),
        ("policy_tokens_per_s_per_gpu", "tok/s/GPU"),
        ("peak_allocated_gib_per_gpu", "peak GiB/GPU"),
        ("compile_s_total", "capture s"),
        ("speedup_vs_fewest_gpus", "x vs fewest"),
        ("projected_hours_1000_steps_512_prompts", "h per 1000x512"),
    ]
    batch = f"{args.prompts_per_gpu} prompts per GPU" if args.prompts_per_gpu else f"{args.prompts} prompts"
    _common.print_table(
        f"paper-scale rehearsal: {args.model}",
        columns,
        rows,
        [
            f"{env['card']} | {batch} x {args.n} | {args.turns} turns x {args.new_tokens} "
            f"tokens, obs <= {args.max_obs_tokens} | {'LoRA' if args.lora else 'full'} {args.parallel}"
            + ("" if args.overlap == "off" else f" | trainer.overlap {args.overlap}")
        ],
    )
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    # a failed configuration fails the command (a resumable driver must not mark the stage done)
    sys.exit(0 if all(r.get("status") == "ok" for r in main()["rows"]) else 1)
