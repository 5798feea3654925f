"""Stopping a training run from outside without losing steps.

SIGTERM (a preempted or cancelled cluster job, `kill`) finishes the step under way, saves a checkpoint and
ends the run (`stop_on_sigterm`, `stop_reason`); a second SIGTERM ends it at once. Ctrl-C (SIGINT) stops at
once; `interrupted_message` then names the last checkpoint and the command that resumes from it.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sleuth.run_layout import latest_checkpoint

SIGTERM_EXIT = 128 + signal.SIGTERM  # what a shell reports for a job ended by SIGTERM
_received: list[int] = []  # SIGTERMs since stop_on_sigterm began (set from the signal handler)


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """While inside, SIGTERM asks the trainer to stop after the current step (`stop_reason`) instead of
    killing the process; outside a main thread (where Python cannot install handlers) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        if _received:  # asked twice: end now, as SIGTERM would have without this handler
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        _received.append(signum)
        sys.stderr.write(
            "SIGTERM: finishing the step under way, then saving a checkpoint and stopping "
            "(send SIGTERM again to stop at once)\n"
        )

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _received.clear()


def sigterm_received() -> bool:
    return bool(_received)


class StoppedBySignal(Exception):  # noqa: N818 - a stop asked for, not a failure
    """A run stopped by SIGTERM between two steps, its last step saved (the SFT stage; the RL loop returns)."""


@dataclass(frozen=True)
class StopReason:
    message: str  # "time limit of 30 min reached" / "SIGTERM received"
    validate: bool  # close the validation series first (not on SIGTERM: a preemption's grace is short)


def stop_reason(run: Any, started: float) -> StopReason | None:
    """Why the run should stop after this step, agreed by every rank (any rank past `trainer.time_limit_minutes`
    or signalled stops them all after the same step); None to go on."""
    limit = run.recipe.trainer.time_limit_minutes
    past = limit is not None and time.monotonic() - started >= 60 * limit
    flags = torch.tensor([float(past), float(sigterm_received())], dtype=torch.float64)
    past_any, signalled = (v > 0 for v in run.ctx.all_reduce_sum(flags).tolist())
    if signalled:
        return StopReason("SIGTERM received", validate=False)
    if past_any:
        return StopReason(f"time limit of {limit} min reached", validate=True)
    return None


def resume_command(recipe_path: str, overrides: Sequence[str]) -> str:
    return shlex.join(["sleuth", "train", recipe_path, *overrides, "--resume"])


def interrupted_message(out_dir: str | Path, recipe_path: str, overrides: Sequence[str]) -> str:
    """What Ctrl-C leaves: the newest checkpoint (the steps after it are lost) and how to continue."""
    ckpt = latest_checkpoint(out_dir)
    if ckpt is None:
        return f"interrupted: no checkpoint in {out_dir} yet; start again with: {shlex.join(['sleuth', 'train', recipe_path, *overrides])}"
    return f"interrupted: last checkpoint {ckpt}; resume with: {resume_command(recipe_path, overrides)}"
