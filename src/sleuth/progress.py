"""Progress of a long loop, for a person at a terminal and for a log file.

On a terminal, rich's live bar. Under nohup, SLURM or a pipe (the console is not a terminal), a bar is drawn
only when it ends, so a 24-minute evaluation would print nothing until its last second: there a plain line
is written every `every_s` seconds instead (and at the end), with the count, percentage, elapsed time and
an ETA, e.g. `search-r1: 120/500 (24%), 3m12s elapsed, ETA 10m08s`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

EVERY_ENV = "SLEUTH_PROGRESS_EVERY"  # seconds between plain progress lines (default 30)
DEFAULT_EVERY_S = 30.0


def clock(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


@dataclass
class _Task:
    description: str
    total: float | None
    completed: float = 0.0
    started: float = field(default_factory=time.monotonic)
    last_line: float = field(default_factory=time.monotonic)
    fields: dict[str, Any] = field(default_factory=dict)


class PlainProgress:
    """The subset of `rich.progress.Progress` sleuth's loops use (add_task, advance, update, start, stop, a
    context manager), printing one plain line per task every `every_s` seconds and when a task completes."""

    def __init__(self, console: Any, every_s: float | None = None) -> None:
        self.console = console
        env = os.environ.get(EVERY_ENV)
        self.every_s = every_s if every_s is not None else (float(env) if env else DEFAULT_EVERY_S)
        self.tasks: list[_Task] = []

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def add_task(
        self, description: str, total: float | None = None, completed: float = 0, **fields: Any
    ) -> int:
        self.tasks.append(_Task(description, total, float(completed), fields=fields))
        return len(self.tasks) - 1

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def update(self, task_id: int, *, advance: float | None = None, completed: float | None = None,
               **fields: Any) -> None:  # fmt: skip
        task = self.tasks[task_id]
        if completed is not None:
            task.completed = float(completed)
        if advance is not None:
            task.completed += advance
        task.fields.update(fields)
        now = time.monotonic()
        finished = task.total is not None and task.completed >= task.total
        if finished or now - task.last_line >= self.every_s:
            task.last_line = now
            self.console.print(self.line(task, now), markup=False, highlight=False, soft_wrap=True)

    @staticmethod
    def line(task: _Task, now: float) -> str:
        elapsed = now - task.started
        shown = " ".join(str(v) for v in task.fields.values() if v not in (None, ""))
        text = f"{task.description}: {task.completed:g}"
        if task.total:
            share = task.completed / task.total
            text += f"/{task.total:g} ({100 * share:.0f}%), {clock(elapsed)} elapsed"
            if 0 < share < 1:
                text += f", ETA {clock(elapsed * (1 - share) / share)}"
        else:
            text += f", {clock(elapsed)} elapsed"
        return f"{text}{', ' + shown if shown else ''}"


def progress_bar(
    console: Any, *columns: ProgressColumn, every_s: float | None = None
) -> Progress | PlainProgress:
    """rich's bar with `columns` (default: description, bar, count, elapsed, remaining) on a terminal, else
    `PlainProgress` lines. `console` None: a new one on stdout, as rich's own default."""
    console = console if console is not None else Console()
    if not console.is_terminal:
        return PlainProgress(console, every_s)
    columns = columns or (
        TextColumn("{task.description:>10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    return Progress(*columns, console=console)
