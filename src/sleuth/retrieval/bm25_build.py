"""BM25 index build with bounded memory, over processes: the same files bm25s writes, built in shards.

bm25s' own `index()` holds every passage's token ids as Python lists (~36 bytes a token: ~50 GB for
21M passages). This build never holds more than one shard of passages per process:

1. tokenize (processes over contiguous shards of `shard_docs` passages, read from the memory-mapped
   docstore): each shard is tokenized with bm25s' own tokenizer (same splitter, stopwords, stemmer)
   into a shard-local vocabulary, reduced to each passage's distinct terms with their counts, and
   spooled to disk with the passage lengths;
2. merge (main process): shard vocabularies are merged in shard order, so a stem's global id is its
   first appearance in the corpus, as in a single bm25s pass; document frequencies are summed;
   IDF and the average passage length are computed once for the whole corpus;
3. fill (processes over shards): each shard computes its BM25 weights with the global IDF and
   average length and writes them straight into the final CSC arrays (memory-mapped `.npy`
   files); shard j's postings of a term go after shards 0..j-1's, so every posting list is in
   ascending passage order.

The weights are bm25s' (float64 arithmetic, one rounding to float32), so the arrays equal those
`bm25s.BM25.index` writes for the same corpus, byte for byte (tested). Peak memory: the main
process holds O(vocabulary) arrays and the vocabulary dict; each worker one shard's tokens (4
bytes a token) plus its shard vocabulary: about workers x (shard_docs x 1 KB) + O(vocabulary),
whatever the corpus size.
"""

from __future__ import annotations

import json
import math
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

from sleuth.errors import ConfigError
from sleuth.retrieval._bm25_kernel import token_weight_bounds
from sleuth.retrieval.bm25 import TOKEN_BOUNDS_FILE, _make_tokenizer, bm25_params, import_bm25s
from sleuth.retrieval.docstore import DocStore

DEFAULT_SHARD_DOCS = 250_000
_READ_BATCH = 4096


@njit(cache=True)
def doc_term_counts(tokens, doc_ptr, n_vocab):
    """Per passage its distinct tokens (first-occurrence order) and their counts: (terms, tfs, term_ptr)."""
    n_docs = len(doc_ptr) - 1
    slot = np.full(n_vocab, -1, dtype=np.int64)
    terms = np.empty(len(tokens), dtype=np.int32)
    tfs = np.empty(len(tokens), dtype=np.int32)
    term_ptr = np.zeros(n_docs + 1, dtype=np.int64)
    n = 0
    for d in range(n_docs):
        first = n
        for j in range(doc_ptr[d], doc_ptr[d + 1]):
            t = tokens[j]
            s = slot[t]
            if s >= first:
                tfs[s] += 1
            else:
                slot[t] = n
                terms[n] = t
                tfs[n] = 1
                n += 1
        term_ptr[d + 1] = n
    return terms[:n], tfs[:n], term_ptr


@njit(cache=True)
def _fill_postings(shard, scoring, first_doc, out):
    """Write one shard's BM25 weights into the global CSC arrays at `cursor` (advanced per posting).

    shard = (terms, tfs, term_ptr, lengths), scoring = (idf, k1, b, avg_len, atire), out = (cursor, data,
    indices). The arithmetic is bm25s' `_score_tfc_robertson` (Lucene/Robertson share it) or
    `_score_tfc_atire` times the float32 IDF, with numpy's types there: float64, except ATIRE's float32
    numerator; rounded once to float32 on store."""
    terms, tfs, term_ptr, lengths = shard
    idf, k1, b, avg_len, atire = scoring
    cursor, data, indices = out
    k1_plus_1 = np.float32(k1 + 1.0)
    for d in range(len(term_ptr) - 1):
        norm = k1 * ((1.0 - b) + b * np.float64(lengths[d]) / avg_len)
        for j in range(term_ptr[d], term_ptr[d + 1]):
            t = terms[j]
            tf32 = np.float32(tfs[j])
            tf = np.float64(tf32)
            numerator = np.float64(tf32 * k1_plus_1) if atire else tf
            pos = cursor[t]
            data[pos] = np.float32(np.float64(idf[t]) * (numerator / (tf + norm)))
            indices[pos] = first_doc + d
            cursor[t] = pos + 1


def _tokenize_shard(job: dict[str, Any]) -> dict[str, Any]:
    """Pass 1 for rows [start, end): spool distinct terms, counts and lengths; return the shard's stats."""
    store = DocStore(job["docstore"])
    tokenizer = _make_tokenizer(job["stemmer"], job["stopwords"])
    token_parts: list[np.ndarray] = []
    lengths = np.empty(job["end"] - job["start"], dtype=np.int64)
    filled = 0
    for lo in range(job["start"], job["end"], _READ_BATCH):
        rows = store.get(np.arange(lo, min(lo + _READ_BATCH, job["end"])))
        ids = tokenizer.tokenize(
            [f"{title}\n{text}" for _, title, text in rows],
            update_vocab=True,
            return_as="ids",
            show_progress=False,
        )
        for doc in ids:
            lengths[filled] = len(doc)
            filled += 1
        token_parts.append(np.fromiter((t for doc in ids for t in doc), dtype=np.int32))
        del ids, rows
    vocab = list(tokenizer.get_vocab_dict())  # insertion order is id order
    tokens = np.concatenate(token_parts) if token_parts else np.zeros(0, np.int32)
    del token_parts
    doc_ptr = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=doc_ptr[1:])
    terms, tfs, term_ptr = doc_term_counts(tokens, doc_ptr, len(vocab))
    del tokens
    spool = Path(job["spool"])
    np.save(spool / "terms.npy", terms)
    np.save(spool / "tfs.npy", tfs)
    np.save(spool / "term_ptr.npy", term_ptr)
    np.save(spool / "lengths.npy", lengths)
    np.save(spool / "df.npy", np.bincount(terms, minlength=len(vocab)).astype(np.int64))
    (spool / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    return {"num_docs": len(lengths), "total_length": int(lengths.sum()), "postings": len(terms)}


def _fill_shard(job: dict[str, Any]) -> int:
    """Pass 3: one shard's weights into the final arrays (opened memory-mapped, read-write)."""
    spool = Path(job["spool"])
    terms = np.load(spool / "terms.npy")
    remap = np.load(spool / "remap.npy")
    global_terms = remap[terms]
    del terms
    data = np.lib.format.open_memmap(job["data"], mode="r+")
    indices = np.lib.format.open_memmap(job["indices"], mode="r+")
    idf = np.load(job["idf"])
    cursor = np.load(spool / "cursor.npy")
    _fill_postings(
        (
            global_terms,
            np.load(spool / "tfs.npy"),
            np.load(spool / "term_ptr.npy"),
            np.load(spool / "lengths.npy"),
        ),
        (idf, job["k1"], job["b"], job["avg_len"], job["method"] == "atire"),
        job["start"],
        (cursor, np.asarray(data), np.asarray(indices)),
    )
    data.flush()
    indices.flush()
    del data, indices
    # Free the shard's spool now: disk peaks near index + one spool, not index + every spool (21M: ~12 GB each).
    shutil.rmtree(spool, ignore_errors=True)
    return len(global_terms)


def _run(fn, jobs: list[dict[str, Any]], workers: int) -> list[Any]:
    if workers <= 1 or len(jobs) <= 1:
        return [fn(job) for job in jobs]
    with ProcessPoolExecutor(min(workers, len(jobs))) as pool:
        return list(pool.map(fn, jobs))


def build_bm25_sharded(
    docstore: DocStore,
    out_dir: str | Path,
    *,
    shard_docs: int = DEFAULT_SHARD_DOCS,
    workers: int = 1,
    **params: Any,
) -> dict[str, Any]:
    """Write a bm25s index of every passage in `docstore` ("title\\ntext") to `out_dir`; returns the params.

    `shard_docs` passages are tokenized per task and `workers` processes run the tasks; the files equal
    a single bm25s build's whatever the two are."""
    if not isinstance(shard_docs, int) or shard_docs < 1:
        raise ConfigError(f"shard_docs must be a positive integer, got {shard_docs!r}")
    if not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be a positive integer, got {workers!r}")
    bm25s = import_bm25s()
    p = bm25_params(**params)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spool_root = out_dir / "build.tmp"
    n = docstore.num_docs
    bounds = list(range(0, n, shard_docs)) + [n]
    jobs = []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        spool = spool_root / f"shard-{i:05d}"
        spool.mkdir(parents=True, exist_ok=True)
        jobs.append(
            {
                "docstore": str(docstore.directory),
                "start": start,
                "end": end,
                "spool": str(spool),
                "stemmer": p["stemmer"],
                "stopwords": p["stopwords"],
            }
        )
    try:
        stats = _run(_tokenize_shard, jobs, workers)
        vocab, df = _merge_vocabularies(jobs)
        total_length = sum(s["total_length"] for s in stats)
        # np.mean of the lengths, as bm25s computes it: float64 sum (exact for integers) over n.
        avg_len = float(np.float64(total_length) / n) if n else 0.0
        idf = np.zeros(len(vocab), dtype=np.float32)
        for t, d in enumerate(df.tolist()):
            if d:
                idf[t] = _idf(p["method"], d, n)
        np.save(spool_root / "idf.npy", idf)
        indptr = np.zeros(len(vocab) + 1, dtype=np.int64)
        np.cumsum(df, out=indptr[1:])
        nnz = int(indptr[-1])
        data_path, indices_path = out_dir / "data.csc.index.npy", out_dir / "indices.csc.index.npy"
        np.lib.format.open_memmap(data_path, mode="w+", dtype=np.float32, shape=(nnz,)).flush()
        np.lib.format.open_memmap(indices_path, mode="w+", dtype=np.int32, shape=(nnz,)).flush()
        cursor = indptr[:-1].copy()
        for job in jobs:
            spool = Path(job["spool"])
            np.save(spool / "cursor.npy", cursor)
            cursor += np.load(spool / "df_global.npy")
            job.update(
                data=str(data_path),
                indices=str(indices_path),
                idf=str(spool_root / "idf.npy"),
                k1=float(p["k1"]),
                b=float(p["b"]),
                avg_len=avg_len,
                method=p["method"],
            )
        if not np.array_equal(cursor, indptr[1:]):
            raise RuntimeError("BM25 build: shard postings do not add up to the document frequencies")
        _run(_fill_shard, jobs, workers)
        np.save(out_dir / "indptr.csc.index.npy", indptr)
        _save_token_bounds(out_dir, indptr)
        _write_metadata(bm25s, out_dir, vocab, p, n)
    finally:
        shutil.rmtree(spool_root, ignore_errors=True)
    return p


def _save_token_bounds(out_dir: Path, indptr: np.ndarray) -> None:
    """The search kernel's per-token bounds, computed once here so that a server's start reads
    16 bytes a token instead of scanning the whole score matrix on its first search."""
    data = np.load(out_dir / "data.csc.index.npy", mmap_mode="r")
    indices = np.load(out_dir / "indices.csc.index.npy", mmap_mode="r")
    upper, magnitude, ascending = token_weight_bounds(data, indices, indptr)
    if not ascending:
        raise RuntimeError(
            "BM25 build: a posting list is not in ascending passage order (a bug in the build)"
        )
    np.save(out_dir / TOKEN_BOUNDS_FILE, np.stack([upper, magnitude]))


def _idf(method: str, df: int, n: int) -> float:
    # bm25s' _score_idf_lucene / _score_idf_robertson / _score_idf_atire, in Python floats as there.
    if method == "lucene":
        return math.log(1 + (n - df + 0.5) / (df + 0.5))
    if method == "atire":
        return math.log(n / df)
    inner = (n - df + 0.5) / (df + 0.5)
    return math.log(inner) if inner > 1 else math.log(1)


def _merge_vocabularies(jobs: list[dict[str, Any]]) -> tuple[dict[str, int], np.ndarray]:
    """Global ids in first-appearance order over shards; writes each shard's local->global map and df."""
    vocab: dict[str, int] = {}
    for job in jobs:
        spool = Path(job["spool"])
        local = json.loads((spool / "vocab.json").read_text(encoding="utf-8"))
        remap = np.empty(len(local), dtype=np.int32)
        for i, stem in enumerate(local):
            remap[i] = vocab.setdefault(stem, len(vocab))
        np.save(spool / "remap.npy", remap)
    # Only now is the vocabulary's size known: each shard's df goes to global ids in a second pass.
    df = np.zeros(len(vocab), dtype=np.int64)
    for job in jobs:
        spool = Path(job["spool"])
        df_global = np.zeros(len(vocab), dtype=np.int64)
        df_global[np.load(spool / "remap.npy")] = np.load(
            spool / "df.npy"
        )  # one local id per stem: no repeats
        np.save(Path(job["spool"]) / "df_global.npy", df_global)
        df += df_global
    return vocab, df


def _write_metadata(bm25s: Any, out_dir: Path, vocab: dict[str, int], p: dict[str, Any], n: int) -> None:
    """params/vocab files as `BM25.save` + `Tokenizer.save_vocab/save_stopwords` write them."""
    model = bm25s.BM25(k1=p["k1"], b=p["b"], method=p["method"], backend="numba")
    params = dict(
        k1=model.k1,
        b=model.b,
        delta=model.delta,
        method=model.method,
        idf_method=model.idf_method,
        dtype=model.dtype,
        int_dtype=model.int_dtype,
        num_docs=n,
        version=bm25s.__version__,
        backend=model.backend,
    )
    (out_dir / "params.index.json").write_text(json.dumps(params, indent=4), encoding="utf-8")
    (out_dir / "vocab.index.json").write_text(
        bm25s.utils.json_functions.dumps(vocab, ensure_ascii=False), encoding="utf-8"
    )
    tokenizer = _make_tokenizer(p["stemmer"], p["stopwords"])
    if p["stemmer"]:
        # Queries stem unseen words and look the stem up, so word->id caches are not needed: only the
        # empty token (how the retriever drops token-less queries) is listed, which keeps a served
        # 21M-passage index from holding a dict of every surface form.
        empty = vocab.get("")
        tokenizer.stem_to_sid = vocab
        tokenizer.word_to_stem = {"": ""} if empty is not None else {}
        tokenizer.word_to_id = {"": empty} if empty is not None else {}
    else:
        tokenizer.word_to_id = vocab
    tokenizer.save_vocab(str(out_dir))
    tokenizer.save_stopwords(str(out_dir))
