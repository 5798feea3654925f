"""Search tools as retrievers: any MCP server's search tool, or any HTTP search API.

Both speak the `Retriever` protocol (`search(queries, k)`), so a recipe's `retriever:` section and
`sleuth eval --retriever` use them like a local index. A tool answers one query per call; the
queries of a batch are sent concurrently. Failures follow the rules of `RemoteRetriever`: a broken
connection, a timeout or an HTTP 5xx is retried with exponential backoff (for MCP on a fresh
session); an HTTP 4xx or an MCP tool error means the request is wrong and fails at once with the
tool's message.

Configs (YAML, e.g. `--retriever search-tool.yaml` or a recipe's `retriever.mcp` / `retriever.http`):

    mcp:                                   http:
      server: http://127.0.0.1:8101/mcp      url: https://api.example.com/search
      # or command: [uvx, some-mcp-server]   method: GET
      tool: search                           params: {q: "{query}", count: "{k}"}
      arguments: {query: "{query}",          headers: {X-Api-Key: "${EXAMPLE_KEY}"}
                  top_k: "{k}"}              response: {results: web.results, text: description}
      response: {results: context}

`"{query}"` and `"{k}"` in arguments/params/json are filled per call (a value that is exactly
`"{k}"` becomes the integer); `${NAME}` in headers and env values is read from the environment.
`response` maps the tool's JSON (MCP: its structured content, or its text parsed as JSON) to
passages: `results` is the dotted path to the list of hits, the other keys name each hit's fields.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sleuth.data.formats import split_contents
from sleuth.errors import ConfigError, ServiceError
from sleuth.retrieval._common import validate_queries
from sleuth.retrieval.base import Hit
from sleuth.retrieval.client import _TransientError, check_status
from sleuth.utils import read_yaml, retry, validation_message


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseMapping(_Strict):
    """Where the passages are in a tool's JSON answer, and what each passage's fields are called."""

    results: str = ""  # dotted path to the list of hits ("" = the answer itself is the list)
    id: str = "id"
    title: str = "title"
    text: str = "text"  # e.g. "snippet" or "description" for web-search APIs
    score: str | None = "score"
    contents: str | None = "contents"  # FlashRAG '"title"\ntext', used when `text` is missing


class RetryConfig(_Strict):
    timeout: float = Field(30.0, gt=0)
    retries: int = Field(4, ge=1)  # attempts per query, as RemoteRetriever
    base_delay: float = Field(0.5, ge=0)
    max_delay: float = Field(8.0, ge=0)
    concurrency: int = Field(8, ge=1)  # queries in flight at once


class HTTPSearchConfig(RetryConfig):
    url: str
    method: Literal["GET", "POST"] = "GET"
    params: dict[str, Any] = Field(default_factory=lambda: {"q": "{query}"})
    json_body: dict[str, Any] | None = Field(None, alias="json")
    headers: dict[str, str] = Field(default_factory=dict)
    response: ResponseMapping = Field(default_factory=ResponseMapping)

    @model_validator(mode="after")
    def _check_url(self) -> HTTPSearchConfig:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url {self.url!r} must start with http:// or https://")
        return self


# A call to an MCP tool may run a whole search agent (sleuth serve-mcp on CPU: tens of seconds to minutes
# per question under load); the server's own limit is `sleuth serve-mcp --timeout-s` (300 s by default).
MCP_DEFAULT_TIMEOUT_S = 300.0
# Array fields of a tool's structured output read as the hits when `response.results` is not set
# (sleuth serve-mcp's `search` returns them under "context").
_HIT_LIST_FIELDS = ("results", "hits", "documents", "passages", "context")


class MCPToolConfig(RetryConfig):
    timeout: float = Field(MCP_DEFAULT_TIMEOUT_S, gt=0)
    server: str | None = None  # a streamable HTTP endpoint, e.g. http://127.0.0.1:8101/mcp
    command: list[str] | None = None  # or a stdio server the client launches: [program, arg, ...]
    env: dict[str, str] = Field(default_factory=dict)  # extra environment of a stdio server
    headers: dict[str, str] = Field(default_factory=dict)  # HTTP only, e.g. Authorization: "Bearer ${TOKEN}"
    tool: str = "search"
    arguments: dict[str, Any] = Field(default_factory=lambda: {"query": "{query}"})
    response: ResponseMapping = Field(default_factory=ResponseMapping)

    @model_validator(mode="after")
    def _one_transport(self) -> MCPToolConfig:
        if (self.server is None) == (self.command is None):
            raise ValueError(
                "set exactly one of server (an http(s) MCP endpoint) or command (a stdio server)"
            )
        if self.server is not None and not self.server.startswith(("http://", "https://")):
            raise ValueError(
                f"server {self.server!r} must be an http(s) URL; for a local program use command"
            )
        if self.command is not None and not self.command:
            raise ValueError("command must name the program to run")
        return self


class ToolRetrieverConfig(_Strict):
    """A `--retriever` YAML file: exactly one of `mcp` or `http`."""

    mcp: MCPToolConfig | None = None
    http: HTTPSearchConfig | None = None

    @model_validator(mode="after")
    def _one_tool(self) -> ToolRetrieverConfig:
        if (self.mcp is None) == (self.http is None):
            raise ValueError("set exactly one of mcp or http")
        return self


# -- shared pieces ---------------------------------------------------------------------------------

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(value: str, where: str) -> str:
    """`"Bearer ${TOKEN}"` -> the value with TOKEN read from the environment."""

    def lookup(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in os.environ:
            raise ConfigError(f"{where}: environment variable {name} is not set")
        return os.environ[name]

    return _ENV_REF.sub(lookup, value)


def fill_template(template: Any, query: str, k: int) -> Any:
    """Put `query` and `k` into a request template (dicts and lists recursively)."""
    if isinstance(template, dict):
        return {key: fill_template(value, query, k) for key, value in template.items()}
    if isinstance(template, list):
        return [fill_template(value, query, k) for value in template]
    if isinstance(template, str):
        if template == "{k}":
            return k
        return template.replace("{query}", query).replace("{k}", str(k))
    return template


def _dig(payload: Any, path: str, where: str) -> Any:
    node = payload
    for part in [p for p in path.split(".") if p]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            keys = sorted(node)[:12] if isinstance(node, dict) else type(node).__name__
            raise ServiceError(
                f"{where}: the answer has no {part!r} on the path response.results={path!r} "
                f"(found: {keys}); fix response.results"
            )
    return node


def hits_from_json(payload: Any, mapping: ResponseMapping, k: int, where: str) -> list[Hit]:
    """The first `k` passages of a tool's JSON answer, read through `mapping`."""
    items = _dig(payload, mapping.results, where)
    if isinstance(items, str):  # a tool answering in prose: one passage
        return [Hit(doc_id="0", title="", text=items, score=0.0)]
    if not isinstance(items, list):
        raise ServiceError(
            f"{where}: response.results={mapping.results!r} is a {type(items).__name__}, "
            "not a list of hits; point it at the list"
        )
    hits = []
    for rank, item in enumerate(items[:k]):
        if isinstance(item, str):
            hits.append(Hit(doc_id=str(rank), title="", text=item, score=0.0))
            continue
        if not isinstance(item, dict):
            raise ServiceError(
                f"{where}: hit {rank} is a {type(item).__name__}, expected an object or a string"
            )
        if mapping.text in item:
            title, text = str(item.get(mapping.title, "") or ""), str(item[mapping.text] or "")
        elif mapping.contents and mapping.contents in item:
            title, text = split_contents(str(item[mapping.contents]))
        else:
            raise ServiceError(
                f"{where}: hit {rank} has no {mapping.text!r} field (fields: {sorted(item)}); "
                "set response.text to the field holding the passage"
            )
        raw_score = item.get(mapping.score) if mapping.score else None
        try:
            score = float(raw_score) if raw_score is not None else 0.0
        except (TypeError, ValueError):
            score = 0.0
        hits.append(Hit(doc_id=str(item.get(mapping.id, rank)), title=title, text=text, score=score))
    return hits


class _PerQueryRetriever:
    """Batches of queries as concurrent single-query calls, each retried with backoff on transient failures."""

    def __init__(self, cfg: RetryConfig, what: str):
        self.cfg = cfg
        self.what = what
        self._pool = ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="sleuth-tool")

    def _search_one(self, query: str, k: int) -> list[Hit]:
        raise NotImplementedError

    def _with_retries(self, query: str, k: int) -> list[Hit]:
        try:
            return retry(
                lambda: self._search_one(query, k),
                attempts=self.cfg.retries,
                base_delay=self.cfg.base_delay,
                max_delay=self.cfg.max_delay,
                retry_on=(_TransientError,),
                what=f"search {query[:60]!r} on {self.what}",
            )
        except ServiceError as err:
            if "failed after" not in str(err):
                raise
            raise ServiceError(
                f"{err}; if the tool is slow rather than down (a search agent on CPU), raise `timeout:` "
                f"(now {self.cfg.timeout:g} s per attempt) in the mcp:/http: section of a --retriever YAML, "
                "and the server's own limit (sleuth serve-mcp --timeout-s)"
            ) from err

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        """Top-k hits per query, in the tool's order (the `Retriever` protocol)."""
        validate_queries(queries, k)
        return list(self._pool.map(lambda q: self._with_retries(q, k), queries))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- HTTP search APIs --------------------------------------------------------------------------------


class HTTPSearchRetriever(_PerQueryRetriever):
    """Any HTTP search API: the request built from templates, passages read through `response`."""

    def __init__(self, cfg: HTTPSearchConfig):
        super().__init__(cfg, cfg.url)
        self.config = cfg
        headers = {name: expand_env(value, f"http.headers.{name}") for name, value in cfg.headers.items()}
        self._client = httpx.Client(timeout=cfg.timeout, headers=headers)

    def _search_one(self, query: str, k: int) -> list[Hit]:
        cfg = self.config
        try:
            resp = self._client.request(
                cfg.method,
                cfg.url,
                params=fill_template(cfg.params, query, k) or None,
                json=fill_template(cfg.json_body, query, k) if cfg.json_body is not None else None,
            )
        except httpx.HTTPError as err:
            raise _TransientError(f"{cfg.url}: {type(err).__name__}: {err}") from err
        check_status(resp, cfg.url)
        try:
            payload = resp.json()
        except ValueError as err:
            raise ServiceError(
                f"{cfg.url} answered with something that is not JSON: {resp.text[:200]!r}"
            ) from err
        return hits_from_json(payload, cfg.response, k, cfg.url)

    def close(self) -> None:
        super().close()
        self._client.close()

    def __repr__(self) -> str:
        return f"HTTPSearchRetriever({self.config.url!r})"


# -- MCP tools ----------------------------------------------------------------------------------------


class MCPRetriever(_PerQueryRetriever):
    """An MCP server's search tool through the official SDK client.

    One session stays open (a stdio server is launched once) on a background event loop; a
    transport failure closes it and the retry opens a new one. `target` replaces the config's
    server/command with any target `mcp.Client` accepts (e.g. an in-process `MCPServer`).
    """

    def __init__(self, cfg: MCPToolConfig, target: Any = None, adapt_to_tool: bool = False):
        super().__init__(cfg, cfg.server or " ".join(cfg.command or []))
        self.config = cfg
        # `mcp:<url>` gives no arguments or response mapping: read them off the tool's schemas
        self._adapt_to_tool = adapt_to_tool
        self._target = target
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sleuth-mcp", daemon=True)
        self._thread.start()
        self._session_lock = asyncio.Lock()
        self._client: Any = None
        self._stop: asyncio.Event | None = None
        self._owner: asyncio.Task | None = None
        self._tool_checked = False

    def _make_client(self) -> Any:
        from mcp import Client  # deferred: the SDK is only needed when an MCP tool is used
        from mcp.client.stdio import StdioServerParameters

        cfg = self.config
        if self._target is not None:
            target = self._target
        elif cfg.command is not None:
            env = {**os.environ, **{n: expand_env(v, f"mcp.env.{n}") for n, v in cfg.env.items()}}
            target = StdioServerParameters(command=cfg.command[0], args=cfg.command[1:], env=env)
        elif cfg.headers:
            # deferred: the MCP SDK's stack is needed only when an MCP tool is used
            import httpx2
            from mcp.client.streamable_http import streamable_http_client

            headers = {n: expand_env(v, f"mcp.headers.{n}") for n, v in cfg.headers.items()}
            target = streamable_http_client(
                cfg.server, http_client=httpx2.AsyncClient(headers=headers, timeout=cfg.timeout)
            )
        else:
            target = cfg.server
        return Client(target, read_timeout_seconds=cfg.timeout)

    async def _own_session(self, ready: asyncio.Future, stop: asyncio.Event) -> None:
        """Hold one client session open until `stop`: the SDK's transports are task-scoped, so the
        task that opens a session must also be the one that closes it."""
        try:
            async with self._make_client() as client:
                if not self._tool_checked:
                    tools = {t.name: t for t in (await client.list_tools()).tools}
                    problem = None
                    if self.config.tool not in tools:
                        problem = (
                            f"MCP server {self.what} has no tool {self.config.tool!r} "
                            f"(its tools: {', '.join(tools) or 'none'}); set mcp.tool"
                        )
                    elif self._adapt_to_tool:
                        problem = self._adapt(tools[self.config.tool])
                    if problem:
                        # set, not raised: the client's task group would wrap it in an ExceptionGroup
                        ready.set_exception(ServiceError(problem))
                        return
                    self._tool_checked = True
                ready.set_result(client)
                await stop.wait()
        except BaseException as err:  # noqa: BLE001 - handed to the caller waiting for the session
            if not ready.done():
                ready.set_exception(err)

    def _adapt(self, tool: Any) -> str | None:
        """Fit the default arguments and response mapping to the tool's schemas: the query goes in
        `query`, else in the tool's one required string argument (sleuth serve-mcp's `question`);
        the hits are the first known array field of its structured output. Returns a problem, or None."""
        # mcp 2.x names the schemas input_schema / output_schema (1.x: inputSchema / outputSchema)
        schema = getattr(tool, "input_schema", None) or getattr(tool, "inputSchema", None) or {}
        props = schema.get("properties", {})
        update: dict[str, Any] = {}
        if "query" not in props:
            strings = [n for n in schema.get("required", []) if props.get(n, {}).get("type") == "string"]
            if len(strings) != 1:
                return (
                    f"MCP tool {self.config.tool!r} on {self.what} takes {sorted(props) or 'no arguments'}, "
                    "not one query string; name its arguments in a --retriever YAML (mcp.arguments)"
                )
            update["arguments"] = {strings[0]: "{query}"}
        output = getattr(tool, "output_schema", None) or getattr(tool, "outputSchema", None) or {}
        out_props = output.get("properties", {})
        listed = [f for f in _HIT_LIST_FIELDS if out_props.get(f, {}).get("type") == "array"]
        if listed and not self.config.response.results:
            update["response"] = self.config.response.model_copy(update={"results": listed[0]})
        if update:
            self.config = self.config.model_copy(update=update)
        return None

    async def _session(self) -> Any:
        async with self._session_lock:
            if self._client is None:
                ready: asyncio.Future = self._loop.create_future()
                stop = asyncio.Event()
                owner = self._loop.create_task(self._own_session(ready, stop))
                client = await ready
                self._client, self._stop, self._owner = client, stop, owner
            return self._client

    async def _drop_session(self) -> None:
        async with self._session_lock:
            if self._client is None:
                return
            self._client = None
            self._stop.set()
            await asyncio.gather(self._owner, return_exceptions=True)

    async def _call(self, query: str, k: int) -> Any:
        try:
            client = await self._session()
            return await client.call_tool(self.config.tool, fill_template(self.config.arguments, query, k))
        except ServiceError:
            raise
        except Exception as err:  # transport failures come as OSError, anyio or MCP errors, or groups of them
            await self._drop_session()
            raise _TransientError(f"MCP {self.what}: {type(err).__name__}: {err}") from err

    def _search_one(self, query: str, k: int) -> list[Hit]:
        future = asyncio.run_coroutine_threadsafe(self._call(query, k), self._loop)
        result = future.result(timeout=self.config.timeout * 2 + 30)
        where = f"MCP tool {self.config.tool!r} on {self.what}"
        texts = [getattr(c, "text", "") for c in result.content if getattr(c, "type", "") == "text"]
        if result.is_error:
            raise ServiceError(f"{where} returned an error: {' '.join(texts)[:300]}")
        structured = result.structured_content
        if (
            isinstance(structured, dict)
            and not self.config.response.results
            and set(structured) == {"result"}
        ):
            structured = structured[
                "result"
            ]  # the SDK wraps a tool's non-object return value as {"result": value}
        if structured is not None:
            return hits_from_json(structured, self.config.response, k, where)
        try:
            payload = json.loads(texts[0]) if len(texts) == 1 else None
        except ValueError:
            payload = None
        if payload is not None:
            return hits_from_json(payload, self.config.response, k, where)
        # plain text blocks: each one is a passage
        return [Hit(doc_id=str(i), title="", text=t, score=0.0) for i, t in enumerate(texts[:k])]

    def close(self) -> None:
        super().close()
        asyncio.run_coroutine_threadsafe(self._drop_session(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __repr__(self) -> str:
        return f"MCPRetriever({self.what!r}, tool={self.config.tool!r})"


# -- from configs ------------------------------------------------------------------------------------


def tool_retriever(mcp: MCPToolConfig | None = None, http: HTTPSearchConfig | None = None) -> Any:
    if mcp is not None:
        return MCPRetriever(mcp)
    if http is not None:
        return HTTPSearchRetriever(http)
    raise ConfigError("a tool retriever needs an mcp or an http section")


def is_tool_spec(spec: str) -> bool:
    """`--retriever` values that name a tool: a YAML config file, or `mcp:<http url>`."""
    return spec.startswith("mcp:") or Path(spec).suffix.lower() in (".yaml", ".yml")


def load_tool_retriever(spec: str) -> Any:
    """`mcp:http://host/mcp` (its `search` tool, default mapping) or a YAML file with an `mcp:` or `http:` section."""
    if spec.startswith("mcp:"):
        try:
            return MCPRetriever(MCPToolConfig(server=spec[len("mcp:") :]), adapt_to_tool=True)
        except ValidationError as err:
            raise ConfigError(f"--retriever {spec!r}: {err.errors()[0]['msg']}") from None
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"--retriever {spec}: no such file")
    try:
        cfg = ToolRetrieverConfig.model_validate(read_yaml(path))
    except ValidationError as err:
        raise ConfigError(validation_message(str(path), "search tool config", err)) from None
    return tool_retriever(cfg.mcp, cfg.http)
