"""The `sleuth` command line.

Each area of the package owns its commands in a `commands.py` module with a
`register(app)` function. `sleuth --help` imports them all, so a command body
imports what loads torch, model or hub code, fastapi or mcp when it runs, with a
one-line reason; everything light sits at the module's top. The modules that defer
and why: tests/test_architecture.py::DEFERRED_IMPORTS.
"""

from __future__ import annotations

import importlib
import os
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperOption

import sleuth

app = typer.Typer(
    name="sleuth",
    help="Train, evaluate and serve RL-trained LLM search agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

_type_column = getattr(TyperOption, "display_type_rich", None)  # typer >= 0.2x's help type column


def _switch_type_column(self: TyperOption, ctx: Any) -> str | None:
    # typer's help prints `<bool>` beside a flag as if it took a value; a switch takes none, so show nothing
    return None if self.is_flag and not self.count else _type_column(self, ctx)


if _type_column is not None:
    TyperOption.display_type_rich = _switch_type_column  # type: ignore[method-assign]


def version_line() -> str:
    """`sleuth 0.1.0 (commit abc1234)`: the git commit of the checkout sleuth runs from, else the one an
    install from a repository recorded (direct_url.json), else "commit unknown"."""
    package = Path(sleuth.__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(package), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(package), "status", "--porcelain", "--untracked-files=no", "."],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        commit += "+changes" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        commit = ""
    if not commit:
        try:
            info = metadata.distribution("sleuth").read_text("direct_url.json") or ""
            commit = info.split('"commit_id": "')[1][:7] if '"commit_id": "' in info else ""
        except metadata.PackageNotFoundError:
            commit = ""
    return f"sleuth {sleuth.__version__} ({'commit ' + commit if commit else 'commit unknown'})"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_line())
        raise typer.Exit()


@app.callback()
def main_options(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_print_version,
        is_eager=True,
        help="Print the version and the git commit, then exit.",
    ),
    verbose: bool = typer.Option(
        False,
        "--verbose",
        help="Show third-party progress bars (model loading, "
        "downloads), hidden by default: in a log each one is a page of lines.",
    ),
) -> None:
    """Train, evaluate and serve RL-trained LLM search agents."""
    # read by huggingface_hub at import (transformers' loading bars follow it), so set before any command
    # imports them; a value the user set wins unless --verbose asks for the bars
    if verbose:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "0"
    else:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


COMMAND_MODULES = [
    "sleuth.data.commands",
    "sleuth.retrieval.commands",
    "sleuth.retrieval.server_commands",
    "sleuth.llm.commands",
    "sleuth.rl.trajectory_commands",
    "sleuth.eval.commands",
    "sleuth.eval.report_commands",
    "sleuth.eval.compare_commands",
    "sleuth.rl.commands",
    "sleuth.serve.commands",
    "sleuth.demo",
    "sleuth.claims.knowledge",
    "sleuth.claims.reader",
    "sleuth.claims.commands",
]


def _register_all() -> None:
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            # Only tolerate an area that does not exist yet, never a broken import inside one.
            if err.name != name:
                raise
            continue
        module.register(app)


_register_all()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
