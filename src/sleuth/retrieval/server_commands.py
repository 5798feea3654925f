"""`sleuth serve-retriever`: serve an index over the Search-R1 `/retrieve` HTTP API."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import typer


def is_loopback_host(host: str) -> bool:
    """True for hosts only reachable from this machine (localhost, 127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to a public interface


def register(app: typer.Typer) -> None:
    @app.command("serve-retriever")
    def serve_retriever(
        index: Path = typer.Option(..., "--index", help="Index directory built by `sleuth index`."),
        corpus: Path | None = typer.Option(
            None, "--corpus", help="Corpus jsonl the index was built from; checked against the index fingerprint."
        ),
        host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind; loopback only by default."),
        port: int = typer.Option(8000, "--port", help="TCP port."),
        max_queries: int = typer.Option(512, "--max-queries", help="Most queries accepted in one request."),
        max_k: int = typer.Option(100, "--max-k", help="Largest topk accepted."),
        max_query_chars: int = typer.Option(2000, "--max-query-chars", help="Longest query accepted."),
        default_k: int = typer.Option(3, "--default-k", help="topk used when a request sends none (Search-R1: 3)."),
        worker_threads: int = typer.Option(
            1, "--worker-threads", "--workers-threads", help="Threads running retriever.search concurrently."
        ),
        threads: int = typer.Option(1, "--threads", help="Threads inside one search call (bm25s, faiss, torch)."),
        batch_wait_ms: float = typer.Option(
            2.0, "--batch-wait-ms", help="How long a request waits for others to share one search call."
        ),
    ) -> None:
        """Serve a retrieval index at POST /retrieve (Search-R1 compatible) and GET /health."""
        from rich.console import Console

        from sleuth.errors import SleuthError

        console = Console(stderr=True, soft_wrap=True)
        if not index.exists():
            console.print(f"[red]error:[/red] --index {index} does not exist; build one with `sleuth index`.")
            raise typer.Exit(2)
        if corpus is not None and not corpus.exists():
            console.print(f"[red]error:[/red] --corpus {corpus} does not exist.")
            raise typer.Exit(2)
        if not 1 <= port <= 65535:
            console.print(f"[red]error:[/red] --port must be in 1..65535, got {port}.")
            raise typer.Exit(2)

        import uvicorn

        from sleuth.retrieval import load_retriever
        from sleuth.retrieval.server import create_app

        try:
            retriever = load_retriever(index, corpus=corpus, threads=threads)
            app = create_app(
                retriever,
                max_queries=max_queries,
                max_k=max_k,
                max_query_chars=max_query_chars,
                default_k=default_k,
                name=f"sleuth-retriever:{index.name}",
                worker_threads=worker_threads,
                batch_wait_ms=batch_wait_ms,
            )
        except (SleuthError, ValueError, OSError) as err:
            console.print(f"[red]error:[/red] {err}")
            raise typer.Exit(2) from err
        try:
            # The first search may compile kernels (bm25s/numba: seconds); pay it before clients time out.
            retriever.search(["warm up"], 1)
        except Exception as err:
            console.print(f"[red]error:[/red] index {index} loaded but a test search failed: {type(err).__name__}: {err}")
            raise typer.Exit(2) from err

        if not is_loopback_host(host):
            console.print(
                f"[bold red]WARNING: binding {host}: this retrieval server has no authentication and anyone "
                "who can reach this address can query the index. Use --host 127.0.0.1 unless you mean it.[/bold red]"
            )
        shown = f"[{host}]" if ":" in host else host
        # The URL goes to stdout so scripts can capture it; diagnostics stay on stderr.
        typer.echo(f"serving {index} at http://{shown}:{port}/retrieve  (health: http://{shown}:{port}/health)")
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
