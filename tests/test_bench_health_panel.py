"""bench/health_panel.py and the committed health panel of issue 26's 48-step H100 run
(docs/guard40_h100/health.png, drawn from bench/results/guard40_h100/): the panel holds every health metric and
the guards' thresholds, the committed image is the render of the committed metrics, and the numbers
docs/results.md quotes (Wilson interval, first vs last steps) against hand-computed values."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sleuth.eval.report import HEALTH_KEYS, guard_thresholds, health_figure, load_training_run

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "guard40_h100"
PANEL = ROOT / "docs" / "guard40_h100" / "health.png"


def _load_bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


health_panel = _load_bench("health_panel")


def _committed_run(tmp_path: Path):
    train = health_panel.build_run_dir(RESULTS, tmp_path / "run")
    return train, load_training_run(train / "metrics.jsonl", tmp_path / "run", [])


def test_the_panel_has_every_health_metric_and_the_guard_thresholds(tmp_path: Path) -> None:
    _, run = _committed_run(tmp_path)
    fig = health_figure(run)
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert set(axes) == set(HEALTH_KEYS)  # the run logged all eleven
    thresholds = guard_thresholds(run)
    assert thresholds == {
        "actor/entropy": [(0.02, "entropy_collapse")],
        "health/no_search": [(0.95, "stopped_searching")],
        "health/invalid_action": [(0.5, "invalid_actions")],
    }
    for metric, drawn in thresholds.items():
        for value, name in drawn:
            ax = axes[metric]
            dashed = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
            assert [list(ln.get_ydata()) for ln in dashed] == [[value, value]], metric
            assert any(name in t.get_text() for t in ax.texts), metric
            low, high = ax.get_ylim()
            assert low <= value <= high, f"{metric}: threshold {value} outside the drawn range {low}-{high}"
    unguarded = [m for m in HEALTH_KEYS if m not in thresholds]
    assert all(not [ln for ln in axes[m].get_lines() if ln.get_linestyle() == "--"] for m in unguarded)


def test_the_committed_image_is_the_render_of_the_committed_metrics(tmp_path: Path) -> None:
    committed = Image.open(PANEL)
    # drawn from exactly these files: a changed metrics.jsonl or run.json needs a re-render
    assert committed.text["Source"] == health_panel.source_text(RESULTS)
    train, _ = _committed_run(tmp_path)
    health_panel.render_health_png(train, tmp_path / "health.png", health_panel.source_text(RESULTS))
    rendered = Image.open(tmp_path / "health.png")
    assert rendered.size == committed.size
    import matplotlib  # deferred: only this comparison needs to know the version

    drawn_by = committed.text.get("Software", "")
    if f"version{matplotlib.__version__}," not in drawn_by:
        pytest.skip(
            f"pixels compared only under the matplotlib that drew the panel ({drawn_by!r}); "
            f"installed {matplotlib.__version__}"
        )
    # one moved point of one curve changes ~0.07% of the pixels (RMS ~2); the render must match exactly
    diff = np.abs(np.asarray(rendered.convert("RGB"), float) - np.asarray(committed.convert("RGB"), float))
    assert float(diff.max()) == 0.0


def test_wilson_interval_by_hand() -> None:
    # 209/240: p = 0.870833, z^2/n = 0.016006; centre (p + z^2/2n)/(1 + z^2/n) = 0.864991,
    # half-width z*sqrt(p(1-p)/n + z^2/4n^2)/(1 + z^2/n) = 0.042499
    lo, hi = health_panel.wilson_interval(209, 240)
    assert lo == pytest.approx(0.822492, abs=1e-5) and hi == pytest.approx(0.907490, abs=1e-5)
    # 0 of n: [0, z^2/(n + z^2)]
    lo, hi = health_panel.wilson_interval(0, 10)
    assert lo == pytest.approx(0.0, abs=1e-12) and hi == pytest.approx(3.841459 / 13.841459, abs=1e-6)
    with pytest.raises(ValueError, match="successes <= n"):
        health_panel.wilson_interval(5, 4)


def test_first_and_last_steps_by_hand() -> None:
    rows = [{"reward/mean": float(s), "accuracy/em": 1.0 if s < 8 else 0.0} for s in range(16)]
    reward, em = health_panel.trend_lines(rows)
    # steps 1-8 hold 0..7 (mean 3.5, SD sqrt(6) = 2.449), steps 9-16 hold 8..15 (mean 11.5)
    assert reward == (
        "reward/mean: steps 1-8 3.500 (SD 2.449, range 0.000-7.000); steps 9-16 11.500 "
        "(SD 2.449, range 8.000-15.000); difference +8.000"
    )
    assert em.endswith("difference -1.000")


def test_the_partial_evaluation_line(tmp_path: Path) -> None:
    path = tmp_path / "em.jsonl"
    path.write_text("".join(json.dumps({"metrics": {"em": float(i < 3)}}) + "\n" for i in range(4)))
    lo, hi = health_panel.wilson_interval(3, 4)
    assert health_panel.partial_eval_line(path) == (
        f"final evaluation (partial, 4 questions): EM 3/4 = 75.0% [{100 * lo:.1f}, {100 * hi:.1f}] (95% Wilson)"
    )


def test_a_folder_without_metrics_is_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="metrics.jsonl is missing"):
        health_panel.build_run_dir(tmp_path, tmp_path / "run")
