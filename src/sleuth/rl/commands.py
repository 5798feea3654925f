"""`sleuth train RECIPE.yaml [key=value ...] [--resume]`."""

from __future__ import annotations

import os
import shlex

import typer

from sleuth.errors import ConfigError, SleuthError


def register(app: typer.Typer) -> None:
    @app.command("train")
    def train_cmd(
        recipe: str = typer.Argument(..., help="Recipe YAML, e.g. recipes/s3.yaml"),
        overrides: list[str] = typer.Argument(None, help="key.path=value overrides, e.g. algorithm.n=4"),
        resume: bool = typer.Option(
            False, "--resume", help="Continue from the newest checkpoint in trainer.out_dir"
        ),
        overwrite: bool = typer.Option(
            False,
            "--overwrite",
            help="Move a run already in trainer.out_dir aside (renamed, nothing deleted)",
        ),
    ) -> None:
        """Train a search agent with RL as the recipe describes."""
        # The update's activations and the decode engine's KV pool take turns in the same memory in blocks of
        # other sizes; expandable segments keep freed blocks usable (read at the first CUDA allocation, so a
        # user's own setting wins)
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        from rich.console import Console
        from rich.markup import escape

        # deferred (and below): recipe schema and training load torch; `sleuth --help` imports this module
        from sleuth.rl.config import load_recipe
        from sleuth.rl.interrupts import (
            SIGTERM_EXIT,
            StoppedBySignal,
            interrupted_message,
            resume_command,
            stop_on_sigterm,
        )

        console = Console(soft_wrap=True)  # a message or path is one line, never broken at the width
        cfg = None
        try:
            cfg = load_recipe(recipe, overrides or [])
            from sleuth.rl.trainer import train

            with stop_on_sigterm():  # a preempted job saves a checkpoint after the step under way
                result = train(cfg, resume=resume, overwrite=overwrite, console=console)
        except SleuthError as err:
            console.print(f"[red]error:[/] {escape(str(err))}")
            raise typer.Exit(2) from None
        except StoppedBySignal as stop:  # in the SFT stage: the same command goes on from its checkpoint
            console.print(
                f"{stop}; resume with: {shlex.join(['sleuth', 'train', recipe, *(overrides or [])])}",
                markup=False,
            )
            raise typer.Exit(SIGTERM_EXIT) from None
        except KeyboardInterrupt:
            if cfg is not None:
                console.print(interrupted_message(cfg.trainer.out_dir, recipe, overrides or []), markup=False)
            raise typer.Exit(130) from None
        finally:
            from sleuth.rl.dist import shutdown_distributed

            shutdown_distributed()
        written = (
            f"checkpoint {result['checkpoint']}" if result["checkpoint"] else "no checkpoint (save_every 0)"
        )
        console.print(f"[green]done[/]: {result['out_dir']}, {result['steps_done']} steps ({written})")
        if result.get("stopped_by_sigterm"):
            console.print(
                f"stopped by SIGTERM; resume with: {resume_command(recipe, overrides or [])}", markup=False
            )
            raise typer.Exit(SIGTERM_EXIT)

    @app.command("sft")
    def sft_cmd(
        recipe: str = typer.Argument(
            ..., help="Recipe YAML with an sft: section (sft.data = trajectory jsonl)"
        ),
        overrides: list[str] = typer.Argument(None, help="key.path=value overrides, e.g. sft.epochs=3"),
        fresh: bool = typer.Option(
            False, "--fresh", help="Ignore existing SFT checkpoints instead of resuming"
        ),
    ) -> None:
        """Supervised fine-tuning on trajectories; checkpoints load like RL ones (sleuth train model.init_from=...)."""
        from rich.console import Console

        # deferred (and below): the recipe schema and SFT load torch; `sleuth --help` imports this module
        from sleuth.rl.config import load_recipe
        from sleuth.rl.interrupts import SIGTERM_EXIT, StoppedBySignal, stop_on_sigterm

        console = Console(soft_wrap=True)  # a message or path is one line, never broken at the width
        try:
            cfg = load_recipe(recipe, overrides or [])
            from sleuth.rl.sft import run_sft

            with stop_on_sigterm():  # a preempted job saves a checkpoint after the step under way
                result = run_sft(cfg, resume=not fresh, console=console)
        except SleuthError as err:
            console.print(f"[red]error:[/] {err}")
            raise typer.Exit(2) from None
        except StoppedBySignal as stop:
            console.print(
                f"{stop}; resume with: {shlex.join(['sleuth', 'sft', recipe, *(overrides or [])])}",
                markup=False,
            )
            raise typer.Exit(SIGTERM_EXIT) from None
        console.print(f"[green]done[/]: {result['out_dir']} (checkpoint {result['checkpoint']})")

    @app.command("check-recipe")
    def check_recipe_cmd(
        recipe: str = typer.Argument(...),
        overrides: list[str] = typer.Argument(None),
    ) -> None:
        """Validate a recipe as `sleuth train` does (schema, loop and reward options; no model loads) and print
        it with all defaults filled in: YAML that `sleuth train` reads back. Inputs that are not there yet
        (data, index) are named on stderr."""
        import sys

        import yaml

        # deferred: the recipe schema loads torch; `sleuth --help` imports this module
        from sleuth.rl.config import load_recipe
        from sleuth.rl.setup import check_input_paths, check_pieces

        try:
            cfg = load_recipe(recipe, overrides or [])
            check_pieces(cfg)
        except SleuthError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(2) from None
        try:
            check_input_paths(cfg)
        except ConfigError as err:  # the files may come later (sleuth synth, sleuth index): not an error here
            typer.echo(f"note: {err}", err=True)
        # plain text, never wrapped or marked up: redirected to a file, it is a recipe again
        sys.stdout.write(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, width=float("inf")))
