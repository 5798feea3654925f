"""CLI: `sleuth generate MODEL PROMPT` and `sleuth models`."""

from __future__ import annotations

import typer

from sleuth.errors import SleuthError
from sleuth.llm.base import SamplingParams
from sleuth.llm.gguf import cache_root


def register(app: typer.Typer) -> None:
    @app.command("generate")
    def generate(
        model: str = typer.Argument(
            ..., help="Model alias, directory, .gguf file, hub name, openai:<url>#<model>"
        ),
        prompt: str = typer.Argument(..., help="Prompt text"),
        chat: bool = typer.Option(False, "--chat", help="Send the prompt as a user chat message"),
        max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1),
        temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy"),
        top_p: float = typer.Option(1.0, "--top-p"),
        seed: int | None = typer.Option(None, "--seed"),
        stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)"),
        show_tokens: bool = typer.Option(False, "--show-tokens", help="Also print token ids and log-probs"),
    ) -> None:
        """Generate one completion with any backend."""
        from rich.console import Console

        # deferred: model loading (huggingface_hub); `sleuth --help` imports this module
        from sleuth.llm.registry import load_generator

        console = Console()
        try:
            generator = load_generator(model)
            item = [{"role": "user", "content": prompt}] if chat else prompt
            params = SamplingParams(
                max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
            )
            (out,) = generator.generate([item], stop=list(stop) or None, params=params)
        except SleuthError as err:
            console.print(f"[red]error:[/red] {err}")
            raise typer.Exit(2) from err
        typer.echo(out.text)
        console.print(
            f"[dim]finish_reason={out.finish_reason} stop={out.stop!r} tokens={len(out.token_ids)}[/dim]",
            highlight=False,
        )
        if show_tokens:
            for token_id, logprob in zip(out.token_ids, out.logprobs, strict=False):
                console.print(f"{token_id}\t{logprob:.4f}", highlight=False)

    @app.command("models")
    def models() -> None:
        """List model aliases and where the embedded model files are."""
        from rich.console import Console
        from rich.table import Table

        # deferred: model loading (huggingface_hub); `sleuth --help` imports this module
        from sleuth.llm.registry import EMBEDDED_MODEL, list_models

        table = Table(title=f"sleuth models (default: {EMBEDDED_MODEL}; cache: {cache_root()})")
        for column in ("alias", "description", "location"):
            table.add_column(column, overflow="fold")
        for row in list_models():
            table.add_row(row["alias"], row["description"], row["location"])
        table.add_row(
            "<dir> | <file.gguf> | org/name", "local checkpoint, GGUF file or hub model (transformers)", "-"
        )
        Console().print(table)
