"""One resumable background-job runner for a lent GPU machine, driven by a plan file (issue 44).

A lease hands the machine over in calls of a few minutes, each followed by the next within the machine's idle
time; work that outlives a call runs in a daemon (its own session, `setsid`) that each call starts, waits on
and packs. Every bench/gpu_*.sh script used to write that machinery itself; they now write a plan and call:

    python3 bench/lease_jobs.py start PLAN         # the daemon, unless one runs (then: "already running")
    python3 bench/lease_jobs.py wait PLAN SECONDS  # until every job ended or SECONDS passed; progress, log tails
    python3 bench/lease_jobs.py pack PLAN          # PLAN's `pack` paths into $OUT/<plan name>.tgz
    python3 bench/lease_jobs.py status|stop|restart PLAN

A plan is JSON (stdlib only: the runner starts before any wheel is installed):

    {"work": "runs/learn",                      # the run's folder: done/, logs/, progress.log, daemon.log, pid
     "env": {"OMP_NUM_THREADS": "8"},           # added to every job's environment
     "lanes": ["0", "1"],                       # one lane a entry (its CUDA_VISIBLE_DEVICES; null: left as is)
     "jobs": [{"id": "learn", "run": "python3 bench/learning.py run ...",
               "after": ["setup"],              # starts once these ended (done or failed)
               "gpus": "0,1"}],                 # overrides the lane's devices
     "pack": ["logs", "progress.log", "results"]}  # paths under `work`

Strings may name environment variables ($WORK, ${GPUS}); `$WORK` is the plan's work folder. Jobs are taken in
order by the first free lane whose turn it is (a job waits for its `after` jobs, holding its lane). A job that
exits 0 leaves its done-marker, work/done/<id>: a later `start` (the next call, or a lease that carried the
folder) skips it, so a plan is resumable job by job; a job itself resumes inside if it can. progress.log gets one
line a start, an end and a failure, and "all jobs ended" when the daemon is done.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ENDED = "all jobs ended"
POLL_S = 2.0


class PlanError(Exception):
    """A plan file that cannot be run: the message names the file and the field."""


@dataclass(frozen=True)
class Job:
    id: str
    run: str
    after: tuple[str, ...] = ()
    gpus: str | None = None


@dataclass(frozen=True)
class Plan:
    name: str
    work: Path
    jobs: tuple[Job, ...]
    lanes: tuple[str | None, ...] = (None,)
    env: dict[str, str] = field(default_factory=dict)
    pack: tuple[str, ...] = ()


def _expand(text: str, work: Path | None) -> str:
    if work is not None:
        text = text.replace("${WORK}", str(work)).replace("$WORK", str(work))
    return os.path.expandvars(text)


def load_plan(path: str | Path) -> Plan:
    """Read and check a plan file (ids unique, `after` naming earlier jobs, at least one lane)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise PlanError(f"plan {path}: cannot read it as JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("jobs"), list) or "work" not in data:
        raise PlanError(f"plan {path}: a JSON object with `work` and a list of `jobs` is needed")
    work = Path(_expand(str(data["work"]), None))
    jobs: list[Job] = []
    for k, raw in enumerate(data["jobs"]):
        if not isinstance(raw, dict) or not raw.get("id") or not raw.get("run"):
            raise PlanError(f"plan {path}: jobs[{k}] needs an `id` and a `run` command")
        job = Job(
            str(raw["id"]),
            _expand(str(raw["run"]), work),
            tuple(raw.get("after") or ()),
            None if raw.get("gpus") is None else _expand(str(raw["gpus"]), work),
        )
        if "/" in job.id or job.id in {j.id for j in jobs}:
            raise PlanError(
                f"plan {path}: job id {job.id!r} is repeated or has a '/'; give each job its own name"
            )
        unknown = [a for a in job.after if a not in {j.id for j in jobs}]
        if unknown:
            raise PlanError(f"plan {path}: job {job.id!r} runs after {unknown}, which no earlier job is")
        jobs.append(job)
    lanes = data.get("lanes", [None])
    if isinstance(lanes, int):
        lanes = [None] * lanes
    if not lanes:
        raise PlanError(f"plan {path}: `lanes` is empty; give a number or one entry per lane")
    return Plan(
        name=path.stem,
        work=work,
        jobs=tuple(jobs),
        lanes=tuple(None if lane is None else _expand(str(lane), work) for lane in lanes),
        env={str(k): _expand(str(v), work) for k, v in (data.get("env") or {}).items()},
        pack=tuple(_expand(str(p), work) for p in data.get("pack") or ()),
    )


def _log(plan: Plan, line: str) -> None:
    with open(plan.work / "progress.log", "a", encoding="utf-8") as f:
        f.write(f"{time.strftime('%H:%M:%S')} {line}\n")


def _done(plan: Plan, job_id: str) -> Path:
    return plan.work / "done" / job_id


class _Queue:
    """The jobs still to run, taken in plan order by the lanes; a job's `after` jobs must have ended."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.todo = [j for j in plan.jobs if not _done(plan, j.id).exists()]
        self.ended = {j.id for j in plan.jobs} - {j.id for j in self.todo}
        self.lock = threading.Lock()

    def take(self) -> Job | None:
        with self.lock:
            return self.todo.pop(0) if self.todo else None

    def wait_for(self, job: Job) -> None:
        while True:
            with self.lock:
                if all(a in self.ended for a in job.after):
                    return
            time.sleep(POLL_S)

    def end(self, job: Job) -> None:
        with self.lock:
            self.ended.add(job.id)


def run_job(plan: Plan, job: Job, lane_gpus: str | None) -> bool:
    """Run one job (its output in work/logs/<id>.log); leave its done-marker when it exits 0. A job whose marker
    an earlier job left (a restored run's) is skipped."""
    if _done(plan, job.id).exists():
        _log(plan, f"skipped {job.id} (done before)")
        return True
    env = {**os.environ, **plan.env, "WORK": str(plan.work)}
    gpus = job.gpus if job.gpus is not None else lane_gpus
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    _log(plan, f"start {job.id}" + (f" on GPU {gpus}" if gpus is not None else ""))
    with open(plan.work / "logs" / f"{job.id}.log", "ab") as log:
        code = subprocess.call(
            ["bash", "-c", job.run], stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL
        )
    if code == 0:
        _done(plan, job.id).touch()
        _log(plan, f"done {job.id}")
    else:
        _log(plan, f"FAILED {job.id} (exit {code}, see logs/{job.id}.log)")
    return code == 0


def daemon(plan: Plan) -> int:
    """Run every job not done yet on the plan's lanes; 0 when each one ended with its done-marker."""
    _prepare(plan)
    queue = _Queue(plan)
    failed: list[str] = []

    def lane(gpus: str | None) -> None:
        while (job := queue.take()) is not None:
            queue.wait_for(job)
            if not run_job(plan, job, gpus):
                failed.append(job.id)
            queue.end(job)

    threads = [threading.Thread(target=lane, args=(gpus,)) for gpus in plan.lanes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _log(plan, ENDED + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _prepare(plan: Plan) -> None:
    for sub in ("done", "logs"):
        (plan.work / sub).mkdir(parents=True, exist_ok=True)


def _pid(plan: Plan) -> int | None:
    """The running daemon's process (and session) id, or None."""
    try:
        pid = int((plan.work / "pid").read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def start(plan: Plan, plan_file: Path) -> str:
    """Start the daemon in its own session, so it outlives the call that started it."""
    _prepare(plan)
    pid = _pid(plan)
    if pid is not None:
        return f"daemon already running (pid {pid})"
    (plan.work / "daemon.finished").unlink(missing_ok=True)
    with open(plan.work / "daemon.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "daemon", str(plan_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    (plan.work / "pid").write_text(str(proc.pid))
    return f"daemon started (pid {proc.pid}): {len(plan.jobs)} jobs, {len(plan.lanes)} lanes, in {plan.work}"


def stop(plan: Plan) -> str:
    """End the daemon and every job it started (its whole session)."""
    pid = _pid(plan)
    if pid is None:
        return "no daemon running"
    try:
        os.killpg(pid, signal.SIGTERM)
    except OSError:
        os.kill(pid, signal.SIGTERM)
    for _ in range(50):
        if _pid(plan) is None:
            break
        time.sleep(0.1)
    return f"stopped daemon {pid}"


def status(plan: Plan) -> list[str]:
    """One line a job: done, running (its log's last line), failed or waiting."""
    progress = (plan.work / "progress.log").read_text() if (plan.work / "progress.log").exists() else ""
    events = {
        tuple(line.split()[1:3]) for line in progress.splitlines()
    }  # ("start", id), ("FAILED", id), ...
    lines = []
    for job in plan.jobs:
        if _done(plan, job.id).exists():
            state = "done"
        elif ("FAILED", job.id) in events:
            state = "FAILED"
        elif ("start", job.id) in events:
            log = plan.work / "logs" / f"{job.id}.log"
            last = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
            state = "running" + (f": {last[0][:200]}" if last else "")
        else:
            state = "waiting"
        lines.append(f"  {job.id}: {state}")
    return lines


def ended(plan: Plan) -> bool:
    progress = plan.work / "progress.log"
    return _pid(plan) is None and progress.exists() and ENDED in progress.read_text().splitlines()[-1]


def wait(plan: Plan, seconds: float) -> None:
    """Until the daemon ended or `seconds` passed (a call's time), then the progress and each log's tail."""
    end = time.time() + seconds
    while time.time() < end and not ended(plan):
        time.sleep(min(POLL_S * 5, max(0.1, end - time.time())))
    progress = plan.work / "progress.log"
    print(progress.read_text() if progress.exists() else "(no progress yet)", end="")
    print("\n".join(status(plan)))
    for log in sorted((plan.work / "logs").glob("*.log")):
        print(f"== {log}")
        print("\n".join(line[:300] for line in log.read_text(errors="replace").splitlines()[-4:]))


def pack(plan: Plan, out: Path) -> Path | None:
    """The plan's `pack` paths (under work; missing ones left out) as out/<plan name>.tgz."""
    present = [p for p in plan.pack if (plan.work / p).exists()]
    if not present:
        return None
    out.mkdir(parents=True, exist_ok=True)
    dest = out / f"{plan.name}.tgz"
    with tarfile.open(dest, "w:gz") as tar:
        for p in present:
            tar.add(plan.work / p, arcname=p)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 bench/lease_jobs.py", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("start", "restart", "stop", "daemon", "wait", "pack", "status"))
    parser.add_argument("plan", type=Path)
    parser.add_argument("seconds", nargs="?", type=float, default=540.0, help="wait: the longest wait")
    parser.add_argument("--out", type=Path, default=None, help="pack: the folder (default $OUT)")
    args = parser.parse_args(argv)
    try:
        plan = load_plan(args.plan)
    except PlanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.command == "daemon":
        return daemon(plan)
    if args.command in ("stop", "restart"):
        print(stop(plan))
    if args.command in ("start", "restart"):
        print(start(plan, args.plan))
    elif args.command == "status":
        print("\n".join(status(plan)))
    elif args.command in ("wait", "pack"):
        if args.command == "wait":
            wait(plan, args.seconds)
        out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
        if out is not None:
            dest = pack(plan, out)
            print(f"packed {dest}" if dest else "nothing to pack yet")
        elif args.command == "pack":
            print("error: pack needs --out DIR or $OUT", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
