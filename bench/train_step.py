"""Time per RL step (rollout / reward / update), tokens/s and peak memory: sleuth's trainer next to TRL's GRPOTrainer.

    # CPU check (tiny model):
    PYTHONPATH=src python bench/train_step.py --model tiny --prompts 2 --n 2 --new-tokens 16 --steps 2
    # GPU: random-weight Qwen2.5-0.5B shape with the Qwen3 tokenizer:
    PYTHONPATH=src python bench/train_step.py --model random:qwen2.5-0.5b --prompts 8 --n 4 --turns 1 \
        --new-tokens 128 --steps 3

What is the same for every row: the model (a random:* model is saved once to a directory with its
tokenizer and every trainer loads it from there; other specs resolve to one directory), the prompts
(Search-R1 template around synthetic-world questions, chat template applied), `--prompts` prompts x
`--n` samples per step, one optimizer step per RL step over all prompts x n trajectories in
micro-batches of `--micro`, lr `--lr` (constant), grad clip 1.0, no weight decay, KL coefficient
`--kl-coef` (default 0: no reference model in either), temperature 1, full vocabulary, no vLLM, no
gradient checkpointing, fp32 master weights with bf16 autocast on CUDA (sleuth's "auto" dtype;
TRL's bf16=True) and plain fp32 on CPU.

Completion budget: sleuth runs its Search-R1 loop with exactly `--turns` generation rounds of
`--new-tokens` tokens (no forced final turn); TRL's max_completion_length is turns x new_tokens,
sleuth's total policy-token budget per trajectory. Random weights emit no stop strings, so both
run the whole budget; the table shows the tokens actually generated. Sleuth's sequences also hold
the inserted feedback/documents between turns (loss-masked), which its update pass processes; TRL's
completion is one span.

Rewards: sleuth uses search_r1_em; TRL a trivial length-based function (reward cost is negligible
for both). Each trainer runs in its own subprocess (clean peak-memory counters, and a crash in one
does not lose the others), for `--warmup-steps` + `--steps` steps; the warm-up steps are excluded.
Step split: sleuth's own metrics (time/rollout, time/reward, time/update = everything after the
reward: old log-probs, advantages, forward/backward, optimizer). Sleuth rows: "sleuth" decodes with
HF's dynamic cache, "sleuth-compiled" with a static cache and a compiled decode step, "sleuth-default"
with whatever a recipe that says nothing gets (`model.generation_cache: auto`); on CUDA all three
decode a bf16 copy of the fp32 policy, synced after every update. TRL: generate = `_generate`
(tokenise, model.generate, decode), reward = `_calculate_rewards`, update = rest of the optimizer
step. Sleuth's checkpoint saving is switched off (it is not part of a step). TRL rows: cache
"dynamic" (transformers default) and "static" (GRPOConfig.cache_implementation="static"; TRL forces
disable_compile=True, so no compiled variant). Peak memory: torch.cuda.max_memory_allocated on GPU,
peak RSS on CPU.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

VARIANTS = ("sleuth", "sleuth-compiled", "sleuth-default", "trl-dynamic", "trl-static")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default="tiny",
        help="tiny | smollm2-135m-instruct | DIR | random:qwen2.5-0.5b | "
        "random:qwen2.5-1.5b | random:qwen-tiny",
    )
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer dir for random:* (default .models/qwen3-tokenizer)"
    )
    p.add_argument("--device", default=None, help="cuda if available, else cpu")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--n", type=int, default=2, help="samples per prompt (GRPO group size, >= 2)")
    p.add_argument("--turns", type=int, default=1, help="sleuth: generation rounds per trajectory")
    p.add_argument(
        "--new-tokens", type=int, default=32, help="sleuth: tokens per turn; TRL gets turns x this"
    )
    p.add_argument("--max-obs-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=2, help="measured steps (after the warm-up steps)")
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--micro", type=int, default=8, help="trajectories per forward/backward (micro-batch)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--kl-coef", type=float, default=0.0, help="sleuth algorithm.kl.coef and TRL beta")
    p.add_argument("--passages", type=int, default=2000)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=1800, help="seconds allowed per trainer subprocess")
    p.add_argument(
        "--out", default=None, help="JSON path (default $OUT/train_step_<device>.json or bench/results/)"
    )
    p.add_argument("--worker", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--work-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    _common.require_positive(
        args, "prompts", "turns", "new_tokens", "max_obs_tokens", "steps", "micro", "passages"
    )
    if args.n < 2:
        raise SystemExit(f"--n must be >= 2 (GRPO compares the samples of one prompt), got {args.n}")
    if args.warmup_steps < 0:
        raise SystemExit("--warmup-steps must be >= 0")
    batch = args.prompts * args.n
    args.micro = min(args.micro, batch)
    if batch % args.micro:
        raise SystemExit(
            f"--micro {args.micro} must divide prompts x n = {batch} (one optimizer step per RL step)"
        )
    return args


# ---------------------------------------------------------------------------------------------------
# shared set-up (parent)


def prepare(args: argparse.Namespace, work: Path, device: str) -> dict[str, Any]:
    """Model directory and synthetic world + BM25 index that every trainer loads."""
    import torch

    t0 = time.perf_counter()
    if args.model.startswith("random:"):
        # Saved in bf16 (half the bytes to write and read); both trainers load fp32 master weights from it.
        model, tokenizer, info = _common.build_model(args.model, args.tokenizer, device, "bfloat16")
        model_dir = work / "model"
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    else:
        from sleuth.llm.registry import resolve_model_path

        model_dir = Path(resolve_model_path(args.model))
        info = {"spec": args.model, "source": str(model_dir)}
    model_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    needed = args.prompts * (args.steps + args.warmup_steps)
    world = _common.build_world(work / "world", args.passages, needed)
    if len(world["examples"]) < needed:
        raise SystemExit(
            f"the synthetic world has {len(world['examples'])} train questions, {needed} needed; "
            "raise --passages"
        )
    return {
        "model_dir": str(model_dir),
        "model": info,
        "train": str(world["train"]),
        "index": str(world["index"]),
        "model_prepare_s": round(model_s, 2),
        "world_s": round(time.perf_counter() - t0, 2),
    }


# ---------------------------------------------------------------------------------------------------
# sleuth (worker)


def bench_recipe(
    args: argparse.Namespace,
    shared: dict[str, Any],
    out_dir: Path,
    device: str,
    *,
    cache: str | None,
    compiled: bool | None,
    parallel: str = "ddp",
    save_every: int = 0,
) -> dict[str, Any]:
    """The Search-R1 GRPO recipe every sleuth row trains (also used by bench/scale_step.py); cache/compiled
    None leave the recipe's defaults."""
    decoding = {
        k: v for k, v in (("generation_cache", cache), ("compile_generation", compiled)) if v is not None
    }
    return {
        "name": "bench-train-step",
        "seed": args.seed,
        "model": {
            "policy": shared["model_dir"],
            "dtype": "auto",
            "gradient_checkpointing": False,
            "device": device,
            "parallel": parallel,
            **decoding,
        },
        "data": {"train": shared["train"], "shuffle": False},
        "retriever": {"index": shared["index"]},
        "agent": {
            "loop": "search_r1",
            "max_turns": args.turns,
            "max_new_tokens_per_turn": args.new_tokens,
            "max_obs_tokens": args.max_obs_tokens,
            "max_response_tokens": args.turns * (args.new_tokens + args.max_obs_tokens) + 64,
            "options": {"forced_final_answer": False},
        },
        "reward": {"name": "search_r1_em"},
        "algorithm": {
            "name": "grpo",
            "n": args.n,
            "prompts_per_step": args.prompts,
            "minibatch_size": args.prompts * args.n,
            "micro_batch_size": args.micro,
            "kl": {"coef": args.kl_coef},
        },
        "optim": {"lr": args.lr, "warmup_steps": 0, "weight_decay": 0.0, "grad_clip": 1.0},
        "sampling": {"temperature": 1.0, "top_p": 1.0},
        # Checkpoints are not part of a step (the last step would otherwise write weights + optimizer state).
        "trainer": {
            "total_steps": args.warmup_steps + args.steps,
            "save_every": save_every,
            "out_dir": str(out_dir),
        },
    }


def run_sleuth(
    args: argparse.Namespace, shared: dict[str, Any], work: Path, device: str, variant: str
) -> dict[str, Any]:
    import sleuth.rl.trainer as trainer_mod
    from sleuth.rl.config import recipe_from_dict

    out_dir = work / f"{variant}-run"
    cache, compiled = {"sleuth": ("dynamic", False), "sleuth-compiled": ("static", True)}.get(
        variant, (None, None)
    )
    recipe = recipe_from_dict(bench_recipe(args, shared, out_dir, device, cache=cache, compiled=compiled))
    start = time.perf_counter()
    trainer_mod.train(recipe)
    wall = time.perf_counter() - start
    lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    trajs = args.prompts * args.n
    steps = [
        {
            "step": m["step"],
            "generate_s": m["time/rollout"],
            "reward_s": m["time/reward"],
            "update_s": m["time/update"],
            "step_s": m["time/step"],
            "policy_tokens": m["response_length/policy_tokens"] * trajs,
            "sequence_tokens": m["response_length/total_tokens"] * trajs,
            **{
                k.removeprefix("memory/"): m[k]
                for k in ("memory/device_in_use_gib", "memory/peak_allocated_gib")
                if k in m
            },
        }
        for m in lines
    ]
    return {
        "steps": steps,
        "wall_s": wall,
        "config": {
            "trainer": "sleuth.rl.trainer.train",
            "recipe": recipe.model_dump(),
            "generation": f"HFGenerator(policy) inside the trainer: cache={recipe.model.generation_cache!r}, "
            f"compile={recipe.model.compile_generation} (auto/None: the CUDA default)",
        },
    }


# ---------------------------------------------------------------------------------------------------
# TRL (worker)


def run_trl(
    args: argparse.Namespace, shared: dict[str, Any], work: Path, device: str, cache: str
) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from sleuth.agent.search_r1 import SEARCH_R1_USER_TEMPLATE
    from sleuth.data.formats import load_qa

    cuda = device.startswith("cuda")
    total = args.warmup_steps + args.steps
    examples = load_qa(shared["train"])[: args.prompts * total]
    dataset = Dataset.from_list(
        [
            {
                "prompt": [
                    {"role": "user", "content": SEARCH_R1_USER_TEMPLATE.format(question=ex.question.strip())}
                ]
            }
            for ex in examples
        ]
    )
    timings: dict[int, dict[str, float]] = {}

    def book(key: str, seconds: float, step: int, tokens: int = 0) -> None:
        slot = timings.setdefault(step, {"generate_s": 0.0, "reward_s": 0.0, "policy_tokens": 0})
        slot[key] += seconds
        slot["policy_tokens"] += tokens

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts):
            start = _common.timer(device)
            out = super()._generate(prompts)
            book("generate_s", _common.timer(device) - start, self.state.global_step + 1)
            return out

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            start = _common.timer(device)
            out = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            book(
                "reward_s",
                _common.timer(device) - start,
                self.state.global_step + 1,
                sum(len(ids) for ids in completion_ids_list),
            )
            return out

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.begin: dict[int, float] = {}
            self.step_s: dict[int, float] = {}

        def on_step_begin(self, args_, state, control, **kwargs):
            self.begin[state.global_step + 1] = _common.timer(device)

        def on_step_end(self, args_, state, control, **kwargs):
            self.step_s[state.global_step] = _common.timer(device) - self.begin[state.global_step]

    def trivial_reward(completions, **kwargs) -> list[float]:
        # Cheap and not constant, so GRPO groups have some variance.
        return [float(len(str(c)) % 7) / 7.0 for c in completions]

    config = GRPOConfig(
        output_dir=str(work / f"trl-{cache}"),
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=args.prompts * args.n // args.micro,
        num_generations=args.n,
        max_completion_length=args.turns * args.new_tokens,
        max_steps=total,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=args.kl_coef,
        num_iterations=1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        bf16=cuda,
        fp16=False,
        use_cpu=not cuda,
        gradient_checkpointing=False,
        use_vllm=False,
        cache_implementation="static" if cache == "static" else None,
        model_init_kwargs={"dtype": torch.float32},
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=args.seed,
        dataloader_num_workers=0,
    )
    clock = StepClock()
    tokenizer = AutoTokenizer.from_pretrained(shared["model_dir"])
    trainer = TimedGRPOTrainer(
        model=shared["model_dir"],
        reward_funcs=trivial_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    steps = []
    for step in sorted(clock.step_s):
        slot = timings.get(step, {"generate_s": 0.0, "reward_s": 0.0, "policy_tokens": 0})
        step_s = clock.step_s[step]
        steps.append(
            {
                "step": step,
                "generate_s": slot["generate_s"],
                "reward_s": slot["reward_s"],
                "update_s": step_s - slot["generate_s"] - slot["reward_s"],
                "step_s": step_s,
                "policy_tokens": slot["policy_tokens"],
                "sequence_tokens": None,
            }
        )
    import trl

    return {
        "steps": steps,
        "wall_s": wall,
        "config": {
            "trainer": f"trl {trl.__version__} GRPOTrainer",
            "cache_implementation": config.cache_implementation,
            "generation": "transformers model.generate (TRL sets disable_compile=True)",
            "max_completion_length": config.max_completion_length,
            "loss_type": config.loss_type,
            "per_device_train_batch_size": config.per_device_train_batch_size,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "generation_batch_size": config.generation_batch_size,
            "bf16": config.bf16,
            "beta": config.beta,
            "old_logprobs_pass": "skipped (on-policy, num_iterations=1)",
        },
    }


def worker_main(args: argparse.Namespace) -> None:
    work = Path(args.work_dir)
    shared = json.loads((work / "shared.json").read_text())
    device = shared["device"]
    import torch

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    if args.worker.startswith("sleuth"):
        result = run_sleuth(args, shared, work, device, args.worker)
    else:
        result = run_trl(args, shared, work, device, args.worker.split("-", 1)[1])
    peak, measure = _common.peak_memory_bytes(device)
    result.update(
        peak_memory_bytes=peak, peak_memory_measure=measure, modules_loaded=_common.watched_modules_loaded()
    )
    if device.startswith("cuda"):
        # Memory held on the card by anything (other allocators included), not only PyTorch's
        free, total = torch.cuda.mem_get_info()
        result["device_memory_in_use_at_end_bytes"] = total - free
    _common.write_json(work / f"{args.worker}.json", result)


# ---------------------------------------------------------------------------------------------------
# parent: run the workers, summarise


def summarise(variant: str, result: dict[str, Any], warmup: int, trajectories: int) -> dict[str, Any]:
    measured = [s for s in result["steps"] if s["step"] > warmup]
    row: dict[str, Any] = {"variant": variant, "status": "ok", "measured_steps": len(measured)}
    if not measured:
        row["status"] = f"no measured steps (logged {len(result['steps'])})"
        return row

    def mean(key: str) -> float:
        return sum(s[key] for s in measured) / len(measured)

    tokens = sum(s["policy_tokens"] for s in measured)
    step_total = sum(s["step_s"] for s in measured)
    gen_total = sum(s["generate_s"] for s in measured)
    row.update(
        step_s=mean("step_s"),
        generate_s=mean("generate_s"),
        reward_s=mean("reward_s"),
        update_s=mean("update_s"),
        policy_tokens_per_step=tokens / len(measured),
        tokens_per_trajectory=tokens / len(measured) / trajectories,
        tokens_per_s=tokens / step_total if step_total else None,
        generate_tokens_per_s=tokens / gen_total if gen_total else None,
        peak_memory_gib=result["peak_memory_bytes"] / 2**30,
        peak_memory_measure=result["peak_memory_measure"],
        trainer_wall_s=result["wall_s"],
    )
    memory = [s["device_in_use_gib"] for s in result["steps"] if "device_in_use_gib" in s]
    if memory:  # the card's memory in use after every step (all allocators): flat, or growing?
        row["device_in_use_gib_per_step"] = [round(m, 3) for m in memory]
        after5 = memory[5:] or memory
        row["device_in_use_growth_after_step5"] = (max(after5) - after5[0]) / after5[0] if after5[0] else None
    return row


def run_worker(
    variant: str, argv: list[str], work: Path, timeout: int
) -> tuple[dict[str, Any] | None, str, list[str]]:
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", variant, "--work-dir", str(work)]
    env = dict(os.environ)
    src = str(_common.REPO / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log_path = work / f"{variant}.log"
    start = time.perf_counter()
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
    elapsed = time.perf_counter() - start
    log_tail = log_path.read_text(errors="replace").splitlines()[-25:]
    print(f"{variant}: exit {code} after {elapsed:.1f} s", flush=True)
    out = work / f"{variant}.json"
    if code == 0 and out.exists():
        return json.loads(out.read_text()), "", log_tail
    print("\n".join("    " + line for line in log_tail), flush=True)
    if code is None:
        return None, f"timed out after {timeout} s", log_tail
    missing = [line for line in log_tail if "ModuleNotFoundError" in line]
    if missing:
        return None, "not installed: " + missing[-1].strip()[:200], log_tail
    last = next((line for line in reversed(log_tail) if line.strip()), "")
    return None, f"failed (exit {code}): {last.strip()[:200]}", log_tail


def assemble(
    args: argparse.Namespace,
    env: dict[str, Any],
    trl_version: str | None,
    shared: dict[str, Any],
    rows: list[dict[str, Any]],
    details: dict[str, Any],
    device: str,
) -> dict[str, Any]:
    # speed-up = TRL's (transformers-default) step time / this row's step time
    base = next((r for r in rows if r["variant"] == "trl-dynamic" and r.get("step_s")), None)
    for row in rows:
        if base and row.get("step_s"):
            row["speedup_vs_trl_dynamic"] = base["step_s"] / row["step_s"]
    return {
        "bench": "train_step",
        "environment": env,
        "trl_version": trl_version,
        "model": shared["model"],
        "settings": vars(args)
        | {
            "device": device,
            "trajectories_per_step": args.prompts * args.n,
            "trl_max_completion_length": args.turns * args.new_tokens,
            "precision": "fp32 master weights + bf16 autocast" if device.startswith("cuda") else "fp32",
        },
        "timings": {"model_prepare_s": shared["model_prepare_s"], "world_and_index_s": shared["world_s"]},
        "rows": rows,
        "details": details,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    if args.worker:
        worker_main(args)
        return {}
    device = _common.pick_device(args.device)
    env = _common.environment(device)
    print(
        f"device: {env['card']} ({device}), torch {env['torch']}, transformers {env['transformers']}",
        flush=True,
    )
    trl_version = None
    try:
        import importlib.metadata as md

        trl_version = md.version("trl")
    except Exception:  # noqa: BLE001 - any failure means "not installed"
        trl_version = None

    trajectories = args.prompts * args.n
    out = _common.out_path(args.out, f"train_step_{device.split(':')[0]}.json")
    rows: list[dict[str, Any]] = []
    details: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="sleuth-bench-train-") as tmp:
        work = Path(tmp)
        shared = prepare(args, work, device) | {"device": device}
        (work / "shared.json").write_text(json.dumps(shared))
        print(
            f"model dir {shared['model_dir']} ({shared['model_prepare_s']} s), world + BM25 ({shared['world_s']} s)",
            flush=True,
        )
        for variant in args.variants:
            if variant.startswith("trl") and trl_version is None:
                rows.append({"variant": variant, "status": "not installed (pip install trl)"})
                continue
            print(f"{variant}: {args.warmup_steps} warm-up + {args.steps} measured steps ...", flush=True)
            result, error, log_tail = run_worker(variant, raw, work, args.timeout)
            if result is None:
                rows.append({"variant": variant, "status": error})
                details[variant] = {"log_tail": log_tail}
            else:
                details[variant] = result
                rows.append(summarise(variant, result, args.warmup_steps, trajectories))
            # Written after every trainer, so a command cut short still returns the rows it finished.
            _common.write_json(out, assemble(args, env, trl_version, shared, rows, details, device))

    result = assemble(args, env, trl_version, shared, rows, details, device)
    columns = [
        ("variant", "trainer"),
        ("status", "status"),
        ("step_s", "step s"),
        ("generate_s", "rollout s"),
        ("reward_s", "reward s"),
        ("update_s", "update s"),
        ("speedup_vs_trl_dynamic", "x vs TRL"),
        ("tokens_per_trajectory", "tok/traj"),
        ("tokens_per_s", "tok/s (step)"),
        ("generate_tokens_per_s", "tok/s (rollout)"),
        ("peak_memory_gib", "peak GiB"),
    ]
    notes = [
        f"{env['card']} | {args.model} | {args.prompts} prompts x {args.n} samples, sleuth {args.turns} turn(s) x "
        f"{args.new_tokens} tokens, TRL max_completion_length {args.turns * args.new_tokens}",
        f"means over {args.steps} steps after {args.warmup_steps} warm-up step(s); tokens = policy-generated "
        "tokens; peak memory: "
        + (
            "torch.cuda.max_memory_allocated"
            if device.startswith("cuda")
            else "peak RSS of the trainer's process"
        ),
    ]
    _common.print_table("RL step: sleuth trainer vs TRL GRPOTrainer", columns, rows, notes)
    _common.write_json(out, result)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
