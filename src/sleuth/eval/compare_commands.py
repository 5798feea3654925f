"""`sleuth compare A B`: the paired difference of two evaluated runs on the questions both answered."""

from __future__ import annotations

from pathlib import Path

import typer

from sleuth.errors import ConfigError, SleuthError
from sleuth.eval.compare import (
    PAIRED_METRICS,
    compare_records,
    format_difference,
    load_method_records,
)
from sleuth.utils import atomic_write_json


def register(app: typer.Typer) -> None:
    @app.command("compare")
    def compare_cmd(
        run_a: str = typer.Argument(
            ..., help="An eval method directory OUT/<method> (or its predictions.jsonl)."
        ),
        run_b: str = typer.Argument(..., help="The one to subtract, e.g. runs/eval_sft/s3."),
        metric: list[str] = typer.Option(
            None, "--metric", help="Metric(s) to compare (default: genacc, span_check, cover_em, em, f1)."
        ),
        seed: int = typer.Option(0, "--seed", help="Bootstrap seed."),
        json_out: Path | None = typer.Option(None, "--json", help="Also write the result to this JSON file."),
    ) -> None:
        """A minus B on the same questions (matched by dataset and id), with a 95% paired bootstrap interval."""
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        # deferred: the harness loads model and hub code; `sleuth --help` imports this module
        from sleuth.eval.harness import ANSWER_METRICS

        console = Console()
        metrics = metric or list(PAIRED_METRICS)
        try:
            unknown = [m for m in metrics if m not in ANSWER_METRICS]
            if unknown:
                raise ConfigError(
                    f"unknown --metric {', '.join(unknown)}; choose from {', '.join(ANSWER_METRICS)}"
                )
            label_a, records_a = load_method_records(run_a)
            label_b, records_b = load_method_records(run_b)
            results = compare_records(records_a, records_b, metrics, seed=seed)
            if not results:
                raise ConfigError(f"the two runs share no score for {', '.join(metrics)} (no judge?)")
        except (SleuthError, OSError) as err:
            Console(stderr=True, soft_wrap=True).print(
                f"[bold red]error:[/] {escape(str(err))}", highlight=False
            )
            raise typer.Exit(2) from None
        table = Table(title=f"{label_a} minus {label_b}: points [95% paired bootstrap interval]")
        for i, name in enumerate(("metric", label_a, label_b, "A - B", "n", "only A / only B")):
            table.add_column(name, justify="left" if i == 0 else "right")
        for name, r in results.items():
            table.add_row(
                name,
                f"{100 * r['mean_a']:.1f}",
                f"{100 * r['mean_b']:.1f}",
                format_difference(r),
                str(r["n"]),
                f"{r['only_a']} / {r['only_b']}",
            )
        console.print(table)
        if json_out is not None:
            atomic_write_json(json_out, {"a": str(run_a), "b": str(run_b), "seed": seed, "metrics": results})
