"""A retriever from where it lives: a local index, a /retrieve server, a search tool, or any location a
backend reads (written once: `sleuth.retrieval.backends.parse_location`).

Training (a recipe's `retriever:` section), evaluation (`--retriever LOCATION`) and serving (`--retriever`,
`--index`, `--retriever-url`) all open the retriever here; what differs between them is explicit: the
server client's retry policy, the corpus check, and the message for a missing index.
"""

from __future__ import annotations

from pathlib import Path

from sleuth.errors import ConfigError
from sleuth.retrieval.backends import open_location
from sleuth.retrieval.base import Retriever
from sleuth.retrieval.cache import CachingRetriever
from sleuth.retrieval.tools import ToolRetrieverConfig, tool_retriever
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
    location: str | None = None,
) -> Retriever:
    """The retriever of exactly one source, each opened by its backend (`sleuth.retrieval.backends`).

    location: any retriever location (`bm25:DIR`, `milvus:URI?collection=C`, a plugin backend's, ...).
    index: a `sleuth index` directory; `corpus`, if given, is checked against its manifest.
    url: one or more Search-R1-compatible /retrieve servers; `retry` is the client's policy
        (None: `RemoteRetriever`'s default).
    tool: a search tool, as a `--retriever` spec (`mcp:<url>` or a YAML file) or a parsed config.
    missing_index: if given, an `index` that is not a directory fails at once with this message
        (naming the flag the user typed); otherwise the index backend reports it.
    cache: a directory recording every search, replayed on the next run (`sleuth.retrieval.cache`).
    """
    given = [
        name
        for name, value in (("index", index), ("url", url), ("tool", tool), ("location", location))
        if value is not None
    ]
    if len(given) != 1:
        raise ConfigError(
            f"a retriever needs exactly one of index, url, tool or location; got {given or 'none'}"
        )
    if isinstance(tool, ToolRetrieverConfig):
        retriever = tool_retriever(tool.mcp, tool.http)
        return (
            retriever
            if cache is None
            else CachingRetriever(retriever, cache, f"tool:{tool.model_dump_json()}")
        )
    if index is not None:
        if missing_index is not None and not Path(index).is_dir():
            raise ConfigError(missing_index)
        location = f"index:{index}"
    elif url is not None:
        location = f"url:{url if isinstance(url, str) else ','.join(url)}"
    elif tool is not None:
        location = tool if tool.startswith("mcp:") else f"tool:{tool}"
    assert location is not None
    return open_location(location, corpus=corpus, retry=retry, cache=cache)
