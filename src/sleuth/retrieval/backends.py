"""Retriever backends by name, and the one parser of a retriever's location.

A location is what a user types to name a retriever, the same string in a recipe (`retriever.location`),
`sleuth eval --retriever` and `sleuth serve-searcher --retriever`:

- `NAME:REST` for a registered backend NAME (`bm25:DIR`, `hybrid:DIR1,DIR2`, `milvus:URI?collection=C`,
  `url:URL1,URL2`, `mcp:URL`, `tool:FILE.yaml`, or a plugin's own);
- an http(s) URL: a Search-R1-compatible /retrieve server (`url`);
- a `.yaml` / `.yml` file: a search tool config with an `mcp:` or `http:` section (`tool`);
- anything else: a `sleuth index` directory, whose manifest says bm25, dense or sharded (`index`).

A plugin module adds a backend with `register_backend(RetrieverBackend(name, open, form))`; every command
that takes a location can then name it, with no edit to sleuth. `cache` wraps any of them
(`sleuth.retrieval.cache`: the recipe's `retriever.cache`, eval's `--retriever-cache`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from sleuth.errors import ConfigError
from sleuth.retrieval.base import Retriever
from sleuth.retrieval.cache import CachingRetriever
from sleuth.retrieval.client import RemoteRetriever
from sleuth.retrieval.index import load_hybrid, load_retriever, read_manifest
from sleuth.retrieval.milvus import MilvusRetriever, MilvusSearch  # pymilvus itself loads on first use
from sleuth.retrieval.tools import load_tool_retriever
from sleuth.utils import RetryPolicy


@dataclass(frozen=True)
class OpenContext:
    """What a backend may use besides its location: the corpus to check an index against, the /retrieve
    client's retry policy (None: its default), load options, and the words naming the location in an error."""

    corpus: str | Path | None = None
    retry: RetryPolicy | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    where: str = "retriever"


@dataclass(frozen=True)
class RetrieverBackend:
    """`open(rest, context)` returns the retriever at `NAME:rest`; `form` shows a location, for help and errors."""

    name: str
    open: Callable[[str, OpenContext], Retriever]
    form: str


_BACKENDS: dict[str, RetrieverBackend] = {}


def register_backend(backend: RetrieverBackend) -> RetrieverBackend:
    """Make `NAME:...` a retriever location everywhere (a name can be taken once)."""
    existing = _BACKENDS.get(backend.name)
    if existing is not None and existing.open is not backend.open:
        raise ValueError(f"retriever backend {backend.name!r} is already registered ({existing.form})")
    if len(backend.name) < 2 or not backend.name.replace("_", "").replace("-", "").isalnum():
        # one letter would read a Windows drive (C:\\...) as a backend
        raise ValueError(
            f"retriever backend name {backend.name!r}: use two or more letters, digits, '_' or '-'"
        )
    _BACKENDS[backend.name] = backend
    return backend


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def location_forms() -> str:
    """Every registered location form, for a help text or an error."""
    return ", ".join(b.form for b in sorted(_BACKENDS.values(), key=lambda b: b.name))


def parse_location(text: str) -> tuple[str, str]:
    """(backend name, the rest) of a location; ConfigError for a `NAME:` prefix no backend has."""
    text = str(text).strip()
    if not text:
        raise ConfigError(f"an empty retriever location; use one of: {location_forms()}")
    if text.startswith(("http://", "https://")):
        return "url", text
    name, sep, rest = text.partition(":")
    if sep and name in _BACKENDS:
        return name, rest
    if sep and len(name) > 1 and "/" not in name and "\\" not in name and not Path(text).exists():
        raise ConfigError(
            f"retriever {text!r}: unknown backend {name!r}; known: {', '.join(backend_names())} "
            "(a backend from a plugin needs its module loaded: --plugin MODULE, or the recipe's plugins:)"
        )
    if Path(text).suffix.lower() in (".yaml", ".yml"):
        return "tool", text
    return "index", text


def cache_source(name: str, rest: str) -> str:
    """What a record-and-replay cache keys a location's searches by (the names `open_retriever` used before)."""
    if name in _INDEX_KINDS:
        return f"index:{Path(rest).expanduser().resolve()}"
    if name == "url":
        urls = _urls(rest)
        return f"url:{json.dumps(urls[0] if len(urls) == 1 else urls)}"
    if name in ("mcp", "tool"):
        return f"tool:{'mcp:' + rest if name == 'mcp' else rest}"
    return f"{name}:{rest}"


def open_location(
    location: str,
    *,
    corpus: str | Path | None = None,
    retry: RetryPolicy | None = None,
    cache: str | Path | None = None,
    options: Mapping[str, Any] | None = None,
    where: str = "retriever",
) -> Retriever:
    """The retriever at `location` (see the module doc), behind a record-and-replay cache if `cache` is set."""
    name, rest = parse_location(location)
    context = OpenContext(corpus=corpus, retry=retry, options=dict(options or {}), where=where)
    retriever = _BACKENDS[name].open(rest, context)
    return retriever if cache is None else CachingRetriever(retriever, cache, cache_source(name, rest))


# -- the built-in backends -----------------------------------------------------------------------------


def _index_dir(rest: str, ctx: OpenContext) -> Path:
    path = Path(rest).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"{ctx.where} {rest!r} is neither an index directory nor an http(s) URL nor a backend location "
            f"({location_forms()}); build an index with `sleuth index CORPUS --out DIR` or start a server with "
            "`sleuth serve-retriever`"
        )
    return path


def _index_of_kind(kind: str | None) -> Callable[[str, OpenContext], Retriever]:
    """An index directory's retriever; with `kind`, refuse an index of another kind (its manifest says)."""

    def open_index(rest: str, ctx: OpenContext) -> Retriever:
        path = _index_dir(rest, ctx)
        if kind is not None:
            manifest = read_manifest(path)
            found = "sharded" if manifest["kind"] == "dense" and "shards" in manifest else manifest["kind"]
            if found != kind:
                raise ConfigError(f"{ctx.where} {kind}:{rest}: that index is {found}; name it {found}:{rest}")
        return load_retriever(path, corpus=ctx.corpus, **ctx.options)

    return open_index


def _hybrid(rest: str, ctx: OpenContext) -> Retriever:
    dirs = [_index_dir(d, ctx) for d in rest.split(",") if d.strip()]
    if len(dirs) < 2:
        raise ConfigError(f"{ctx.where} hybrid:{rest}: name two or more index directories, hybrid:DIR1,DIR2")
    return load_hybrid(dirs, corpus=ctx.corpus, **ctx.options)


def _urls(rest: str) -> list[str]:
    return [u.strip() for u in rest.split(",") if u.strip()]


def _url(rest: str, ctx: OpenContext) -> Retriever:
    urls = _urls(rest)
    if not urls:
        raise ConfigError(
            f"{ctx.where} url:{rest}: name a /retrieve server, url:http://HOST:PORT[,http://...]"
        )
    return RemoteRetriever(urls[0] if len(urls) == 1 else urls, retry=ctx.retry)


def _milvus(rest: str, ctx: OpenContext) -> Retriever:
    uri, _, query = rest.rpartition("?") if "?" in rest else (rest, "", "")
    params = dict(parse_qsl(query))
    collection = params.pop("collection", None)
    if not uri or not collection:
        raise ConfigError(
            f"{ctx.where} milvus:{rest}: use milvus:URI?collection=NAME[&mode=dense|bm25|hybrid]"
        )
    search = MilvusSearch(mode=params.pop("mode", "dense"))
    token = params.pop("token", None)
    if params:
        raise ConfigError(
            f"{ctx.where} milvus:{rest}: unknown parameter(s) {sorted(params)}; "
            "known: collection, mode, token"
        )
    return MilvusRetriever(uri, collection, search=search, token=token)  # type: ignore[return-value]


_INDEX_KINDS = ("index", "bm25", "dense", "sharded")
for _kind in _INDEX_KINDS:
    register_backend(
        RetrieverBackend(_kind, _index_of_kind(None if _kind == "index" else _kind), f"{_kind}:DIR")
    )
register_backend(RetrieverBackend("hybrid", _hybrid, "hybrid:DIR1,DIR2"))
register_backend(RetrieverBackend("milvus", _milvus, "milvus:URI?collection=NAME"))
register_backend(RetrieverBackend("url", _url, "url:http://HOST:PORT[,...]"))
register_backend(RetrieverBackend("mcp", lambda rest, ctx: load_tool_retriever(f"mcp:{rest}"), "mcp:URL"))
register_backend(RetrieverBackend("tool", lambda rest, ctx: load_tool_retriever(rest), "tool:FILE.yaml"))
