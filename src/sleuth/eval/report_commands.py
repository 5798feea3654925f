"""`sleuth report RUN_DIR [--out FILE] [--title TEXT] [--note TEXT ...]`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report_cmd(
        run_dir: str = typer.Argument(
            ..., help="A training run, eval directory, or a directory holding several"
        ),
        out: str = typer.Option(None, "--out", "-o", help="Output HTML file (default RUN_DIR/report.html)"),
        title: str = typer.Option(None, "--title", help="Page title (default: from the recipe name)"),
        notes: list[str] = typer.Option(None, "--note", help="A paragraph for the Notes section; repeatable"),
        max_trajectories: int = typer.Option(
            200, "--max-trajectories", min=0, help="Cap on trajectories shown"
        ),
    ) -> None:
        """Write one self-contained HTML report (plots, tables, trajectory viewer) for a run directory."""
        from rich.console import Console

        from sleuth.errors import SleuthError
        from sleuth.eval.report import build_report, training_verdicts

        console = Console()
        try:
            path = build_report(run_dir, out=out, title=title, notes=notes, max_trajectories=max_trajectories)
        except SleuthError as err:
            console.print(f"[red]error:[/] {err}")
            raise typer.Exit(2) from None
        console.print(f"[green]report written[/]: {path} ({path.stat().st_size / 1024:.0f} KiB)")
        for label, verdict in training_verdicts(run_dir):
            console.print(f"{label}: {verdict}", markup=False, highlight=False)
