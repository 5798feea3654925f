"""A run directory knows its run: a fresh run never writes into another run's history.

A run directory holds a history once it has logged a step (`metrics.jsonl`) or written a checkpoint.
A fresh run into such a directory would mix two runs (pruning the new run's checkpoints beside the old
higher-numbered ones, truncating the old metrics), so it is refused; `--overwrite` moves the old run
aside under a new name (nothing is deleted); `--resume` continues it. `--resume` without a usable
checkpoint is refused when there is a history to lose, instead of silently starting over.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from sleuth.appendlog import read_appended
from sleuth.errors import CheckpointError, ConfigError, OutputError
from sleuth.run_layout import CHECKPOINTS, METRICS, latest_checkpoint
from sleuth.utils import output_error

_WAIT_FOR_MAIN_S = 600.0  # other ranks wait this long for rank 0 to move an old run aside


@dataclass
class RunHistory:
    """What a run directory already holds."""

    steps_logged: int
    checkpoints: list[str]

    @property
    def empty(self) -> bool:
        return self.steps_logged == 0 and not self.checkpoints

    def describe(self) -> str:
        newest = f", newest checkpoint {self.checkpoints[-1]}" if self.checkpoints else ", no checkpoint"
        return f"{self.steps_logged} logged step(s){newest}"


def run_history(out_dir: str | Path) -> RunHistory:
    out_dir = Path(out_dir)
    steps = len(read_appended(out_dir / METRICS).records) if (out_dir / METRICS).is_file() else 0
    root = out_dir / CHECKPOINTS
    ckpts = sorted(p.name for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []
    return RunHistory(steps, ckpts)


def aside_name(out_dir: Path) -> Path:
    """A new sibling name for an old run moved aside: `<name>.replaced-YYYYmmdd-HHMMSS[-k]`."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate = out_dir.with_name(f"{out_dir.name}.replaced-{stamp}")
    k = 1
    while candidate.exists():
        k += 1
        candidate = out_dir.with_name(f"{out_dir.name}.replaced-{stamp}-{k}")
    return candidate


def prepare_run_dir(out_dir: str | Path, *, resume: bool, overwrite: bool, console=None) -> Path | None:
    """Refuse a fresh run into a directory holding a run's history, or move that run aside (`overwrite`).
    Returns where the old run went (None: nothing moved). Rank 0 moves; other ranks wait for it."""
    out_dir = Path(out_dir)
    if resume and overwrite:
        raise ConfigError(
            "--resume continues the run in trainer.out_dir and --overwrite moves it aside: pass one"
        )
    history = run_history(out_dir)
    if resume or history.empty:
        return None
    if not overwrite:
        raise ConfigError(
            f"trainer.out_dir={out_dir} already holds a run ({history.describe()}); pass --resume to continue it, "
            "--overwrite to move it aside (nothing is deleted), or another trainer.out_dir"
        )
    if int(os.environ.get("RANK", "0")) != 0:
        deadline = time.monotonic() + _WAIT_FOR_MAIN_S
        while not run_history(out_dir).empty and time.monotonic() < deadline:
            time.sleep(0.5)
        return None
    target = aside_name(out_dir)
    out_dir.rename(target)
    if console is not None:
        console.print(f"--overwrite: moved the earlier run ({history.describe()}) to {target}")
    return target


def no_usable_checkpoint(out_dir: str | Path, skipped: list[tuple[Path, str]]) -> CheckpointError | None:
    """The error for `--resume` when no checkpoint can be loaded and starting over would lose a history;
    None when the directory holds nothing to lose (a first start with --resume is a fresh run)."""
    history = run_history(out_dir)
    if history.empty:
        return None
    damaged = (
        f"{len(skipped)} damaged (newest: {skipped[0][0].name}: {skipped[0][1]})"
        if skipped
        else "none written"
    )
    return CheckpointError(
        f"--resume: no usable checkpoint under {Path(out_dir) / CHECKPOINTS} ({damaged}); starting over would "
        f"lose {history.describe()}: rerun without --resume and with --overwrite to move this run aside and start fresh"
    )


def write_failure(err: BaseException, out_dir: str | Path) -> OutputError:
    """A failed write under a run (disk full, read-only, no permission) as one line naming the path."""
    last = latest_checkpoint(out_dir)
    kept = f"the last good checkpoint {last} is intact" if last is not None else "no checkpoint was written"
    path = getattr(err, "filename", None) or out_dir
    return output_error(
        "the run's output",
        path,
        err,
        None,
        f"{kept}; free space or pass a writable trainer.out_dir, then rerun (--resume to continue)",
    )
