"""MCP server of a trained searcher (official `mcp` SDK, 2.x `MCPServer` API).

Tools:
- `search(question, max_turns?, top_k?)`: runs the searcher; the text content is the served
  context formatted for an LLM, the structured content the full result (context documents,
  queries, per-call documents, timings);
- `answer(question, max_turns?, top_k?)` (only with a frozen generator): the same plus the
  generator's answer from the served context.

Transports: stdio (`run_stdio`) and streamable HTTP (`http_app`, served by uvicorn).
Bad arguments and backend failures come back as tool errors (`is_error`) with a message.

An MCP client launches the stdio server itself, e.g. in its server config:
    {"command": "sleuth", "args": ["serve-mcp", "--checkpoint", "runs/s3", "--index", "indexes/wiki-bm25"]}
"""

# No `from __future__ import annotations`: the SDK reads the tools' annotations at registration.

import json
from typing import Annotated, Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import CallToolResult, TextContent

from sleuth.serve.schemas import AnswerResponse, SearchResponse
from sleuth.serve.searcher_server import bearer_token_ok
from sleuth.serve.service import (
    NoAnswerGenerator,
    RequestError,
    SearcherService,
    SearchTimeout,
    ServiceFailure,
)

SEARCH_DESCRIPTION = (
    "Search a document collection with a trained multi-turn search agent ({loop}). It issues its own "
    "queries and returns the passages it judged useful for answering `question`: read the returned "
    "context to answer. Optional: max_turns (search rounds, 1-{max_turns}), top_k (documents per search, "
    "1-{max_top_k})."
)
ANSWER_DESCRIPTION = (
    "Like `search`, then a frozen generator model answers `question` from the gathered context; "
    "returns the answer and the context it used."
)


def _as_text(body: dict[str, Any], with_answer: bool) -> str:
    parts = []
    if with_answer:
        parts.append(f"Answer: {body['answer']}")
    context = body["context_text"] or "(the search found no documents)"
    parts.append(f"Context gathered by the searcher ({body['retrieval_count']} searches):\n{context}")
    return "\n\n".join(parts)


async def _run(
    service: SearcherService, question: str, max_turns: int | None, top_k: int | None, want_answer: bool
) -> dict[str, Any]:
    try:
        query = service.validate(question, max_turns, top_k, want_answer=want_answer)
    except RequestError as err:
        service.count("rejected")
        raise ToolError(f"invalid {err.field}: {err.message}") from err
    try:
        return await service.search(query)
    except (NoAnswerGenerator, ServiceFailure, SearchTimeout) as err:
        raise ToolError(str(err)) from err


def create_mcp_server(
    service: SearcherService, *, name: str = "sleuth-searcher", answer_tool: bool | None = None
) -> MCPServer:
    """An MCPServer exposing `service` as tools; `answer_tool` defaults to "a generator is configured"."""
    with_answer = service.answer_generator is not None if answer_tool is None else answer_tool
    if with_answer and service.answer_generator is None:
        raise ValueError("answer_tool=True needs a service with an answer generator (--generator)")
    limits = service.limits
    server = MCPServer(
        name,
        log_level="WARNING",  # stdio: stderr is the only log channel; keep it for real problems
        instructions=(
            "A retrieval tool backed by a trained search agent. Call `search` with a question to get "
            "evidence passages" + (", or `answer` to also get a short answer." if with_answer else ".")
        ),
    )

    async def search(
        question: str, max_turns: int | None = None, top_k: int | None = None
    ) -> Annotated[CallToolResult, SearchResponse]:
        body = await _run(service, question, max_turns, top_k, want_answer=False)
        return CallToolResult(
            content=[TextContent(type="text", text=_as_text(body, False))], structured_content=body
        )

    server.add_tool(
        search,
        name="search",
        description=SEARCH_DESCRIPTION.format(
            loop=service.loop.name, max_turns=limits.max_turns, max_top_k=limits.max_top_k
        ),
    )

    if with_answer:

        async def answer(
            question: str, max_turns: int | None = None, top_k: int | None = None
        ) -> Annotated[CallToolResult, AnswerResponse]:
            body = await _run(service, question, max_turns, top_k, want_answer=True)
            return CallToolResult(
                content=[TextContent(type="text", text=_as_text(body, True))], structured_content=body
            )

        server.add_tool(answer, name="answer", description=ANSWER_DESCRIPTION)
    return server


class _BearerAuth:
    """ASGI middleware: HTTP requests need `Authorization: Bearer <token>` (lifespan events pass through)."""

    def __init__(self, app: Any, token: str):
        self.app = app
        self.token = token

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            if not bearer_token_ok(headers.get("authorization"), self.token):
                body = json.dumps(
                    {"detail": "missing or wrong bearer token: send 'Authorization: Bearer <token>'"}
                )
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
                    }
                )
                await send({"type": "http.response.body", "body": body.encode()})
                return
        await self.app(scope, receive, send)


def http_app(
    server: MCPServer, *, host: str = "127.0.0.1", token: str | None = None, path: str = "/mcp"
) -> Any:
    """The streamable-HTTP ASGI app (endpoint `path`), behind bearer auth when `token` is set."""
    app = server.streamable_http_app(streamable_http_path=path, host=host)
    return _BearerAuth(app, token) if token else app


def run_stdio(server: MCPServer) -> None:
    server.run("stdio")
