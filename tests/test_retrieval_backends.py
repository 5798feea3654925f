"""One location parser for every retriever (sleuth.retrieval.backends): recipe, eval and serve read
`NAME:REST`, URLs, tool files and index directories the same way."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sleuth.errors import ConfigError
from sleuth.eval.loading import resolve_retriever
from sleuth.retrieval.backends import (
    RetrieverBackend,
    backend_names,
    cache_source,
    open_location,
    parse_location,
    register_backend,
)
from sleuth.retrieval.hybrid import HybridRetriever
from sleuth.serve.loading import load_retriever_from


def test_every_built_in_backend_is_registered() -> None:
    assert {"index", "bm25", "dense", "sharded", "hybrid", "milvus", "url", "mcp", "tool"} <= set(
        backend_names()
    )


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("http://127.0.0.1:8000", ("url", "http://127.0.0.1:8000")),
        ("url:http://a:1,http://b:2", ("url", "http://a:1,http://b:2")),
        ("mcp:http://host/mcp", ("mcp", "http://host/mcp")),
        ("tools/search.yaml", ("tool", "tools/search.yaml")),
        ("hybrid:a,b", ("hybrid", "a,b")),
        ("milvus:./c.db?collection=wiki", ("milvus", "./c.db?collection=wiki")),
        ("runs/world/bm25", ("index", "runs/world/bm25")),
        ("C:\\indexes\\bm25", ("index", "C:\\indexes\\bm25")),  # a drive letter is no backend
    ],
)
def test_locations_parse_one_way(text: str, parsed: tuple[str, str]) -> None:
    assert parse_location(text) == parsed


def test_an_unknown_backend_names_the_known_ones_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"unknown backend 'elastic'; known: .*bm25.*--plugin MODULE"):
        parse_location("elastic:http://host:9200")


def test_a_directory_with_a_colon_is_still_an_index(small_world: Path, tmp_path: Path) -> None:
    odd = tmp_path / "my:index"
    shutil.copytree(small_world / "bm25", odd)
    assert parse_location(str(odd)) == ("index", str(odd))


def test_kind_names_check_the_manifest(small_world: Path) -> None:
    index = small_world / "bm25"
    assert open_location(f"bm25:{index}").search(["capital of Dzexbraenia"], 1)[0]
    with pytest.raises(ConfigError, match=r"that index is bm25; name it bm25:"):
        open_location(f"dense:{index}")


def test_hybrid_and_milvus_are_nameable_from_eval_and_serve(small_world: Path, tmp_path: Path) -> None:
    index = small_world / "bm25"
    shutil.copytree(index, tmp_path / "b")
    location = f"hybrid:{index},{tmp_path / 'b'}"
    assert isinstance(resolve_retriever(location), HybridRetriever)
    served, name = load_retriever_from(None, None, location)
    assert isinstance(served, HybridRetriever) and name == location
    with pytest.raises(ConfigError, match=r"milvus:URI\?collection=NAME"):
        resolve_retriever("milvus:./c.db")  # the form is checked before pymilvus is needed
    with pytest.raises(ConfigError, match=r"hybrid:DIR1,DIR2"):
        resolve_retriever(f"hybrid:{index}")


def test_a_registered_backend_is_nameable_with_a_cache(small_world: Path, tmp_path: Path) -> None:
    opened: list[str] = []

    class Fixed:
        def search(self, queries: list[str], k: int) -> list[list]:
            return [[] for _ in queries]

    def open_fixed(rest: str, ctx) -> Fixed:
        opened.append(rest)
        return Fixed()

    register_backend(RetrieverBackend("test_fixed", open_fixed, "test_fixed:ANY"))
    retriever = open_location("test_fixed:x", cache=tmp_path / "cache")
    assert retriever.search(["q"], 3) == [[]] and opened == ["x"]
    assert cache_source("test_fixed", "x") == "test_fixed:x"
    with pytest.raises(ValueError, match="already registered"):
        register_backend(RetrieverBackend("test_fixed", lambda rest, ctx: Fixed(), "test_fixed:ANY"))
    with pytest.raises(ValueError, match="two or more letters"):
        register_backend(RetrieverBackend("z", open_fixed, "z:ANY"))


def test_the_cache_keys_an_index_as_before(small_world: Path) -> None:
    """A cache recorded before the registry (`index:<resolved dir>`, `url:"<url>"`) is still replayed."""
    assert cache_source("index", str(small_world / "bm25")) == f"index:{(small_world / 'bm25').resolve()}"
    assert cache_source("url", "http://a:1") == 'url:"http://a:1"'
    assert cache_source("url", "http://a:1,http://b:2") == 'url:["http://a:1", "http://b:2"]'
