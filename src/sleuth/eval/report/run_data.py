"""What the report reads from a run directory: training runs (metrics, validations), evaluations (summary,
predictions), found recursively (`discover`)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sleuth.appendlog import read_appended
from sleuth.errors import ConfigError, DataFormatError
from sleuth.eval.report.format import is_number
from sleuth.eval.stats import bootstrap_ci, paired_bootstrap
from sleuth.run_layout import (
    GUARDS,
    METRICS,
    RUN_INFO,
    SEARCHER_FILE,
    SFT_INFO,
    VALIDATION,
    validation_records,
)


def read_jsonl(path: Path) -> tuple[list[dict], list[str]]:
    """Records of an append-only JSONL file, plus warnings (`sleuth.appendlog.read_appended`): a torn
    *last* line is dropped with a warning naming the byte offset; a broken line elsewhere is a DataFormatError."""
    appended = read_appended(path)
    return appended.records, appended.warnings


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataFormatError(str(path), err.lineno, f"not valid JSON ({err.msg})") from err


@dataclass
class Validation:
    """One validation on data.dev: its step and each question's reward (question order, `sleuth.rl.validate`)."""

    step: int
    ids: list[str]
    rewards: list[float]
    stage: int = 1  # a two-stage reward (staged) scores by another definition in stage 2

    @property
    def mean(self) -> float:
        return sum(self.rewards) / len(self.rewards)


@dataclass
class TrainingRun:
    path: Path
    label: str
    rows: list[dict]  # metrics.jsonl records, sorted by step
    info: dict  # run.json, {} if absent
    rollout_files: list[Path]
    validations: list[Validation] = field(default_factory=list)  # sorted by step
    guard_events: list[dict] = field(default_factory=list)  # guards.jsonl: what the recipe's guards did

    @property
    def recipe(self) -> dict:
        recipe = self.info.get("recipe")
        return recipe if isinstance(recipe, dict) else {}

    def series(self, key: str) -> tuple[list[int], list[float]]:
        steps = [int(r["step"]) for r in self.rows]
        values = [float(r[key]) if is_number(r.get(key)) else math.nan for r in self.rows]
        return steps, values

    def numeric_keys(self) -> set[str]:
        return {k for r in self.rows for k, v in r.items() if k != "step" and is_number(v)}


@dataclass
class EvalRun:
    path: Path
    label: str
    methods: dict[str, dict[str, dict[str, Any]]]  # method -> dataset|"overall" -> metric -> value
    config: dict
    paired: dict | None = None  # summary.json "paired": each method minus naive-rag with its interval
    predictions: dict[str, list[dict]] = field(default_factory=dict)  # method -> records


def _label(path: Path, root: Path) -> str:
    rel = path.relative_to(root)
    return str(rel) if str(rel) != "." else root.resolve().name


def load_training_run(metrics_path: Path, root: Path, warnings: list[str]) -> TrainingRun:
    records, warn = read_jsonl(metrics_path)
    warnings += warn
    for i, rec in enumerate(records):
        if not isinstance(rec.get("step"), int) or isinstance(rec.get("step"), bool):
            raise DataFormatError(
                str(metrics_path), None, f"record {i + 1} has no integer 'step' (keys: {sorted(rec)[:8]})"
            )
    # A resumed run can repeat a step; the later line is the one the trainer kept.
    by_step = {rec["step"]: rec for rec in records}
    rows = [by_step[s] for s in sorted(by_step)]
    run_dir = metrics_path.parent
    info: dict = {}
    if (run_dir / RUN_INFO).exists():
        loaded = _read_json(run_dir / RUN_INFO)
        if not isinstance(loaded, dict):
            raise DataFormatError(str(run_dir / RUN_INFO), None, "expected a JSON object")
        info = loaded
    elif (run_dir / SFT_INFO).exists():
        info = sft_run_info(run_dir / SFT_INFO)
    rollouts = sorted((run_dir / "rollouts").glob("step_*.jsonl"))
    events = read_jsonl(run_dir / GUARDS)[0] if (run_dir / GUARDS).exists() else []
    return TrainingRun(
        run_dir, _label(run_dir, root), rows, info, rollouts, load_validations(run_dir, warnings), events
    )


def sft_run_info(path: Path) -> dict:
    """An SFT folder's run.json stand-in from its sft.json (records, steps, recipe); an sft.json written before
    it held the recipe names recipe, base model and loop from its final checkpoint's searcher.json."""
    loaded = _read_json(path)
    if not isinstance(loaded, dict):
        raise DataFormatError(str(path), None, "expected a JSON object")
    info = {**loaded, "kind": "sft"}
    if not isinstance(info.get("recipe"), dict):
        searcher = Path(str(info.get("final_checkpoint", ""))) / SEARCHER_FILE
        known = _read_json(searcher) if info.get("final_checkpoint") and searcher.is_file() else {}
        known = known if isinstance(known, dict) else {}
        info["recipe"] = {
            "name": known.get("recipe"),
            "model": {"policy": known.get("base_model")},
            "agent": {"loop": known.get("loop")},
        }
    return info


def load_validations(run_dir: Path, warnings: list[str]) -> list[Validation]:
    """The validations validation.jsonl lists, each with its question-by-question file (one whose file is
    missing is left out with a warning: its interval cannot be drawn)."""
    if not (run_dir / VALIDATION).exists():
        return []
    logged, warn = read_jsonl(run_dir / VALIDATION)
    warnings += warn
    out: dict[int, Validation] = {}
    for rec in logged:
        step = rec.get("step")
        path = (
            validation_records(run_dir, step)
            if isinstance(step, int) and not isinstance(step, bool)
            else None
        )
        if path is None or not path.exists():
            warnings.append(
                f"{run_dir / VALIDATION}: validation of step {step!r} has no per-question file; left out"
            )
            continue
        records, warn = read_jsonl(path)
        warnings += warn
        kept = [r for r in records if is_number(r.get("reward"))]
        stage = int(rec["val/stage"]) if is_number(rec.get("val/stage")) else 1
        if kept:
            out[step] = Validation(
                step, [str(r.get("id")) for r in kept], [float(r["reward"]) for r in kept], stage
            )
    return [out[s] for s in sorted(out)]


def validation_change(validations: Sequence[Validation]) -> dict[str, Any] | None:
    """The last validation (of a run's, sorted by step) minus the first of the same reward stage, on the
    questions both scored (their means over those questions too), with a paired 95% bootstrap interval."""
    if not validations:
        return None
    last = validations[-1]
    same_stage = [v for v in validations if v.stage == last.stage]
    if len(same_stage) < 2:
        return None
    first = same_stage[0]
    before = dict(zip(first.ids, first.rewards, strict=True))
    common = [(before[i], r) for i, r in zip(last.ids, last.rewards, strict=True) if i in before]
    if not common:
        return None
    diff, lo, hi = paired_bootstrap([b for _, b in common], [a for a, _ in common])
    return {
        "first_step": first.step,
        "last_step": last.step,
        "first": sum(a for a, _ in common) / len(common),
        "last": sum(b for _, b in common) / len(common),
        "diff": diff,
        "ci": [lo, hi],
        "n": len(common),
        "slope": validation_slope(same_stage),
    }


def validation_slope(validations: Sequence[Validation]) -> dict[str, Any] | None:
    """Least-squares slope of the mean validation reward over steps (one reward stage, >= 3 validations), on
    the questions every validation scored, with a 95% bootstrap interval over those questions.

    The slope of the means is the mean of the questions' own slopes (it is linear in the rewards), so
    resampling questions resamples the slope, like the paired difference of two validations."""
    if len(validations) < 3:
        return None
    shared = set(validations[0].ids).intersection(*(v.ids for v in validations[1:]))
    if not shared:
        return None
    steps = [float(v.step) for v in validations]
    centre = sum(steps) / len(steps)
    spread = sum((x - centre) ** 2 for x in steps)
    weights = [(x - centre) / spread for x in steps]
    by_id = [dict(zip(v.ids, v.rewards, strict=True)) for v in validations]
    per_question = [
        sum(w * rewards[i] for w, rewards in zip(weights, by_id, strict=True)) for i in sorted(shared)
    ]
    lo, hi = bootstrap_ci(per_question)
    return {
        "per_step": sum(per_question) / len(per_question),
        "ci": [lo, hi],
        "n": len(per_question),
        "steps": [v.step for v in validations],
    }


def load_eval_run(summary_path: Path, root: Path, warnings: list[str]) -> EvalRun | None:
    summary = _read_json(summary_path)
    if not isinstance(summary, dict) or "methods" not in summary:
        return None  # some other tool's summary.json; not ours to judge
    methods = summary["methods"]
    if not isinstance(methods, dict) or not all(isinstance(v, dict) for v in methods.values()):
        raise DataFormatError(
            str(summary_path), None, "'methods' must map method -> {dataset or 'overall': {metric: value}}"
        )
    eval_dir = summary_path.parent
    run = EvalRun(
        eval_dir,
        _label(eval_dir, root),
        methods,
        summary.get("config") if isinstance(summary.get("config"), dict) else {},
        summary.get("paired") if isinstance(summary.get("paired"), dict) else None,
    )
    for method in methods:
        pred_path = eval_dir / method / "predictions.jsonl"
        if pred_path.exists():
            records, warn = read_jsonl(pred_path)
            warnings += warn
            run.predictions[method] = records
    return run


@dataclass
class RunData:
    root: Path
    training: list[TrainingRun]
    evals: list[EvalRun]
    warnings: list[str]


def discover(run_dir: str | Path) -> RunData:
    """Find and load every training log and eval summary under `run_dir`."""
    root = Path(run_dir)
    if not root.is_dir():
        raise ConfigError(f"run directory {root} does not exist or is not a directory")
    warnings: list[str] = []
    training = [load_training_run(p, root, warnings) for p in sorted(root.rglob(METRICS)) if p.is_file()]
    # Oldest summary first, so a demo's eval_before precedes eval_after in tables and arrows.
    summaries = sorted(
        (p for p in root.rglob("summary.json") if p.is_file()), key=lambda p: (p.stat().st_mtime, str(p))
    )
    evals = [e for e in (load_eval_run(p, root, warnings) for p in summaries) if e is not None]
    return RunData(root, training, evals, warnings)
