"""bench/lease_jobs.py, the one background-job runner of the GPU lease scripts, on CPU: a plan's jobs run in
lanes in order, after their dependencies, leave done-markers, resume after a stop, fail alone, and pack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from bench_loading import BENCH, load_bench

lease_jobs = load_bench("lease_jobs")


def _plan(tmp_path: Path, jobs: list[dict], **extra) -> Path:
    path = tmp_path / "demo.json"
    path.write_text(json.dumps({"work": str(tmp_path / "work"), "jobs": jobs, **extra}))
    return path


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / "lease_jobs.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_jobs_run_in_lanes_after_their_dependencies_and_resume(tmp_path: Path) -> None:
    order = tmp_path / "order.txt"
    path = _plan(
        tmp_path,
        [
            {"id": "a", "run": f"sleep 0.3; echo a >> {order}"},
            {"id": "b", "run": f"echo b:$CUDA_VISIBLE_DEVICES:$LANE_TEST >> {order}", "gpus": "7"},
            {"id": "c", "run": f"echo c >> {order}", "after": ["a"]},
            {"id": "bad", "run": "echo broken; exit 3"},
        ],
        lanes=["0", "1"],
        env={"LANE_TEST": "$WORK"},
        pack=["logs", "progress.log", "missing"],
    )
    plan = lease_jobs.load_plan(path)
    lease_jobs.POLL_S = 0.05
    assert lease_jobs.daemon(plan) == 1  # one job failed
    lines = order.read_text().split()
    assert lines.index("a") < lines.index("c")  # c waited for a, though a lane was free
    assert f"b:7:{tmp_path / 'work'}" in lines  # the job's own GPUs, $WORK expanded
    done = {p.name for p in (tmp_path / "work" / "done").iterdir()}
    assert done == {"a", "b", "c"}
    progress = (tmp_path / "work" / "progress.log").read_text()
    assert "FAILED bad (exit 3, see logs/bad.log)" in progress and "all jobs ended; failed: bad" in progress
    assert "broken" in (tmp_path / "work" / "logs" / "bad.log").read_text()
    # resumed: the done jobs are skipped, only the failed one runs again
    order.write_text("")
    lease_jobs.daemon(plan)
    assert order.read_text() == ""
    assert [s.split(": ")[1] for s in lease_jobs.status(plan)] == ["done", "done", "done", "FAILED"]
    # a job whose id begins another's is not taken for it
    prefixed = lease_jobs.load_plan(
        _plan(tmp_path, [{"id": "a.x", "run": "true"}, {"id": "a", "run": "true"}])
    )
    (tmp_path / "work" / "progress.log").write_text("00:00:01 start a.x on GPU 0\n")
    (tmp_path / "work" / "done" / "a").unlink()
    assert lease_jobs.status(prefixed) == ["  a.x: running", "  a: waiting"]
    packed = lease_jobs.pack(plan, tmp_path / "out")
    with tarfile.open(packed) as tar:
        names = tar.getnames()
    assert packed.name == "demo.tgz" and "progress.log" in names and "logs/bad.log" in names


def test_start_detaches_a_daemon_that_wait_sees_end_and_stop_ends_it(tmp_path: Path) -> None:
    path = _plan(tmp_path, [{"id": "quick", "run": "echo hi"}], pack=["progress.log"])
    started = _cli("start", str(path))
    assert started.returncode == 0 and "daemon started" in started.stdout
    waited = _cli("wait", str(path), "30", "--out", str(tmp_path / "out"))
    assert "done quick" in waited.stdout and "all jobs ended" in waited.stdout, waited.stdout + waited.stderr
    assert (tmp_path / "out" / "demo.tgz").is_file()
    # a long job: start twice is one daemon; stop ends the job with it (its session)
    long_plan = _plan(tmp_path, [{"id": "long", "run": "sleep 60"}])
    assert "daemon started" in _cli("start", str(long_plan)).stdout
    assert "already running" in _cli("start", str(long_plan)).stdout
    time.sleep(0.5)
    assert "stopped daemon" in _cli("stop", str(long_plan)).stdout
    assert lease_jobs._pid(lease_jobs.load_plan(long_plan)) is None
    assert not (tmp_path / "work" / "done" / "long").exists()


@pytest.mark.parametrize(
    ("jobs", "message"),
    [
        ([{"id": "a"}], r"jobs\[0\] needs an `id` and a `run`"),
        ([{"id": "a", "run": "x"}, {"id": "a", "run": "y"}], "job id 'a' is repeated"),
        ([{"id": "a", "run": "x", "after": ["b"]}, {"id": "b", "run": "y"}], r"runs after \['b'\]"),
    ],
)
def test_a_wrong_plan_is_named(tmp_path: Path, jobs: list, message: str) -> None:
    with pytest.raises(lease_jobs.PlanError, match=message):
        lease_jobs.load_plan(_plan(tmp_path, jobs))
    res = _cli("status", str(_plan(tmp_path, jobs)))
    assert res.returncode == 2 and "error: plan" in res.stderr


def test_the_gpu_scripts_plans_load() -> None:
    """Every committed plan is valid (the scripts' jobs, named once)."""
    plans = sorted((BENCH / "plans").glob("*.json"))
    assert plans
    for plan in plans:
        assert lease_jobs.load_plan(plan).jobs


def _claims_plan(tmp_path: Path, **env: str) -> lease_jobs.Plan:
    """The plan `bench/gpu_claims.sh plan-file` writes under these settings (no GPU needed)."""
    res = subprocess.run(
        ["bash", str(BENCH / "gpu_claims.sh"), "plan-file"],
        capture_output=True,
        text=True,
        env={**os.environ, "CLAIMS_WORK": str(tmp_path), "PY": sys.executable, **env},
        timeout=120,
        cwd=BENCH.parent,
    )
    assert res.returncode == 0, res.stderr
    return lease_jobs.load_plan(tmp_path / "claims.json")


def test_gpu_claims_writes_a_plan_of_arms_then_reports(tmp_path: Path) -> None:
    """bench/gpu_claims.sh's jobs are a plan for the runner: `prepare`, one job per arm, each claim's report after
    its arms, LANES_PER_GPU lanes a GPU."""
    plan = _claims_plan(tmp_path, PROFILE="cpu", GPUS="2", LANES_PER_GPU="2", CLAIMS="staged qagent")
    assert plan.lanes == ("0", "1", "0", "1")
    ids = [j.id for j in plan.jobs]
    assert ids[0] == "prepare" and {"staged.staged", "staged.search_r1", "qagent", "staged"} <= set(ids)
    report = plan.jobs[ids.index("staged")]
    assert set(report.after) == {"prepare", "staged.staged", "staged.search_r1"}
    assert report.run == "bash bench/gpu_claims.sh job staged"


def test_gpu_claims_splits_seeds_into_jobs_and_reports_after_all(tmp_path: Path) -> None:
    """SPLIT_SEEDS=1: one job per arm and seed (`--only-seed`), seed by seed, qagent a job per seed; each claim's
    report after every one of its jobs."""
    plan = _claims_plan(
        tmp_path,
        PROFILE="cpu",
        GPUS="1",
        LANES_PER_GPU="3",
        CLAIMS="staged qagent",
        SPLIT_SEEDS="1",
        SEEDS="2",
    )
    runs = {j.id: j.run for j in plan.jobs}
    parts = [f"staged.{arm}.s{seed}" for seed in (0, 1) for arm in ("staged", "search_r1")]
    assert set(runs) == {"prepare", *parts, "qagent.s0", "qagent.s1", "staged", "qagent"}
    assert runs["staged.search_r1.s1"] == "bash bench/gpu_claims.sh job staged search_r1 @1"
    assert runs["qagent.s0"] == "bash bench/gpu_claims.sh job qagent @0"
    after = {j.id: set(j.after) for j in plan.jobs}
    assert after["staged"] == {"prepare", *parts} and after["qagent"] == {"prepare", "qagent.s0", "qagent.s1"}
    ids = [j.id for j in plan.jobs]
    assert max(ids.index(p) for p in parts if p.endswith("s0")) < min(
        ids.index(p) for p in parts if p.endswith("s1")
    )


def test_the_package_names_no_lenders_limits() -> None:
    """The GPU lender's call limits live in bench/ (gpu_claims.sh passes them to claim_bundle.py), not in sleuth."""
    package = BENCH.parent / "src" / "sleuth"
    for path in package.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for name in ("PART_BYTES", "OUT_FILES", "OUT_BYTES", "CARRY_BYTES", "CallLimits"):
            assert name not in text, f"{path} names {name}: lease limits belong to bench/claim_bundle.py"


def test_gpu_claims_plans_chosen_seeds_by_cost_and_can_leave_a_report_out(tmp_path: Path) -> None:
    """CLAIM@S picks seeds of one claim; ORDER=cost starts the most GRPO rollouts first across claims (s3's
    1,600-question arms: 100 steps x 80 rollouts, before staged's 30 x 128 and s3's 20-step arms); NO_REPORT leaves
    a claim's report job out (its other seeds run in another lease)."""
    plan = _claims_plan(
        tmp_path,
        PROFILE="gpu",
        GPUS="2",
        LANES_PER_GPU="3",
        CLAIMS="s3@1 staged",
        SPLIT_SEEDS="1",
        ORDER="cost",
        NO_REPORT="s3",
    )
    ids = [j.id for j in plan.jobs]
    s3_parts = [f"s3.{arm}.s1" for arm in ("s3_1600", "search_r1_1600", "s3_400", "search_r1_400")]
    staged_parts = [f"staged.{arm}.s{seed}" for seed in (0, 1, 2) for arm in ("staged", "search_r1")]
    assert ids[:3] == ["prepare", "s3.s3_1600.s1", "s3.search_r1_1600.s1"]
    assert set(ids[3:9]) == set(staged_parts)
    assert ids[9:11] == ["s3.s3_400.s1", "s3.search_r1_400.s1"]
    assert not any(i.endswith(".s0") and i.startswith("s3") for i in ids)  # seed 0 of s3 not chosen
    assert set(s3_parts) < set(ids) and "s3" not in ids and "staged" in ids
    assert {j.run for j in plan.jobs if j.id == "s3.s3_25.s1"} == {"bash bench/gpu_claims.sh job s3 s3_25 @1"}
