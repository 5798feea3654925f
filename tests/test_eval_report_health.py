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
    {
        "step": 3,
        "guard": "stopped_searching",
        "kind": "above",
        "action": "warn",
        "message": "no search",
        "values": {},
        "healthy_until": 1,
        "outcome": "warned",
    },
    {
        "step": 4,
        "guard": "entropy_collapse",
        "kind": "below",
        "action": "rollback",
        "message": "actor/entropy below 0.02 for 2 steps (steps 3-4: 0.01, 0.01)",
        "values": {},
        "healthy_until": 2,
        "outcome": "rolled back to runs/x/checkpoints/step_000002 (learning rate x0.5, now 5e-07)",
    },
]


def _sft_run(run_dir: Path) -> None:
    # what sleuth's SFT stage writes: sft/ metrics, sft.json, no run.json, no guards.jsonl
    run_dir.mkdir(parents=True)
    rows = [
        {"step": s, "sft/loss": 6.0 - 0.1 * s, "sft/grad_norm": 0.3, "sft/tokens": 800, "time/step": 0.3}
        for s in (1, 2)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "sft.json").write_text("{}")


def _healthy_run(run_dir: Path, events: list[dict] | None, steps: int = 6) -> None:
    write_training_run(run_dir, steps=steps)  # 6 steps: enough for the guards below to fire
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.update(
            {"health/no_search": 0.1 * r["step"], "health/invalid_action": 0.0, "health/nonfinite_skips": 0.0}
        )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    info = json.loads((run_dir / "run.json").read_text())
    info["recipe"].setdefault("trainer", {})["guards"] = [
        {
            "name": "stopped_searching",
            "kind": "above",
            "metric": "health/no_search",
            "value": 0.95,
            "steps": 5,
        },
        {"name": "reward_collapse", "kind": "drop", "window": 5, "by_noise": 4.0},
    ]
    (run_dir / "run.json").write_text(json.dumps(info))
    if events is not None:
        (run_dir / "guards.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_verdicts() -> None:
    assert health_verdict([]) == "healthy (no guard fired)"
    assert health_verdict(EVENTS) == (
        "rolled back at step 4 because entropy_collapse: actor/entropy below 0.02 for 2 steps (steps 3-4: 0.01, "
        "0.01); warned at step 3 (stopped_searching)"
    )
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


def test_too_few_steps_to_judge_names_the_metrics_past_thresholds(tmp_path: Path) -> None:
    # the demo's case: 2 RL steps, no search and only invalid actions at both, guards needing 5 steps
    _healthy_run(tmp_path / "short", None, steps=2)
    rows = [json.loads(x) for x in (tmp_path / "short" / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.update({"health/no_search": 1.0, "health/invalid_action": 1.0})
    (tmp_path / "short" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    info = json.loads((tmp_path / "short" / "run.json").read_text())
    info["recipe"]["trainer"]["guards"].append(
        {
            "name": "invalid_actions",
            "kind": "above",
            "metric": "health/invalid_action",
            "value": 0.5,
            "steps": 5,
        }
    )
    (tmp_path / "short" / "run.json").write_text(json.dumps(info))
    verdict = training_verdict(discover(tmp_path / "short").training[0])
    assert verdict == (
        "too few steps to judge (2 logged; the guards need at least 5); past a guard's threshold: "
        "health/no_search > 0.95 at 2 of 2 steps (stopped_searching needs 5 in a row); "
        "health/invalid_action > 0.5 at 2 of 2 steps (invalid_actions needs 5 in a row)"
    )
    assert "Health: too few steps to judge" in render_report(discover(tmp_path / "short"))

    # enough steps for a guard to fire, none fired: healthy, still naming a metric past its threshold at times
    _healthy_run(tmp_path / "long", None)
    rows = [json.loads(x) for x in (tmp_path / "long" / "metrics.jsonl").read_text().splitlines()]
    rows[-1]["health/no_search"] = 1.0
    (tmp_path / "long" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert training_verdict(discover(tmp_path / "long").training[0]) == (
        "healthy (no guard fired); past a guard's threshold: health/no_search > 0.95 at 1 of 6 steps "
        "(stopped_searching needs 5 in a row)"
    )


def test_an_sft_folder_reads_its_sft_json(tmp_path: Path) -> None:
    ckpt = tmp_path / "sft" / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "searcher.json").write_text(
        json.dumps({"recipe": "demo", "loop": "search_r1", "base_model": "tiny"})
    )
    _sft_run_files = tmp_path / "sft"
    rows = [{"step": s, "sft/loss": 6.0 - 0.1 * s} for s in (1, 2)]
    (_sft_run_files / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # an sft.json from before it held the recipe: recipe and model come from the final checkpoint
    (_sft_run_files / "sft.json").write_text(
        json.dumps({"records": 12, "held_out_records": 2, "steps": 2, "final_checkpoint": str(ckpt)})
    )
    page = render_report(discover(tmp_path))
    assert "No run.json" not in page
    for shown in (
        "<dt>recipe</dt><dd>demo</dd>",
        "<dt>model</dt><dd>tiny</dd>",
        "<dt>steps</dt><dd>2 / 2</dd>",
        "<dt>SFT records</dt><dd>12</dd>",
    ):
        assert shown in page, shown
    # what run_sft writes now: the recipe itself
    (_sft_run_files / "sft.json").write_text(
        json.dumps(
            {"records": 12, "steps": 2, "kind": "sft", "recipe": {"name": "r2", "model": {"policy": "m2"}}}
        )
    )
    page = render_report(discover(tmp_path))
    assert "<dt>recipe</dt><dd>r2</dd>" in page and "<dt>model</dt><dd>m2</dd>" in page
