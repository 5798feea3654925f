"""Dense retrieval over several FAISS shards: contiguous passage ranges, searched in parallel, merged.

Layout inside an index directory (kind "dense", manifest key `"shards"`):

- `shards/shard-000.faiss`, ... one FAISS index per contiguous row range `[start, end)`; row ids
  inside a shard are local (0-based) and the manifest's `start` turns them into global rows
- `vectors.f16` (optional, `keep_vectors=True`) every passage's embedding as float16, row order;
  memory-mapped at query time to re-score IVF-PQ candidates exactly

The corpus is encoded once, streaming; Flat/HNSW shards are filled and written one after the other,
so only one shard is ever in RAM. IVF-PQ first spools the embeddings (float16) to disk, trains one
coarse quantizer + PQ codebook on a random `train_sample` of them (so every shard shares the same
codebooks and scores are comparable across shards), then fills each shard from the spool.

Searching encodes the queries once, searches every shard (thread pool: faiss releases the GIL; or
one GPU per shard when faiss has GPU support) and keeps each query's best k over all shards.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sleuth.errors import ConfigError, IndexMismatchError
from sleuth.retrieval._common import hits_from_rows, validate_queries
from sleuth.retrieval.base import Hit
from sleuth.retrieval.dense import (
    BLAS_BATCH_MIN,
    _blas_lock,
    new_faiss_index,
    read_faiss,
    searchable_index,
    set_nprobe,
)
from sleuth.retrieval.docstore import DocStore
from sleuth.retrieval.ivf_build import IvfBuilder
from sleuth.retrieval.mapped import MappedFile, RowFile

SHARD_DIR = "shards"
VECTORS_FILE = "vectors.f16"
# Candidates re-scored per query when an index kept its vectors and the caller sets no `rerank`.
DEFAULT_RERANK = 64


@dataclass(frozen=True)
class ShardSpec:
    """One shard: its faiss file (relative to the index dir) and the global rows `[start, end)` it holds."""

    file: str
    start: int
    end: int

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "start": self.start, "end": self.end}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardSpec:
        return cls(file=str(d["file"]), start=int(d["start"]), end=int(d["end"]))


def shard_ranges(num_docs: int, shards: int) -> list[tuple[int, int]]:
    """Split rows 0..num_docs into `shards` contiguous ranges whose sizes differ by at most one."""
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise ConfigError(f"shards must be a positive integer, got {shards!r}")
    if num_docs < shards:
        raise ConfigError(
            f"cannot split {num_docs} passages into {shards} shards; use at most {max(num_docs, 1)}"
        )
    base, extra = divmod(num_docs, shards)
    ranges, start = [], 0
    for i in range(shards):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def default_train_sample(params: dict[str, Any]) -> int:
    """Training points for IVF-PQ: ~64 per coarse centroid and >= 64 per PQ centroid (faiss wants 39-256)."""
    return max(64 * params["nlist"], 64 * 2 ** params["nbits"])


def _rechunk(chunks: Iterable[np.ndarray], bounds: Sequence[int]) -> Iterator[tuple[int, np.ndarray]]:
    """Split a stream of row chunks at the shard boundaries: yields (shard number, rows of that shard)."""
    shard, pos = 0, 0
    for chunk in chunks:
        chunk = np.ascontiguousarray(chunk, dtype=np.float32)
        offset = 0
        while offset < len(chunk):
            while shard < len(bounds) - 1 and pos >= bounds[shard + 1]:
                shard += 1
            if shard >= len(bounds) - 1:
                raise RuntimeError(f"the encoder produced more than the expected {bounds[-1]} vectors")
            take = min(len(chunk) - offset, bounds[shard + 1] - pos)
            yield shard, chunk[offset : offset + take]
            offset += take
            pos += take


@dataclass(frozen=True)
class ShardBuild:
    """How `build_sharded_faiss` shards: `shards` indexes; `train_sample` (IVF-PQ only) caps the vectors held
    in RAM for training; `keep_vectors` keeps a float16 copy of all vectors for exact re-ranking;
    `ivf_device` (IVF-PQ only) where the coarse k-means and assignment run (`sleuth.retrieval.ivf_build`;
    None = 'auto': a GPU when torch sees one, else faiss alone on the CPU)."""

    shards: int
    train_sample: int | None = None
    keep_vectors: bool = False
    seed: int = 0
    ivf_device: str | None = None
    # A float16 [N, dim] file holding exactly the streamed vectors (precomputed embeddings): hard-linked as the
    # spool / kept vectors instead of written again (16 GB and a minute or two at 21M), where the file system
    # allows; the build reads it and never writes to it.
    source_vectors: str | None = None


def build_sharded_faiss(
    vectors: Iterable[np.ndarray],
    num_vectors: int,
    dim: int,
    params: dict[str, Any],
    out_dir: Path,
    build: ShardBuild,
) -> dict[str, Any]:
    """Write `build.shards` faiss indexes over contiguous ranges of a vector stream; returns the manifest
    part. `params` come from `dense.faiss_params`."""
    shards, train_sample, keep_vectors, seed = (
        build.shards,
        build.train_sample,
        build.keep_vectors,
        build.seed,
    )
    import faiss  # deferred: faiss is heavy; only dense indexes need it

    ranges = shard_ranges(num_vectors, shards)
    bounds = [0] + [end for _, end in ranges]
    (out_dir / SHARD_DIR).mkdir(parents=True, exist_ok=True)
    specs = [ShardSpec(f"{SHARD_DIR}/shard-{i:03d}.faiss", s, e) for i, (s, e) in enumerate(ranges)]
    is_ivf = params["type"] == "ivfpq"
    if train_sample is not None and not is_ivf:
        raise ConfigError(f"train_sample applies to ivfpq indexes, this one is {params['type']!r}")
    if build.ivf_device is not None and not is_ivf:
        raise ConfigError(f"ivf_device applies to ivfpq indexes, this one is {params['type']!r}")
    # Resolved before the stream starts: a bad device fails before hours of encoding.
    builder = IvfBuilder(build.ivf_device, seed) if is_ivf else None
    spool_path = out_dir / (VECTORS_FILE if keep_vectors else "vectors.tmp.f16")
    spool = None
    started = time.perf_counter()
    linked = False
    if is_ivf or keep_vectors:
        linked = build.source_vectors is not None and _link_vectors(
            Path(build.source_vectors), spool_path, num_vectors * dim * 2
        )
        spool = np.memmap(
            spool_path, dtype=np.float16, mode="r" if linked else "w+", shape=(num_vectors, dim)
        )

    stream = not (linked and is_ivf)  # a linked spool is whole: IVF needs nothing streamed
    written = 0 if stream else num_vectors
    current: Any = None
    current_shard = -1

    def finish(shard: int) -> None:
        faiss.write_index(current, str(out_dir / specs[shard].file))

    for shard, rows in _rechunk(vectors, bounds) if stream else []:
        if spool is not None and not linked:
            spool[written : written + len(rows)] = rows
        written += len(rows)
        if is_ivf:
            continue  # shards are filled from the spool once the codebooks are trained
        if shard != current_shard:
            if current is not None:
                finish(current_shard)
            current, current_shard = new_faiss_index(dim, params, ranges[shard][1] - ranges[shard][0]), shard
        current.add(rows)
    if written != num_vectors:
        raise RuntimeError(f"encoded {written} passages, expected {num_vectors}")
    if current is not None:
        finish(current_shard)

    info: dict[str, Any] = {"shards": [s.to_dict() for s in specs]}
    if spool is not None:
        info["vectors_source"] = "linked" if linked else "written"
    if is_ivf:
        assert spool is not None and builder is not None
        spool.flush()
        builder.clock("spool", started)
        info["train_sample"] = _train_and_fill_ivf(
            spool, dim, params, out_dir, specs, train_sample=train_sample, builder=builder
        )
        info["ivf_build"] = builder.record()
    if spool is not None:
        del spool
        if keep_vectors:
            info["vectors"] = {"file": VECTORS_FILE, "dtype": "float16", "shape": [num_vectors, dim]}
        else:
            spool_path.unlink()
    return info


def _link_vectors(source: Path, spool_path: Path, size: int) -> bool:
    """Hard-link `source` as `spool_path`; False where it cannot be (another file system, no hard links, a
    size other than the vectors'), and the caller writes the spool from the stream instead."""
    try:
        if source.stat().st_size != size:
            return False
        spool_path.unlink(missing_ok=True)
        os.link(source, spool_path)
    except OSError:
        return False
    return True


def _train_and_fill_ivf(
    spool: np.ndarray,
    dim: int,
    params: dict[str, Any],
    out_dir: Path,
    specs: list[ShardSpec],
    *,
    train_sample: int | None,
    builder: IvfBuilder,
) -> int:
    import faiss  # deferred: faiss is heavy; only dense indexes need it

    num_vectors = spool.shape[0]
    # Every shard is a copy of one trained empty index, so codes from all shards share one codebook.
    template = new_faiss_index(dim, params, num_vectors)
    need = max(params["nlist"], 2 ** params["nbits"])
    n_train = min(num_vectors, train_sample if train_sample is not None else default_train_sample(params))
    if n_train < need:
        raise ConfigError(
            f"train_sample={train_sample} is too small: ivfpq with nlist={params['nlist']}, nbits={params['nbits']} "
            f"needs at least {need} training vectors"
        )
    rng = np.random.default_rng(builder.seed)
    started = time.perf_counter()
    # Sorted rows read the spool front to back, which matters when it lives on disk.
    sample = np.sort(rng.choice(num_vectors, size=n_train, replace=False))
    sample_vectors = spool[sample].astype(np.float32)
    builder.clock("sample", started)
    builder.train(template, sample_vectors)
    del sample_vectors
    for spec in specs:
        index = faiss.clone_index(template)
        builder.fill(index, spool, spec.start, spec.end)
        started = time.perf_counter()
        faiss.write_index(searchable_index(index, params), str(out_dir / spec.file))
        builder.clock("write", started)
        del index
    return n_train


def merge_topk(
    shard_scores: Sequence[np.ndarray], shard_ids: Sequence[np.ndarray], k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per-query best `k` over several shards' (scores, global ids) arrays, each (num_queries, k_i).

    Missing results (id -1) sort last and come back as id -1, score -inf. Equal scores are ordered by
    ascending global id, so the merge does not depend on shard order.
    """
    scores = np.concatenate([np.asarray(s, dtype=np.float32) for s in shard_scores], axis=1)
    ids = np.concatenate([np.asarray(i, dtype=np.int64) for i in shard_ids], axis=1)
    scores = np.where(ids < 0, -np.inf, scores)
    # lexsort's last key is the primary one: descending score, then ascending id.
    order = np.lexsort((ids, -scores), axis=1)[:, :k]
    top_scores = np.take_along_axis(scores, order, axis=1)
    top_ids = np.take_along_axis(ids, order, axis=1)
    top_ids[~np.isfinite(top_scores)] = -1
    return top_scores, top_ids


def exact_scores(vectors: np.ndarray, queries: np.ndarray, rows: np.ndarray, chunk: int = 16) -> np.ndarray:
    """Exact inner products of each query with its `rows` of `vectors` (-1 = none: -inf), float32.

    `chunk` queries at a time: their rows are gathered and widened to float32 in a block that stays in cache
    (all queries at once would build a queries x rows x dim float32 array, 100 MB at 256 x 256 x 384, and
    moving it cost more than the arithmetic: 2.2-2.7x slower on one thread, the same scores)."""
    rows = np.asarray(rows, dtype=np.int64)
    valid = rows >= 0
    safe = np.where(valid, rows, 0)
    exact = np.empty(rows.shape, np.float32)
    queries = np.asarray(queries, dtype=np.float32)
    for start in range(0, len(queries), chunk):
        block_rows = safe[start : start + chunk]
        block = np.asarray(vectors[block_rows.ravel()], dtype=np.float32).reshape(*block_rows.shape, -1)
        exact[start : start + chunk] = np.einsum("qcd,qd->qc", block, queries[start : start + chunk])
    return np.where(valid, exact, -np.inf).astype(np.float32)


def exact_rerank(
    vectors: np.ndarray, queries: np.ndarray, candidates: np.ndarray, k: int, chunk: int = 16
) -> tuple[np.ndarray, np.ndarray]:
    """Re-score each query's candidate rows (-1 = none) with exact inner products; best `k` per query."""
    exact = exact_scores(vectors, queries, candidates, chunk)
    return merge_topk([exact], [np.where(candidates >= 0, candidates, -1)], k)


def read_faiss_mmap(path: Path) -> Any:
    """One shard, memory-mapped where faiss supports it (see `sleuth.retrieval.dense.read_faiss`)."""
    return read_faiss(path)


def _to_gpu(index: Any, gpu: int) -> Any:
    import faiss  # deferred: faiss is heavy; only dense indexes need it

    if not hasattr(faiss, "StandardGpuResources"):
        raise ConfigError(
            "gpus were requested but this faiss has no GPU support; install faiss-gpu (conda or "
            "pip faiss-gpu-cu12) or load without gpus"
        )
    resources = faiss.StandardGpuResources()
    gpu_index = faiss.index_cpu_to_gpu(resources, gpu, index)
    gpu_index.sleuth_resources = resources  # the resources must live as long as the index
    return gpu_index


@dataclass(frozen=True)
class ShardSearch:
    """How a `ShardedDenseRetriever` searches (see its docstring)."""

    faiss_type: str = "flat"
    threads: int = 1
    rerank: int = 0
    gpus: Sequence[int] | None = None
    search_params: dict[str, Any] = field(default_factory=dict)  # ef_search (HNSW), nprobe (IVF)


class ShardedDenseRetriever:
    """Encode queries once, search every shard, merge to global top-k, return passages from the docstore.

    `threads` is the total CPU budget: up to `threads` shards are searched at once, each with the
    remaining threads for faiss' own OpenMP loop. `gpus`: shard i goes to GPU `gpus[i % len(gpus)]`.
    `rerank`: candidates per query re-scored exactly from the float16 vectors (needs `keep_vectors`
    at build time; 0 = off). `vectors`: an array or a `RowFile`; `vectors_map`: the file map an array `vectors`
    views, whose pages each re-rank releases.
    """

    kind = "dense-sharded"

    def __init__(
        self,
        shard_indexes: Sequence[Any],
        specs: Sequence[ShardSpec],
        encoder: Any,
        docstore: DocStore,
        vectors: np.ndarray | RowFile | None = None,
        search: ShardSearch | None = None,
        vectors_map: MappedFile | None = None,
    ):
        search = search or ShardSearch()
        faiss_type, threads, rerank, gpus = search.faiss_type, search.threads, search.rerank, search.gpus
        if len(shard_indexes) != len(specs) or not specs:
            raise ValueError(f"got {len(shard_indexes)} shard indexes for {len(specs)} shard specs")
        expected_start = 0
        for spec, index in zip(specs, shard_indexes, strict=True):
            if spec.start != expected_start or index.ntotal != spec.end - spec.start:
                raise IndexMismatchError(
                    f"shard {spec.file} holds {index.ntotal} vectors for rows [{spec.start}, {spec.end}); "
                    "the shards do not tile the corpus, rebuild the index with `sleuth index`"
                )
            if index.d != encoder.dim:
                raise IndexMismatchError(
                    f"shard {spec.file} has dimension {index.d}, the encoder {encoder.dim}; rebuild the index"
                )
            expected_start = spec.end
        if expected_start != docstore.num_docs:
            raise IndexMismatchError(
                f"the shards cover {expected_start} passages but the docstore has {docstore.num_docs}; rebuild"
            )
        if rerank and vectors is None:
            raise ConfigError("rerank needs the passage vectors; build the index with keep_vectors=True")
        if rerank < 0:
            raise ConfigError(f"rerank must be >= 0, got {rerank}")
        self.specs = list(specs)
        self.encoder = encoder
        self.docstore = docstore
        self.faiss_type = faiss_type
        self.threads = max(1, int(threads))
        self.vectors = vectors
        self._vectors_map = vectors_map  # the map `vectors` views: re-ranking lets go of the pages it read
        self.rerank = int(rerank)
        self.indexes = list(shard_indexes)
        self.set_search_params(**search.search_params)
        if gpus:
            self.indexes = [_to_gpu(ix, gpus[i % len(gpus)]) for i, ix in enumerate(self.indexes)]
        self.parallel = len(gpus) if gpus else min(self.threads, len(self.indexes))
        self._pool = (
            ThreadPoolExecutor(self.parallel, thread_name_prefix="sleuth-shard")
            if self.parallel > 1
            else None
        )
        self._lock = threading.Lock()

    @property
    def num_docs(self) -> int:
        return self.docstore.num_docs

    def set_search_params(self, ef_search: int | None = None, nprobe: int | None = None) -> None:
        import faiss  # deferred: faiss is heavy; only dense indexes need it

        for index in self.indexes:
            if ef_search is not None:
                hnsw = faiss.downcast_index(index)
                if not hasattr(hnsw, "hnsw"):
                    raise ConfigError(f"ef_search applies to HNSW indexes, this one is {self.faiss_type!r}")
                hnsw.hnsw.efSearch = int(ef_search)
            if nprobe is not None:
                set_nprobe(index, nprobe)

    def _search_shard(
        self, i: int, vectors: np.ndarray, k: int, omp_threads: int
    ) -> tuple[np.ndarray, np.ndarray]:
        import faiss  # deferred: faiss is heavy; only dense indexes need it

        # OpenMP thread counts are per calling thread, so each pool thread sets its own.
        faiss.omp_set_num_threads(omp_threads)
        index, start = self.indexes[i], self.specs[i].start
        scores, ids = index.search(vectors, min(k, index.ntotal))
        return scores, np.where(ids >= 0, ids + start, -1)

    def search_vectors(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Global (scores, rows) of shape (num_queries, <= k); rows are -1 where fewer than k were found."""
        import faiss  # deferred: faiss is heavy; only dense indexes need it

        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        fetch = max(k, self.rerank) if self.rerank else k
        omp = max(1, self.threads // self.parallel)

        def run() -> list[tuple[np.ndarray, np.ndarray]]:
            if self._pool is None:
                return [self._search_shard(i, vectors, fetch, omp) for i in range(len(self.indexes))]
            return list(
                self._pool.map(lambda i: self._search_shard(i, vectors, fetch, omp), range(len(self.indexes)))
            )

        if len(vectors) >= BLAS_BATCH_MIN and self.faiss_type == "flat":
            # See DenseRetriever.search_vectors: the BLAS threshold is process-global.
            with _blas_lock:
                old = faiss.cvar.distance_compute_blas_threshold
                faiss.cvar.distance_compute_blas_threshold = BLAS_BATCH_MIN
                try:
                    parts = run()
                finally:
                    faiss.cvar.distance_compute_blas_threshold = old
        else:
            parts = run()
        scores, ids = merge_topk([p[0] for p in parts], [p[1] for p in parts], min(fetch, self.num_docs))
        if self.rerank:
            assert self.vectors is not None
            scores, ids = exact_rerank(self.vectors, vectors, ids, min(k, self.num_docs))
            if self._vectors_map is not None:
                self._vectors_map.release()
        return scores[:, :k], ids[:, :k]

    def search_indices(self, queries: list[str], k: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        validate_queries(queries, k)
        scores, ids = self.search_vectors(self.encoder.encode_queries(queries), k)
        keep = ids >= 0
        return [ids[i][keep[i]] for i in range(len(queries))], [
            scores[i][keep[i]] for i in range(len(queries))
        ]

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        rows, scores = self.search_indices(queries, k)
        return hits_from_rows(self.docstore, rows, scores)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def load_sharded(
    index_dir: Path,
    manifest: dict[str, Any],
    encoder: Any,
    docstore: DocStore,
    *,
    threads: int = 1,
    rerank: int | None = None,
    gpus: Sequence[int] | None = None,
    **search_params: Any,
) -> ShardedDenseRetriever:
    """Open every shard memory-mapped (where faiss supports it) and the float16 vectors if kept."""
    specs = [ShardSpec.from_dict(d) for d in manifest["shards"]]
    indexes = [read_faiss_mmap(index_dir / spec.file) for spec in specs]
    vectors, vectors_map = None, None
    vec_meta = manifest.get("vectors")
    if vec_meta:
        path = index_dir / vec_meta["file"]
        if not path.exists():
            raise IndexMismatchError(f"{path}: missing (the manifest lists it); rebuild the index")
        shape = tuple(vec_meta["shape"])
        expected = int(np.prod(shape)) * np.dtype(vec_meta["dtype"]).itemsize
        if path.stat().st_size != expected:
            raise IndexMismatchError(
                f"{path}: {path.stat().st_size} bytes, expected {expected}; rebuild the index"
            )
        if hasattr(os, "pread"):  # positional reads: re-ranking maps no pages (sleuth.retrieval.mapped)
            vectors = RowFile(path, vec_meta["dtype"], shape)
        else:
            vectors_map = MappedFile(path)
            vectors = vectors_map.array(vec_meta["dtype"], shape)
    if rerank is None:
        rerank = DEFAULT_RERANK if vectors is not None else 0
    search = ShardSearch(
        faiss_type=manifest["faiss"]["type"],
        threads=threads,
        rerank=int(rerank),
        gpus=gpus,
        search_params=dict(search_params),
    )
    return ShardedDenseRetriever(indexes, specs, encoder, docstore, vectors, search, vectors_map)
