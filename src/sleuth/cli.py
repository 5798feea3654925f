"""The `sleuth` command line.

Each area of the package owns its commands in a `commands.py` module with a
`register(app)` function. Imports inside the command bodies (and their helpers in
those modules) are deliberate: they stay deferred so that `sleuth --help` stays
fast. Everywhere else a module imports at its top, except a heavy optional
dependency deferred with a one-line reason.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="sleuth",
    help="Train, evaluate and serve RL-trained LLM search agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

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
