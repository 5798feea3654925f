"""`sleuth serve-searcher` (HTTP API) and `sleuth serve-mcp` (MCP server): a trained searcher as a tool."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer

CHECKPOINT = typer.Option(None, "--checkpoint", help="A `sleuth train` checkpoint or run directory.")
MODEL = typer.Option(None, "--model", help="Serve an untrained local model instead (alias, dir or .gguf); needs --loop.")
LOOP = typer.Option(None, "--loop", help="Agent loop for --model: a registered method (s3, search_r1, ...).")
LOOP_OPTION = typer.Option(None, "--loop-option", help="Loop option KEY=VALUE (repeatable), e.g. top_k=5.")
INDEX = typer.Option(None, "--index", help="Local index directory built by `sleuth index`.")
RETRIEVER_URL = typer.Option(None, "--retriever-url", help="A Search-R1 compatible /retrieve server.")
GENERATOR = typer.Option(None, "--generator", help="Frozen generator for /answer: model alias/dir or openai:<url>#<model>.")
MAX_BATCH = typer.Option(16, "--max-batch", help="Most requests merged into one batched rollout.")
BATCH_WAIT_MS = typer.Option(
    10.0, "--batch-wait-ms",
    help="Longest a request that finds the model idle waits for others to share its rollout; it waits only "
         "while requests have lately overlapped (a lone client never waits). 0: never wait.")
# A searcher on CPU under concurrent requests takes tens of seconds to minutes per batched rollout.
TIMEOUT_S = typer.Option(300.0, "--timeout-s", help="Per-request time limit (queueing included); 504 after it.")
MAX_TURNS = typer.Option(8, "--max-turns-limit", help="Largest max_turns a request may ask for.")
MAX_TOP_K = typer.Option(20, "--max-top-k", help="Largest top_k a request may ask for.")
MAX_CHARS = typer.Option(2000, "--max-question-chars", help="Longest question accepted.")
TOKEN_ENV = typer.Option(
    "SLEUTH_API_TOKEN", "--token-env", help="Environment variable holding a bearer token; when set, auth is required."
)
PLUGIN = typer.Option(
    None, "--plugin", help="Module registering more methods (repeatable), importable on PYTHONPATH."
)
DEVICE = typer.Option(None, "--device", help="Torch device of the searcher (default: cuda if available, else cpu).")


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
    from sleuth.retrieval.server_commands import is_loopback_host

    if not 1 <= port <= 65535:
        _fail(f"--port must be in 1..65535, got {port}")
    if not is_loopback_host(host):
        _warn(
            f"binding {host}: anyone who can reach this address can use this {what} "
            + ("(bearer token required)." if token else "WITHOUT authentication (set SLEUTH_API_TOKEN).")
            + " Use --host 127.0.0.1 unless you mean it."
        )


def _build(**kwargs: Any):
    from sleuth.agent.registry import load_plugins
    from sleuth.errors import SleuthError
    from sleuth.serve.loading import build_service, parse_loop_options

    try:
        load_plugins(kwargs.pop("plugin") or [])
        kwargs["loop_options"] = parse_loop_options(kwargs.pop("loop_option"))
        return build_service(**kwargs)
    except (SleuthError, ValueError, OSError) as err:
        _fail(str(err))


def _limits(max_batch: int, batch_wait_ms: float, timeout_s: float, max_turns: int, max_top_k: int, max_chars: int):
    from sleuth.serve.service import ServeLimits

    try:
        return ServeLimits(max_question_chars=max_chars, max_turns=max_turns, max_top_k=max_top_k,
                           max_batch=max_batch, batch_wait_ms=batch_wait_ms, timeout_s=timeout_s)
    except ValueError as err:
        _fail(str(err))


def register(app: typer.Typer) -> None:
    @app.command("export")
    def export_cmd(
        checkpoint: Path = typer.Argument(..., help="A `sleuth train` checkpoint or run directory (its newest)."),
        out: Path = typer.Option(..., "--out", "-o", help="Directory to write the Hugging Face model to."),
        dtype: str = typer.Option("keep", "--dtype", help="keep, float32, bfloat16 or float16."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty --out."),
    ) -> None:
        """Merge a trained searcher (LoRA folded in) into a Hugging Face model directory for vLLM/SGLang/TGI."""
        from sleuth.agent.searcher import export_searcher
        from sleuth.errors import SleuthError

        try:
            path = export_searcher(checkpoint, out, dtype=dtype, overwrite=overwrite)
        except (SleuthError, OSError) as err:
            _fail(str(err))
        typer.echo(f"exported {checkpoint} -> {path} (load with AutoModelForCausalLM.from_pretrained, "
                   f"serve with `sleuth serve-searcher --checkpoint {path}` or vLLM)")

    @app.command("serve-searcher")
    def serve_searcher(
        checkpoint: Path | None = CHECKPOINT,
        model: str | None = MODEL,
        loop: str | None = LOOP,
        loop_option: list[str] | None = LOOP_OPTION,
        index: Path | None = INDEX,
        retriever_url: str | None = RETRIEVER_URL,
        generator: str | None = GENERATOR,
        host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind; loopback only by default."),
        port: int = typer.Option(8100, "--port", help="TCP port."),
        max_batch: int = MAX_BATCH,
        batch_wait_ms: float = BATCH_WAIT_MS,
        timeout_s: float = TIMEOUT_S,
        max_turns_limit: int = MAX_TURNS,
        max_top_k: int = MAX_TOP_K,
        max_question_chars: int = MAX_CHARS,
        token_env: str = TOKEN_ENV,
        device: str | None = DEVICE,
        plugin: list[str] | None = PLUGIN,
        max_body_bytes: int = typer.Option(1 << 20, "--max-body-bytes", help="Largest request body accepted (413 beyond)."),
    ) -> None:
        """Serve a searcher over HTTP: POST /search, POST /answer, GET /health."""
        token = _token(token_env)
        _check_network(host, port, token, "searcher")
        limits = _limits(max_batch, batch_wait_ms, timeout_s, max_turns_limit, max_top_k, max_question_chars)
        service = _build(checkpoint=checkpoint, model=model, loop=loop, loop_option=loop_option, index=index,
                         retriever_url=retriever_url, generator=generator, limits=limits, device=device,
                         plugin=plugin)
        import uvicorn

        from sleuth.serve.searcher_server import create_app

        shown = f"[{host}]" if ":" in host else host
        # The URL goes to stdout so scripts can capture it; diagnostics stay on stderr.
        typer.echo(f"serving {service.loop.name} searcher at http://{shown}:{port}/search "
                   f"(answer: /answer, health: /health, auth: {'on' if token else 'off'})")
        uvicorn.run(create_app(service, token=token, max_body_bytes=max_body_bytes), host=host, port=port, log_level="warning", access_log=False)

    @app.command("serve-mcp")
    def serve_mcp(
        checkpoint: Path | None = CHECKPOINT,
        model: str | None = MODEL,
        loop: str | None = LOOP,
        loop_option: list[str] | None = LOOP_OPTION,
        index: Path | None = INDEX,
        retriever_url: str | None = RETRIEVER_URL,
        generator: str | None = GENERATOR,
        transport: str = typer.Option("stdio", "--transport", help="stdio or http (streamable HTTP at /mcp)."),
        host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind (http); loopback by default."),
        port: int = typer.Option(8101, "--port", help="TCP port (http)."),
        max_batch: int = MAX_BATCH,
        batch_wait_ms: float = BATCH_WAIT_MS,
        timeout_s: float = TIMEOUT_S,
        max_turns_limit: int = MAX_TURNS,
        max_top_k: int = MAX_TOP_K,
        max_question_chars: int = MAX_CHARS,
        token_env: str = TOKEN_ENV,
        device: str | None = DEVICE,
        plugin: list[str] | None = PLUGIN,
    ) -> None:
        """Serve a searcher as MCP tools `search` (and `answer` with --generator) over stdio or HTTP."""
        if transport not in ("stdio", "http"):
            _fail(f"--transport must be stdio or http, got {transport!r}")
        token = _token(token_env) if transport == "http" else None
        if transport == "http":
            _check_network(host, port, token, "MCP server")
        limits = _limits(max_batch, batch_wait_ms, timeout_s, max_turns_limit, max_top_k, max_question_chars)
        service = _build(checkpoint=checkpoint, model=model, loop=loop, loop_option=loop_option, index=index,
                         retriever_url=retriever_url, generator=generator, limits=limits, device=device,
                         plugin=plugin)
        from sleuth.serve.mcp_server import create_mcp_server, http_app, run_stdio

        server = create_mcp_server(service)
        if transport == "stdio":
            # stdout carries the protocol: nothing else may be printed there.
            run_stdio(server)
            return
        import uvicorn

        shown = f"[{host}]" if ":" in host else host
        typer.echo(f"serving MCP tools at http://{shown}:{port}/mcp (auth: {'on' if token else 'off'})")
        uvicorn.run(http_app(server, host=host, token=token), host=host, port=port, log_level="warning",
                    access_log=False)
