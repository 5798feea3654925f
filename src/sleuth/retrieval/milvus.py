"""Milvus as a retrieval backend: load a corpus into a collection, search it through `search(queries, k)`.

The same code talks to a local milvus-lite file (`uri="./corpus.db"`, tests and laptops) and to a
Milvus cluster (`uri="http://host:19530"`, `token="user:password"`); see docs/retrieval_scale.md
for cluster sizing and index choices.

Collection layout (one row per passage, row = line number in the corpus):

- `row` INT64 primary key, `doc_id` / `title` VARCHAR
- `contents` VARCHAR: title, newline, text; BM25-analysed when `bm25=True` so titles count for BM25
- `embedding` FLOAT_VECTOR: the encoder's passage vector (same text layout as a sleuth dense index)
- `sparse` SPARSE_FLOAT_VECTOR: filled by Milvus itself from `contents` (Milvus >= 2.5 BM25 Function)

The collection records the encoder config (collection property `sleuth.meta`, and the schema
description for servers that drop unknown properties), so a retriever can refuse a mismatched
encoder the way a sleuth index manifest does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from sleuth.data.formats import iter_corpus
from sleuth.errors import ConfigError, IndexMismatchError, ServiceError
from sleuth.retrieval._common import validate_queries
from sleuth.retrieval.base import Hit
from sleuth.retrieval.dense import passage_text
from sleuth.retrieval.encoders import Encoder, EncoderConfig

MODES = ("dense", "bm25", "hybrid")
DOC_ID_MAX = 512
TITLE_MAX = 4096
CONTENTS_MAX = 65535  # Milvus' largest VARCHAR
# AUTOINDEX works everywhere (milvus-lite 2.5 accepts only FLAT/IVF_FLAT/AUTOINDEX; a Milvus server
# maps it to HNSW); pass HNSW / IVF_PQ / DISKANN explicitly on a cluster (docs/retrieval_scale.md).
DEFAULT_INDEX: dict[str, Any] = {"index_type": "AUTOINDEX", "params": {}}
DEFAULT_SEARCH_PARAMS: dict[str, Any] = {}
OUTPUT_FIELDS = ["doc_id", "title", "contents"]
META_KEY = "sleuth"
META_PROPERTY = "sleuth.meta"


def _pymilvus():
    try:
        import pymilvus  # deferred: optional; only a Milvus index needs it
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ConfigError(
            "the Milvus backend needs pymilvus (and milvus-lite for local .db files): "
            "pip install 'pymilvus>=2.5' 'milvus-lite>=2.5'"
        ) from err
    return pymilvus


def connect(uri: str | Path, token: str | None = None, timeout: float | None = None) -> Any:
    """A MilvusClient for a cluster URL (`http://host:19530`) or a local milvus-lite file (`*.db`)."""
    pymilvus = _pymilvus()
    uri = str(uri)
    kwargs: dict[str, Any] = {"uri": uri}
    if token:
        kwargs["token"] = token
    if timeout is not None:
        kwargs["timeout"] = timeout
    try:
        return pymilvus.MilvusClient(**kwargs)
    except Exception as err:
        hint = (
            "is milvus-lite installed?"
            if uri.endswith(".db")
            else "is the Milvus server up and the token right?"
        )
        raise ServiceError(
            f"cannot connect to Milvus at {uri}: {type(err).__name__}: {err} ({hint})"
        ) from err


def contents_field(title: str, text: str) -> str:
    """What the `contents` field stores: title and text on separate lines (just the text when untitled)."""
    return f"{title}\n{text}" if title else text


def text_from_contents(title: str, contents: str) -> str:
    return contents[len(title) + 1 :] if title else contents


def _check_lengths(doc_id: str, title: str, contents: str, where: str) -> None:
    # Milvus limits VARCHAR fields in bytes; checking here names the passage instead of failing a whole batch.
    for name, value, limit in (
        ("id", doc_id, DOC_ID_MAX),
        ("title", title, TITLE_MAX),
        ("title + text", contents, CONTENTS_MAX),
    ):
        size = len(value.encode("utf-8"))
        if size > limit:
            raise ConfigError(
                f"{where}: passage {doc_id[:80]!r} has a {name} of {size} bytes; Milvus VARCHAR fields here hold "
                f"at most {limit}. Split long passages (e.g. 100-word chunks) before indexing"
            )


def _build_schema(client: Any, dim: int, bm25: bool, meta: dict[str, Any]) -> Any:
    pymilvus = _pymilvus()
    dt = pymilvus.DataType
    schema = client.create_schema(
        auto_id=False, enable_dynamic_field=False, description=json.dumps({META_KEY: meta})
    )
    schema.add_field("row", dt.INT64, is_primary=True)
    schema.add_field("doc_id", dt.VARCHAR, max_length=DOC_ID_MAX)
    schema.add_field("title", dt.VARCHAR, max_length=TITLE_MAX)
    schema.add_field("contents", dt.VARCHAR, max_length=CONTENTS_MAX, enable_analyzer=bm25)
    schema.add_field("embedding", dt.FLOAT_VECTOR, dim=dim)
    if bm25:
        schema.add_field("sparse", dt.SPARSE_FLOAT_VECTOR)
        schema.add_function(
            pymilvus.Function(
                name="contents_bm25",
                function_type=pymilvus.FunctionType.BM25,
                input_field_names=["contents"],
                output_field_names=["sparse"],
            )
        )
    return schema


def _batches(corpus: str | Path, batch: int) -> Iterator[list[tuple[int, Any]]]:
    buf: list[tuple[int, Any]] = []
    for row, passage in enumerate(iter_corpus(corpus)):
        buf.append((row, passage))
        if len(buf) >= batch:
            yield buf
            buf = []
    if buf:
        yield buf


@dataclass(frozen=True)
class MilvusBuild:
    """How `index_corpus` writes a collection. `index_params`: the dense index, e.g. `{"index_type": "IVF_PQ",
    "params": {"nlist": 16384, "m": 64}}` (metric is always IP: encoders here produce normalised vectors).
    `num_shards`: Milvus write shards (cluster parallelism for inserts; ignored by milvus-lite). `bm25`: also
    build the server-side BM25 sparse index (Milvus >= 2.5)."""

    batch: int = 256
    bm25: bool = True
    index_params: dict[str, Any] | None = None
    num_shards: int | None = None
    consistency_level: str = "Bounded"
    overwrite: bool = False
    show_progress: bool = False


def index_corpus(
    corpus: str | Path,
    uri: str | Path,
    collection: str,
    encoder: Any,
    build: MilvusBuild | None = None,
    token: str | None = None,
) -> dict[str, Any]:
    """Encode a corpus jsonl and insert it into a new Milvus collection (`build`: how); returns counts and
    timings."""
    build = build or MilvusBuild()
    batch, bm25, index_params, num_shards = build.batch, build.bm25, build.index_params, build.num_shards
    consistency_level, overwrite, show_progress = (
        build.consistency_level,
        build.overwrite,
        build.show_progress,
    )
    if batch < 1:
        raise ConfigError(f"batch must be >= 1, got {batch}")
    dense_index = {**DEFAULT_INDEX, **(index_params or {})}
    if dense_index.get("metric_type", "IP") != "IP":
        raise ConfigError(
            f"index_params metric_type must be IP (normalised embeddings), got {dense_index['metric_type']!r}"
        )
    dense_index["metric_type"] = "IP"
    client = connect(uri, token)
    try:
        if client.has_collection(collection):
            if not overwrite:
                raise ConfigError(
                    f"Milvus collection {collection!r} already exists at {uri}; pass overwrite=True to replace it "
                    "or choose another collection name"
                )
            client.drop_collection(collection)
        meta = {
            "encoder": {**encoder.config.to_dict(), "dim": int(encoder.dim)},
            "bm25": bm25,
            "corpus": str(corpus),
        }
        schema = _build_schema(client, int(encoder.dim), bm25, meta)
        params = client.prepare_index_params()
        params.add_index(
            "embedding",
            index_type=dense_index["index_type"],
            metric_type="IP",
            params=dense_index.get("params", {}),
        )
        if bm25:
            params.add_index("sparse", index_type="SPARSE_INVERTED_INDEX", metric_type="BM25")
        create_kwargs: dict[str, Any] = {
            "consistency_level": consistency_level,
            "properties": {META_PROPERTY: json.dumps(meta)},
        }
        if num_shards is not None:
            create_kwargs["num_shards"] = num_shards
        client.create_collection(collection, schema=schema, index_params=params, **create_kwargs)

        t0 = time.perf_counter()
        inserted = 0
        batches = _batches(corpus, batch)
        if show_progress:
            batches = tqdm(batches, desc=f"milvus insert {collection}", unit="batches")
        for chunk in batches:
            rows = []
            for row, p in chunk:
                contents = contents_field(p.title, p.text)
                _check_lengths(p.id, p.title, contents, str(corpus))
                rows.append({"row": row, "doc_id": p.id, "title": p.title, "contents": contents})
            vectors = encoder.encode_passages([passage_text(p.title, p.text) for _, p in chunk])
            for r, v in zip(rows, vectors, strict=True):
                r["embedding"] = v.tolist()
            inserted += int(client.insert(collection, rows)["insert_count"])
        client.flush(collection)
        client.load_collection(collection)
        seconds = time.perf_counter() - t0
    finally:
        client.close()
    return {
        "collection": collection,
        "uri": str(uri),
        "num_docs": inserted,
        "dim": int(encoder.dim),
        "bm25": bm25,
        "index": dense_index,
        "insert_seconds": round(seconds, 3),
        "passages_per_second": round(inserted / seconds, 1) if seconds > 0 else None,
    }


@dataclass(frozen=True)
class MilvusSearch:
    """How a `MilvusRetriever` searches: `mode` dense, bm25 (server-side) or hybrid (both, RRF-fused with
    `rrf_k`); `search_params` of the dense index (e.g. {"nprobe": 64}); queries per request `max_batch`."""

    mode: str = "dense"
    search_params: dict[str, Any] | None = None
    consistency_level: str | None = None
    rrf_k: int = 60
    max_batch: int = 256


class MilvusRetriever:
    """`search(queries, k)` over a Milvus collection written by `index_corpus`.

    `mode`: "dense" (encoder + vector index), "bm25" (Milvus full-text search, no encoder needed) or
    "hybrid" (both, fused by Milvus' RRF ranker). `search_params` go to the dense index (HNSW `ef`,
    IVF `nprobe`, DISKANN `search_list`). `encoder=None` loads the encoder the collection records.
    """

    kind = "milvus"

    def __init__(
        self,
        uri: str | Path,
        collection: str,
        encoder: Any = None,
        search: MilvusSearch | None = None,
        token: str | None = None,
        client: Any = None,
    ):
        search = search or MilvusSearch()
        mode, search_params, max_batch = search.mode, search.search_params, search.max_batch
        consistency_level, rrf_k = search.consistency_level, search.rrf_k
        if mode not in MODES:
            raise ConfigError(f"unknown Milvus search mode {mode!r}; choose one of {list(MODES)}")
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        self.uri = str(uri)
        self.collection = collection
        self.mode = mode
        self.search_params = dict(DEFAULT_SEARCH_PARAMS if search_params is None else search_params)
        self.consistency_level = consistency_level
        self.rrf_k = rrf_k
        self.max_batch = max_batch
        self._own_client = client is None
        self.client = client if client is not None else connect(uri, token)
        if not self.client.has_collection(collection):
            raise IndexMismatchError(
                f"Milvus collection {collection!r} does not exist at {self.uri}; "
                "create it with sleuth.retrieval.milvus.index_corpus"
            )
        meta = self._collection_meta()
        if mode in ("bm25", "hybrid") and not meta.get("bm25", False):
            raise IndexMismatchError(
                f"collection {collection!r} has no BM25 field; rebuild it with index_corpus(..., MilvusBuild(bm25=True)) "
                "or search with MilvusSearch(mode='dense')"
            )
        self.encoder = None
        if mode != "bm25":
            self.encoder = self._check_encoder(encoder, meta.get("encoder"))
        self.client.load_collection(collection)
        self.num_docs = int(self.client.get_collection_stats(collection).get("row_count", 0))

    def _collection_meta(self) -> dict[str, Any]:
        info = self.client.describe_collection(self.collection)
        meta = None
        try:
            prop = (info.get("properties") or {}).get(META_PROPERTY)
            meta = json.loads(prop) if prop else json.loads(info.get("description") or "{}").get(META_KEY)
        except (json.JSONDecodeError, AttributeError):
            meta = None
        if not isinstance(meta, dict):
            raise IndexMismatchError(
                f"Milvus collection {self.collection!r} was not written by sleuth (no {META_PROPERTY!r} "
                "property); load it with sleuth.retrieval.milvus.index_corpus"
            )
        return meta

    def _check_encoder(self, encoder: Any, recorded: dict[str, Any] | None) -> Any:
        if recorded is None:
            raise IndexMismatchError(f"collection {self.collection!r} records no encoder")
        recorded = dict(recorded)
        dim = recorded.pop("dim")
        if encoder is None:
            encoder = Encoder(EncoderConfig(**recorded))
        for key in ("name", "query_prefix", "passage_prefix", "normalize"):
            if getattr(encoder.config, key) != recorded.get(key):
                raise IndexMismatchError(
                    f"Milvus collection {self.collection!r} was built with encoder {key}={recorded.get(key)!r}, "
                    f"the encoder passed has {key}={getattr(encoder.config, key)!r}"
                )
        if int(encoder.dim) != int(dim):
            raise IndexMismatchError(f"encoder dimension {encoder.dim} != collection dimension {dim}")
        return encoder

    def _requests(self, queries: list[str], k: int) -> list[Any]:
        pymilvus = _pymilvus()
        assert self.encoder is not None
        vectors = self.encoder.encode_queries(queries).tolist()
        return [
            pymilvus.AnnSearchRequest(
                data=vectors,
                anns_field="embedding",
                param={"metric_type": "IP", "params": self.search_params},
                limit=k,
            ),
            pymilvus.AnnSearchRequest(
                data=queries, anns_field="sparse", param={"metric_type": "BM25"}, limit=k
            ),
        ]

    def _search_chunk(self, queries: list[str], k: int) -> list[list[Hit]]:
        kwargs: dict[str, Any] = {"limit": k, "output_fields": OUTPUT_FIELDS}
        if self.consistency_level:
            kwargs["consistency_level"] = self.consistency_level
        if self.mode == "hybrid":
            result = self.client.hybrid_search(
                self.collection,
                reqs=self._requests(queries, k),
                ranker=_pymilvus().RRFRanker(self.rrf_k),
                **kwargs,
            )
        elif self.mode == "bm25":
            result = self.client.search(
                self.collection,
                data=queries,
                anns_field="sparse",
                search_params={"metric_type": "BM25"},
                **kwargs,
            )
        else:
            assert self.encoder is not None
            result = self.client.search(
                self.collection,
                data=self.encoder.encode_queries(queries).tolist(),
                anns_field="embedding",
                search_params={"metric_type": "IP", "params": self.search_params},
                **kwargs,
            )
        return [[self._hit(h) for h in hits] for hits in result]

    def _hit(self, h: Any) -> Hit:
        entity = h["entity"]
        title = entity.get("title", "")
        score = float(h["distance"])
        if self.mode == "bm25":
            # BM25 scores are positive by construction; milvus-lite 3.x reports them negated.
            score = abs(score)
        return Hit(
            doc_id=str(entity["doc_id"]),
            title=title,
            text=text_from_contents(title, entity["contents"]),
            score=score,
        )

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        validate_queries(queries, k)
        out: list[list[Hit]] = []
        for start in range(0, len(queries), self.max_batch):
            chunk = list(queries[start : start + self.max_batch])
            try:
                out.extend(self._search_chunk(chunk, k))
            except _pymilvus().MilvusException as err:
                raise ServiceError(
                    f"Milvus search in {self.collection!r} at {self.uri} failed: {err}"
                ) from err
        return out

    def close(self) -> None:
        if self._own_client:
            self.client.close()

    def __enter__(self) -> MilvusRetriever:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MilvusRetriever({self.uri!r}, {self.collection!r}, mode={self.mode!r})"
