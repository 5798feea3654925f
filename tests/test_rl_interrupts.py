"""Stopping `sleuth train` from outside: SIGTERM (a preempted job) saves a checkpoint after the step under
way and names the resume command; Ctrl-C (SIGINT) names the last checkpoint and the resume command."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tiny_recipe import tiny_grpo_recipe


def _interruptible() -> None:
    # a shell starts a background job (`make test &`, CI under nohup) with SIGINT ignored, and Python then never
    # turns SIGINT into KeyboardInterrupt: the child gets the default back, as a terminal's foreground job has it
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "sleuth.cli", "train", *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=_interruptible,
    )


def _steps_logged(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _signal_after_step(proc: subprocess.Popen, run: Path, steps: int, sig: int) -> str:
    deadline = time.time() + 300
    while _steps_logged(run) < steps:
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=300)
    return out


def test_sigterm_saves_a_checkpoint_and_sigint_names_the_resume_command(
    small_world: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    data = tiny_grpo_recipe(small_world, run, "interrupts", steps=500)
    data["trainer"]["save_every"] = 1000  # no checkpoint but the one the stop writes
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(data))

    proc = _start([str(recipe), "trainer.keep_checkpoints=3"])
    out = _signal_after_step(proc, run, 1, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, out
    saved = sorted((run / "checkpoints").glob("step_*"))
    assert len(saved) == 1, out
    step = int(saved[0].name.removeprefix("step_"))
    assert f"SIGTERM received after step {step} of 500; checkpoint saved" in out
    assert (
        f"stopped by SIGTERM; resume with: sleuth train {recipe} trainer.keep_checkpoints=3 --resume" in out
    )
    assert _steps_logged(run) == step  # the step under way finished and was kept

    proc = _start([str(recipe), "--resume"])
    out = _signal_after_step(proc, run, step + 1, signal.SIGINT)
    assert proc.returncode == 130, out
    assert f"interrupted: last checkpoint {saved[0]}; resume with: sleuth train {recipe} --resume" in out
    assert "Traceback" not in out


def test_sigterm_during_sft_saves_the_step_and_the_same_command_goes_on(
    small_world: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    from sleuth.agent import get_loop
    from sleuth.agent.coldstart import collect_oracle, write_records
    from sleuth.agent.engine import RolloutBudget
    from sleuth.data.formats import read_qa_jsonl
    from sleuth.llm.registry import tiny_model_dir
    from sleuth.retrieval import load_retriever
    from sleuth.rl.config import recipe_from_dict
    from sleuth.rl.interrupts import StoppedBySignal, stop_on_sigterm
    from sleuth.rl.sft import run_sft

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    retriever = load_retriever(small_world / "bm25", corpus=small_world / "corpus.jsonl")
    records, _ = collect_oracle(
        get_loop("search_r1", top_k=3),
        retriever,
        tokenizer,
        read_qa_jsonl(small_world / "train.jsonl")[:8],
        budget=RolloutBudget(max_obs_tokens=128, max_response_tokens=512),
    )
    write_records(tmp_path / "traj.jsonl", records)
    data = tiny_grpo_recipe(small_world, tmp_path / "run", "sft-stop")
    data["sft"] = {
        "data": str(tmp_path / "traj.jsonl"),
        "batch_size": 2,
        "micro_batch_size": 2,
        "epochs": 1,
        "held_out": 0.0,
    }
    recipe = recipe_from_dict(data)
    with stop_on_sigterm():
        os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would: the handler only notes it
        try:
            run_sft(recipe)
            raise AssertionError("SFT went on after SIGTERM")
        except StoppedBySignal as stop:
            said = re.fullmatch(r"SIGTERM received after SFT step 1 of (\d+); checkpoint saved", str(stop))
    assert said is not None and int(said.group(1)) > 1
    assert [p.name for p in (tmp_path / "run" / "sft" / "checkpoints").glob("step_*")] == ["step_000001"]
    total = int(said.group(1))
    assert run_sft(recipe)["checkpoint"].endswith(f"step_{total:06d}")  # the same call goes on from step 1
