"""`sleuth reproduce <claim>`: one command per registered claim (`sleuth.claims.registry.CLAIMS`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import typer
from typer.core import TyperGroup

from sleuth.claims.base import ClaimSpec
from sleuth.claims.committed import CHECK_FILE, check_committed, check_text
from sleuth.claims.registry import CLAIMS
from sleuth.claims.runner import RunPart, reproduce
from sleuth.claims.stages import ArmsPending
from sleuth.errors import SleuthError

FROM_COMMITTED = "--from-committed"
NEWEST = "newest"  # a bare --from-committed: the newest committed gpu run of the claim that holds adapters


class ClaimGroup(TyperGroup):
    """An unknown claim name is one line naming the registered claims, not a usage box."""

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, Any, list[str]]:
        name = click.utils.make_str(args[0]) if args else None
        if name is not None and not name.startswith("-") and self.get_command(ctx, name) is None:
            typer.echo(
                f"error: no claim registered for {name!r}; choose one of {', '.join(CLAIMS)}", err=True
            )
            ctx.exit(2)
        return super().resolve_command(ctx, _optional_value(args))


def _optional_value(args: list[str]) -> list[str]:
    """`--from-committed` takes an optional DIR: given bare (last, or before another option) it means NEWEST."""
    out = []
    for i, arg in enumerate(args):
        out.append(arg)
        if arg == FROM_COMMITTED and (i + 1 == len(args) or args[i + 1].startswith("-")):
            out.append(NEWEST)
    return out


def register(app: typer.Typer) -> None:
    repro = typer.Typer(
        help="Reproduce each paper's own claim end to end: seeds, a noise floor, paired 95% "
        "intervals and a verdict.",
        no_args_is_help=True,
        cls=ClaimGroup,
    )
    app.add_typer(repro, name="reproduce")
    for claim in CLAIMS.values():
        _register_claim(repro, claim)


def _register_claim(repro: typer.Typer, spec: ClaimSpec) -> None:
    claim = spec.text
    text = (
        f"{claim.claim}.\n\nWorld: {claim.world}. Cold start: {claim.cold_start}. Arms: {claim.arms}. "
        f"Evaluation: {claim.evaluation}. Claim test: {claim.test}."
    )

    def command(
        profile: str = typer.Option(
            "cpu", help="cpu (tiny model, minutes on 2 cores) or gpu (the measured sizes)"
        ),
        out: Path = typer.Option(
            None, "--out", help="Run directory (default runs/reproduce/<method>); reruns resume"
        ),
        arms: str = typer.Option(
            None,
            help="Only these arms (comma-separated, e.g. s3_100,search_r1_100): runs "
            "on several GPUs share one --out; the one that finds every arm done writes the report",
        ),
        reuse: Path = typer.Option(
            None,
            help="A folder whose reader/ (r_search, qagent, s3) or injected/ (staged), "
            "trained on this claim's world, is used instead of training one (e.g. "
            "checkpoints/claims); checked against the world and measured again",
        ),
        seed: int = typer.Option(
            0,
            min=0,
            help="The first training seed of the arms (SFT, RL); the world, reader "
            "and injected model stay seed 0's. Another first seed: another run (default --out "
            ".../<method>-seed<N>)",
        ),
        seeds: int = typer.Option(
            None,
            min=1,
            help="Train every arm with this many seeds (SEED, SEED+1, ...); the "
            "verdict pools them and needs 2 or more for its noise floor (default: the "
            "profile's, cpu 1, gpu 3). A rerun with more seeds adds them to the same --out",
        ),
        force: bool = typer.Option(
            False,
            "--force",
            help="Train the arms even when the premise check finds that "
            "they cannot test the claim (the report records the premise)",
        ),
        only_seed: int = typer.Option(
            None,
            "--only-seed",
            min=0,
            help="Only this training seed's stages (and the "
            "shared ones): runs that spread the seeds over GPUs share one --out and give "
            "the same --seed/--seeds; the one that finds every seed done writes the report",
        ),
        from_committed: str = typer.Option(
            None,
            FROM_COMMITTED,
            metavar="[DIR]",
            help="Train nothing: evaluate the "
            "committed arms of one seed (bfloat16 LoRA adapters in DIR/adapters) on "
            "this machine, a CPU will do, and print the claim's tests beside the "
            "committed GPU numbers. DIR: a committed run (default: the newest under "
            "bench/results/claims packed with adapters)",
        ),
        questions: int = typer.Option(100, min=1, help="--from-committed: the first N held-out questions"),
    ) -> None:
        from rich.console import Console
        from rich.markup import escape

        console = Console(soft_wrap=True)  # never break a path or the error across lines
        if from_committed is not None:
            _check_committed(claim.method, from_committed, out, questions, console)
            return
        try:
            chosen = None if arms is None else [a.strip() for a in arms.split(",") if a.strip()]
            default_out = Path("runs/reproduce") / (claim.method + (f"-seed{seed}" if seed else ""))
            count = seeds or (spec.profiles[profile].seeds if profile in spec.profiles else 1)
            wanted = (
                None if seeds is None and seed == 0 else range(seed, seed + count)
            )  # None: OUT's own seeds
            report = reproduce(
                claim.method,
                out or default_out,
                profile,
                console,
                RunPart(chosen, only_seed),
                reuse,
                wanted,
                force,
            )
        except ArmsPending as err:  # this run's arms are done: the report is another run's to write
            done = ", ".join(chosen or ["every arm"]) + ("" if only_seed is None else f" at seed {only_seed}")
            console.print(f"[green]arms done:[/] {escape(done)}. {escape(str(err))}", highlight=False)
            return
        except SleuthError as err:
            console.print(f"[red]error:[/] {escape(str(err))}", highlight=False)
            raise typer.Exit(2) from None
        verdict = _verdict_line(report.with_name("report.json"))
        console.print(f"[green]report:[/] {escape(str(report))}", highlight=False)
        console.print(verdict, highlight=False, markup=False)

    repro.command(claim.method, help=text, short_help=claim.claim)(command)


def _check_committed(method: str, folder: str, out: Path | None, questions: int, console: Any) -> None:
    """`--from-committed`: the committed adapters evaluated here, the table printed, check.json/html written."""
    from rich.markup import escape

    try:
        page = check_committed(
            method,
            None if folder == NEWEST else Path(folder),
            out or Path("runs/from-committed") / f"{method}-q{questions}",
            questions,
            console,
        )
    except SleuthError as err:
        console.print(f"[red]error:[/] {escape(str(err))}", highlight=False)
        raise typer.Exit(2) from None
    console.print(
        check_text(json.loads(page.with_name(CHECK_FILE).read_text())), highlight=False, markup=False
    )
    console.print(f"[green]report:[/] {escape(str(page))}", highlight=False)


def _verdict_line(report_json: Path) -> str:
    """The console's last line: the claim's verdict and its decisive pooled differences."""
    report = json.loads(report_json.read_text())
    parts = []
    for test in report["table"]["seeds"]["tests"]:
        scale, unit = (100, " points") if test["points"] else (1, "")
        lo, hi = test["pooled"]["ci"]
        parts.append(
            f"{test['row']}: {scale * test['pooled']['diff']:+.2f}{unit} [{scale * lo:+.2f}, "
            f"{scale * hi:+.2f}] over {test['pooled']['seeds']} seed(s), {test['verdict']}"
        )
    verdict = {"not shown": "is not shown"}.get(report["verdict"], report["verdict"])
    return f"verdict: the {report['claim']['method']} claim {verdict} ({'; '.join(parts)})"
