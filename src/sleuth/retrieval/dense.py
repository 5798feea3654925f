"""Dense retrieval: an `Encoder` plus a FAISS index (Flat IP, HNSW or IVF-PQ), passages from a `DocStore`."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from sleuth.errors import ConfigError, IndexMismatchError
from sleuth.retrieval._common import hits_from_rows, validate_queries
from sleuth.retrieval.base import Hit
from sleuth.retrieval.docstore import DocStore
from sleuth.retrieval.encoders import Encoder
from sleuth.retrieval.ivf_build import IvfBuilder

FAISS_FILE = "faiss.index"
FAISS_DEFAULTS: dict[str, dict[str, Any]] = {
    "flat": {},
    "hnsw": {"M": 32, "ef_construction": 200, "ef_search": 128},
    "ivfpq": {"nlist": 1024, "m": 48, "nbits": 8, "nprobe": 16},
}
# Query-time knobs that may be changed when loading; the rest fix the index structure.
SEARCH_PARAMS = {"ef_search", "nprobe"}
# Below this many queries faiss' per-query loop beats one BLAS matrix product (measured; see notes).
BLAS_BATCH_MIN = 16
_blas_lock = threading.Lock()


def faiss_params(kind: str, **params: Any) -> dict[str, Any]:
    """Defaults for `kind` overridden by `params`; unknown kinds/params are an error naming the choices."""
    if kind not in FAISS_DEFAULTS:
        raise ConfigError(f"unknown faiss index type {kind!r}; choose one of {sorted(FAISS_DEFAULTS)}")
    unknown = set(params) - set(FAISS_DEFAULTS[kind])
    if unknown:
        raise ConfigError(
            f"faiss type {kind!r} takes parameters {sorted(FAISS_DEFAULTS[kind])}, got unknown {sorted(unknown)}"
        )
    out = {**FAISS_DEFAULTS[kind], **params}
    for name, value in out.items():
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"faiss parameter {name} must be a positive integer, got {value!r}")
    return {"type": kind, **out}


def new_faiss_index(dim: int, params: dict[str, Any], num_vectors: int):
    """An empty index for `params` (from `faiss_params`); IVF sizes are checked against `num_vectors`."""
    import faiss  # deferred: faiss is heavy; only dense indexes need it

    kind = params["type"]
    if kind == "flat":
        return faiss.IndexFlatIP(dim)
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, params["M"], faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = params["ef_construction"]
        index.hnsw.efSearch = params["ef_search"]
        return index
    if dim % params["m"]:
        raise ConfigError(f"ivfpq: m={params['m']} must divide the embedding dimension {dim}")
    need = max(params["nlist"], 2 ** params["nbits"])
    if num_vectors < need:
        raise ConfigError(
            f"ivfpq with nlist={params['nlist']}, nbits={params['nbits']} needs at least {need} passages to train "
            f"but the corpus has {num_vectors}; lower nlist/nbits or use --faiss flat"
        )
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFPQ(
        quantizer, dim, params["nlist"], params["m"], params["nbits"], faiss.METRIC_INNER_PRODUCT
    )
    set_nprobe(index, params["nprobe"])
    return index


def set_nprobe(index: Any, nprobe: int) -> None:
    """Probe `nprobe` of an IVF index's lists, at most all of them: faiss 1.15's IVF-PQ fast-scan search
    returns garbage (every id the same, scores ~2e31) when nprobe exceeds nlist, where the other IVF indexes
    probe every list; probing nlist lists is the same search."""
    import faiss  # deferred: faiss is heavy; only dense indexes need it

    ivf = faiss.extract_index_ivf(index)
    ivf.nprobe = min(int(nprobe), int(ivf.nlist))


def searchable_index(index: Any, params: dict[str, Any]) -> Any:
    """The index as written to disk: IVF-PQ with 4-bit codes (`nbits` 4) in faiss's fast-scan layout
    (`IndexIVFPQFastScan`), whose SIMD scan of 32-code blocks is ~6x faster per query than the 8-bit scan at
    the same bytes (48 of them: m 96 x 4 bits vs m 48 x 8; measured on one core, 1M vectors, nprobe 40; at 21M
    the served rate was set by query encoding and re-ranking, not the scan). Faiss reads these lists into the
    heap rather than mapping them, so pre-forked server workers are what keep one copy;
    every other index as built. The codes are the same; the fast scan quantizes its look-up tables to 8
    bits, so scores move by ~1e-3, which an exact re-rank of the candidates takes back."""
    import faiss  # deferred: faiss is heavy; only dense indexes need it

    if params["type"] != "ivfpq" or params["nbits"] != 4:
        return index
    ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
    fast = faiss.IndexIVFPQFastScan(ivf)
    set_nprobe(fast, ivf.nprobe)
    return fast


def build_faiss(
    vectors: Iterable[np.ndarray],
    num_vectors: int,
    dim: int,
    params: dict[str, Any],
    out_dir: Path,
    *,
    seed: int = 0,
    ivf_device: str | None = None,
) -> dict[str, Any]:
    """Stream embedding chunks into a faiss index and write it to `out_dir/faiss.index`; returns the
    manifest part (`ivf_build` for IVF-PQ).

    Flat/HNSW add chunks as they come; IVF-PQ needs all vectors for training, so they are spooled
    to a memory-mapped file first and a random sample trains the quantizers, on `ivf_device`
    (`sleuth.retrieval.ivf_build.resolve_ivf_device`; None = a GPU when torch sees one).
    """
    import faiss  # deferred: faiss is heavy; only dense indexes need it

    out_dir.mkdir(parents=True, exist_ok=True)
    index = new_faiss_index(dim, params, num_vectors)
    info: dict[str, Any] = {}
    if ivf_device is not None and params["type"] != "ivfpq":
        raise ConfigError(f"ivf_device applies to ivfpq indexes, this one is {params['type']!r}")
    if params["type"] == "ivfpq":
        builder = IvfBuilder(ivf_device, seed)  # a bad device fails here, before any encoding
        spool_path = out_dir / "embeddings.tmp.f32"
        spool = np.memmap(spool_path, dtype=np.float32, mode="w+", shape=(num_vectors, dim))
        pos = 0
        for chunk in vectors:
            spool[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
        if pos != num_vectors:
            raise RuntimeError(f"encoded {pos} passages, expected {num_vectors}")
        rng = np.random.default_rng(seed)
        # faiss' k-means wants ~39-256 points per centroid; more only slows training.
        n_train = min(num_vectors, max(256 * params["nlist"] // 4, 64 * 2 ** params["nbits"]))
        sample = np.sort(rng.choice(num_vectors, size=n_train, replace=False))
        builder.train(index, np.ascontiguousarray(spool[sample]))
        builder.fill(index, spool, 0, num_vectors)
        del spool
        spool_path.unlink()
        info["ivf_build"] = builder.record()
    else:
        added = 0
        for chunk in vectors:
            index.add(np.ascontiguousarray(chunk, dtype=np.float32))
            added += len(chunk)
        if added != num_vectors:
            raise RuntimeError(f"encoded {added} passages, expected {num_vectors}")
    faiss.write_index(searchable_index(index, params), str(out_dir / FAISS_FILE))
    return info


def read_faiss(path: Path):
    """Open a faiss index with its vectors/codes memory-mapped, falling back to reading it into RAM.

    faiss >= 1.10's IO_FLAG_MMAP_IFC maps Flat, HNSW and IVF storage in place (zero copy); the older
    IO_FLAG_MMAP only maps IVF inverted lists and silently reads Flat/HNSW into RAM.
    """
    import faiss  # deferred: faiss is heavy; only dense indexes need it

    if not path.exists():
        raise FileNotFoundError(f"{path}: faiss index file missing; rebuild the index with `sleuth index`")
    flags = [getattr(faiss, "IO_FLAG_MMAP_IFC", None), faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY]
    for flag in flags:
        if flag is None:
            continue
        try:
            return faiss.read_index(str(path), flag)
        except RuntimeError:
            continue
    return faiss.read_index(str(path))


def passage_text(title: str, text: str) -> str:
    """What the encoder sees for a passage: FlashRAG's `contents` layout (quoted title line, then text)."""
    return f'"{title}"\n{text}' if title else text


class DenseRetriever:
    """Encode queries, search a faiss index, return passages from the docstore."""

    def __init__(
        self,
        index: Any,
        encoder: Encoder,
        docstore: DocStore,
        *,
        faiss_type: str = "flat",
        threads: int = 1,
        **search_params: Any,
    ):
        self.index = index
        self.encoder = encoder
        self.docstore = docstore
        self.faiss_type = faiss_type
        self.threads = threads
        if index.ntotal != docstore.num_docs:
            raise IndexMismatchError(
                f"faiss index has {index.ntotal} vectors but the docstore has {docstore.num_docs} passages; "
                "rebuild with `sleuth index`"
            )
        if index.d != encoder.dim:
            raise IndexMismatchError(
                f"faiss index dimension {index.d} differs from encoder {encoder.config.name!r} dimension {encoder.dim}"
            )
        self.set_search_params(**search_params)

    def set_search_params(self, ef_search: int | None = None, nprobe: int | None = None) -> None:
        import faiss  # deferred: faiss is heavy; only dense indexes need it

        if ef_search is not None:
            hnsw = faiss.downcast_index(self.index)
            if not hasattr(hnsw, "hnsw"):
                raise ConfigError(f"ef_search applies to HNSW indexes, this one is {self.faiss_type!r}")
            hnsw.hnsw.efSearch = int(ef_search)
        if nprobe is not None:
            set_nprobe(self.index, nprobe)

    def search_vectors(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        import faiss  # deferred: faiss is heavy; only dense indexes need it

        faiss.omp_set_num_threads(self.threads)
        k_eff = min(k, self.index.ntotal)
        if len(vectors) >= BLAS_BATCH_MIN and self.faiss_type == "flat":
            # The threshold is process-global: lowering it makes single queries slower, so only
            # batches see the low value, and the lock keeps a concurrent single query off it.
            with _blas_lock:
                old = faiss.cvar.distance_compute_blas_threshold
                faiss.cvar.distance_compute_blas_threshold = BLAS_BATCH_MIN
                try:
                    scores, ids = self.index.search(vectors, k_eff)
                finally:
                    faiss.cvar.distance_compute_blas_threshold = old
        else:
            scores, ids = self.index.search(vectors, k_eff)
        return scores, ids

    def search_indices(self, queries: list[str], k: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        validate_queries(queries, k)
        if self.index.ntotal == 0:
            return [np.zeros(0, np.int64)] * len(queries), [np.zeros(0, np.float32)] * len(queries)
        scores, ids = self.search_vectors(self.encoder.encode_queries(queries), k)
        rows, out_scores = [], []
        for i in range(len(queries)):
            keep = ids[i] >= 0  # faiss pads with -1 when fewer than k vectors were reachable
            rows.append(ids[i][keep].astype(np.int64))
            out_scores.append(scores[i][keep])
        return rows, out_scores

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        rows, scores = self.search_indices(queries, k)
        return hits_from_rows(self.docstore, rows, scores)
