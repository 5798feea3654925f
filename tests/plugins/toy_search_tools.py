"""Stand-ins for third-party search tools, over the six toy passages (tests/toyworld.py): an MCP server
with a `web_search` tool (run as a stdio program by `python toy_search_tools.py`) and a web-search style
HTTP API whose failures the tests can script."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ for toyworld

from toyworld import ToyRetriever  # noqa: E402


def hit_dicts(query: str, k: int) -> list[dict[str, Any]]:
    (hits,) = ToyRetriever().search([query], k)
    return [
        {
            "url": f"https://toy.example/{h.doc_id}",
            "name": h.title,
            "snippet": h.text,
            "rank_score": h.score,
            "doc": h.doc_id,
        }
        for h in hits
    ]


def build_mcp_server(text_only: bool = False):
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("toy-search", log_level="WARNING")

    if text_only:

        def web_search(q: str, limit: int = 3) -> str:
            """Plain-text results: one line per hit."""
            return "\n".join(f"{h['name']}: {h['snippet']}" for h in hit_dicts(q, limit))
    else:

        def web_search(q: str, limit: int = 3) -> dict[str, Any]:
            """Search the toy web; structured results under data.hits."""
            return {"data": {"hits": hit_dicts(q, limit)}, "query": q}

    server.add_tool(web_search, name="web_search")
    return server


def build_http_api(state: dict[str, Any]):
    """GET /search?q=&count= (header X-Api-Key must equal state["key"]); state["fail"] scripts the next
    answers, e.g. [503, 503] (then success), and state["calls"] counts requests."""
    from fastapi import FastAPI, Header, HTTPException

    app = FastAPI()

    @app.get("/search")
    def search(q: str, count: int = 3, x_api_key: str | None = Header(None)) -> dict[str, Any]:
        state["calls"] = state.get("calls", 0) + 1
        if state.get("fail"):
            raise HTTPException(state["fail"].pop(0), detail="scripted failure")
        if x_api_key != state.get("key"):
            raise HTTPException(401, detail="bad api key")
        return {"type": "search", "web": {"results": hit_dicts(q, count)}}

    @app.post("/v1/retrieve")
    def retrieve(body: dict[str, Any]) -> dict[str, Any]:
        state["calls"] = state.get("calls", 0) + 1
        return {"items": hit_dicts(body["query"]["text"], body["options"]["k"])}

    return app


if __name__ == "__main__":
    build_mcp_server(text_only="--text" in sys.argv).run("stdio")
