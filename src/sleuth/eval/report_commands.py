"""`sleuth report RUN_DIR [--out FILE] [--title TEXT] [--note TEXT ...]`."""

from __future__ import annotations

from pathlib import Path

import typer

from sleuth.errors import SleuthError


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report_cmd(
        run_dir: str = typer.Argument(
            ..., help="A training run, eval directory, or a directory holding several"
        ),
        out: str = typer.Option(
            None,
            "--out",
            "-o",
            help="Output HTML file (default RUN_DIR/report.html; RUN_DIR/sleuth_report.html where report.html "
            "is another command's report, which is never overwritten)",
        ),
        title: str = typer.Option(None, "--title", help="Page title (default: from the recipe name)"),
        notes: list[str] = typer.Option(None, "--note", help="A paragraph for the Notes section; repeatable"),
        max_trajectories: int = typer.Option(
            200, "--max-trajectories", min=0, help="Cap on trajectories shown"
        ),
    ) -> None:
        """Write one self-contained HTML report (plots, tables, trajectory viewer) for a run directory."""
        from rich.console import Console

        # deferred: the report loads jinja2 and pydantic; `sleuth --help` imports this module
        from sleuth.eval.report import build_report, training_verdicts

        console = Console(soft_wrap=True)  # paths whole, never broken at the terminal's width
        try:
            path = build_report(run_dir, out=out, title=title, notes=notes, max_trajectories=max_trajectories)
        except SleuthError as err:
            console.print(f"[red]error:[/] {err}")
            raise typer.Exit(2) from None
        console.print(f"[green]report written[/]: {path} ({path.stat().st_size / 1024:.0f} KiB)")
        if out is None and path.name != "report.html":
            console.print(
                f"kept {Path(run_dir) / 'report.html'}: another command's report (sleuth reproduce)",
                markup=False,
                highlight=False,
            )
        for label, verdict in training_verdicts(run_dir):
            console.print(f"{label}: {verdict}", markup=False, highlight=False)
