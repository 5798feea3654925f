"""`sleuth reproduce <method>`: one command per registered claim (`sleuth.reproduce.CLAIMS`)."""

from __future__ import annotations

from pathlib import Path

import typer

from sleuth.claim_stages import ArmsPending
from sleuth.reproduce import CLAIMS, Claim, reproduce


def register(app: typer.Typer) -> None:
    repro = typer.Typer(help="Reproduce each paper's own claim end to end, with paired 95% intervals.",
                        no_args_is_help=True)
    app.add_typer(repro, name="reproduce")
    for claim in CLAIMS.values():
        _register_claim(repro, claim)


def _register_claim(repro: typer.Typer, claim: Claim) -> None:
    text = (f"{claim.claim}.\n\nWorld: {claim.world}. Cold start: {claim.cold_start}. Arms: {claim.arms}. "
            f"Evaluation: {claim.evaluation}. Claim test: {claim.test}.")

    def command(
        profile: str = typer.Option("cpu", help="cpu (tiny model, minutes on 2 cores) or gpu (the measured sizes)"),
        out: Path = typer.Option(None, "--out", help="Run directory (default runs/reproduce/<method>); reruns resume"),
        arms: str = typer.Option(None, help="Only these arms (comma-separated, e.g. s3_100,search_r1_100): runs "
                                 "on several GPUs share one --out; the one that finds every arm done writes the report"),
        reuse: Path = typer.Option(None, help="A folder whose reader/ (r_search, qagent, s3) or injected/ (staged), "
                                   "trained on this claim's world, is used instead of training one (e.g. "
                                   "checkpoints/claims); checked against the world and measured again"),
        seed: int = typer.Option(0, help="The arms' training seed (SFT, RL); the world, reader and injected model "
                                 "stay seed 0's. Another seed: another run (default --out .../<method>-seed<N>)"),
    ) -> None:
        from rich.console import Console
        from rich.markup import escape

        from sleuth.errors import SleuthError

        console = Console(soft_wrap=True)  # never break a path or the error across lines
        try:
            chosen = None if arms is None else [a.strip() for a in arms.split(",") if a.strip()]
            default_out = Path("runs/reproduce") / (claim.method + (f"-seed{seed}" if seed else ""))
            report = reproduce(claim.method, out or default_out, profile, console, chosen, reuse, seed)
        except ArmsPending as err:  # this run's arms are done: the report is another run's to write
            console.print(f"[green]arms done:[/] {escape(', '.join(chosen or []))}. {escape(str(err))}", highlight=False)
            return
        except SleuthError as err:
            console.print(f"[red]error:[/] {escape(str(err))}", highlight=False)
            raise typer.Exit(2) from None
        console.print(f"[green]report:[/] {escape(str(report))}", highlight=False)

    repro.command(claim.method, help=text, short_help=claim.claim)(command)

