"""Data-parallel training on CPU (gloo, 2 processes) computes the same update as one process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml


def _recipe(small_world: Path, out_dir: Path, parallel: str = "ddp", micro: int = 2) -> dict:
    # PPO with greedy rollouts in float64: the trajectories do not depend on how prompts are
    # split over ranks, so both runs see the same data and must compute the same update.
    return {
        "name": "parity",
        "seed": 0,
        "model": {"policy": "tiny", "dtype": "float64", "parallel": parallel},
        # 3 validation questions split over 2 ranks unevenly (2 + 1); gathered, they must read as one rank's
        "data": {"train": str(small_world / "train.jsonl"), "dev": str(small_world / "dev.jsonl")},
        "retriever": {"index": str(small_world / "bm25")},
        "agent": {
            "loop": "search_r1",
            "max_turns": 1,
            "max_new_tokens_per_turn": 8,
            "max_response_tokens": 64,
            "max_obs_tokens": 24,
        },
        "plugins": ["sleuth_test_rewards"],
        "reward": {"name": "test_token_fraction", "options": {"mode": "residue", "modulus": 7}},
        "algorithm": {
            "name": "ppo",
            "n": 1,
            "prompts_per_step": 4,
            "minibatch_size": 4,
            "micro_batch_size": micro,
            "kl": {"coef": 0.01, "mode": "penalty", "estimator": "k1"},
        },
        # a large Adam eps makes the step proportional to the gradient (no per-element sign
        # amplification), so the comparison tests the distributed gradient itself
        "optim": {"lr": 1e-2, "critic_lr": 1e-2, "eps": 1e-3},
        "sampling": {"temperature": 0.0},
        "trainer": {"total_steps": 2, "save_every": 2, "out_dir": str(out_dir), "eval_examples": 3},
    }


def _run(tmp: Path, small_world: Path, name: str, nproc: int, parallel: str = "ddp", micro: int = 2) -> Path:
    out = tmp / name
    out.mkdir()
    # an earlier run's row: a fresh run drops it and validates anew, and every rank must agree on that
    (out / "validation.jsonl").write_text(json.dumps({"step": 0, "val/reward/mean": 9.0}) + "\n")
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(_recipe(small_world, out, parallel, micro)))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(Path(__file__).parent / "plugins"), os.environ.get("PYTHONPATH")) if p
        ),
    }
    if nproc == 1:
        cmd = [sys.executable, "-m", "sleuth.cli", "train", str(cfg)]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "sleuth.cli",
            "train",
            str(cfg),
        ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def one_process_run(small_world: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one-process run both parity tests compare against (the same recipe for either: one run, read only)."""
    return _run(tmp_path_factory.mktemp("one"), small_world, "one", 1)


@pytest.fixture(scope="module")
def two_rank_ddp_run(small_world: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-rank DDP run: compared with one process, and (a copy) resumed on one. Read only."""
    return _run(tmp_path_factory.mktemp("two"), small_world, "two", 2, "ddp")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_match_one_process(
    small_world: Path, tmp_path: Path, parallel: str, one_process_run: Path, two_rank_ddp_run: Path
) -> None:
    one = one_process_run
    two = two_rank_ddp_run if parallel == "ddp" else _run(tmp_path, small_world, "two", 2, parallel)

    m1 = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in m1] == [m["step"] for m in m2] == [1, 2]
    # Tolerances: rollouts, rewards, KL and value losses agree to ~1e-15. The policy update agrees to
    # ~1e-4 relative (float64 sums in another order, amplified by Adam's normalisation); a wrong
    # normaliser or a missing gradient all-reduce would be off by 100% or more.
    for a, b in zip(m1, m2, strict=True):
        for key in ("reward/mean", "critic/value_loss", "actor/kl", "response_length/policy_tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12), key
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-3)
        # whitened advantages sum to ~0, so the on-policy surrogate is a ~1e-6 residual of O(1) terms
        assert a["actor/pg_loss"] == pytest.approx(b["actor/pg_loss"], abs=1e-5)
    assert json.loads((two / "run.json").read_text())["ranks"] == 2
    for step in (0, 2):  # validation before training and after the last step, question by question
        v1 = [json.loads(x) for x in (one / "validation" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        v2 = [json.loads(x) for x in (two / "validation" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert [r["id"] for r in v1] == [r["id"] for r in v2] and len(v1) == 3
        assert [r["reward"] for r in v1] == pytest.approx([r["reward"] for r in v2], rel=1e-9, abs=1e-12)
    logged = [json.loads(x) for x in (two / "validation.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged] == [0, 2] and logged[0]["val/reward/mean"] != 9.0

    from safetensors.torch import load_file

    w1 = load_file(one / "checkpoints" / "step_000002" / "policy" / "model.safetensors")
    w2 = load_file(two / "checkpoints" / "step_000002" / "policy" / "model.safetensors")
    moved = 0
    base = load_file(Path(json.loads((one / "run.json").read_text())["model_path"]) / "model.safetensors")
    for k in w1:
        # updates are up to ~1e-2 here; the runs agree to ~1e-7 of that (float64, other summation order)
        torch.testing.assert_close(w1[k], w2[k], rtol=0, atol=1e-7, msg=f"{k} differs between 1 and 2 ranks")
        moved += int(not torch.allclose(w1[k].double(), base[k].double()))
    assert moved > 0, "training changed no weights, so the comparison proves nothing"


def test_checkpoint_from_two_ranks_resumes_on_one(tmp_path: Path, two_rank_ddp_run: Path) -> None:
    """Checkpoints hold full (unsharded) state and a global data cursor, so the rank count may change.
    (A copy of the module's 2-rank run is resumed, under its own recipe file naming the copy.)"""
    two = tmp_path / "two"
    shutil.copytree(two_rank_ddp_run, two)
    recipe = yaml.safe_load((two_rank_ddp_run.parent / "two.yaml").read_text())
    recipe["trainer"]["out_dir"] = str(two)
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(recipe))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(Path(__file__).parent / "plugins"), os.environ.get("PYTHONPATH")) if p
        ),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sleuth.cli",
            "train",
            str(tmp_path / "two.yaml"),
            "trainer.total_steps=3",
            "--resume",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    state = json.loads((two / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    # 4 prompts per step were drawn by the 2-rank run twice and by the 1-process run once
    assert state["cursor"]["position"] + state["cursor"]["epoch"] * 48 == 12


def test_update_does_not_depend_on_the_micro_batch_size(small_world: Path, tmp_path: Path) -> None:
    """The GPU profiles pass several groups at once (DemoSize.rl_micro): each micro-batch's loss is normalised by the
    minibatch's totals, so one trajectory a pass and the whole minibatch in one pass make the same update."""
    runs = [_run(tmp_path, small_world, f"micro{m}", 1, micro=m) for m in (1, 4)]
    m1, m4 = ([json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines()] for r in runs)
    assert [m["step"] for m in m1] == [m["step"] for m in m4] == [1, 2]
    for a, b in zip(
        m1, m4, strict=True
    ):  # step 2's rollouts come from the updated policy: equal only if step 1's were
        for key in ("reward/mean", "critic/value_loss", "actor/kl", "response_length/policy_tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12), key
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-6)
        assert a["actor/pg_loss"] == pytest.approx(b["actor/pg_loss"], abs=1e-9)
