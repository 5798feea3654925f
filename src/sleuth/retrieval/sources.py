"""A retriever from where it lives: a local index, a /retrieve server, or a search tool (written once).

Training (a recipe's `retriever:` section), evaluation (`--retriever SPEC`) and serving (`--index` /
`--retriever-url`) parse their own inputs and all open the retriever here; what differs between them
is explicit: the server client's retry policy, the corpus check, and the message for a missing index.
"""

from __future__ import annotations

import json
from pathlib import Path

from sleuth.errors import ConfigError
from sleuth.retrieval.base import Retriever
from sleuth.retrieval.cache import CachingRetriever
from sleuth.retrieval.client import RemoteRetriever
from sleuth.retrieval.index import load_retriever
from sleuth.retrieval.tools import ToolRetrieverConfig, load_tool_retriever, tool_retriever
from sleuth.utils import RetryPolicy


def open_retriever(
    *,
    index: str | Path | None = None,
    url: str | list[str] | None = None,
    tool: str | ToolRetrieverConfig | None = None,
    corpus: str | Path | None = None,
    retry: RetryPolicy | None = None,
    missing_index: str | None = None,
    cache: str | Path | None = None,
) -> Retriever:
    """The retriever of exactly one source.

    index: a `sleuth index` directory; `corpus`, if given, is checked against its manifest.
    url: one or more Search-R1-compatible /retrieve servers; `retry` is the client's policy
        (None: `RemoteRetriever`'s default).
    tool: a search tool, as a `--retriever` spec (`mcp:<url>` or a YAML file) or a parsed config.
    missing_index: if given, an `index` that is not a directory fails at once with this message
        (naming the flag the user typed); otherwise `load_retriever` reports it.
    cache: a directory recording every search, replayed on the next run (`sleuth.retrieval.cache`).
    """
    retriever = _open_source(index=index, url=url, tool=tool, corpus=corpus, retry=retry, missing_index=missing_index)
    if cache is None:
        return retriever
    if tool is not None:
        source = f"tool:{tool.model_dump_json() if isinstance(tool, ToolRetrieverConfig) else tool}"
    elif url is not None:
        source = f"url:{json.dumps(url)}"
    else:
        source = f"index:{Path(index).expanduser().resolve()}"
    return CachingRetriever(retriever, cache, source)


def _open_source(
    *,
    index: str | Path | None,
    url: str | list[str] | None,
    tool: str | ToolRetrieverConfig | None,
    corpus: str | Path | None,
    retry: RetryPolicy | None,
    missing_index: str | None,
) -> Retriever:
    given = [name for name, value in (("index", index), ("url", url), ("tool", tool)) if value is not None]
    if len(given) != 1:
        raise ConfigError(f"a retriever needs exactly one of index, url or tool; got {given or 'none'}")
    if tool is not None:
        if isinstance(tool, ToolRetrieverConfig):
            return tool_retriever(tool.mcp, tool.http)
        return load_tool_retriever(tool)
    if url is not None:
        return RemoteRetriever(url, retry=retry)
    assert index is not None
    if missing_index is not None and not Path(index).is_dir():
        raise ConfigError(missing_index)
    return load_retriever(index, corpus=corpus)
