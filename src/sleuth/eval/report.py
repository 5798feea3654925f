"""One self-contained HTML page for a run directory: training curves, eval tables, trajectories.

The page must open on an offline machine and be safe to share, so plots are embedded as base64
PNG (matplotlib, Agg canvas, no pyplot global state), CSS/JS are inline, and every piece of text
from a run (questions, retrieved documents that may contain `<script>`) goes through jinja's
autoescape or through `highlight_text`, which escapes each segment itself.

A run directory is searched recursively, because a demo run nests a training run and several
eval directories (eval_before/, eval_after/...):
- training: `metrics.jsonl` (+ sibling `run.json`, `rollouts/step_*.jsonl`) from the trainer;
- evaluation: `summary.json` with a "methods" mapping (+ `<method>/predictions.jsonl`) from the harness.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup

from sleuth.appendlog import read_appended
from sleuth.errors import ConfigError, DataFormatError
from sleuth.eval.compare import paired_rows
from sleuth.eval.stats import bootstrap_ci, paired_bootstrap
from sleuth.rewards.metrics import exact_match, normalize_answer
from sleuth.run_layout import (
    GUARDS,
    METRICS,
    REWARD_EVERY_ROLLOUT,
    RUN_INFO,
    VALIDATION,
    groups_filtered,
    validation_records,
)
from sleuth.utils import atomic_write_text

MAX_TRAJECTORIES = 200
MAX_TEXT_CHARS = 20_000  # per text block; a runaway generation must not make the page unusable

# Summary columns shown first, in this order; any other metric follows alphabetically.
METRIC_ORDER = (
    "em",
    "cover_em",
    "f1",
    "span_check",
    "genacc",
    "judge",
    "retrieval_count",
    "input_tokens",
    "output_tokens",
    "latency_s",
)
# Costs: the best value is the smallest. Everything else (accuracy-like) is best when largest.
LOWER_IS_BETTER = frozenset(
    {"retrieval_count", "input_tokens", "output_tokens", "latency_s", "tokens", "turns", "cost"}
)
# The accuracy used on the accuracy-vs-retrieval scatter: the first one a summary has.
SCATTER_ACCURACY_PREFERENCE = ("em", "genacc", "cover_em", "f1", "span_check")

# Action tags of the supported loops, highlighted in trajectory text.
AGENT_TAGS = (
    "think",
    "search",
    "answer",
    "information",
    "observation",
    "original_evidence",
    "query",
    "important_info",
    "search_complete",
    "reflect",
    "documents",
    "rewritten_query",
)

_NON_COMPONENT_REWARD_KEYS = {"reward/mean", "reward/std", "reward/mean_before_filter"}
_OPTIM_KEYS = (
    "actor/kl",
    "actor/kl_loss",
    "actor/entropy",
    "actor/pg_loss",
    "actor/clipfrac",
    "actor/grad_norm",
    "critic/value_loss",
    "critic/clipfrac",
    "lr",
)
_BEHAVIOUR_KEYS = (
    "accuracy/em",
    "retrieval_count",
    "turns",
    "response_length/policy_tokens",
    "answered",
)
_TIME_KEYS = ("time/rollout", "time/reward", "time/update")


# ----------------------------------------------------------------------------
# Small pure helpers (unit-tested against hand-computed values)
# ----------------------------------------------------------------------------


def ema_smooth(values: Sequence[float], weight: float) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing).

    s_t = (1-w) * sum_{i<=t} w^(t-i) x_i / (1 - w^(n_t)), with n_t the number of values seen,
    so the first point equals the first value instead of being pulled towards 0.
    NaN inputs (a step where the metric is missing) stay NaN and do not update the average.
    """
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    out: list[float] = []
    acc = 0.0
    seen = 0
    for x in values:
        if x is None or math.isnan(x):
            out.append(math.nan)
            continue
        acc = weight * acc + (1.0 - weight) * x
        seen += 1
        out.append(acc / (1.0 - weight**seen))
    return out


def smoothing_weight(n_points: int) -> float:
    """More smoothing for longer runs: 0 (none) up to 10 points, 0.9 at 100, capped at 0.95."""
    if n_points <= 10:
        return 0.0
    return min(0.95, 1.0 - 10.0 / n_points)


def best_indices(values: Sequence[float | None], lower_is_better: bool) -> set[int]:
    """Indices holding the best value of a column (ties all win). Empty when fewer than two rows
    have a value or when all values are equal: then nothing stands out and nothing is marked."""
    present = [(i, v) for i, v in enumerate(values) if _is_number(v)]
    if len(present) < 2:
        return set()
    target = min(v for _, v in present) if lower_is_better else max(v for _, v in present)
    best = {i for i, v in present if math.isclose(v, target, rel_tol=1e-12, abs_tol=1e-12)}
    return set() if len(best) == len(present) else best


def column_decimals(values: Sequence[Any]) -> int:
    """One number of decimals per table column so values line up: 0 when every value is a whole
    number (counts), else 1 from 100 up (token counts), 2 from 10 up, 4 below (rates, seconds)."""
    nums = [float(v) for v in values if _is_number(v)]
    if not nums or all(v.is_integer() for v in nums):
        return 0
    top = max(abs(v) for v in nums)
    return 1 if top >= 100 else 2 if top >= 10 else 4


def order_metrics(keys: Iterable[str]) -> list[str]:
    """Known metrics in METRIC_ORDER, then the others alphabetically; "n" and the intervals
    (`<metric>_ci`, shown inside their metric's cell) are left out."""
    keys = set(keys)
    keys = {k for k in keys if k != "n" and not (k.endswith("_ci") and k[: -len("_ci")] in keys)}
    known = [k for k in METRIC_ORDER if k in keys]
    return known + sorted(keys - set(known))


def highlight_text(
    text: str | None,
    needles: Sequence[str] = (),
    tags: Sequence[str] = AGENT_TAGS,
    max_chars: int = MAX_TEXT_CHARS,
) -> Markup:
    """Escape `text` and wrap agent tags (`<search>`...) and occurrences of `needles` (gold answers).

    Spans are found on the raw text and every segment is escaped on its own, so highlighting
    can never split an HTML entity or let markup from the text through.
    """
    if not text:
        return Markup("")
    truncated = 0
    if len(text) > max_chars:
        truncated = len(text) - max_chars
        text = text[:max_chars]
    spans: list[tuple[int, int, str]] = []
    if tags:
        tag_re = re.compile(r"</?(?:" + "|".join(re.escape(t) for t in tags) + r")>")
        spans += [(m.start(), m.end(), "tag") for m in tag_re.finditer(text)]
    words = [n for n in {n.strip() for n in needles if n} if n]
    if words:
        # Longest first so "New York City" wins over "New York"; word edges so "one" misses "money".
        alternation = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
        gold_re = re.compile(rf"(?<!\w)(?:{alternation})(?!\w)", re.IGNORECASE)
        spans += [(m.start(), m.end(), "gold") for m in gold_re.finditer(text)]
    spans.sort(key=lambda s: (s[0], -(s[1] - s[0])))
    parts: list[str] = []
    pos = 0
    for start, end, kind in spans:
        if start < pos:  # overlaps a span already taken
            continue
        parts.append(html.escape(text[pos:start], quote=False))
        css = "tag" if kind == "tag" else "gold"
        element = "span" if kind == "tag" else "mark"
        parts.append(f'<{element} class="{css}">{html.escape(text[start:end], quote=False)}</{element}>')
        pos = end
    parts.append(html.escape(text[pos:], quote=False))
    if truncated:
        parts.append(f'<span class="trunc">… ({truncated} more characters not shown)</span>')
    return Markup("".join(parts))


def contains_answer(text: str | None, golds: Sequence[str]) -> bool:
    """Whether a document mentions a gold answer (normalised substring, as cover-EM does)."""
    if not text:
        return False

    hay = f" {normalize_answer(text)} "
    return any(g and f" {normalize_answer(g)} " in hay for g in golds if normalize_answer(g))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def format_value(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3g}"
        return f"{v:.4f}".rstrip("0").rstrip(".") if abs(v) < 100 else f"{v:.1f}"
    return str(v)


# ----------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------


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
        values = [float(r[key]) if _is_number(r.get(key)) else math.nan for r in self.rows]
        return steps, values

    def numeric_keys(self) -> set[str]:
        return {k for r in self.rows for k, v in r.items() if k != "step" and _is_number(v)}


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
    rollouts = sorted((run_dir / "rollouts").glob("step_*.jsonl"))
    events = read_jsonl(run_dir / GUARDS)[0] if (run_dir / GUARDS).exists() else []
    return TrainingRun(run_dir, _label(run_dir, root), rows, info, rollouts, load_validations(run_dir, warnings),
                       events)


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
        path = validation_records(run_dir, step) if isinstance(step, int) and not isinstance(step, bool) else None
        if path is None or not path.exists():
            warnings.append(f"{run_dir / VALIDATION}: validation of step {step!r} has no per-question file; left out")
            continue
        records, warn = read_jsonl(path)
        warnings += warn
        kept = [r for r in records if _is_number(r.get("reward"))]
        stage = int(rec["val/stage"]) if _is_number(rec.get("val/stage")) else 1
        if kept:
            out[step] = Validation(step, [str(r.get("id")) for r in kept], [float(r["reward"]) for r in kept], stage)
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
    return {"first_step": first.step, "last_step": last.step, "first": sum(a for a, _ in common) / len(common),
            "last": sum(b for _, b in common) / len(common), "diff": diff, "ci": [lo, hi], "n": len(common),
            "slope": validation_slope(same_stage)}


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
    per_question = [sum(w * rewards[i] for w, rewards in zip(weights, by_id, strict=True)) for i in sorted(shared)]
    lo, hi = bootstrap_ci(per_question)
    return {"per_step": sum(per_question) / len(per_question), "ci": [lo, hi], "n": len(per_question),
            "steps": [v.step for v in validations]}


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
    training = [
        load_training_run(p, root, warnings) for p in sorted(root.rglob(METRICS)) if p.is_file()
    ]
    # Oldest summary first, so a demo's eval_before precedes eval_after in tables and arrows.
    summaries = sorted(
        (p for p in root.rglob("summary.json") if p.is_file()), key=lambda p: (p.stat().st_mtime, str(p))
    )
    evals = [e for e in (load_eval_run(p, root, warnings) for p in summaries) if e is not None]
    return RunData(root, training, evals, warnings)


# ----------------------------------------------------------------------------
# Plots (matplotlib Figure + Agg canvas: no pyplot, no global backend switch)
# ----------------------------------------------------------------------------

_COLORS = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


def _new_figure(width: float, height: float, constrained: bool = True):
    # deferred: matplotlib is heavy; only reports with plots need it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # deferred: matplotlib is heavy; only reports with plots need it

    # Constrained layout costs ~0.4 s per grid of small plots; grids place themselves by hand.
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained" if constrained else None)
    FigureCanvasAgg(fig)
    return fig


def _png_data_uri(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _stage_switches(run: TrainingRun) -> list[tuple[int, float]]:
    """(first step, stage) wherever the logged stage changes (staged reward, QAgent stages)."""
    steps, stages = run.series("stage")
    return [
        (s, cur)
        for s, prev, cur in zip(steps[1:], stages, stages[1:], strict=False)
        if not math.isnan(cur) and not math.isnan(prev) and cur != prev
    ]


def _plot_line(ax, steps: list[int], values: list[float], color: str, label: str, weight: float) -> None:
    marker = "o" if len(steps) <= 30 else None
    if weight > 0:
        ax.plot(steps, values, color=color, alpha=0.3, linewidth=1, marker=marker, markersize=3)
        ax.plot(steps, ema_smooth(values, weight), color=color, linewidth=2, label=label)
    else:
        ax.plot(steps, values, color=color, linewidth=1.8, marker=marker, markersize=4, label=label)


def _mark_stages(ax, switches: list[tuple[int, float]]) -> None:
    for step, stage in switches:
        ax.axvline(step - 0.5, color="#888", linestyle="--", linewidth=1)
        ax.text(
            step - 0.5, 0.98, f" stage {stage:g}", transform=ax.get_xaxis_transform(),
            fontsize=7, color="#555", va="top", ha="left",
        )  # fmt: skip


def filtered_steps(rows: Sequence[Mapping[str, Any]]) -> bool:
    """Whether DAPO's dynamic sampling dropped groups at any step: then the reward of every rollout (the
    policy's, `run_layout.policy_reward`) is plotted beside the kept groups' mean."""
    return any(groups_filtered(r) for r in rows)


def plot_rewards(run: TrainingRun) -> str | None:
    keys = run.numeric_keys()
    components = sorted(k for k in keys if k.startswith("reward/") and k not in _NON_COMPONENT_REWARD_KEYS)
    if "reward/mean" not in keys and not components:
        return None
    fig = _new_figure(9, 4)
    ax = fig.add_subplot()
    weight = smoothing_weight(len(run.rows))
    filtered = filtered_steps(run.rows)
    if "reward/mean" in keys:
        steps, mean = run.series("reward/mean")
        if "reward/std" in keys:
            _, std = run.series("reward/std")
            ax.fill_between(
                steps, [m - s for m, s in zip(mean, std, strict=True)], [m + s for m, s in zip(mean, std, strict=True)],
                color="black", alpha=0.08, linewidth=0, label="mean ± std",
            )  # fmt: skip
        if filtered:  # the policy's reward in black, the trained-on subset in grey
            _plot_line(ax, steps, mean, "#999999", "reward, groups kept for the update", weight)
            steps, every = run.series(REWARD_EVERY_ROLLOUT)
            _plot_line(ax, steps, every, "black", "reward, every rollout of the step", weight)
        else:
            _plot_line(ax, steps, mean, "black", "reward (total)", weight)
    for i, key in enumerate(components):
        steps, values = run.series(key)
        _plot_line(ax, steps, values, _COLORS[i % len(_COLORS)], key.removeprefix("reward/"), weight)
    if run.validations:
        means = [v.mean for v in run.validations]
        cis = [bootstrap_ci(v.rewards) for v in run.validations]
        ax.errorbar([v.step for v in run.validations], means, fmt="o-", color="tab:blue", capsize=3, ms=4,
                    yerr=[[m - lo for m, (lo, _) in zip(means, cis, strict=True)],
                          [hi - m for m, (_, hi) in zip(means, cis, strict=True)]],
                    label=f"validation: the same {len(run.validations[-1].rewards)} data.dev questions, greedy (95% CI)")
    _mark_stages(ax, _stage_switches(run))
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    smooth_note = f" (thin: raw, thick: EMA {weight:.2f})" if weight > 0 else ""
    ax.set_title("Reward and its components" + smooth_note, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return _png_data_uri(fig)


def _small_multiples(run: TrainingRun, keys: Sequence[str], title: str, ncols: int = 3,
                     annotate: Callable[[Any, str], None] | None = None) -> str | None:
    """One small plot per present key; `annotate(ax, key)` adds to each (thresholds, events)."""
    present = [k for k in keys if k in run.numeric_keys()]
    if not present:
        return None
    ncols = min(ncols, len(present))
    nrows = math.ceil(len(present) / ncols)
    height = 2.5 * nrows + 0.5
    fig = _new_figure(3.3 * ncols, height, constrained=False)
    fig.subplots_adjust(
        left=0.22 / ncols + 0.02,
        right=0.98,
        top=1 - 0.55 / height,
        bottom=0.35 / height,
        hspace=0.55,
        wspace=0.35,
    )
    fig.suptitle(title, fontsize=10)
    weight = smoothing_weight(len(run.rows))
    switches = _stage_switches(run)
    for i, key in enumerate(present):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        steps, values = run.series(key)
        _plot_line(ax, steps, values, _COLORS[i % len(_COLORS)], key, weight)
        _mark_stages(ax, switches)
        if annotate is not None:
            annotate(ax, key)
        ax.set_title(key, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    return _png_data_uri(fig)


def plot_behaviour(run: TrainingRun) -> str | None:
    return _small_multiples(run, _BEHAVIOUR_KEYS, "Accuracy and search behaviour per step")


def plot_optimisation(run: TrainingRun) -> str | None:
    return _small_multiples(run, _OPTIM_KEYS, "Optimisation: KL, entropy, losses")


HEALTH_KEYS = (
    "health/no_search", "health/repeated_query", "health/invalid_action", "health/unsupported_answer",
    "health/truncated", "health/distinct_queries", "health/zero_advantage_groups", "health/nonfinite_skips",
    "health/response_length_trend", "health/entropy_trend", "actor/entropy",
)


def guard_thresholds(run: TrainingRun) -> dict[str, list[tuple[float, str]]]:
    """metric -> (threshold, guard name) of the recipe's `below` / `above` guards (run.json)."""
    guards = (run.recipe.get("trainer") or {}).get("guards") or []
    out: dict[str, list[tuple[float, str]]] = {}
    for g in guards:
        if isinstance(g, dict) and g.get("kind") in ("below", "above") and _is_number(g.get("value")):
            out.setdefault(str(g.get("metric")), []).append((float(g["value"]), str(g.get("name"))))
    return out


def plot_health(run: TrainingRun) -> str | None:
    """The health metrics (sleuth.rl.health), each with its guards' thresholds (dashed) and every guard
    event of the run (a red line at its step, labelled with the guard and what was done)."""
    if not any(k.startswith("health/") for k in run.numeric_keys()):
        return None
    thresholds = guard_thresholds(run)

    def thresholds_and_events(ax: Any, key: str) -> None:
        for value, name in thresholds.get(key, []):
            ax.axhline(value, color="#d62728", linestyle="--", linewidth=1)
            ax.text(0.01, value, f" {name}", transform=ax.get_yaxis_transform(), fontsize=6, color="#d62728")
        for event in run.guard_events:
            ax.axvline(event.get("step", 0), color="#d62728", linewidth=1, alpha=0.7)
            ax.text(event.get("step", 0), 0.98, f" {event.get('guard')}: {event.get('outcome', '').split(' ')[0]}",
                    transform=ax.get_xaxis_transform(), fontsize=6, color="#d62728", va="top", rotation=90)

    return _small_multiples(run, HEALTH_KEYS, "Health per step: guard thresholds dashed, guard events in red",
                            annotate=thresholds_and_events)


def health_verdict(events: Sequence[Mapping[str, Any]]) -> str:
    """One line per run: healthy / warned / rolled back / stopped, at which step and why."""
    def say(e: Mapping[str, Any]) -> str:
        return f"at step {e.get('step')} because {e.get('guard')}: {e.get('message')}"

    stops = [e for e in events if str(e.get("outcome", "")).startswith("stopped")]
    rollbacks = [e for e in events if str(e.get("outcome", "")).startswith("rolled back")]
    warned = [e for e in events if e.get("outcome") == "warned"]
    parts = [f"rolled back {say(e)}" for e in rollbacks] + [f"stopped {say(e)}" for e in stops]
    if warned:
        parts.append("warned " + "; ".join(f"at step {e.get('step')} ({e.get('guard')})" for e in warned))
    return "; ".join(parts) if parts else "healthy (no guard fired)"


def training_verdict(run: TrainingRun) -> str:
    """The run's verdict line. "healthy" only where guards watched RL steps: a folder without RL steps (SFT)
    says so, and so does an RL run logged before the health metrics existed or with its guards turned off."""
    if run.guard_events:
        return health_verdict(run.guard_events)
    keys = run.numeric_keys()
    if not any(k.startswith("health/") for k in keys):
        if "reward/mean" in keys:  # RL steps, but no health metrics for guards to watch
            return "not watched by guards (metrics.jsonl has no health/ metrics)"
        return "no RL steps"
    guards = (run.recipe.get("trainer") or {}).get("guards")
    if guards == []:
        return "not watched by guards (trainer.guards: [])"
    if not isinstance(guards, list):
        return "no guard event (which guards watched is unknown: run.json missing or without trainer.guards)"
    return health_verdict(run.guard_events)


def training_verdicts(run_dir: str | Path) -> list[tuple[str, str]]:
    """(run label, verdict) for every training run under `run_dir` (training_verdict)."""
    root = Path(run_dir)
    warnings: list[str] = []
    return [(run.label, training_verdict(run))
            for run in (load_training_run(m, root, warnings) for m in sorted(root.rglob(METRICS)) if m.is_file())]


_MEMORY_KEYS = ("memory/device_in_use_gib", "memory/peak_allocated_gib", "memory/host_peak_rss_gib")


def plot_memory(run: TrainingRun) -> str | None:
    """Memory per step: what the card has in use (all allocators) beside PyTorch's peak, so growth that
    the allocator's own counters miss (graph pools, fragmentation) shows; and the host's peak RSS."""
    return _small_multiples(run, _MEMORY_KEYS, "Memory per step (GiB)", ncols=3)


def plot_time(run: TrainingRun) -> str | None:
    keys = run.numeric_keys()
    present = [k for k in _TIME_KEYS if k in keys]
    if not present:
        return None
    fig = _new_figure(9, 3.2)
    ax = fig.add_subplot()
    steps = [int(r["step"]) for r in run.rows]
    bottom = [0.0] * len(steps)
    parts = [(k.removeprefix("time/"), run.series(k)[1]) for k in present]
    if "time/step" in keys:
        total = run.series("time/step")[1]
        known = [sum(0.0 if math.isnan(v[j]) else v[j] for _, v in parts) for j in range(len(steps))]
        parts.append(
            (
                "other",
                [max(0.0, t - k) if not math.isnan(t) else 0.0 for t, k in zip(total, known, strict=True)],
            )
        )
    for i, (name, values) in enumerate(parts):
        heights = [0.0 if math.isnan(v) else v for v in values]
        ax.bar(steps, heights, bottom=bottom, color=_COLORS[i % len(_COLORS)], label=name, width=0.8)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("Time per step", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", ncols=len(parts))
    ax.grid(alpha=0.3, axis="y")
    return _png_data_uri(fig)


# ----------------------------------------------------------------------------
# Eval tables and the accuracy vs retrieval scatter
# ----------------------------------------------------------------------------


def _cell(v: Any, best: bool, decimals: int, interval: Any = None) -> dict:
    """A table cell; `interval` ([lo, hi] from summary.json) is shown beside the value, same decimals."""
    ci = ""
    if isinstance(interval, (list, tuple)) and len(interval) == 2 and all(_is_number(x) for x in interval):
        ci = f"[{interval[0]:.{decimals}f}, {interval[1]:.{decimals}f}]"
    return {"text": f"{v:.{decimals}f}" if _is_number(v) else format_value(v), "best": best, "ci": ci}


def _interval_ends(rows: list[tuple[str, dict[str, Any]]], metric: str) -> list[Any]:
    """The interval ends of a column: a 1.0 accuracy with a [0.85, 1.0] interval needs decimals too."""
    ends = [vals.get(f"{metric}_ci") for _, vals in rows]
    return [x for ci in ends if isinstance(ci, (list, tuple)) for x in ci]


def build_table(rows: list[tuple[str, dict[str, Any]]], caption: str) -> dict:
    """rows: (row label, {metric: value, "n": count}). Returns what the template renders."""
    metrics = order_metrics(k for _, vals in rows for k in vals)
    best = {m: best_indices([vals.get(m) for _, vals in rows], m in LOWER_IS_BETTER) for m in metrics}
    decimals = {m: column_decimals([vals.get(m) for _, vals in rows] + _interval_ends(rows, m)) for m in metrics}
    return {
        "caption": caption,
        "columns": [{"name": m, "lower": m in LOWER_IS_BETTER} for m in metrics],
        "rows": [
            {
                "label": label,
                "n": vals.get("n"),
                "cells": [_cell(vals.get(m), i in best[m], decimals[m], vals.get(f"{m}_ci")) for m in metrics],
            }
            for i, (label, vals) in enumerate(rows)
        ],
    }


def eval_tables(run: EvalRun) -> list[dict]:
    """One table per dataset ("overall" first), rows are methods."""
    datasets = sorted({d for per in run.methods.values() for d in per if isinstance(per[d], dict)})
    datasets = (["overall"] if "overall" in datasets else []) + [d for d in datasets if d != "overall"]
    tables = []
    for ds in datasets:
        rows = [(m, per[ds]) for m, per in run.methods.items() if isinstance(per.get(ds), dict)]
        tables.append(build_table(rows, ds))
    return tables


def paired_table(run: EvalRun) -> dict | None:
    """Each method minus the baseline on the same questions (summary.json "paired"), in points."""
    paired = run.paired
    if not paired or not isinstance(paired.get("methods"), dict) or not paired["methods"]:
        return None
    try:
        header, rows = paired_rows(paired)
    except (KeyError, TypeError, ValueError) as err:
        raise DataFormatError(str(run.path / "summary.json"), None, f"unreadable 'paired' section ({err!r})") from err
    pct = round(100 * float(paired.get("confidence", 0.95)))
    caption = (f"difference with {paired.get('baseline')} on the same questions, percentage points "
               f"[{pct}% paired bootstrap interval]")  # fmt: skip
    return {"caption": caption, "header": header, "rows": rows}


def comparison_table(evals: list[EvalRun]) -> dict | None:
    """Overall scores of every method of every eval dir in one table (before vs after...)."""
    if len(evals) < 2:
        return None
    rows = [
        (f"{e.label} · {m}", per["overall"])
        for e in evals
        for m, per in e.methods.items()
        if isinstance(per.get("overall"), dict)
    ]
    return build_table(rows, "overall, all eval directories") if rows else None


def _mean_retrieval(records: list[dict]) -> float | None:
    vals = [r["retrieval_count"] for r in records if _is_number(r.get("retrieval_count"))]
    return sum(vals) / len(vals) if vals else None


def scatter_points(evals: list[EvalRun]) -> tuple[str | None, list[dict]]:
    """(accuracy metric name, points {eval, method, x retrieval count, y accuracy})."""
    overall_keys = {k for e in evals for per in e.methods.values() for k in (per.get("overall") or {})}
    metric = next((m for m in SCATTER_ACCURACY_PREFERENCE if m in overall_keys), None)
    if metric is None:
        return None, []
    points = []
    for e in evals:
        for method, per in e.methods.items():
            overall = per.get("overall") or {}
            y = overall.get(metric)
            x = overall.get("retrieval_count")
            if not _is_number(x):
                x = _mean_retrieval(e.predictions.get(method, []))
            if _is_number(x) and _is_number(y):
                points.append({"eval": e.label, "method": method, "x": float(x), "y": float(y)})
    return metric, points


def dodge(xs: Sequence[float], ys: Sequence[float], step: float) -> list[float]:
    """x positions with coinciding points spread sideways, centred on the true x (display only:
    ten methods with the same score and retrieval count must not hide behind one marker)."""
    groups: dict[tuple[float, float], list[int]] = {}
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        groups.setdefault((round(x, 6), round(y, 6)), []).append(i)
    out = list(xs)
    for members in groups.values():
        for rank, i in enumerate(members):
            out[i] = xs[i] + (rank - (len(members) - 1) / 2) * step
    return out


def plot_scatter(metric: str, points: list[dict]) -> str:
    from matplotlib.lines import Line2D  # deferred: matplotlib is heavy; only reports with plots need it

    fig = _new_figure(7.5, 4.5)
    ax = fig.add_subplot()
    methods = list(dict.fromkeys(p["method"] for p in points))
    evals = list(dict.fromkeys(p["eval"] for p in points))  # in eval-directory order (oldest first)
    markers = "osD^vP*X"
    color = {m: _COLORS[i % len(_COLORS)] for i, m in enumerate(methods)}
    marker = {e: markers[i % len(markers)] for i, e in enumerate(evals)}
    xs = [p["x"] for p in points]
    ys = [p["y"] for p in points]
    shown_x = dodge(xs, ys, step=0.03 * max(1.0, max(xs) - min(xs)))
    for p, x in zip(points, shown_x, strict=True):
        ax.scatter(x, p["y"], color=color[p["method"]], marker=marker[p["eval"]], s=70, zorder=3)
    # Arrows follow each method from one eval directory to the next (before -> after training).
    for m in methods:
        mine = [(x, p["y"]) for p, x in zip(points, shown_x, strict=True) if p["method"] == m]
        for a, b in zip(mine, mine[1:], strict=False):
            ax.annotate(
                "", xy=b, xytext=a,
                arrowprops={"arrowstyle": "->", "color": color[m], "alpha": 0.6, "shrinkA": 6, "shrinkB": 6},
            )  # fmt: skip
    # Labels next to points collide as soon as two methods score alike; a legend never does.
    handles = [Line2D([], [], color=color[m], marker="o", linestyle="", label=m) for m in methods]
    if len(evals) > 1:
        handles += [Line2D([], [], color="#555", marker=marker[e], linestyle="", label=e) for e in evals]
    ax.legend(handles=handles, fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    ax.set_xlabel("mean retrieval calls per question")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} vs retrieval count (one point per method per eval directory)", fontsize=10)
    if shown_x != xs:
        ax.set_xlabel("mean retrieval calls per question (points at one spot spread sideways; see table)")
    ax.grid(alpha=0.3)
    pad_x = max(0.5, (max(shown_x) - min(shown_x)) * 0.15)
    pad_y = max(0.05, (max(ys) - min(ys)) * 0.15)
    ax.set_xlim(min(shown_x) - pad_x, max(shown_x) + pad_x)
    ax.set_ylim(min(ys) - pad_y, max(ys) + pad_y)
    return _png_data_uri(fig)


# ----------------------------------------------------------------------------
# Trajectory viewer
# ----------------------------------------------------------------------------


def _correct_from_metrics(metrics: dict | None) -> bool | None:
    if not isinstance(metrics, dict):
        return None
    for key in ("em", "genacc", "cover_em"):
        if _is_number(metrics.get(key)):
            return metrics[key] >= 1.0
    return None


def _doc_view(hit: dict, golds: Sequence[str], selected_ids: set[str]) -> dict:
    text = str(hit.get("text", "") or hit.get("contents", ""))
    title = str(hit.get("title", ""))
    doc_id = str(hit.get("doc_id", hit.get("id", "")))
    return {
        "doc_id": doc_id,
        "title": title,
        "score": format_value(hit.get("score")) if hit.get("score") is not None else "",
        "text": highlight_text(text, golds, tags=()),
        "selected": doc_id in selected_ids,
        "has_gold": contains_answer(f"{title} {text}", golds),
    }


def trajectory_view(source: str, record: dict, traj: dict | None) -> dict:
    """Everything the viewer shows for one question, from a prediction record and/or a trajectory."""
    traj = traj or {}
    golds = [str(g) for g in (record.get("golden_answers") or traj.get("golden_answers") or [])]
    prediction = record.get("prediction", traj.get("answer"))
    metrics = record.get("metrics") if isinstance(record.get("metrics"), dict) else {}
    correct = _correct_from_metrics(metrics)
    if correct is None and "golden_answers" in traj:
        correct = bool(exact_match(traj.get("answer") or "", golds))
    selected_ids = {str(h.get("doc_id", h.get("id", ""))) for h in traj.get("selected") or []}
    rewards = traj.get("rewards") or record.get("rewards") or {}
    return {
        "source": source,
        "id": str(record.get("id", traj.get("question_id", ""))),
        "question": str(record.get("question", traj.get("question", ""))),
        "dataset": record.get("dataset") or "",
        "method": record.get("method") or traj.get("method") or "",
        "golds": golds,
        "prediction": "" if prediction is None else str(prediction),
        "no_answer": prediction is None,
        "correct": correct,
        "metrics": [(k, format_value(v)) for k, v in metrics.items()],
        "rewards": [
            (k, format_value(v)) for k, v in sorted(rewards.items(), key=lambda kv: kv[0] != "total")
        ],
        "retrieval_count": record.get("retrieval_count", traj.get("retrieval_count")),
        "finish_reason": traj.get("finish_reason", ""),
        "has_trajectory": bool(traj),
        "prompt": highlight_text(traj.get("prompt_text"), (), tags=AGENT_TAGS),
        # Baselines without an agent loop record no turns, only the response.
        "turns": [
            {"role": t.get("role", "policy"), "text": highlight_text(t.get("text", ""), golds)}
            for t in traj.get("turns") or []
        ]
        or (
            [{"role": "policy", "text": highlight_text(traj["response_text"], golds)}]
            if traj.get("response_text")
            else []
        ),
        "record_extra": [
            (str(k), highlight_text(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False), golds))
            for k, v in (
                [("answer_source", record.get("answer_source"))]
                + list((record.get("extra") if isinstance(record.get("extra"), dict) else {}).items())
            )
            if v is not None
        ],
        "queries": [str(q) for q in traj.get("queries") or []],
        "retrieved": [
            [_doc_view(h, golds, selected_ids) for h in call if isinstance(h, dict)]
            for call in traj.get("retrieved") or []
        ],
        "selected": [_doc_view(h, golds, set()) for h in traj.get("selected") or [] if isinstance(h, dict)],
        "evidence": highlight_text(traj.get("evidence"), golds) if traj.get("evidence") else None,
        "served_context": [
            _doc_view(h, golds, selected_ids) for h in traj.get("served_context") or [] if isinstance(h, dict)
        ],
    }


def _interleave(sources: list[tuple[str, list[dict]]], cap: int) -> list[tuple[str, dict]]:
    """Round-robin over sources so every source is represented when the cap bites."""
    picked: list[tuple[str, dict]] = []
    i = 0
    while len(picked) < cap and any(i < len(recs) for _, recs in sources):
        for label, recs in sources:
            if i < len(recs) and len(picked) < cap:
                picked.append((label, recs[i]))
        i += 1
    return picked


def collect_trajectories(data: RunData, cap: int) -> tuple[list[dict], int, list[str]]:
    """(views, total available, source labels). Sources: each eval dir x method, then the first
    and last training rollout files of each training run (to see what training changed)."""
    sources: list[tuple[str, list[dict]]] = []
    for e in data.evals:
        for method, records in e.predictions.items():
            sources.append((f"{e.label} · {method}", records))
    for run in data.training:
        files = run.rollout_files
        for path in dict.fromkeys([files[0], files[-1]] if files else []):
            records, warn = read_jsonl(path)
            data.warnings.extend(warn)
            step = path.stem.removeprefix("step_").lstrip("0") or "0"
            # Rollout lines are bare trajectories: the record *is* the trajectory.
            sources.append((f"{run.label} · train step {step}", [{"__traj__": r} for r in records]))
    total = sum(len(recs) for _, recs in sources)
    views = []
    for label, rec in _interleave(sources, cap):
        if "__traj__" in rec:
            views.append(trajectory_view(label, {}, rec["__traj__"]))
        else:
            traj = rec.get("trajectory") if isinstance(rec.get("trajectory"), dict) else None
            views.append(trajectory_view(label, rec, traj))
    return views, total, [label for label, recs in sources if recs]


# ----------------------------------------------------------------------------
# Page
# ----------------------------------------------------------------------------


def _run_info(run: TrainingRun) -> list[tuple[str, str]]:
    recipe = run.recipe
    steps_done = run.rows[-1]["step"] if run.rows else 0
    total = (recipe.get("trainer") or {}).get("total_steps")
    info = [
        ("recipe", recipe.get("name")),
        ("model", (recipe.get("model") or {}).get("policy")),
        ("model path", run.info.get("model_path")),
        ("loop", (recipe.get("agent") or {}).get("loop")),
        ("reward", (recipe.get("reward") or {}).get("name")),
        ("algorithm", (recipe.get("algorithm") or {}).get("name")),
        ("steps", f"{steps_done} / {total}" if total else str(steps_done)),
        ("device", run.info.get("device")),
    ]
    return [(k, str(v)) for k, v in info if v not in (None, "")]


def _config_items(config: dict) -> list[tuple[str, str]]:
    items = []
    for k, v in config.items():
        text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
        items.append((str(k), text if len(text) <= 200 else text[:200] + "…"))
    return items


def _template_env():
    return Environment(
        loader=PackageLoader("sleuth.eval", "templates"),
        autoescape=select_autoescape(["html"], default_for_string=True, default=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render_report(data: RunData, title: str | None = None, notes: list[str] | None = None,
                  max_trajectories: int = MAX_TRAJECTORIES, headline: str | None = None) -> str:  # fmt: skip
    """The page as a string (no file written); `headline`, if given, opens it under the title."""
    training = []
    for run in data.training:
        training.append(
            {
                "label": run.label,
                "info": _run_info(run),
                "has_run_json": bool(run.info),
                "n_steps": len(run.rows),
                "validation": validation_change(run.validations),
                "verdict": training_verdict(run),
                "plots": [
                    (name, uri)
                    for name, uri in (
                        ("rewards", plot_rewards(run)),
                        ("behaviour", plot_behaviour(run)),
                        ("optimisation", plot_optimisation(run)),
                        ("health", plot_health(run)),
                        ("time", plot_time(run)),
                        ("memory", plot_memory(run)),
                    )
                    if uri
                ],
                "missing": [
                    name
                    for name, keys in (
                        ("reward", ("reward/mean",)),
                        ("accuracy / retrieval", _BEHAVIOUR_KEYS),
                        ("KL / entropy / loss", _OPTIM_KEYS),
                        ("time", _TIME_KEYS),
                    )
                    if not set(keys) & run.numeric_keys()
                ],
            }
        )
    evals = [
        {
            "label": e.label,
            "path": str(e.path),
            "config": _config_items(e.config),
            "tables": eval_tables(e),
            "paired": paired_table(e),
            "n_predictions": {m: len(r) for m, r in e.predictions.items()},
        }
        for e in data.evals
    ]
    metric, points = scatter_points(data.evals)
    scatter = plot_scatter(metric, points) if points else None
    views, total, sources = collect_trajectories(data, max_trajectories)
    if title is None:
        names = [r.recipe.get("name") for r in data.training if r.recipe.get("name")]
        title = f"sleuth report: {names[0] if names else data.root.resolve().name}"
    page = (
        _template_env()
        .get_template("report.html")
        .render(
            title=title,
            headline=headline,
            run_dir=str(data.root),
            generated=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            notes=[n for n in (notes or []) if n and n.strip()],
            training=training,
            evals=evals,
            comparison=comparison_table(data.evals),
            scatter=scatter,
            scatter_metric=metric,
            scatter_points=points,
            trajectories=views,
            n_trajectories_total=total,
            trajectory_sources=sources,
            max_trajectories=max_trajectories,
            warnings=data.warnings,
        )
    )
    return page


def without_home(text: str) -> str:
    """`text` with the home directory written as `~`: a shared report should not show the user's paths
    (model caches, checkpoints under $HOME)."""
    home = str(Path.home()).rstrip("/")
    if len(home) <= 1:  # HOME=/ : nothing to hide
        return text
    # data: URIs (the embedded plots) are left alone: base64 may spell the home path by chance
    pattern = re.compile(r"(data:[^\"'\s]*)|" + re.escape(home) + r"(?=/|\b|$)")
    return pattern.sub(lambda m: m.group(1) or "~", text)


def build_report(
    run_dir: str | Path,
    out: str | Path | None = None,
    title: str | None = None,
    notes: list[str] | None = None,
    max_trajectories: int = MAX_TRAJECTORIES,
    headline: str | None = None,
) -> Path:
    """Write the HTML report for `run_dir` (default `run_dir/report.html`) atomically; return its path.
    `headline`: a line the page opens with (the demo's trained-searcher-vs-naive-RAG comparison)."""
    if max_trajectories < 0:
        raise ConfigError(f"max_trajectories must be >= 0, got {max_trajectories}")
    data = discover(run_dir)
    page = without_home(render_report(data, title=title, notes=notes, max_trajectories=max_trajectories,
                                      headline=headline))
    out_path = Path(out) if out is not None else Path(run_dir) / "report.html"
    atomic_write_text(out_path, page)
    # The temp file behind the atomic write is private (0600); a report is meant to be shared.
    umask = os.umask(0)
    os.umask(umask)
    out_path.chmod(0o666 & ~umask)
    return out_path
