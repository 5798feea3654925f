"""CLI: `sleuth synth`, `sleuth data convert`, `sleuth data filter`."""

from __future__ import annotations

from pathlib import Path

import typer

from sleuth.data.filters import drop_yes_no as drop_yn
from sleuth.data.filters import keep_hard
from sleuth.data.formats import load_qa, save_qa
from sleuth.data.score_cache import ScoreCache
from sleuth.data.synth import generate_world, parse_hops, split_sizes, write_world
from sleuth.errors import SleuthError


def _fail(message: str) -> None:
    from rich.console import Console
    from rich.markup import escape

    # soft_wrap: never break a path in the message across lines.
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    raise typer.Exit(code=2)


def register(app: typer.Typer) -> None:
    data_app = typer.Typer(help="Convert and filter QA datasets.", no_args_is_help=True)
    app.add_typer(data_app, name="data")

    @app.command("synth")
    def synth(
        out: Path = typer.Option(..., "--out", help="Output directory."),
        passages: int = typer.Option(10_000, "--passages", help="Number of corpus passages."),
        questions: int = typer.Option(2_000, "--questions", help="Number of questions (all splits)."),
        hops: str = typer.Option("1-4", "--hops", help="Hop range, e.g. 1-4 or 2."),
        seed: int = typer.Option(0, "--seed", help="Random seed; same arguments give identical files."),
        splits: str = typer.Option("0.8,0.1,0.1", "--splits", help="train,dev,test fractions."),
        corpus_size: int | None = typer.Option(
            None,
            "--corpus-size",
            help="Grow corpus.jsonl to this many passages with distractors (after the "
            "world's --passages; e.g. 21000000 for a Wikipedia-size corpus).",
        ),
        workers: int = typer.Option(
            1, "--workers", help="Processes making distractors (same bytes for any count)."
        ),
        known_fraction: float | None = typer.Option(
            None,
            "--known-fraction",
            help="Draw a knowledge boundary: this share of facts is known (0-1). Questions "
            "are labelled per hop known/unknown (all-known, mixed, all-unknown) and knowledge.jsonl holds the known "
            "facts' closed-book statements (inject them with `sleuth inject-knowledge`).",
        ),
    ) -> None:
        """Generate a synthetic world: corpus.jsonl, train/dev/test.jsonl and world.json."""
        import time

        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.table import Table

        try:
            hop_range = parse_hops(hops)
        except ValueError as err:
            _fail(f"--hops: {err}")
        try:
            fractions = tuple(float(x) for x in splits.split(","))
            split_sizes(0, fractions)  # type: ignore[arg-type]
        except ValueError as err:
            _fail(f"--splits must be three fractions summing to 1 like 0.8,0.1,0.1 ({err})")
        if passages < 40:
            _fail(f"--passages must be at least 40, got {passages}")
        if questions < 0:
            _fail(f"--questions must be >= 0, got {questions}")
        if corpus_size is not None and corpus_size < passages:
            _fail(
                f"--corpus-size ({corpus_size}) must be >= --passages ({passages}): it counts the world's passages too"
            )
        if workers < 1:
            _fail(f"--workers must be >= 1, got {workers}")
        if known_fraction is not None and not 0.0 <= known_fraction <= 1.0:
            _fail(f"--known-fraction must be between 0 and 1, got {known_fraction}")

        console = Console()
        start = time.perf_counter()
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=False) as progress:
            q_task = progress.add_task("questions", total=questions)
            try:
                world = generate_world(
                    passages,
                    questions,
                    hops=hop_range,
                    seed=seed,
                    progress=lambda n: progress.update(q_task, completed=n),
                    known_fraction=known_fraction,
                )
            except ValueError as err:
                _fail(str(err))
            progress.update(q_task, completed=questions)
            p_task = progress.add_task("passages", total=corpus_size or passages)
            summary = write_world(
                world,
                out,
                splits=fractions,  # type: ignore[arg-type]
                progress=lambda n: progress.update(p_task, completed=n),
                corpus_size=corpus_size,
                workers=workers,
            )
        elapsed = time.perf_counter() - start

        table = Table(title=f"synthetic world -> {out}  ({elapsed:.1f} s)")
        table.add_column("item")
        table.add_column("value", justify="right")
        table.add_row("seed", str(seed))
        table.add_row("passages", f"{summary['num_passages']:,}")
        if "corpus" in summary:
            table.add_row("corpus passages (with distractors)", f"{summary['corpus']['num_passages']:,}")
        table.add_row("entities", ", ".join(f"{k} {v:,}" for k, v in summary["entity_counts"].items()))
        for split, n in summary["splits"].items():
            table.add_row(f"questions: {split}", f"{n:,}")
        for h, n in summary["hop_distribution"].items():
            table.add_row(f"{h}-hop", f"{n:,}")
        for t, n in summary["type_distribution"].items():
            table.add_row(f"type {t}", f"{n:,}")
        for t, n in summary.get("knowledge_distribution", {}).items():
            table.add_row(f"questions {t}", f"{n:,}")
        if "known_statements" in summary:
            table.add_row("closed-book statements (knowledge.jsonl)", f"{summary['known_statements']:,}")
        console.print(table)

    @data_app.command("convert")
    def convert(
        src: Path = typer.Argument(..., help="Input: .jsonl/.json (FlashRAG) or .parquet (Search-R1)."),
        dst: Path = typer.Argument(..., help="Output: .jsonl or .parquet."),
        data_source: str = typer.Option(
            None,
            "--data-source",
            help="Dataset of the questions whose metadata names none: the parquet "
            "data_source column and each question's metadata.dataset (kept through merges and conversions).",
        ),
        split: str = typer.Option("train", "--split", help="Parquet extra_info.split value."),
    ) -> None:
        """Convert a QA dataset between FlashRAG jsonl and Search-R1 parquet; each question keeps its dataset
        (data_source), so converted files merged into one (as Search-R1's qa_search_test_merge.py does) load."""
        try:
            examples = load_qa(src)
            if data_source:  # both formats carry it in the question's metadata; parquet in data_source too
                for ex in examples:
                    ex.metadata.setdefault("dataset", data_source)
            options = {"split": split} if dst.suffix.lower() == ".parquet" else {}
            n = save_qa(dst, examples, **options)
        except SleuthError as err:
            _fail(str(err))
        typer.echo(f"wrote {n} examples to {dst}")

    @data_app.command("filter")
    def filter_(
        src: Path = typer.Argument(..., help="Input QA file (.jsonl/.json/.parquet)."),
        dst: Path = typer.Argument(..., help="Output QA file (.jsonl/.parquet)."),
        drop_yes_no: bool = typer.Option(
            False, "--drop-yes-no", help="Drop questions answered yes/no/true/false."
        ),
        hard_from: Path | None = typer.Option(
            None, "--hard-from", help="Score cache jsonl; keep questions with score <= --threshold."
        ),
        threshold: float = typer.Option(0.0, "--threshold", help="Keep-hard threshold on the cached score."),
        missing: str = typer.Option(
            "error", "--missing", help="Questions absent from the cache: error|keep|drop."
        ),
    ) -> None:
        """Apply s3's training-set filters."""
        if missing not in ("error", "keep", "drop"):
            _fail(f"--missing must be error, keep or drop, got {missing!r}")
        if hard_from is not None and not hard_from.exists():
            _fail(f"--hard-from: score cache {hard_from} does not exist")
        try:
            examples = load_qa(src)
            n_in = len(examples)
            if drop_yes_no:
                examples = drop_yn(examples)
            n_after_yn = len(examples)
            if hard_from is not None:
                examples = keep_hard(examples, ScoreCache(hard_from), threshold=threshold, missing=missing)  # type: ignore[arg-type]
            save_qa(dst, examples)
        except (SleuthError, ValueError) as err:
            _fail(str(err))
        typer.echo(
            f"{n_in} in, {n_in - n_after_yn} yes/no dropped, {n_after_yn - len(examples)} easy dropped, "
            f"{len(examples)} written to {dst}"
        )
