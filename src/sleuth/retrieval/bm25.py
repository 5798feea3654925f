"""BM25 over bm25s (numba backend) with English stemming and stopwords.

`sleuth index` builds the index files with `sleuth.retrieval.bm25_build` (sharded over processes,
bounded memory); `build_bm25` here is bm25s' own single pass, which holds every passage's token-id list
in memory, kept as the reference the sharded build is tested against (byte-identical files).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from sleuth.errors import ConfigError, IndexMismatchError
from sleuth.retrieval._bm25_kernel import bm25_topk, token_weight_bounds
from sleuth.retrieval._common import hits_from_rows, validate_queries
from sleuth.retrieval.base import Hit
from sleuth.retrieval.docstore import DocStore

# Methods whose scores are zero for passages without a query term (bm25l/bm25+ are not).
BM25_METHODS = ("lucene", "robertson", "atire")
DEFAULT_BM25_PARAMS: dict[str, Any] = {
    "k1": 0.9,
    "b": 0.4,
    "method": "lucene",
    "stemmer": "english",
    "stopwords": "en",
}
_BM25_PARAM_KEYS = set(DEFAULT_BM25_PARAMS)
# (2, vocabulary) float64: per token its largest weight (floored at 0) and largest |weight|.
TOKEN_BOUNDS_FILE = "token_bounds.npy"


def import_bm25s() -> Any:
    """`import bm25s`, keeping JAX off the GPU.

    bm25s runs `jax.lax.top_k` at import time whenever JAX is installed. On a machine with a CUDA
    build of JAX that initialises JAX's GPU backend, which by default preallocates 75% of every
    visible GPU's memory for the rest of the process, leaving the policy a quarter of the card
    (this is what made sleuth's trainer run out of GPU memory). sleuth never uses JAX, so unless the
    process already imported JAX or the user chose its platform, JAX is pointed at the CPU and told
    not to preallocate."""
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import bm25s  # deferred: JAX's environment must be set before bm25s imports it (see above)

    return bm25s


def _make_tokenizer(stemmer: str | None, stopwords: str | list[str] | None):
    Tokenizer = import_bm25s().tokenization.Tokenizer

    stem_fn = None
    if stemmer:
        import Stemmer  # deferred: only stemmed indexes need PyStemmer

        stem_fn = Stemmer.Stemmer(stemmer).stemWord
    return Tokenizer(stemmer=stem_fn, stopwords=stopwords if stopwords else [])


def bm25_params(**params: Any) -> dict[str, Any]:
    """Defaults (Pyserini's k1=0.9, b=0.4) overridden by `params`; unknown names are an error."""
    unknown = set(params) - _BM25_PARAM_KEYS
    if unknown:
        raise ConfigError(f"unknown BM25 parameter(s) {sorted(unknown)}; known: {sorted(_BM25_PARAM_KEYS)}")
    out = {**DEFAULT_BM25_PARAMS, **params}
    if out["method"] not in BM25_METHODS:
        raise ValueError(
            f"BM25 method {out['method']!r} is not supported; choose one of {list(BM25_METHODS)}"
        )
    return out


def build_bm25(
    texts: Iterable[str], num_docs: int, out_dir: str | Path, *, show_progress: bool = True, **params: Any
) -> dict[str, Any]:
    """Tokenize a stream of `num_docs` passage texts, index and save to `out_dir`; returns the params used.

    bm25s' single in-memory pass (~36 bytes per token); `sleuth.retrieval.bm25_build` writes the same files
    with bounded memory."""
    bm25s = import_bm25s()

    p = bm25_params(**params)
    tokenizer = _make_tokenizer(p["stemmer"], p["stopwords"])
    token_ids = tokenizer.tokenize(
        texts, update_vocab=True, return_as="ids", length=num_docs, show_progress=show_progress
    )
    model = bm25s.BM25(k1=p["k1"], b=p["b"], method=p["method"], backend="numba")
    model.index(
        bm25s.tokenization.Tokenized(ids=token_ids, vocab=tokenizer.get_vocab_dict()),
        show_progress=show_progress,
    )
    del token_ids
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save(str(out_dir), show_progress=False)
    tokenizer.save_vocab(str(out_dir))
    tokenizer.save_stopwords(str(out_dir))
    return p


class BM25Retriever:
    """BM25 search returning full passages from a memory-mapped `DocStore`."""

    def __init__(
        self, index_dir: str | Path, docstore: DocStore, *, stemmer: str | None = "english", threads: int = 1
    ):
        bm25s = import_bm25s()
        self.index_dir = Path(index_dir)
        if not (self.index_dir / "params.index.json").exists():
            raise FileNotFoundError(f"{self.index_dir}: no BM25 index here (params.index.json missing)")
        self.docstore = docstore
        self.threads = threads
        # The tokenizer holds the vocabulary; a second copy in the model would only cost memory.
        self.model = bm25s.BM25.load(
            str(self.index_dir), mmap=True, load_vocab=False, show_progress=False, backend="numba"
        )
        self.tokenizer = _make_tokenizer(stemmer, None)
        self.tokenizer.load_vocab(str(self.index_dir))
        self.tokenizer.load_stopwords(str(self.index_dir))
        self._empty_id = self.tokenizer.word_to_id.get("")
        # Per token (largest weight, largest |weight|): the kernel's pruning bounds. Indexes built by
        # sleuth.retrieval.bm25_build store them (a load reads V x 16 bytes, not the score matrix);
        # for others they are computed on the first search (one pass over the whole matrix).
        self._token_bounds: tuple[np.ndarray, np.ndarray] | None = None
        bounds_path = self.index_dir / TOKEN_BOUNDS_FILE
        if bounds_path.exists():
            bounds = np.load(bounds_path)
            if bounds.shape != (2, len(self.model.scores["indptr"]) - 1):
                raise IndexMismatchError(
                    f"{bounds_path}: shape {bounds.shape} does not fit the index's vocabulary; rebuild the index "
                    "with `sleuth index`"
                )
            self._token_bounds = (bounds[0], bounds[1])
        self._thread_scratch = threading.local()
        if docstore.num_docs != self.num_indexed:
            raise IndexMismatchError(
                f"{self.index_dir}: BM25 index has {self.num_indexed} passages but the docstore has "
                f"{docstore.num_docs}; rebuild with `sleuth index`"
            )

    @property
    def num_indexed(self) -> int:
        return int(self.model.scores["num_docs"])

    def _tokenize(self, queries: list[str]) -> list[list[int]]:
        # update_vocab=False still maps unseen surface forms of known stems; unknown words are dropped.
        ids = self.tokenizer.tokenize(queries, update_vocab=False, return_as="ids", show_progress=False)
        return [[t for t in q if t != self._empty_id] for q in ids]

    def search_indices(self, queries: list[str], k: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Row indices and scores per query, best first; passages with score 0 (no shared term) are dropped."""
        validate_queries(queries, k)
        token_ids = self._tokenize(queries)
        k_eff = min(k, self.num_indexed)
        rows: list[np.ndarray] = [np.zeros(0, np.int64)] * len(queries)
        scores: list[np.ndarray] = [np.zeros(0, np.float32)] * len(queries)
        nonempty = [i for i, t in enumerate(token_ids) if t]
        if nonempty and k_eff > 0:
            batch = [token_ids[i] for i in nonempty]
            ids, sc, counts = self._topk(batch, k_eff)
            for j, i in enumerate(nonempty):
                rows[i] = ids[j, : counts[j]]
                scores[i] = sc[j, : counts[j]]
        return rows, scores

    def _topk(self, batch: list[list[int]], k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        m = self.model.scores
        if self._token_bounds is None:
            # One pass over the score matrix on the first search, not at load: loading stays a memory map.
            # Concurrent first searches may both compute it; the results are identical.
            upper, magnitude, ascending = token_weight_bounds(m["data"], m["indices"], m["indptr"])
            if not ascending:
                raise IndexMismatchError(
                    f"{self.index_dir}: BM25 posting lists are not in ascending passage order; "
                    "rebuild the index with `sleuth index`"
                )
            self._token_bounds = (upper, magnitude)
        args = (m["data"], m["indices"], m["indptr"], self._token_bounds, k)
        if self.threads <= 1 or len(batch) < 2 * self.threads:
            return bm25_topk(batch, *args, self._scratch())
        # The kernel releases the GIL (nogil), so threads over slices of the batch run in parallel.

        step = -(-len(batch) // self.threads)
        parts = [batch[i : i + step] for i in range(0, len(batch), step)]
        with ThreadPoolExecutor(self.threads) as pool:
            results = list(pool.map(lambda part: bm25_topk(part, *args, self._scratch()), parts))
        return tuple(np.concatenate([r[j] for r in results]) for j in range(3))

    def _scratch(self) -> np.ndarray:
        # The kernel's per-passage accumulator, zeros between calls: one per thread, kept, so a
        # search does not allocate and fault in num_docs floats.
        scratch = getattr(self._thread_scratch, "scores", None)
        if scratch is None:
            scratch = self._thread_scratch.scores = np.zeros(self.num_indexed, dtype=np.float32)
        return scratch

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        rows, scores = self.search_indices(queries, k)
        return hits_from_rows(self.docstore, rows, scores)
