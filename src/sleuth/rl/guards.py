"""Guards: conditions over a run's logged metrics and validations (`trainer.guards`), evaluated after each step.

`GuardMonitor` holds what the guards look at (the logged rows, the validations' per-question rewards) and
says which guards fire; it needs no model, so the committed learning runs' metrics can be replayed through
it (tests/test_rl_guards.py). A guard fires when its condition becomes true, and again only after it was
false in between (a persistent condition is one event). What the trainer does about an event is in
`sleuth.rl.guard_actions`. The monitor's state is rebuilt from the run directory on resume (`from_run_dir`):
metrics.jsonl, validation.jsonl with its per-question files, and guards.jsonl (the events, append-only).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sleuth.appendlog import read_appended
from sleuth.rl.guard_config import CountGuard, DropGuard, GuardConfig, ThresholdGuard, ValidationGuard
from sleuth.rl.health import trends
from sleuth.run_layout import GUARDS, METRICS, VALIDATION, validation_records

SEVERITY = {"warn": 0, "rollback": 1, "stop": 2}


@dataclass
class GuardEvent:
    """One guard firing: at which step, why (the numbers), what was done (`outcome`, set by the trainer)."""

    step: int
    guard: str
    kind: str
    action: str
    message: str
    values: dict[str, Any] = field(default_factory=dict)
    healthy_until: int | None = None  # the newest checkpoint step the guard still considers healthy
    outcome: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ValidationResult:
    step: int
    stage: float
    rewards: dict[str, float]  # question id -> reward

    @property
    def mean(self) -> float:
        return sum(self.rewards.values()) / max(len(self.rewards), 1)


def noise_unit(values: Sequence[float]) -> float:
    """Step-to-step noise of a series, robust to level shifts: median |change| / 0.954 (the standard deviation
    of i.i.d. normal steps); the mean |change| / 1.128 when the median is 0."""
    changes = [abs(b - a) for a, b in zip(values, values[1:], strict=False)]
    if not changes:
        return 0.0
    med = statistics.median(changes)
    return med / 0.954 if med > 0 else (sum(changes) / len(changes)) / 1.128


def paired_interval(diffs: Sequence[float], resamples: int, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of paired differences (seeded)."""
    d = np.asarray(diffs, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(resamples, len(d)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


class GuardMonitor:
    def __init__(self, guards: Sequence[GuardConfig], rows: Sequence[Mapping[str, Any]] = (),
                 validations: Sequence[ValidationResult] = (), events: Sequence[GuardEvent] = ()):  # fmt: skip
        self.guards = list(guards)
        self.rows: list[dict[str, Any]] = [dict(r) for r in rows]
        self.validations: list[ValidationResult] = list(validations)
        self.events: list[GuardEvent] = list(events)
        self.active: set[str] = set()  # guards whose condition held at the last check (edge-triggered)

    # -- what the guards see ----------------------------------------------------------------------
    def record(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Add a step's logged metrics; returns its trend metrics (health/*_trend), added to the row too."""
        row = {"step": step, **metrics}
        self.rows.append(row)
        extra = trends(self.rows)
        row.update(extra)
        return extra

    def add_validation(self, result: ValidationResult) -> None:
        self.validations = [v for v in self.validations if v.step != result.step] + [result]

    def rewind(self, step: int) -> None:
        """Forget what happened after `step` updates (a rollback to that checkpoint)."""
        self.rows = [r for r in self.rows if r["step"] <= step]
        self.validations = [v for v in self.validations if v.step <= step]
        self.active.clear()

    def rollbacks(self, guard: str) -> int:
        return sum(e.guard == guard and e.outcome.startswith("rolled back") for e in self.events)

    def lr_scale(self) -> float:
        """The product of the learning-rate factors of every rollback done so far."""
        scale = 1.0
        for e in self.events:
            if e.outcome.startswith("rolled back"):
                scale *= float(e.values.get("lr_factor", 1.0))
        return scale

    # -- checks -------------------------------------------------------------------------------
    def check(self, step: int, validated: bool = False) -> list[GuardEvent]:
        """The events of the guards that fire after `step` updates (validation guards only when a validation
        of that step was just added)."""
        fired = []
        for guard in self.guards:
            if isinstance(guard, ValidationGuard):
                if not validated:
                    continue
                event = self._validation(guard, step)
            elif step <= guard.after_step:
                continue
            else:
                event = _CHECKS[type(guard)](self, guard, step)
            if event is None:
                self.active.discard(guard.name)
            elif guard.name not in self.active or isinstance(guard, ValidationGuard):
                self.active.add(guard.name)
                fired.append(event)
        return fired

    def _recent(self, guard: GuardConfig, count: int) -> list[dict[str, Any]]:
        rows = [r for r in self.rows[-count:] if r["step"] > guard.after_step and guard.metric in r]
        return rows if len(rows) == count else []

    def _threshold(self, guard: ThresholdGuard, step: int) -> GuardEvent | None:
        rows = self._recent(guard, guard.steps)
        values = [float(r[guard.metric]) for r in rows]
        past = (lambda v: v < guard.value) if guard.kind == "below" else (lambda v: v > guard.value)
        if not rows or not all(past(v) for v in values):
            return None
        onset = rows[0]["step"]
        message = (
            f"{guard.metric} {guard.kind} {guard.value:g} for {guard.steps} steps "
            f"(steps {onset}-{step}: {', '.join(f'{v:.4g}' for v in values)})"
        )
        return GuardEvent(
            step,
            guard.name,
            guard.kind,
            guard.action,
            message,
            {"metric": guard.metric, "threshold": guard.value, "values": values, "onset": onset},
            healthy_until=onset - 2,
        )

    def _count(self, guard: CountGuard, step: int) -> GuardEvent | None:
        rows = [r for r in self.rows[-guard.steps :] if r["step"] > guard.after_step and guard.metric in r]
        total = sum(float(r[guard.metric]) for r in rows)
        if total < guard.value:
            return None
        onset = next(r["step"] for r in rows if float(r[guard.metric]) > 0)
        message = (
            f"{guard.metric} summed to {total:g} over the last {len(rows)} steps (limit {guard.value:g})"
        )
        return GuardEvent(
            step,
            guard.name,
            guard.kind,
            guard.action,
            message,
            {"metric": guard.metric, "threshold": guard.value, "total": total, "onset": onset},
            healthy_until=onset - 2,
        )

    def _drop(self, guard: DropGuard, step: int) -> GuardEvent | None:
        rows = [r for r in self.rows if r["step"] > guard.after_step and guard.metric in r]
        if not rows:
            return None
        stage = rows[-1].get("stage", 1.0)
        same = []
        for r in reversed(rows):  # the current reward stage: a new stage redefines the reward
            if r.get("stage", 1.0) != stage:
                break
            same.append(r)
        same.reverse()
        values = [float(r[guard.metric]) for r in same]
        w = guard.window
        if len(values) < w + 1:
            return None
        means = np.convolve(values, np.ones(w) / w, mode="valid")
        best_at = int(np.argmax(means[:-1]))
        best, now = float(means[best_at]), float(means[-1])
        noise = noise_unit(values)
        limit = guard.by if guard.by is not None else guard.by_noise * noise
        if best - now <= limit:
            return None
        best_end = same[best_at + w - 1]["step"]
        unit = f" = {guard.by_noise:g} x noise {noise:.4g}" if guard.by is None else ""
        message = (
            f"{guard.metric} mean of the last {w} steps {now:.4g} is {best - now:.4g} below its best "
            f"{w}-step mean {best:.4g} (steps {same[best_at]['step']}-{best_end}); limit {limit:.4g}{unit}"
        )
        return GuardEvent(
            step,
            guard.name,
            guard.kind,
            guard.action,
            message,
            {
                "metric": guard.metric,
                "best": best,
                "now": now,
                "limit": limit,
                "noise": noise,
                "best_steps": [same[best_at]["step"], best_end],
            },
            healthy_until=best_end - 1,
        )

    def _validation(self, guard: ValidationGuard, step: int) -> GuardEvent | None:
        latest = next((v for v in self.validations if v.step == step), None)
        earlier = [
            v for v in self.validations if v.step < step and latest is not None and v.stage == latest.stage
        ]
        if latest is None or not earlier:
            return None
        best = max(earlier, key=lambda v: (v.mean, -v.step))
        common = sorted(set(best.rewards) & set(latest.rewards))
        if len(common) < 2:
            return None
        diffs = [latest.rewards[q] - best.rewards[q] for q in common]
        low, high = paired_interval(diffs, guard.resamples)
        if high >= -guard.margin:
            return None
        diff = sum(diffs) / len(diffs)
        message = (
            f"validation reward {latest.mean:.4g} after step {step} is {-diff:.4g} below the best "
            f"{best.mean:.4g} (step {best.step}), paired over {len(common)} questions: "
            f"{diff:+.4g} [{low:+.4g}, {high:+.4g}]"
        )
        return GuardEvent(
            step,
            guard.name,
            guard.kind,
            guard.action,
            message,
            {
                "best_step": best.step,
                "best": best.mean,
                "now": latest.mean,
                "diff": diff,
                "ci": [low, high],
                "n": len(common),
            },
            healthy_until=best.step,
        )

    # -- resume -------------------------------------------------------------------------------
    @classmethod
    def from_run_dir(cls, guards: Sequence[GuardConfig], run_dir: str | Path, upto_step: int) -> GuardMonitor:
        """The monitor of a run resumed after `upto_step` updates: its logged rows and validations up to that
        step, and every rollback or stop event (they changed the run); later warnings will be redone."""
        run_dir = Path(run_dir)
        rows = [r for r in _read_jsonl(run_dir / METRICS) if r.get("step", 0) <= upto_step]
        monitor = cls(guards, rows)
        for r in _read_jsonl(run_dir / VALIDATION):
            step = int(r["step"])
            path = validation_records(run_dir, step)
            if step <= upto_step and path.exists():
                monitor.add_validation(read_validation(path, step, float(r.get("val/stage", 1.0))))
        for e in _read_jsonl(run_dir / GUARDS):
            event = GuardEvent(**e)
            if event.step <= upto_step or event.action != "warn":
                monitor.events.append(event)
        return monitor


def read_validation(path: Path, step: int, stage: float) -> ValidationResult:
    rewards = {str(r["id"]): float(r["reward"]) for r in _read_jsonl(path)}
    return ValidationResult(step, stage, rewards)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    # append-only files of the run: a torn last line (a kill or a full disk) is dropped, not a crash on resume
    return read_appended(path).records


def decide(events: Sequence[GuardEvent]) -> GuardEvent | None:
    """The event that decides what the trainer does: the most severe action, the first such guard."""
    acting = [e for e in events if e.action != "warn"]
    return max(acting, key=lambda e: SEVERITY[e.action]) if acting else None


_CHECKS = {
    ThresholdGuard: GuardMonitor._threshold,
    CountGuard: GuardMonitor._count,
    DropGuard: GuardMonitor._drop,
}
