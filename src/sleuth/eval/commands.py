"""CLI: `sleuth eval`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer

from sleuth.agent.registry import load_plugins
from sleuth.errors import SleuthError
from sleuth.eval.compare import CONSOLE_PAIRED_METRICS, paired_rows


def _fail(message: str) -> None:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    raise typer.Exit(code=2)


def _pack(items: list[str], width: int, sep: str) -> list[str]:
    """Whole items per line, as many as fit in `width` (an item longer than `width` gets its own line)."""
    lines: list[str] = []
    for item in items:
        if lines and len(lines[-1]) + len(sep) + len(item) <= width:
            lines[-1] += sep + item
        else:
            lines.append(item)
    return ["  " + line for line in lines]


def print_summary(console: Any, title: str, header: list[str], rows: list[list[str]], keys: int = 2) -> None:
    """The summary as a table when it fits the console, else one block per row that wraps, never truncates.

    A file or pipe gets rich's default 80 columns, where a 13-column table would shrink every cell to
    an ellipsis; the stacked form keeps every value readable at any width (summary.md has the table).
    """
    from rich.measure import Measurement
    from rich.table import Table

    table = Table(title=title)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i < keys else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    # the width the table needs unshrunk (measuring against the console's own width caps it there)
    if Measurement.get(console, console.options.update(max_width=10_000), table).maximum <= console.width:
        console.print(table)
        return
    console.print(title, highlight=False, markup=False)
    for row in rows:
        head = f"{' / '.join(row[:keys])} ({header[keys]}={row[keys]})"
        pairs = [f"{name}: {value}" for name, value in zip(header[keys + 1 :], row[keys + 1 :], strict=True)]
        console.print(
            "\n".join([head] + _pack(pairs, console.width - 2, "   ")),
            highlight=False,
            markup=False,
            soft_wrap=True,
        )


def register(app: typer.Typer) -> None:
    @app.command("eval")
    def eval_cmd(
        method: list[str] = typer.Option(
            ...,
            "--method",
            "-m",
            help="Method(s), repeatable or comma-separated: direct, direct-generator, cot, naive-rag, ircot, "
            "search-o1, search-r1, s3, r-search, staged, qagent, oracle. direct answers with --model, "
            "direct-generator with --generator (a contamination check: both without retrieval); oracle hands "
            "each question's gold passages (metadata.supporting_ids of a synthetic world) to --generator.",
        ),
        data: list[Path] = typer.Option(
            ..., "--data", "-d", help="QA file(s): .jsonl/.json (FlashRAG) or .parquet."
        ),
        retriever: str | None = typer.Option(
            None,
            "--retriever",
            "-r",
            help="A retriever location: index directory, retrieval server URL, mcp:<MCP server "
            "URL>, a search-tool YAML (mcp:/http: section), bm25:|dense:|sharded:DIR, hybrid:DIR1,DIR2, "
            "milvus:URI?collection=C, or a plugin backend's NAME:... (sleuth.retrieval.backends); not needed for "
            "direct/cot.",
        ),
        model: str = typer.Option(
            "smollm2-135m-instruct",
            "--model",
            help="Policy / prompted model: alias, checkpoint dir or openai:URL#model.",
        ),
        generator: str | None = typer.Option(
            None,
            "--generator",
            help="Frozen reader (default: --model) that answers from documents for s3/qagent and for naive-rag, "
            "IRCoT's reader, oracle and direct-generator, so one call compares them fairly.",
        ),
        judge: str | None = typer.Option(
            None, "--judge", help="LLM judge for GenAcc / judge accuracy (optional)."
        ),
        judge_rule: str = typer.Option(
            "strict",
            "--judge-rule",
            help="How a judge reply is read: strict (yes only when it clearly says yes) or upstream "
            "(s3's code: 'yes' anywhere in the reply).",
        ),
        retriever_cache: Path | None = typer.Option(
            None,
            "--retriever-cache",
            help="Directory recording every search (any retriever or search tool); a later run replays them.",
        ),
        out: Path = typer.Option(Path("eval-results"), "--out", "-o", help="Output directory (resumable)."),
        limit: int | None = typer.Option(
            None,
            "--limit",
            help="First N questions of each data source (dataset) of each data file: a merged "
            "Search-R1 file keeps N of each of its data sources.",
        ),
        seed: int = typer.Option(0, "--seed", help="Random seed."),
        top_k: int | None = typer.Option(
            None, "--top-k", help="Documents per search (default: a checkpoint's own, else each method's)."
        ),
        max_turns: int | None = typer.Option(
            None, "--max-turns", help="Search turns (default: a checkpoint's own, else each method's)."
        ),
        batch_size: int = typer.Option(16, "--batch-size", help="Questions generated together."),
        max_new_tokens: int | None = typer.Option(
            None,
            "--max-new-tokens",
            help="Tokens per agent turn / CoT (default: a checkpoint's own, else 512).",
        ),
        max_obs_tokens: int | None = typer.Option(
            None,
            "--max-obs-tokens",
            help="Tokens of inserted documents per search (default: a checkpoint's, else 512).",
        ),
        max_response_tokens: int | None = typer.Option(
            None,
            "--max-response-tokens",
            help="Tokens of a whole agent response (default: a checkpoint's, else 4096).",
        ),
        answer_max_new_tokens: int = typer.Option(
            64, "--answer-max-new-tokens", help="Tokens per short answer."
        ),
        r_search_evidence: bool = typer.Option(
            False,
            "--r-search-evidence",
            help="R-Search: the frozen generator answers from its evidence (RSTool).",
        ),
        keep_token_ids: bool = typer.Option(
            False, "--keep-token-ids", help="Store token ids in trajectories."
        ),
        fresh: bool = typer.Option(
            False, "--fresh", help="Discard existing predictions in --out instead of resuming."
        ),
        plugin: list[str] | None = typer.Option(
            None,
            "--plugin",
            help="Module registering more methods or rewards (repeatable), importable on PYTHONPATH.",
        ),
        tokenizer: str | None = typer.Option(
            None,
            "--tokenizer",
            help="Tokenizer directory of an openai: --model (agent methods build prompts "
            "with it; default: the model name's, when it names a local model or export directory).",
        ),
        openai_timeout: float | None = typer.Option(
            None,
            "--openai-timeout",
            min=0.001,
            help="Seconds to wait for an openai: model's answer (default "
            "SLEUTH_OPENAI_TIMEOUT, else 60); a request past it fails, it is not sent again.",
        ),
    ) -> None:
        """Evaluate methods on QA data: EM, cover-EM, F1, span, GenAcc, judge, retrievals, tokens, latency."""
        import time

        from rich.console import Console

        # deferred: the harness loads model and hub code; `sleuth --help` imports this module
        from sleuth.eval.harness import (
            EvalConfig,
            EvalOutput,
            checkpoint_budgets,
            count_by_dataset,
            evaluate,
            load_eval_data,
            load_model_plugins,
            parse_methods,
            summary_rows,
        )
        from sleuth.llm.openai_http import TIMEOUT_ENV
        from sleuth.llm.registry import parse_openai_spec

        console = Console()
        if openai_timeout is not None:  # every openai: model this command opens (model, generator, judge)
            os.environ[TIMEOUT_ENV] = str(openai_timeout)
        if tokenizer is not None:
            if not model.startswith("openai:"):
                _fail(f"--tokenizer {tokenizer}: only an openai: --model needs one (got --model {model})")
            model_spec: Any = {**parse_openai_spec(model), "tokenizer": tokenizer}
        else:
            model_spec = model
        try:
            load_plugins(plugin or [])
            load_model_plugins(model)  # the plugin modules a checkpoint recorded for its method
            methods = parse_methods(method)
            given = {
                "top_k": top_k,
                "max_turns": max_turns,
                "max_new_tokens": max_new_tokens,
                "max_obs_tokens": max_obs_tokens,
                "max_response_tokens": max_response_tokens,
            }
            # a trained checkpoint is evaluated with the budgets it was trained with unless told otherwise
            budgets = {**checkpoint_budgets(model), **{k: v for k, v in given.items() if v is not None}}
            cfg = EvalConfig(
                batch_size=batch_size,
                seed=seed,
                answer_max_new_tokens=answer_max_new_tokens,
                r_search_evidence=r_search_evidence,
                keep_token_ids=keep_token_ids,
                fresh=fresh,
                judge_rule=judge_rule,
                retriever_cache=str(retriever_cache) if retriever_cache else None,
                **budgets,
            )
            examples = load_eval_data(data, limit)
            if limit:
                kept = ", ".join(f"{name} {n}" for name, n in count_by_dataset(examples).items())
                console.print(f"--limit {limit} per data source: {kept}")
        except (SleuthError, OSError) as err:
            _fail(str(err))
        start = time.perf_counter()
        try:
            summary = evaluate(
                methods,
                examples,
                retriever=retriever,
                model=model_spec,
                generator=generator,
                judge=judge,
                config=cfg,
                out_dir=EvalOutput(
                    out,
                    run_info={"data": [str(p) for p in data], "limit": limit},
                    progress=True,
                    console=console,
                ),
            )
        except (SleuthError, OSError) as err:
            _fail(str(err))
        elapsed = time.perf_counter() - start

        header, rows = summary_rows(summary)
        print_summary(console, f"sleuth eval -> {out}  ({elapsed:.1f} s)", header, rows)
        if summary.get("paired"):
            header, rows = paired_rows(summary["paired"], CONSOLE_PAIRED_METRICS)
            print_summary(
                console,
                "minus naive-rag on the same questions: points [95% paired bootstrap interval]",
                header,
                rows,
                keys=1,
            )
        if summary.get("retriever_cache"):
            cached = summary["retriever_cache"]
            console.print(
                f"retriever cache {cached['dir']}: {cached['retriever/cache_hits']:.0f} searches replayed, "
                f"{cached['retriever/cache_misses']:.0f} searched and recorded",
                highlight=False,
            )
        console.print(
            f"predictions: {out}/<method>/predictions.jsonl   summary: {out}/summary.json, summary.md"
        )
