"""`sleuth serve-searcher` (HTTP API) and `sleuth serve-mcp` (MCP server): a trained searcher as a tool."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from sleuth.agent.registry import load_plugins
from sleuth.errors import SleuthError
from sleuth.retrieval.server_commands import is_loopback_host

# The options serve-searcher and serve-mcp share, declared once: (type, typer option) by parameter name.
SEARCHER_OPTIONS: dict[str, tuple[Any, Any]] = {
    "checkpoint": (
        Path | None,
        typer.Option(None, "--checkpoint", help="A `sleuth train` checkpoint or run directory."),
    ),
    "model": (
        str | None,
        typer.Option(
            None,
            "--model",
            help="Serve an untrained local model instead (alias, dir or .gguf); needs --loop.",
        ),
    ),
    "loop": (
        str | None,
        typer.Option(
            None, "--loop", help="Agent loop for --model: a registered method (s3, search_r1, ...)."
        ),
    ),
    "loop_option": (
        list[str] | None,
        typer.Option(None, "--loop-option", help="Loop option KEY=VALUE (repeatable), e.g. top_k=5."),
    ),
    "index": (
        Path | None,
        typer.Option(None, "--index", help="Local index directory built by `sleuth index`."),
    ),
    "retriever_url": (
        str | None,
        typer.Option(None, "--retriever-url", help="A Search-R1 compatible /retrieve server."),
    ),
    "retriever": (
        str | None,
        typer.Option(
            None,
            "--retriever",
            help="Any retriever location: bm25:DIR, hybrid:DIR1,DIR2, milvus:URI?collection=C, "
            "mcp:URL, a tool YAML, or a plugin backend's NAME:... (sleuth.retrieval.backends).",
        ),
    ),
    "generator": (
        str | None,
        typer.Option(
            None, "--generator", help="Frozen generator for /answer: model alias/dir or openai:<url>#<model>."
        ),
    ),
    "max_batch": (
        int,
        typer.Option(16, "--max-batch", help="Most requests merged into one batched rollout."),
    ),
    "batch_wait_ms": (
        float,
        typer.Option(
            10.0,
            "--batch-wait-ms",
            help="Longest a request that finds the model idle waits for others to share its rollout; it waits only "
            "while requests have lately overlapped (a lone client never waits). 0: never wait.",
        ),
    ),
    # A searcher on CPU under concurrent requests takes tens of seconds to minutes per batched rollout.
    "timeout_s": (
        float,
        typer.Option(300.0, "--timeout-s", help="Per-request time limit (queueing included); 504 after it."),
    ),
    "max_turns_limit": (
        int,
        typer.Option(8, "--max-turns-limit", help="Largest max_turns a request may ask for."),
    ),
    "max_top_k": (int, typer.Option(20, "--max-top-k", help="Largest top_k a request may ask for.")),
    "max_question_chars": (
        int,
        typer.Option(2000, "--max-question-chars", help="Longest question accepted."),
    ),
    "max_question_tokens": (
        int,
        typer.Option(
            512,
            "--max-question-tokens",
            help="Most tokens a question may have for the searcher's tokenizer; 422 above it (every row of a batched "
            "turn pays for the longest prompt).",
        ),
    ),
    "max_generation_s": (
        float,
        typer.Option(
            120.0,
            "--max-generation-s",
            help="Longest a search's rollout may run; past it the search stops at the next turn and its request "
            "gets 504, so it does not hold the requests batched with it. 0: no limit.",
        ),
    ),
    "token_env": (
        str,
        typer.Option(
            "SLEUTH_API_TOKEN",
            "--token-env",
            help="Environment variable holding a bearer token; when set, auth is required.",
        ),
    ),
    "device": (
        str | None,
        typer.Option(
            None, "--device", help="Torch device of the searcher (default: cuda if available, else cpu)."
        ),
    ),
    "plugin": (
        list[str] | None,
        typer.Option(
            None, "--plugin", help="Module registering more methods (repeatable), importable on PYTHONPATH."
        ),
    ),
}


@dataclass(frozen=True)
class SearcherOptions:
    """The values of SEARCHER_OPTIONS a serve command was called with."""

    checkpoint: Path | None
    model: str | None
    loop: str | None
    loop_option: list[str] | None
    index: Path | None
    retriever_url: str | None
    retriever: str | None
    generator: str | None
    max_batch: int
    batch_wait_ms: float
    timeout_s: float
    max_turns_limit: int
    max_top_k: int
    max_question_chars: int
    max_question_tokens: int
    max_generation_s: float
    token_env: str
    device: str | None
    plugin: list[str] | None


def with_searcher_options(command: Callable[..., None]) -> Callable[..., None]:
    """A serve command taking `options: SearcherOptions` becomes one whose CLI has the shared options after
    its own (typer reads the signature): the option set is written once for both commands."""
    own = [p for name, p in inspect.signature(command, eval_str=True).parameters.items() if name != "options"]
    shared = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
        for name, (kind, option) in SEARCHER_OPTIONS.items()
    ]

    @functools.wraps(command)
    def with_options(**kwargs: Any) -> None:
        options = SearcherOptions(**{name: kwargs.pop(name) for name in SEARCHER_OPTIONS})
        command(options=options, **kwargs)

    with_options.__signature__ = inspect.Signature(
        [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + shared
    )  # type: ignore[attr-defined]
    with_options.__annotations__ = {}  # typer reads the types from the signature above
    return with_options


def _fail(message: str) -> None:
    from rich.console import Console

    Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {message}")
    raise typer.Exit(2)


def _warn(message: str) -> None:
    from rich.console import Console

    Console(stderr=True, soft_wrap=True).print(f"[bold red]WARNING: {message}[/bold red]")


def _token(token_env: str) -> str | None:
    value = os.environ.get(token_env)
    if value is None:
        return None
    if not value.strip():
        _fail(f"environment variable {token_env} is set but empty; unset it to disable auth or set a secret")
    return value


def _check_network(host: str, port: int, token: str | None, what: str) -> None:
    if not 1 <= port <= 65535:
        _fail(f"--port must be in 1..65535, got {port}")
    if not is_loopback_host(host):
        _warn(
            f"binding {host}: anyone who can reach this address can use this {what} "
            + ("(bearer token required)." if token else "WITHOUT authentication (set SLEUTH_API_TOKEN).")
            + " Use --host 127.0.0.1 unless you mean it."
        )


def _build(options: SearcherOptions):
    """The service the shared options describe (an error is printed and the command exits 2)."""
    # deferred: the service loads model code; `sleuth --help` imports this module
    from sleuth.serve.loading import ServiceSpec, build_service, parse_loop_options
    from sleuth.serve.service import ServeLimits

    try:
        load_plugins(options.plugin or [])
        limits = ServeLimits(
            max_question_chars=options.max_question_chars,
            max_turns=options.max_turns_limit,
            max_top_k=options.max_top_k,
            max_batch=options.max_batch,
            batch_wait_ms=options.batch_wait_ms,
            timeout_s=options.timeout_s,
            max_question_tokens=options.max_question_tokens,
            max_generation_s=options.max_generation_s or None,
        )
        spec = ServiceSpec(
            checkpoint=options.checkpoint,
            model=options.model,
            loop=options.loop,
            loop_options=parse_loop_options(options.loop_option),
            index=options.index,
            retriever_url=options.retriever_url,
            retriever=options.retriever,
            generator=options.generator,
            limits=limits,
            device=options.device,
        )
        return build_service(spec)
    except (SleuthError, ValueError, OSError) as err:
        _fail(str(err))


def register(app: typer.Typer) -> None:
    @app.command("export")
    def export_cmd(
        checkpoint: Path = typer.Argument(
            ..., help="A `sleuth train` checkpoint or run directory (its newest)."
        ),
        out: Path = typer.Option(..., "--out", "-o", help="Directory to write the Hugging Face model to."),
        dtype: str = typer.Option("keep", "--dtype", help="keep, float32, bfloat16 or float16."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty --out."),
    ) -> None:
        """Merge a trained searcher (LoRA folded in) into a Hugging Face model directory for vLLM/SGLang/TGI."""
        # deferred: the export loads model and hub code; `sleuth --help` imports this module
        from sleuth.agent.searcher import export_searcher

        try:
            path = export_searcher(checkpoint, out, dtype=dtype, overwrite=overwrite)
        except (SleuthError, OSError) as err:
            _fail(str(err))
        typer.echo(
            f"exported {checkpoint} -> {path} (load with AutoModelForCausalLM.from_pretrained, "
            f"serve with `sleuth serve-searcher --checkpoint {path}` or vLLM)"
        )

    @app.command("serve-searcher")
    @with_searcher_options
    def serve_searcher(
        options: SearcherOptions,
        host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind; loopback only by default."),
        port: int = typer.Option(8100, "--port", help="TCP port."),
        max_body_bytes: int = typer.Option(
            1 << 20, "--max-body-bytes", help="Largest request body accepted (413 beyond)."
        ),
    ) -> None:
        """Serve a searcher over HTTP: POST /search, POST /answer, GET /health."""
        token = _token(options.token_env)
        _check_network(host, port, token, "searcher")
        service = _build(options)
        import uvicorn

        # deferred: the server loads fastapi; `sleuth --help` imports this module
        from sleuth.serve.searcher_server import create_app

        shown = f"[{host}]" if ":" in host else host
        # The URL goes to stdout so scripts can capture it; diagnostics stay on stderr.
        typer.echo(
            f"serving {service.loop.name} searcher at http://{shown}:{port}/search "
            f"(answer: /answer, health: /health, auth: {'on' if token else 'off'})"
        )
        uvicorn.run(
            create_app(service, token=token, max_body_bytes=max_body_bytes),
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
        )

    @app.command("serve-mcp")
    @with_searcher_options
    def serve_mcp(
        options: SearcherOptions,
        transport: str = typer.Option(
            "stdio", "--transport", help="stdio or http (streamable HTTP at /mcp)."
        ),
        host: str = typer.Option(
            "127.0.0.1", "--host", help="Interface to bind (http); loopback by default."
        ),
        port: int = typer.Option(8101, "--port", help="TCP port (http)."),
    ) -> None:
        """Serve a searcher as MCP tools `search` (and `answer` with --generator) over stdio or HTTP."""
        if transport not in ("stdio", "http"):
            _fail(f"--transport must be stdio or http, got {transport!r}")
        token = _token(options.token_env) if transport == "http" else None
        if transport == "http":
            _check_network(host, port, token, "MCP server")
        service = _build(options)
        # deferred: the MCP server loads mcp; `sleuth --help` imports this module
        from sleuth.serve.mcp_server import create_mcp_server, http_app, run_stdio

        server = create_mcp_server(service)
        if transport == "stdio":
            # stdout carries the protocol: nothing else may be printed there.
            run_stdio(server)
            return
        import uvicorn

        shown = f"[{host}]" if ":" in host else host
        typer.echo(f"serving MCP tools at http://{shown}:{port}/mcp (auth: {'on' if token else 'off'})")
        uvicorn.run(
            http_app(server, host=host, token=token),
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
        )
