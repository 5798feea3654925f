"""The searcher as MCP tools, called through the official SDK client: in-memory, stdio and streamable HTTP."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sleuth.serve.service import SearcherService, ServeLimits

QUESTION = "Where was the founder of the company born?"


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    from sleuth.llm.registry import tiny_model_dir

    return tiny_model_dir()


@pytest.fixture(scope="module")
def service(small_world: Path, tiny_dir: Path) -> Iterator[SearcherService]:
    """An untrained model served with a loop (the --model SPEC --loop NAME path)."""
    from sleuth.serve.loading import ServiceSpec, build_service

    svc = build_service(
        ServiceSpec(
            model=str(tiny_dir),
            loop="s3",
            loop_options={"max_turns": 1},
            index=small_world / "bm25",
            generator=str(tiny_dir),
            max_new_tokens_per_turn=12,
            max_obs_tokens=64,
            max_response_tokens=96,
            limits=ServeLimits(max_top_k=5),
        )
    )
    yield svc
    svc.close()


def _call(target, tool: str, args: dict):
    from mcp import Client

    async def main():
        async with Client(target) as client:
            names = [t.name for t in (await client.list_tools()).tools]
            return names, await client.call_tool(tool, args)

    return asyncio.run(main())


def test_search_tool_returns_context_text_and_structure(service: SearcherService) -> None:
    from sleuth.serve.mcp_server import create_mcp_server

    names, result = _call(create_mcp_server(service), "search", {"question": QUESTION, "top_k": 2})
    assert names == ["search", "answer"]
    assert not result.is_error
    data = result.structured_content
    direct = service.retriever.inner.search([QUESTION], 2)[0]
    assert data["loop"] == "s3" and data["trajectory"]["queries"][0] == QUESTION
    assert [d["id"] for d in data["trajectory"]["documents"][0]] == [h.doc_id for h in direct]
    assert data["context"] and data["context_text"] in result.content[0].text
    # the tool gives what the HTTP API's /search gives (same service, greedy decoding)
    expected = asyncio.run(service.search(service.validate(QUESTION, None, 2)))
    assert data["context"] == expected["context"]


def test_answer_tool_and_argument_errors(service: SearcherService) -> None:
    from sleuth.serve.mcp_server import create_mcp_server

    server = create_mcp_server(service)
    _, result = _call(server, "answer", {"question": QUESTION})
    assert not result.is_error
    assert result.content[0].text.startswith(f"Answer: {result.structured_content['answer']}")
    _, bad = _call(server, "search", {"question": "  "})
    assert bad.is_error and "invalid question" in bad.content[0].text
    # the limit was 5, raised to s3's own default top_k (8) so that default requests are always valid
    _, bad = _call(server, "search", {"question": QUESTION, "top_k": 9})
    assert bad.is_error and "top_k must be between 1 and 8, got 9" in bad.content[0].text


def test_no_answer_tool_without_generator(service: SearcherService) -> None:
    from sleuth.serve.mcp_server import create_mcp_server

    bare = SearcherService(service.generator.inner, service.loop, service.retriever.inner)
    names, result = _call(create_mcp_server(bare), "search", {"question": QUESTION, "max_turns": 1})
    assert names == ["search"] and not result.is_error


def test_streamable_http_with_bearer_token(service: SearcherService) -> None:
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    from sleuth.serve.mcp_server import create_mcp_server, http_app
    from sleuth.serve.threaded import serve_in_thread

    with serve_in_thread(http_app(create_mcp_server(service), token="tok")) as base:
        denied = httpx.post(f"{base}/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        assert denied.status_code == 401
        client = httpx2.AsyncClient(headers={"Authorization": "Bearer tok"}, timeout=60)
        _, result = _call(
            streamable_http_client(f"{base}/mcp", http_client=client),
            "search",
            {"question": QUESTION, "top_k": 3},
        )
    assert not result.is_error
    assert result.structured_content["retrieval_count"] >= 1 and result.structured_content["context"]


def test_stdio_server_subprocess(small_world: Path, tiny_dir: Path) -> None:
    from mcp.client.stdio import StdioServerParameters

    params = StdioServerParameters(
        command=sys.executable,
        args=[
            "-m",
            "sleuth.cli",
            "serve-mcp",
            "--model",
            str(tiny_dir),
            "--loop",
            "qagent",
            "--loop-option",
            "max_turns=1",
            "--index",
            str(small_world / "bm25"),
            "--transport",
            "stdio",
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    names, result = _call(params, "search", {"question": QUESTION})
    assert names == ["search"]  # no --generator, no answer tool
    assert not result.is_error, result.content
    assert result.structured_content["loop"] == "qagent"
    assert result.structured_content["trajectory"]["num_turns"] <= 1


def test_mcp_url_shorthand_searches_through_sleuth_serve_mcp(service: SearcherService) -> None:
    """`--retriever mcp:URL` against sleuth's own server: the query goes in the tool's `question`
    argument and the hits are its structured `context` (the shorthand used to send `query`)."""
    from sleuth.retrieval.tools import load_tool_retriever
    from sleuth.serve.mcp_server import create_mcp_server, http_app
    from sleuth.serve.threaded import serve_in_thread

    with serve_in_thread(http_app(create_mcp_server(service))) as base:
        retriever = load_tool_retriever(f"mcp:{base}/mcp")
        try:
            (hits,) = retriever.search([QUESTION], 3)
        finally:
            retriever.close()
    expected = asyncio.run(service.search(service.validate(QUESTION, None, None)))["context"][:3]
    assert hits and [(h.doc_id, h.title, h.text) for h in hits] == [
        (d["id"], d["title"], d["text"]) for d in expected
    ]


def test_timeouts_are_sized_for_a_cpu_searcher_and_a_slow_tool_error_names_the_setting() -> None:
    from sleuth.errors import ServiceError
    from sleuth.retrieval.tools import HTTPSearchConfig, HTTPSearchRetriever, MCPToolConfig
    from sleuth.serve.service import ServeLimits

    assert MCPToolConfig(server="http://127.0.0.1:1/mcp").timeout == 300.0
    assert ServeLimits().timeout_s == 300.0
    dead = HTTPSearchRetriever(HTTPSearchConfig(url="http://127.0.0.1:9/search", retries=1, timeout=0.5))
    try:
        with pytest.raises(ServiceError, match=r"raise `timeout:` \(now 0.5 s per attempt\).*--timeout-s"):
            dead.search(["q"], 1)
    finally:
        dead.close()
