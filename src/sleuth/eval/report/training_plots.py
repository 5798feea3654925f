"""The training section: reward, behaviour, optimisation, health, memory and time curves, and the
verdicts on a run's health guards."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from sleuth.eval.report.figures import COLORS, new_figure, png_data_uri
from sleuth.eval.report.format import ema_smooth, is_number, smoothing_weight
from sleuth.eval.report.run_data import TrainingRun, load_training_run
from sleuth.eval.stats import bootstrap_ci
from sleuth.rl.guard_config import DropGuard, GuardConfig, ThresholdGuard
from sleuth.run_layout import (
    METRICS,
    REWARD_EVERY_ROLLOUT,
    groups_filtered,
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
    fig = new_figure(9, 4)
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
        _plot_line(ax, steps, values, COLORS[i % len(COLORS)], key.removeprefix("reward/"), weight)
    if run.validations:
        means = [v.mean for v in run.validations]
        cis = [bootstrap_ci(v.rewards) for v in run.validations]
        ax.errorbar(
            [v.step for v in run.validations],
            means,
            fmt="o-",
            color="tab:blue",
            capsize=3,
            ms=4,
            yerr=[
                [m - lo for m, (lo, _) in zip(means, cis, strict=True)],
                [hi - m for m, (_, hi) in zip(means, cis, strict=True)],
            ],
            label=f"validation: the same {len(run.validations[-1].rewards)} data.dev questions, greedy (95% CI)",
        )
    _mark_stages(ax, _stage_switches(run))
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    smooth_note = f" (thin: raw, thick: EMA {weight:.2f})" if weight > 0 else ""
    ax.set_title("Reward and its components" + smooth_note, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return png_data_uri(fig)


def _small_multiples(
    run: TrainingRun,
    keys: Sequence[str],
    title: str,
    ncols: int = 3,
    annotate: Callable[[Any, str], None] | None = None,
) -> str | None:
    """One small plot per present key (`_small_multiples_figure`), as a PNG data URI."""
    fig = _small_multiples_figure(run, keys, title, ncols, annotate)
    return png_data_uri(fig) if fig is not None else None


def _small_multiples_figure(
    run: TrainingRun,
    keys: Sequence[str],
    title: str,
    ncols: int = 3,
    annotate: Callable[[Any, str], None] | None = None,
) -> Any:
    """One small plot per present key; `annotate(ax, key)` adds to each (thresholds, events). None if no key
    is present."""
    present = [k for k in keys if k in run.numeric_keys()]
    if not present:
        return None
    ncols = min(ncols, len(present))
    nrows = math.ceil(len(present) / ncols)
    height = 2.5 * nrows + 0.5
    fig = new_figure(3.3 * ncols, height, constrained=False)
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
        _plot_line(ax, steps, values, COLORS[i % len(COLORS)], key, weight)
        _mark_stages(ax, switches)
        if annotate is not None:
            annotate(ax, key)
        ax.set_title(key, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    return fig


def plot_behaviour(run: TrainingRun) -> str | None:
    return _small_multiples(run, _BEHAVIOUR_KEYS, "Accuracy and search behaviour per step")


def plot_optimisation(run: TrainingRun) -> str | None:
    return _small_multiples(run, _OPTIM_KEYS, "Optimisation: KL, entropy, losses")


HEALTH_KEYS = (
    "health/no_search",
    "health/repeated_query",
    "health/invalid_action",
    "health/unsupported_answer",
    "health/truncated",
    "health/distinct_queries",
    "health/zero_advantage_groups",
    "health/nonfinite_skips",
    "health/response_length_trend",
    "health/entropy_trend",
    "actor/entropy",
)


def guard_thresholds(run: TrainingRun) -> dict[str, list[tuple[float, str]]]:
    """metric -> (threshold, guard name) of the recipe's `below` / `above` guards (run.json)."""
    guards = (run.recipe.get("trainer") or {}).get("guards") or []
    out: dict[str, list[tuple[float, str]]] = {}
    for g in guards:
        if isinstance(g, dict) and g.get("kind") in ("below", "above") and is_number(g.get("value")):
            out.setdefault(str(g.get("metric")), []).append((float(g["value"]), str(g.get("name"))))
    return out


def plot_health(run: TrainingRun) -> str | None:
    """The health panel (`health_figure`) as a PNG data URI, None for a run without health metrics."""
    fig = health_figure(run)
    return png_data_uri(fig) if fig is not None else None


def health_figure(run: TrainingRun) -> Any:
    """The health metrics (sleuth.rl.health), each with its guards' thresholds (dashed) and every guard
    event of the run (a red line at its step, labelled with the guard and what was done): a matplotlib
    Figure, None for a run without health metrics."""
    if not any(k.startswith("health/") for k in run.numeric_keys()):
        return None
    thresholds = guard_thresholds(run)

    def thresholds_and_events(ax: Any, key: str) -> None:
        for value, name in thresholds.get(key, []):
            ax.axhline(value, color="#d62728", linestyle="--", linewidth=1)
            ax.text(0.01, value, f" {name}", transform=ax.get_yaxis_transform(), fontsize=6, color="#d62728")
        for event in run.guard_events:
            ax.axvline(event.get("step", 0), color="#d62728", linewidth=1, alpha=0.7)
            ax.text(
                event.get("step", 0),
                0.98,
                f" {event.get('guard')}: {event.get('outcome', '').split(' ')[0]}",
                transform=ax.get_xaxis_transform(),
                fontsize=6,
                color="#d62728",
                va="top",
                rotation=90,
            )

    return _small_multiples_figure(
        run,
        HEALTH_KEYS,
        "Health per step: guard thresholds dashed, guard events in red",
        annotate=thresholds_and_events,
    )


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
    parsed = _parse_guards(guards)
    past = "; ".join(_past_thresholds(run, parsed))
    watching = [g for g in parsed if isinstance(g, (ThresholdGuard, DropGuard))]
    if watching and all(_steps_watched(run, g) < _steps_to_fire(g) for g in watching):
        # No guard had the steps it needs to fire: "healthy" would claim what nobody checked.
        need = min(_steps_to_fire(g) for g in watching)
        line = f"too few steps to judge ({len(run.rows)} logged; the guards need at least {need})"
    else:
        line = health_verdict(run.guard_events)
    return f"{line}; past a guard's threshold: {past}" if past else line


def _parse_guards(guards: list[Any]) -> list[Any]:
    """The recipe's guards as their models (defaults filled); an entry that does not parse is left out."""
    adapter = TypeAdapter(GuardConfig)
    parsed = []
    for g in guards:
        try:
            parsed.append(adapter.validate_python(g))
        except ValidationError:
            continue
    return parsed


def _steps_to_fire(guard: ThresholdGuard | DropGuard) -> int:
    """Steps a guard must see before it can fire (`sleuth.rl.guards`: a threshold for `steps` consecutive
    steps; a drop compares the last `window` steps with an earlier window, so `window + 1`)."""
    return guard.steps if isinstance(guard, ThresholdGuard) else guard.window + 1


def _steps_watched(run: TrainingRun, guard: ThresholdGuard | DropGuard) -> int:
    return sum(1 for r in run.rows if r["step"] > guard.after_step and is_number(r.get(guard.metric)))


def _past_thresholds(run: TrainingRun, guards: Sequence[Any]) -> list[str]:
    """ "health/no_search > 0.95 at 3 of 3 steps (stopped_searching needs 5)" for each threshold guard whose
    metric was past its value at some logged step: what the guard would see with more steps."""
    out = []
    for g in guards:
        if not isinstance(g, ThresholdGuard):
            continue
        values = [
            float(r[g.metric]) for r in run.rows if r["step"] > g.after_step and is_number(r.get(g.metric))
        ]
        hits = sum(1 for v in values if (v < g.value if g.kind == "below" else v > g.value))
        if hits:
            sign = "<" if g.kind == "below" else ">"
            out.append(
                f"{g.metric} {sign} {g.value:g} at {hits} of {len(values)} steps ({g.name} needs {g.steps} "
                "in a row)"
            )
    return out


def training_verdicts(run_dir: str | Path) -> list[tuple[str, str]]:
    """(run label, verdict) for every training run under `run_dir` (training_verdict)."""
    root = Path(run_dir)
    warnings: list[str] = []
    return [
        (run.label, training_verdict(run))
        for run in (load_training_run(m, root, warnings) for m in sorted(root.rglob(METRICS)) if m.is_file())
    ]


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
    fig = new_figure(9, 3.2)
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
        ax.bar(steps, heights, bottom=bottom, color=COLORS[i % len(COLORS)], label=name, width=0.8)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("Time per step", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", ncols=len(parts))
    ax.grid(alpha=0.3, axis="y")
    return png_data_uri(fig)
