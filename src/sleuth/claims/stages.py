"""The resumable stages of `sleuth reproduce`: one record per finished stage under OUT/stages/.

A record keeps the stage's result and the directory it was written under (`root`). Results name files
under OUT by absolute path (checkpoints, predictions, the world), so a run directory that moved (copied
to another machine, restored from a claim bundle: `bench/claim_bundle.py`) would otherwise hand the next
stage paths of the old place; `stage` re-roots every such path to where OUT is now when it reads a record.

OUT/claim.json names the claim, profile and training seed a run directory holds, so a bundle can rebuild the parts it
leaves out (the world, from its seed) without being told.

Several processes may share one OUT (`sleuth reproduce --arms`: each trains and evaluates its own arms, on its
own GPU): a stage runs under a lock of its own, so a stage they share (the world, a cold start) runs once and the
others wait for its record.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

from sleuth.errors import ConfigError, SleuthError
from sleuth.utils import atomic_write_json

STAGES_DIR = "stages"
LOCKS_DIR = ".locks"
CLAIM_FILE = "claim.json"
# stop before running a stage once this many stages are done: leaves a run cut at a stage boundary, as a
# lease that ends would (the claim-bundle tests; rehearsing the bundle round trip on a CPU box)
STOP_AFTER_ENV = "SLEUTH_REPRODUCE_STOP_AFTER"


class StagesStopped(SleuthError):
    """The run stopped at a stage boundary: SLEUTH_REPRODUCE_STOP_AFTER asked it to, or stages it needs are left
    to other `--arms` runs."""


def reroot(value: Any, old: str, new: str) -> Any:
    """`value` (JSON: dicts, lists, strings) with every string that is `old` or lies under it moved to `new`."""
    if isinstance(value, str):
        if value == old:
            return new
        return new + value[len(old) :] if value.startswith(old + "/") else value
    if isinstance(value, dict):
        return {k: reroot(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [reroot(v, old, new) for v in value]
    return value


def read_stage(out: Path, name: str) -> dict[str, Any] | None:
    """A finished stage's result with its paths re-rooted under OUT as it is now; None if not finished."""
    marker = out / STAGES_DIR / f"{name}.json"
    if not marker.exists():
        return None
    record = json.loads(marker.read_text())
    root, here = record.get("root"), str(out.resolve())
    # a record from before roots were kept names paths where it was written: nothing to re-root against
    return record["result"] if root in (None, here) else reroot(record["result"], root, here)


def finished_stages(out: Path) -> list[str]:
    return sorted(p.stem for p in (out / STAGES_DIR).glob("*.json"))


@contextlib.contextmanager
def _stage_lock(out: Path, name: str) -> Iterator[None]:
    """Held while stage `name` runs: another process that reaches the same stage waits, then finds its record."""
    path = out / LOCKS_DIR / f"{name}.lock"  # beside the records, not among them
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def stage(out: Path, name: str, run: Callable[[], dict[str, Any]], console: Any = None) -> dict[str, Any]:
    """Run a stage once: its result is kept in OUT/stages/<name>.json, and a rerun returns it unrun (with
    its paths re-rooted if OUT moved since)."""
    done = read_stage(out, name)
    if done is None:
        with _stage_lock(out, name):
            done = read_stage(out, name)  # another process may have run it while this one waited
            if done is None:
                return _run_stage(out, name, run, console)
    if console is not None:
        console.print(f"[dim]stage {name}: done earlier, skipped[/]")
    return done


def _run_stage(out: Path, name: str, run: Callable[[], dict[str, Any]], console: Any) -> dict[str, Any]:
    limit = os.environ.get(STOP_AFTER_ENV)
    if limit and not limit.isdigit():
        raise ConfigError(f"{STOP_AFTER_ENV}={limit!r}: give a number of stages (e.g. 3), or unset it")
    if limit and len(finished_stages(out)) >= int(limit):
        raise StagesStopped(
            f"stopped before stage {name}: {limit} stages are done ({STOP_AFTER_ENV}={limit}); "
            f"rerun without it to go on"
        )
    if console is not None:
        console.print(f"[bold cyan]stage {name}[/]")
    start = time.perf_counter()
    result = run()
    marker = out / STAGES_DIR / f"{name}.json"
    marker.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        marker, {"result": result, "seconds": time.perf_counter() - start, "root": str(out.resolve())}
    )
    return result


class ArmSelection:
    """The arms of a claim that this process trains and evaluates (`sleuth reproduce --arms`); None: all of them.
    Processes given disjoint arms can share one OUT; the report needs every arm's stages, so it is written by the
    run that finds them all done (the last of them, or one without --arms)."""

    def __init__(self, wanted: Collection[str] | None, arms: Sequence[str], claim: str) -> None:
        unknown = sorted(set(wanted or ()) - set(arms))
        if unknown:
            raise ConfigError(f"--arms {','.join(unknown)}: the {claim} claim's arms are {', '.join(arms)}")
        self.wanted = None if wanted is None else frozenset(wanted)

    def runs(self, arm: str) -> bool:
        return self.wanted is None or arm in self.wanted


class ArmsPending(StagesStopped):
    """A `--arms` run finished its arms; the report waits for stages that other runs write."""


def write_claim_file(out: Path, method: str, profile: str, seed: int = 0, seeds: int = 1) -> None:
    """OUT/claim.json: which claim, profile and training seeds (the first, and how many) this run directory holds.
    A directory that holds another claim, profile or first seed is refused: resuming it would mix two runs' stages.
    The number of seeds may change: a rerun with more seeds adds their stages, one with fewer reports on those."""
    wanted = {"method": method, "profile": profile, "seed": seed}
    held = read_claim_file(out)
    if held is not None:
        held = {"seed": 0, **held}  # written before the seed was recorded: seed 0, the only one then
        differ = ", ".join(
            f"{k} {held.get(k)!r} (asked: {v!r})" for k, v in wanted.items() if held.get(k) != v
        )
        if differ:
            raise ConfigError(
                f"{out} holds another claim run ({differ}); give another --out, or the same "
                f"settings to resume it"
            )
    atomic_write_json(out / CLAIM_FILE, {**wanted, "seeds": seeds})


def read_claim_file(out: Path) -> dict[str, Any] | None:
    path = out / CLAIM_FILE
    return json.loads(path.read_text()) if path.exists() else None


def run_seeds(out: Path) -> range:
    """The training seeds of the claim run in OUT: claim.json's first seed and how many (seed 0 and 1 seed where it
    records none, as before seeds were recorded)."""
    held = read_claim_file(out) or {}
    first = int(held.get("seed", 0))
    return range(first, first + int(held.get("seeds", 1)))
