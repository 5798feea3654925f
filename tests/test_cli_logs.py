"""The command line under nohup / SLURM and for a first look: plain progress lines with a percentage and an
ETA when stdout is not a terminal, third-party loading bars hidden unless --verbose, `sleuth --version` with
the commit, flags shown as switches."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from sleuth.cli import app


def test_version_names_the_commit() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert re.fullmatch(r"sleuth \d+\.\d+\.\d+ \(commit [0-9a-f]{7,}(\+changes)?\)\n", result.output), (
        result.output
    )


def test_flags_are_shown_as_switches() -> None:
    for command in (["train", "--help"], ["eval", "--help"], ["--help"]):
        result = CliRunner().invoke(app, command, env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        assert "<bool>" not in result.output, command
    assert re.search(
        r"--resume +Continue from the newest",
        CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).output,
    )


def test_plain_progress_lines_have_percentage_and_eta() -> None:
    from sleuth.progress import PlainProgress, _Task

    lines: list[str] = []

    class Console:
        is_terminal = False

        def print(self, text: str, **kwargs: object) -> None:
            lines.append(text)

    task = _Task("search-r1", total=400, completed=100, started=0.0)
    assert PlainProgress.line(task, 60.0) == "search-r1: 100/400 (25%), 1m00s elapsed, ETA 3m00s"
    bar = PlainProgress(Console(), every_s=3600)
    t = bar.add_task("sft", total=4, loss="")
    for _ in range(4):
        bar.advance(t)
    assert len(lines) == 1 and lines[0].startswith("sft: 4/4 (100%)")  # in between, at most one line per hour


def test_eval_prints_progress_as_it_goes_when_piped(tmp_path: Path) -> None:
    from sleuth.llm.registry import tiny_model_dir

    data = tmp_path / "mini.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "question": f"Who founded Varonia {i}?", "golden_answers": ["x"]})
            + "\n"
            for i in range(4)
        )
    )
    res = CliRunner().invoke(
        app,
        [
            "eval",
            "-m",
            "direct",
            "--data",
            str(data),
            "--model",
            str(tiny_model_dir()),
            "--out",
            str(tmp_path / "out"),
            "--max-new-tokens",
            "2",
            "--batch-size",
            "1",
        ],
        env={"SLEUTH_PROGRESS_EVERY": "0"},
    )
    assert res.exit_code == 0, res.output
    progress = [line for line in res.output.splitlines() if line.startswith("direct: ")]
    assert any(line.startswith("direct: 1/4 (25%), ") and ", ETA " in line for line in progress), res.output
    assert progress[-1].startswith("direct: 4/4 (100%), ")


def test_third_party_loading_bars_only_with_verbose() -> None:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "sleuth.cli", "generate", "tiny", "hi", "--max-new-tokens", "1"]
    quiet = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert "Loading weights" not in quiet.stderr
    verbose = subprocess.run(
        [*command[:3], "--verbose", *command[3:]], env=env, capture_output=True, text=True, timeout=300
    )
    assert verbose.returncode == 0 and "Loading weights" in verbose.stderr, verbose.stderr


def test_rl_step_lines_say_the_share_done_and_an_eta() -> None:
    from sleuth.rl.step_metrics import format_line

    m = {
        "reward/mean": 0.5,
        "retrieval_count": 1.0,
        "response_length/policy_tokens": 10.0,
        "time/rollout": 1.0,
        "time/reward": 0.0,
        "time/update": 1.0,
        "time/step": 30.0,
    }
    assert format_line(5, 20, m).startswith("[bold]step 5/20[/] (25%, ETA ~7m30s)")
    assert format_line(20, 20, m).startswith("[bold]step 20/20[/] (100%)")
