"""sleuth report's health panel and verdicts: the health metrics plotted with the guards' thresholds and
events, one line per run on the console."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from sleuth.eval.report import (  # noqa: E402
    discover,
    guard_thresholds,
    health_verdict,
    plot_health,
    render_report,
    training_verdict,
)
from test_eval_report import write_training_run  # noqa: E402

EVENTS = [
    {"step": 3, "guard": "stopped_searching", "kind": "above", "action": "warn", "message": "no search",
     "values": {}, "healthy_until": 1, "outcome": "warned"},
    {"step": 4, "guard": "entropy_collapse", "kind": "below", "action": "rollback",
     "message": "actor/entropy below 0.02 for 2 steps (steps 3-4: 0.01, 0.01)", "values": {}, "healthy_until": 2,
     "outcome": "rolled back to runs/x/checkpoints/step_000002 (learning rate x0.5, now 5e-07)"},
]


def _sft_run(run_dir: Path) -> None:
    # what sleuth's SFT stage writes: sft/ metrics, sft.json, no run.json, no guards.jsonl
    run_dir.mkdir(parents=True)
    rows = [{"step": s, "sft/loss": 6.0 - 0.1 * s, "sft/grad_norm": 0.3, "sft/tokens": 800, "time/step": 0.3}
            for s in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "sft.json").write_text("{}")


def _healthy_run(run_dir: Path, events: list[dict] | None) -> None:
    write_training_run(run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.update({"health/no_search": 0.1 * r["step"], "health/invalid_action": 0.0, "health/nonfinite_skips": 0.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    info = json.loads((run_dir / "run.json").read_text())
    info["recipe"].setdefault("trainer", {})["guards"] = [
        {"name": "stopped_searching", "kind": "above", "metric": "health/no_search", "value": 0.95, "steps": 5},
        {"name": "reward_collapse", "kind": "drop", "window": 5, "by_noise": 4.0},
    ]
    (run_dir / "run.json").write_text(json.dumps(info))
    if events is not None:
        (run_dir / "guards.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_verdicts() -> None:
    assert health_verdict([]) == "healthy (no guard fired)"
    assert health_verdict(EVENTS) == (
        "rolled back at step 4 because entropy_collapse: actor/entropy below 0.02 for 2 steps (steps 3-4: 0.01, "
        "0.01); warned at step 3 (stopped_searching)")
    stop = {**EVENTS[1], "outcome": "stopped: checkpoint runs/x/checkpoints/step_000004"}
    assert health_verdict([stop]).startswith("stopped at step 4 because entropy_collapse: ")


def test_report_has_the_health_panel_and_verdict(tmp_path: Path) -> None:
    _healthy_run(tmp_path / "runs" / "guarded", EVENTS)
    _healthy_run(tmp_path / "runs" / "calm", None)
    data = discover(tmp_path / "runs")
    guarded = next(r for r in data.training if r.label == "guarded")
    assert guard_thresholds(guarded) == {"health/no_search": [(0.95, "stopped_searching")]}
    assert plot_health(guarded).startswith("data:image/png;base64,")
    page = render_report(data)
    assert len(re.findall(r'data-plot="health"', page)) == 2
    assert "Health: rolled back at step 4 because entropy_collapse" in page
    assert "Health: healthy (no guard fired)" in page


def test_a_run_without_health_metrics_has_no_health_panel(tmp_path: Path) -> None:
    write_training_run(tmp_path / "old")
    assert plot_health(discover(tmp_path / "old").training[0]) is None


def test_sleuth_report_prints_one_verdict_per_run(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from sleuth.cli import app

    _healthy_run(tmp_path / "runs" / "guarded", EVENTS)
    _healthy_run(tmp_path / "runs" / "calm", None)
    result = CliRunner().invoke(app, ["report", str(tmp_path / "runs")], terminal_width=400)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "calm: healthy (no guard fired)" in lines
    assert any(x.startswith("guarded: rolled back at step 4 because entropy_collapse: ") for x in lines)


def test_only_runs_watched_by_guards_are_called_healthy(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from sleuth.cli import app

    _healthy_run(tmp_path / "runs" / "train", None)
    _sft_run(tmp_path / "runs" / "train" / "sft")
    write_training_run(tmp_path / "runs" / "old")  # RL steps logged before the health metrics existed
    _healthy_run(tmp_path / "runs" / "off", None)
    info = json.loads((tmp_path / "runs" / "off" / "run.json").read_text())
    info["recipe"]["trainer"]["guards"] = []
    (tmp_path / "runs" / "off" / "run.json").write_text(json.dumps(info))
    _healthy_run(tmp_path / "runs" / "unknown", None)
    (tmp_path / "runs" / "unknown" / "run.json").unlink()

    verdicts = {r.label: training_verdict(r) for r in discover(tmp_path / "runs").training}
    assert verdicts == {
        "train": "healthy (no guard fired)",
        "train/sft": "no RL steps",
        "old": "not watched by guards (metrics.jsonl has no health/ metrics)",
        "off": "not watched by guards (trainer.guards: [])",
        "unknown": "no guard event (which guards watched is unknown: run.json missing or without trainer.guards)",
    }
    # guard events are reported whatever else is missing
    _sft_run(tmp_path / "ev")
    (tmp_path / "ev" / "guards.jsonl").write_text(json.dumps(EVENTS[0]) + "\n")
    assert training_verdict(discover(tmp_path / "ev").training[0]) == "warned at step 3 (stopped_searching)"

    page = render_report(discover(tmp_path / "runs"))
    assert page.count("Health: healthy (no guard fired)") == 1 and "Health: no RL steps" in page
    result = CliRunner().invoke(app, ["report", str(tmp_path / "runs")], terminal_width=400)
    assert result.exit_code == 0, result.output
    assert "train/sft: no RL steps" in result.output.splitlines()
    assert "train: healthy (no guard fired)" in result.output.splitlines()
    assert "old: not watched by guards (metrics.jsonl has no health/ metrics)" in result.output.splitlines()
