"""Search tools as retrievers: an MCP server's tool through the official SDK client (in-process, streamable
HTTP, stdio) and an HTTP search API with a configured request/response mapping, against stand-ins on
127.0.0.1; with RemoteRetriever's retry rules; used by `evaluate` and by the trainer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from sleuth.errors import ConfigError, ServiceError
from sleuth.retrieval.tools import (
    HTTPSearchConfig,
    HTTPSearchRetriever,
    MCPRetriever,
    MCPToolConfig,
    load_tool_retriever,
)
from sleuth.serve.threaded import serve_in_thread
from toyworld import ToyRetriever

PLUGINS = Path(__file__).parent / "plugins"
sys.path.insert(0, str(PLUGINS))

from toy_search_tools import build_http_api, build_mcp_server  # noqa: E402

QUERIES = ["capital of Varonia", "director of Blue Harbor", "river through Quellstad"]
FAST_RETRY = {"base_delay": 0.01, "max_delay": 0.02}
MCP_MAPPING = {
    "tool": "web_search",
    "arguments": {"q": "{query}", "limit": "{k}"},
    "response": {
        "results": "data.hits",
        "id": "doc",
        "title": "name",
        "text": "snippet",
        "score": "rank_score",
    },
}
HTTP_MAPPING = {
    "params": {"q": "{query}", "count": "{k}"},
    "headers": {"X-Api-Key": "${TOY_SEARCH_KEY}"},
    "response": {
        "results": "web.results",
        "id": "doc",
        "title": "name",
        "text": "snippet",
        "score": "rank_score",
    },
}


def expected(queries: list[str], k: int) -> list[list[tuple[str, str, str, float]]]:
    return [
        [(h.doc_id, h.title, h.text, h.score) for h in hits] for hits in ToyRetriever().search(queries, k)
    ]


def as_tuples(result) -> list[list[tuple[str, str, str, float]]]:
    return [[(h.doc_id, h.title, h.text, h.score) for h in hits] for hits in result]


@pytest.fixture
def api(monkeypatch):
    monkeypatch.setenv("TOY_SEARCH_KEY", "s3cret")
    state: dict = {"key": "s3cret"}
    with serve_in_thread(build_http_api(state)) as base:
        yield base, state


# -- HTTP search APIs -------------------------------------------------------------------------------


def test_http_api_maps_request_and_response(api) -> None:
    base, state = api
    with HTTPSearchRetriever(HTTPSearchConfig(url=f"{base}/search", **HTTP_MAPPING)) as retriever:
        assert as_tuples(retriever.search(QUERIES, 2)) == expected(QUERIES, 2)
    assert state["calls"] == len(QUERIES)


def test_http_api_post_json_body(api) -> None:
    base, _ = api
    cfg = HTTPSearchConfig.model_validate(
        {
            "url": f"{base}/v1/retrieve",
            "method": "POST",
            "params": {},
            "json": {"query": {"text": "{query}"}, "options": {"k": "{k}"}},
            "response": {"results": "items", "id": "doc", "title": "name", "text": "snippet", "score": None},
        }
    )
    with HTTPSearchRetriever(cfg) as retriever:
        got = retriever.search(QUERIES[:1], 3)
    assert [(h.doc_id, h.title, h.text) for h in got[0]] == [e[:3] for e in expected(QUERIES[:1], 3)[0]]
    assert all(h.score == 0.0 for h in got[0])  # score: null in the mapping


def test_http_5xx_is_retried_4xx_is_not(api) -> None:
    base, state = api
    cfg = HTTPSearchConfig(url=f"{base}/search", retries=3, **FAST_RETRY, **HTTP_MAPPING)
    with HTTPSearchRetriever(cfg) as retriever:
        state.update(fail=[503, 502], calls=0)
        assert as_tuples(retriever.search(QUERIES[:1], 3)) == expected(QUERIES[:1], 3)
        assert state["calls"] == 3  # two failures, then the answer
        state.update(fail=[503, 503, 503], calls=0)
        with pytest.raises(ServiceError, match="failed after 3 attempts.*HTTP 503"):
            retriever.search(QUERIES[:1], 3)
        state.update(fail=[400], calls=0)
        with pytest.raises(ServiceError, match="rejected the request: HTTP 400: scripted failure"):
            retriever.search(QUERIES[:1], 3)
        assert state["calls"] == 1


def test_http_connection_failure_is_retried_then_named(api) -> None:
    base, _ = api
    dead = "http://127.0.0.1:9/search"  # discard port: nothing listens
    cfg = HTTPSearchConfig(url=dead, retries=2, timeout=2, **FAST_RETRY, **HTTP_MAPPING)
    with (
        HTTPSearchRetriever(cfg) as retriever,
        pytest.raises(ServiceError, match="failed after 2 attempts.*ConnectError"),
    ):
        retriever.search(QUERIES[:1], 3)


def test_http_mapping_and_env_errors_name_what_to_fix(api, monkeypatch) -> None:
    base, _ = api
    bad_path = {**HTTP_MAPPING, "response": {**HTTP_MAPPING["response"], "results": "web.items"}}
    with (
        HTTPSearchRetriever(HTTPSearchConfig(url=f"{base}/search", **bad_path)) as retriever,
        pytest.raises(ServiceError, match="no 'items' on the path response.results='web.items'.*results"),
    ):
        retriever.search(QUERIES[:1], 3)
    bad_field = {**HTTP_MAPPING, "response": {**HTTP_MAPPING["response"], "text": "body"}}
    with (
        HTTPSearchRetriever(HTTPSearchConfig(url=f"{base}/search", **bad_field)) as retriever,
        pytest.raises(ServiceError, match="no 'body' field.*'snippet'"),
    ):
        retriever.search(QUERIES[:1], 3)
    monkeypatch.delenv("TOY_SEARCH_KEY")
    with pytest.raises(ConfigError, match="TOY_SEARCH_KEY is not set"):
        HTTPSearchRetriever(HTTPSearchConfig(url=f"{base}/search", **HTTP_MAPPING))


# -- MCP tools -------------------------------------------------------------------------------------


def test_mcp_tool_in_process_structured_results() -> None:
    cfg = MCPToolConfig(server="http://unused.invalid/mcp", **MCP_MAPPING)
    with MCPRetriever(cfg, target=build_mcp_server()) as retriever:
        assert as_tuples(retriever.search(QUERIES, 3)) == expected(QUERIES, 3)
        assert as_tuples(retriever.search(QUERIES[:1], 1)) == expected(QUERIES[:1], 1)


def test_mcp_tool_over_streamable_http_and_missing_tool() -> None:
    server = build_mcp_server()
    with serve_in_thread(server.streamable_http_app(streamable_http_path="/mcp")) as base:
        with MCPRetriever(MCPToolConfig(server=f"{base}/mcp", **MCP_MAPPING)) as retriever:
            assert as_tuples(retriever.search(QUERIES, 2)) == expected(QUERIES, 2)
        wrong = {**MCP_MAPPING, "tool": "search"}
        with (
            MCPRetriever(MCPToolConfig(server=f"{base}/mcp", **wrong)) as retriever,
            pytest.raises(ServiceError, match="has no tool 'search' \\(its tools: web_search\\)"),
        ):
            retriever.search(QUERIES[:1], 2)


def test_mcp_stdio_server_text_results() -> None:
    cfg = MCPToolConfig(
        command=[sys.executable, str(PLUGINS / "toy_search_tools.py"), "--text"],
        tool="web_search",
        arguments={"q": "{query}", "limit": "{k}"},
        timeout=60,
    )
    with MCPRetriever(cfg) as retriever:
        (hits,) = retriever.search(QUERIES[:1], 2)
    (want,) = expected(QUERIES[:1], 2)
    # a plain-text tool answer is one passage holding the tool's text
    assert [h.text for h in hits] == ["\n".join(f"{title}: {text}" for _, title, text, _ in want)]


def test_mcp_unreachable_server_is_retried_then_named() -> None:
    cfg = MCPToolConfig(server="http://127.0.0.1:9/mcp", retries=2, timeout=5, **FAST_RETRY, **MCP_MAPPING)
    with MCPRetriever(cfg) as retriever, pytest.raises(ServiceError, match="failed after 2 attempts"):
        retriever.search(QUERIES[:1], 2)


def test_tool_argument_errors_come_back_as_service_errors() -> None:
    bad_args = {**MCP_MAPPING, "arguments": {"query": "{query}"}}  # the tool needs `q`
    with (
        MCPRetriever(
            MCPToolConfig(server="http://unused.invalid/mcp", **bad_args), target=build_mcp_server()
        ) as retriever,
        pytest.raises(ServiceError, match="returned an error"),
    ):
        retriever.search(QUERIES[:1], 2)


# -- configs, evaluation and training -----------------------------------------------------------------


def test_yaml_spec_errors_name_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "tool.yaml"
    bad.write_text(yaml.safe_dump({"http": {"url": "ftp://x", "metod": "GET"}}))
    with pytest.raises(ConfigError, match=r"tool.yaml: invalid search tool config(.|\n)*http.metod"):
        load_tool_retriever(str(bad))
    bad.write_text(yaml.safe_dump({"mcp": {"tool": "search"}}))
    with pytest.raises(ConfigError, match="exactly one of server .* or command"):
        load_tool_retriever(str(bad))
    with pytest.raises(ConfigError, match="no such file"):
        load_tool_retriever(str(tmp_path / "missing.yaml"))


def test_evaluate_with_an_http_search_api(api, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from sleuth.data.formats import QAExample
    from sleuth.eval.harness import EvalConfig, evaluate
    from sleuth.llm.registry import tiny_model_dir
    from sleuth.llm.scripted import ScriptedGenerator

    base, state = api
    spec = tmp_path / "search-api.yaml"
    spec.write_text(yaml.safe_dump({"http": {"url": f"{base}/search", **HTTP_MAPPING}}))
    turns = ["<search> capital of Varonia </search>", "<answer> Quellstad </answer>"]
    model = ScriptedGenerator(
        AutoTokenizer.from_pretrained(tiny_model_dir()), lambda call: turns[min(call.turn_index, 1)]
    )
    examples = [QAExample("q1", "What is the capital of Varonia?", ["Quellstad"])]
    summary = evaluate(
        "search-r1", examples, str(spec), model, out_dir=tmp_path / "out", config=EvalConfig(top_k=2)
    )
    (record,) = [
        json.loads(x) for x in (tmp_path / "out" / "search-r1" / "predictions.jsonl").read_text().splitlines()
    ]
    assert summary["methods"]["search-r1"]["overall"]["em"] == 1.0 and record["retrieval_count"] == 1
    assert [h["doc_id"] for h in record["trajectory"]["retrieved"][0]] == [
        e[0] for e in expected(["capital of Varonia"], 2)[0]
    ]
    assert state["calls"] == 1


def test_training_against_an_mcp_search_tool(small_world: Path, tmp_path: Path) -> None:
    """A recipe whose retriever is an MCP server's tool (here: an MCP server over the world's BM25 index)."""
    from mcp.server.mcpserver import MCPServer

    from sleuth.retrieval import load_retriever
    from sleuth.rl.config import recipe_from_dict
    from sleuth.rl.trainer import train

    index = load_retriever(small_world / "bm25")
    calls: list[str] = []
    server = MCPServer("bm25", log_level="WARNING")

    def search(query: str, top_k: int = 3) -> dict:
        calls.append(query)
        (hits,) = index.search([query], top_k)
        return {"results": [h.to_dict() for h in hits]}

    server.add_tool(search, name="search")
    with serve_in_thread(server.streamable_http_app(streamable_http_path="/mcp")) as base:
        recipe = recipe_from_dict(
            {
                "name": "mcp-train",
                "model": {"policy": "tiny"},
                "data": {"train": str(small_world / "train.jsonl")},
                "retriever": {
                    "mcp": {
                        "server": f"{base}/mcp",
                        "arguments": {"query": "{query}", "top_k": "{k}"},
                        "response": {"results": "results", "id": "doc_id"},
                    }
                },
                "agent": {
                    "loop": "s3",
                    "max_turns": 1,
                    "top_k": 2,
                    "max_new_tokens_per_turn": 8,
                    "max_response_tokens": 64,
                    "max_obs_tokens": 32,
                },
                "reward": {"name": "search_r1_em"},
                "algorithm": {
                    "name": "grpo",
                    "n": 2,
                    "prompts_per_step": 1,
                    "minibatch_size": 2,
                    "micro_batch_size": 2,
                },
                "trainer": {"total_steps": 1, "save_every": 0, "out_dir": str(tmp_path / "run")},
            }
        )
        train(recipe)
    assert calls  # s3 begins with a search of the question: the rollouts went through the MCP tool
    rollouts = [
        json.loads(x) for x in (tmp_path / "run" / "rollouts" / "step_000001.jsonl").read_text().splitlines()
    ]
    first = rollouts[0]["retrieved"][0]
    (want,) = index.search([calls[0]], 2)
    assert [h["doc_id"] for h in first] == [h.doc_id for h in want]


def test_recipe_takes_exactly_one_retriever_source(monkeypatch) -> None:
    from sleuth.rl.config import recipe_from_dict
    from sleuth.rl.setup import build_retriever

    base = {"name": "x", "data": {"train": "t.jsonl"}}
    with pytest.raises(ConfigError, match="exactly one of retriever.index, retriever.url, retriever.mcp"):
        recipe_from_dict({**base, "retriever": {"index": "i", "http": {"url": "http://127.0.0.1:1/s"}}})
    recipe = recipe_from_dict(
        {**base, "retriever": {"http": {"url": "http://127.0.0.1:1/s", **HTTP_MAPPING}}}
    )
    assert recipe.retriever.http.response.results == "web.results"
    # secrets are read when the retriever opens, so a recipe can be checked without them
    monkeypatch.delenv("TOY_SEARCH_KEY", raising=False)
    with pytest.raises(ConfigError, match="http.headers.X-Api-Key: environment variable TOY_SEARCH_KEY"):
        build_retriever(recipe)
