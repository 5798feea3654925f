"""`sleuth serve-retriever`: serve an index over the Search-R1 `/retrieve` HTTP API."""

from __future__ import annotations

import ipaddress
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from sleuth.errors import ConfigError, SleuthError
from sleuth.retrieval import load_retriever, prefork
from sleuth.retrieval.base import (
    BODY_BUDGET_REQUESTS,
    BODY_BUDGET_WAIT_S,
    DEFAULT_MAX_QUERIES,
    DEFAULT_MAX_QUERY_CHARS,
    DEFAULT_SEARCH_CHUNK,
    default_max_body_bytes,
)
from sleuth.retrieval.index import check_corpus, read_manifest

if TYPE_CHECKING:  # the CLI must import without the serving stack (GPU images, training-only installs)
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

# `--workers N` hands the serving options to the worker processes through this variable: uvicorn
# starts each worker from an import string, so the app factory cannot take arguments.
SERVE_ENV = "SLEUTH_RETRIEVER_SERVE"
WORKER_PID_HEADER = "X-Sleuth-Worker-Pid"


class WorkerPidHeader:
    """Pure-ASGI middleware adding `X-Sleuth-Worker-Pid` to every HTTP response. (Starlette's
    `@app.middleware("http")` would re-stream each response body through a task group.)"""

    def __init__(self, app: ASGIApp, pid: int):
        self.app = app
        self.header = (WORKER_PID_HEADER.lower().encode("latin-1"), str(pid).encode("latin-1"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, send_tagged)


def is_loopback_host(host: str) -> bool:
    """True for hosts only reachable from this machine (localhost, 127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to a public interface


def check_search_options(manifest: dict[str, Any], search: dict[str, int]) -> None:
    """--nprobe needs an IVF index, --rerank one whose float16 vectors were kept: say so before any worker loads."""
    kind = manifest.get("kind")
    faiss_type = (manifest.get("faiss") or {}).get("type") if kind == "dense" else None
    if "nprobe" in search and faiss_type != "ivfpq":
        raise ConfigError(f"--nprobe applies to IVF-PQ indexes; this one is {faiss_type or kind!r}")
    if "rerank" in search and (kind != "dense" or search["rerank"] and not manifest.get("vectors")):
        raise ConfigError(
            f"--rerank needs a dense index with its passage vectors (`sleuth index --shards N "
            f"--keep-vectors`); this one is {kind!r}{' and kept none' if kind == 'dense' else ''}"
        )


def load_serving_retriever(options: dict[str, Any]) -> Any:
    """Load the retriever `options` name (checking the search options first) without searching it:
    the pre-fork supervisor calls this before forking, when no thread pool may have run."""
    index = Path(options["index"])
    search = options.get("search") or {}
    if search:
        check_search_options(read_manifest(index), search)
    return load_retriever(index, corpus=options.get("corpus"), threads=options.get("threads", 1), **search)


def set_search_threads(threads: int) -> None:
    """torch's and faiss's thread counts for this process (a pre-forked worker sets its own after the fork)."""
    if "torch" in sys.modules:  # a BM25 server never imports torch: do not pay for it here
        sys.modules["torch"].set_num_threads(max(1, threads))
    if "faiss" in sys.modules:
        sys.modules["faiss"].omp_set_num_threads(max(1, threads))


def serving_app(retriever: Any, options: dict[str, Any]) -> ASGIApp:
    """Wrap a loaded retriever in the `/retrieve` app and run one warm-up search (in the serving process).

    Every response carries the serving process id in `X-Sleuth-Worker-Pid`, so a client or a test
    can see which worker answered.
    """
    # deferred: the server loads fastapi; `sleuth --help` imports this module
    from sleuth.http_errors import BodyBudget
    from sleuth.retrieval.server import create_app

    budget_bytes = options.get("body_budget_bytes")
    budget = BodyBudget(budget_bytes, BODY_BUDGET_WAIT_S) if budget_bytes else None
    app = create_app(
        retriever,
        max_queries=options.get("max_queries", DEFAULT_MAX_QUERIES),
        max_k=options.get("max_k", 100),
        max_query_chars=options.get("max_query_chars", DEFAULT_MAX_QUERY_CHARS),
        max_batch_queries=options.get("search_chunk", DEFAULT_SEARCH_CHUNK),
        default_k=options.get("default_k", 3),
        name=f"sleuth-retriever:{Path(options['index']).name}",
        worker_threads=options.get("worker_threads", 1),
        batch_wait_ms=options.get("batch_wait_ms", 2.0),
        max_body_bytes=options.get("max_body_bytes"),
        body_budget=budget,
    )
    app.add_middleware(WorkerPidHeader, pid=os.getpid())

    # The first search may compile kernels (bm25s/numba: seconds) and starts the OpenMP pools; pay
    # it before clients time out, in the process that serves (never in a pre-fork supervisor).
    retriever.search(["warm up"], 1)
    return app


def build_serving_app(options: dict[str, Any]) -> ASGIApp:
    """Load the index named in `options` and wrap it in the `/retrieve` app (one process)."""
    return serving_app(load_serving_retriever(options), options)


def app_from_env() -> ASGIApp:
    """uvicorn app factory for `--workers N --no-preload` (and where fork is unavailable): uvicorn
    spawns each worker from an import string, and each loads its own copy of the index and encoder.

    Memory-mapped parts (docstore, faiss indexes opened with mmap) share the OS page cache, but what
    is read into the heap (a fast-scan IVF-PQ index, torch and the encoder weights) is held once per
    worker; the default pre-fork workers (`sleuth.retrieval.prefork`) share those copy-on-write.
    """
    raw = os.environ.get(SERVE_ENV)
    if not raw:
        raise RuntimeError(f"{SERVE_ENV} is not set; start workers with `sleuth serve-retriever --workers N`")
    return build_serving_app(json.loads(raw))


def register(app: typer.Typer) -> None:
    @app.command("serve-retriever")
    def serve_retriever(
        index: Path = typer.Option(..., "--index", help="Index directory built by `sleuth index`."),
        corpus: Path | None = typer.Option(
            None,
            "--corpus",
            help="Corpus jsonl the index was built from; checked against the index fingerprint.",
        ),
        host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind; loopback only by default."),
        port: int = typer.Option(8000, "--port", help="TCP port."),
        max_queries: int = typer.Option(
            DEFAULT_MAX_QUERIES, "--max-queries", help="Most queries accepted in one request."
        ),
        max_k: int = typer.Option(100, "--max-k", help="Largest topk accepted."),
        max_query_chars: int = typer.Option(
            DEFAULT_MAX_QUERY_CHARS,
            "--max-query-chars",
            help="Longer queries are truncated to this many characters.",
        ),
        search_chunk: int = typer.Option(
            DEFAULT_SEARCH_CHUNK,
            "--search-chunk",
            help="Most queries per retriever search call (larger requests are chunked).",
        ),
        default_k: int = typer.Option(
            3, "--default-k", help="topk used when a request sends none (Search-R1: 3)."
        ),
        worker_threads: int = typer.Option(
            1, "--worker-threads", "--workers-threads", help="Threads running retriever.search concurrently."
        ),
        threads: int = typer.Option(
            1, "--threads", help="Threads inside one search call (bm25s, faiss, torch)."
        ),
        batch_wait_ms: float = typer.Option(
            2.0,
            "--batch-wait-ms",
            help="Longest a request that finds a worker idle is held (from its arrival) for concurrent requests "
            "to share its search call. Held only while requests have lately overlapped and the batch is under "
            "half of --search-chunk; a client sending one request at a time is never held. 0: never hold.",
        ),
        nprobe: int | None = typer.Option(
            None, "--nprobe", help="IVF lists searched per query (IVF-PQ indexes; default: the index's own)."
        ),
        rerank: int | None = typer.Option(
            None,
            "--rerank",
            help="Candidates per query re-scored exactly from the kept float16 vectors (sharded "
            "IVF-PQ built with --keep-vectors; default 64; 0: off). Deeper buys recall for CPU time.",
        ),
        workers: int = typer.Option(
            1,
            "--workers",
            help="Worker processes behind the one address. On Linux the index and encoder are loaded once and "
            "the workers are forked from that process, sharing them copy-on-write (see --preload).",
        ),
        preload: bool | None = typer.Option(
            None,
            "--preload/--no-preload",
            help="With --workers N > 1: load once in a supervisor process and fork "
            "the workers from it (default on Linux), or --no-preload: start each worker as a new process that "
            "loads its own copy (only memory-mapped parts shared; the default where fork is unsafe, e.g. macOS).",
        ),
        max_body_bytes: int | None = typer.Option(
            None,
            "--max-body-bytes",
            help="Largest request body accepted, 413 beyond (default: --max-queries x "
            "(--max-query-chars + 4) + 65536, i.e. a full request of ASCII queries; 8,273,920 with the defaults).",
        ),
        body_budget_bytes: int | None = typer.Option(
            None,
            "--body-budget-bytes",
            help="Most request-body bytes held at once over all concurrent requests of a "
            f"worker process; a request that does not fit within {BODY_BUDGET_WAIT_S:g} s gets 503 with Retry-After "
            f"(default: {BODY_BUDGET_REQUESTS} x --max-body-bytes).",
        ),
    ) -> None:
        """Serve a retrieval index at POST /retrieve (Search-R1 compatible) and GET /health."""
        from rich.console import Console

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
        if workers < 1:
            console.print(f"[red]error:[/red] --workers must be >= 1, got {workers}.")
            raise typer.Exit(2)
        if max_body_bytes is not None and max_body_bytes < 1:
            console.print(f"[red]error:[/red] --max-body-bytes must be >= 1, got {max_body_bytes}.")
            raise typer.Exit(2)
        if body_budget_bytes is not None and body_budget_bytes < (
            max_body_bytes or default_max_body_bytes(max_queries, max_query_chars)
        ):
            console.print(
                f"[red]error:[/red] --body-budget-bytes {body_budget_bytes} is smaller than the per-request "
                "limit (--max-body-bytes); a request at the limit could never be served: raise it."
            )
            raise typer.Exit(2)
        for name, value, least in (("--nprobe", nprobe, 1), ("--rerank", rerank, 0)):
            if value is not None and value < least:
                console.print(f"[red]error:[/red] {name} must be >= {least}, got {value}.")
                raise typer.Exit(2)
        if not batch_wait_ms >= 0:
            console.print(f"[red]error:[/red] --batch-wait-ms must be >= 0, got {batch_wait_ms}.")
            raise typer.Exit(2)

        if preload and not hasattr(os, "fork"):
            console.print(
                "[red]error:[/red] --preload needs os.fork, which this platform lacks; use --no-preload."
            )
            raise typer.Exit(2)
        forked = workers > 1 and (prefork.prefork_available() if preload is None else preload)

        import uvicorn

        options = {
            "index": str(index.resolve()),
            "corpus": str(corpus.resolve()) if corpus is not None else None,
            "threads": threads,
            "max_queries": max_queries,
            "max_k": max_k,
            "max_query_chars": max_query_chars,
            "search_chunk": search_chunk,
            "default_k": default_k,
            "worker_threads": worker_threads,
            "batch_wait_ms": batch_wait_ms,
            "max_body_bytes": max_body_bytes,
            "body_budget_bytes": body_budget_bytes,
            "search": {k: v for k, v in (("nprobe", nprobe), ("rerank", rerank)) if v is not None},
        }
        app = retriever = sock = None
        try:
            if workers == 1:
                app = build_serving_app(options)
            elif forked:
                # Bound (not yet listening) before the load, so a taken port fails in a second, not after it.
                sock = prefork.bind_listener(host, port)
                retriever = load_serving_retriever(options)  # no search here: see sleuth.retrieval.prefork
            else:
                # Fail here, once, on a bad index instead of in every worker; workers load it themselves.
                manifest = read_manifest(index)
                if corpus is not None:
                    check_corpus(manifest, index, corpus)
                check_search_options(manifest, options["search"])
        except (SleuthError, ValueError, OSError) as err:
            console.print(f"[red]error:[/red] {err}")
            raise typer.Exit(2) from err
        except Exception as err:
            if sock is not None:
                sock.close()
            console.print(
                f"[red]error:[/red] index {index}: loading it or a test search failed: {type(err).__name__}: {err}"
            )
            raise typer.Exit(2) from err

        if not is_loopback_host(host):
            console.print(
                f"[bold red]WARNING: binding {host}: this retrieval server has no authentication and anyone "
                "who can reach this address can query the index. Use --host 127.0.0.1 unless you mean it.[/bold red]"
            )
        shown = f"[{host}]" if ":" in host else host
        # The URL goes to stdout so scripts can capture it; diagnostics stay on stderr.
        typer.echo(
            f"serving {index} at http://{shown}:{port}/retrieve  (health: http://{shown}:{port}/health)"
            + (f" with {workers} worker processes" if workers > 1 else "")
        )
        if app is not None:
            uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
            return
        if sock is not None:

            def worker_app() -> ASGIApp:  # runs in each forked worker
                set_search_threads(threads)
                return serving_app(retriever, options)

            prefork.preimport_serving_modules("sleuth.retrieval.server", "sleuth.http_errors")
            raise typer.Exit(prefork.run_supervisor(sock, workers, worker_app))
        os.environ[SERVE_ENV] = json.dumps(options)
        uvicorn.run(
            f"{__name__}:app_from_env",
            factory=True,
            host=host,
            port=port,
            workers=workers,
            log_level="warning",
            access_log=False,
        )
