"""Build an index directory from a corpus jsonl, and load the right retriever back from one.

An index directory holds `docstore/`, the engine's files (`bm25/` or `faiss.index`) and a
`manifest.json` written last, so a directory without a manifest is an incomplete build.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from sleuth import __version__
from sleuth.data.formats import corpus_fingerprint, iter_corpus
from sleuth.errors import ConfigError, IndexMismatchError
from sleuth.retrieval.base import Retriever
from sleuth.retrieval.bm25 import BM25Retriever
from sleuth.retrieval.bm25_build import DEFAULT_SHARD_DOCS, build_bm25_sharded
from sleuth.retrieval.dense import (
    FAISS_FILE,
    DenseRetriever,
    build_faiss,
    faiss_params,
    passage_text,
    read_faiss,
)
from sleuth.retrieval.docstore import DocStore
from sleuth.retrieval.encoders import Encoder, EncoderConfig
from sleuth.retrieval.hybrid import HybridRetriever
from sleuth.retrieval.ivf_build import resolve_ivf_device
from sleuth.retrieval.sharded import ShardBuild, build_sharded_faiss, load_sharded
from sleuth.utils import (
    atomic_write_json,
    give_normal_permissions,
    is_write_failure,
    link_or_copy,
    output_error,
    tree_bytes,
)

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
KINDS = ("bm25", "dense")
# A directory holding only a docstore and a manifest (sleuth.retrieval.docstore_build.build_docstore_index):
# not searchable, but a `docstore_from` source for dense builds.
DOCSTORE_KIND = "docstore"
_ENCODER_KEYS = {
    "encoder",
    "query_prefix",
    "passage_prefix",
    "normalize",
    "batch_size",
    "max_length",
    "device",
}
_FAISS_KEYS = {"faiss", "M", "ef_construction", "ef_search", "nlist", "m", "nbits", "nprobe"}
# Any of these selects the sharded dense layout (sleuth.retrieval.sharded), even with shards=1.
_SHARD_KEYS = {"shards", "train_sample", "keep_vectors"}
# Precomputed passage embeddings (`encode_docstore`'s float16 file) instead of encoding at build time.
_EMBEDDINGS_KEY = "embeddings"
# Where an IVF-PQ build runs its k-means and assignment (sleuth.retrieval.ivf_build): how, not what, it builds.
_IVF_DEVICE_KEY = "ivf_device"
_BM25_KEYS = {"k1", "b", "method", "stemmer", "stopwords"}
# How a BM25 index is built (sleuth.retrieval.bm25_build), not what it is: recorded apart from its params.
_BM25_BUILD_KEYS = {"shard_docs", "workers"}
_LOAD_KEYS = {
    "bm25": {"threads"},
    "dense": {"threads", "ef_search", "nprobe", "batch_size", "device", "encoder", "rerank", "gpus"},
}


def _progress(iterable, total: int | None, desc: str, show: bool, unit: str = "passages"):
    if not show:
        return iterable
    # deferred: tqdm.auto imports asyncio (~70 ms), which every `import sleuth.retrieval` would pay
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, dynamic_ncols=True)


def build_index(
    corpus_path: str | Path | None,
    kind: str,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    show_progress: bool = True,
    threads: int = 1,
    docstore_from: str | Path | None = None,
    **params: Any,
) -> dict[str, Any]:
    """Build a `kind` ("bm25" | "dense") index of `corpus_path` in `out_dir`; returns the manifest.

    `docstore_from`: an index directory of the same corpus (e.g. its BM25 index) whose docstore is
    hard-linked (copied across file systems) instead of reading the corpus again: at 21M passages that
    pass writes 15 GB. Its manifest's corpus path and fingerprint are recorded; `corpus_path` may then
    be None (the corpus file may be gone), and if given it must be that corpus.

    BM25 params: k1, b, method, stemmer, stopwords. Dense params: encoder (alias, dir or hub name),
    query_prefix, passage_prefix, normalize, batch_size, max_length, device, faiss ("flat" | "hnsw" |
    "ivfpq") and the faiss type's own params (M, ef_construction, ef_search | nlist, m, nbits, nprobe).
    Sharded dense layout (see sleuth.retrieval.sharded): shards (number of contiguous shards),
    train_sample (ivfpq training vectors held in RAM), keep_vectors (float16 copy for exact re-ranking).
    ivf_device (ivfpq): where the coarse k-means and assignment run: "auto" (default: a GPU when torch
    sees one, else "cpu"), "cpu" (faiss alone), "torch-cpu", "cuda" or "cuda:N"; the manifest's
    `ivf_build` records the path taken and the seconds of each phase.
    """

    if kind not in KINDS:
        raise ConfigError(f"unknown index kind {kind!r}; choose one of {list(KINDS)}")
    allowed = (
        _BM25_KEYS | _BM25_BUILD_KEYS
        if kind == "bm25"
        else _ENCODER_KEYS | _FAISS_KEYS | _SHARD_KEYS | {_EMBEDDINGS_KEY, _IVF_DEVICE_KEY}
    )
    unknown = set(params) - allowed
    if unknown:
        raise ConfigError(f"{kind} index: unknown parameter(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    if params.get(_IVF_DEVICE_KEY) is not None:
        # Checked before the docstore and the encoding, which take hours at Wikipedia size.
        if params.get("faiss", "flat") != "ivfpq":
            raise ConfigError(
                f"ivf_device applies to ivfpq indexes, this one is {params.get('faiss', 'flat')!r}"
            )
        resolve_ivf_device(params[_IVF_DEVICE_KEY])
    source = _docstore_source(corpus_path, docstore_from)
    corpus_path = Path(corpus_path) if corpus_path is not None else Path(source["corpus_path"])
    if source is None and not corpus_path.is_file():
        raise FileNotFoundError(f"{corpus_path}: corpus file does not exist")
    out_dir = Path(out_dir)
    replace_existing = out_dir.exists() and any(out_dir.iterdir())
    if replace_existing:
        if not overwrite:
            raise FileExistsError(
                f"{out_dir}: directory exists and is not empty; pass --overwrite (overwrite=True) to replace it"
            )
        if not (out_dir / MANIFEST).exists() and not (out_dir / "docstore").exists():
            # Refuse to wipe a directory that does not look like an index.
            raise FileExistsError(f"{out_dir}: exists and is not a sleuth index; choose another --out")
    # Built in a sibling temporary directory and renamed at the end: a failed build leaves nothing
    # behind, and an index being replaced stays usable until the new one is complete.
    building: Path | None = None
    written = 0
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_builds(out_dir)
        building = Path(
            tempfile.mkdtemp(dir=out_dir.parent, prefix=f"{_BUILDING_PREFIX.format(out_dir.name)}")
        )
        (building / _BUILDER_PID).write_text(str(os.getpid()))
        manifest = _build_into(
            corpus_path, kind, building, threads=threads, show_progress=show_progress, source=source, **params
        )
        (building / _BUILDER_PID).unlink()
        give_normal_permissions(building)  # mkdtemp made it 0700
        if out_dir.exists():
            shutil.rmtree(out_dir)
        building.rename(out_dir)
    except BaseException as err:
        if building is not None:
            written = tree_bytes(building)
            shutil.rmtree(building, ignore_errors=True)
        if is_write_failure(err):  # disk full or read-only: one line, the old index (if any) untouched
            needed = corpus_path.stat().st_size if corpus_path.is_file() else 0
            raise output_error(
                f"{kind} index",
                out_dir,
                err,
                max(written, needed),
                "nothing was left behind; free space or pass another --out",
                at_least=True,
            ) from None
        raise
    return manifest


_BUILDING_PREFIX = ".{}.building-"
_BUILDER_PID = ".builder-pid"


def _remove_stale_builds(out_dir: Path) -> None:
    """Remove temporary build directories of `out_dir` left by a build that was killed (SIGKILL skips
    cleanup): their builder process is gone. A build still running elsewhere is left alone."""
    for stale in out_dir.parent.glob(_BUILDING_PREFIX.format(out_dir.name) + "*"):
        try:
            pid = int((stale / _BUILDER_PID).read_text())
        except (OSError, ValueError):
            pid = None  # from before builds recorded their pid, or killed before writing it: stale
        if pid is not None and _alive(pid):
            continue
        shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _docstore_source(
    corpus_path: str | Path | None, docstore_from: str | Path | None
) -> dict[str, Any] | None:
    """The manifest of `docstore_from` (with "dir" added), checked against `corpus_path` if given."""
    if docstore_from is None:
        if corpus_path is None:
            raise ConfigError("build_index needs a corpus file, or docstore_from (an index of the corpus)")
        return None
    manifest = read_manifest(docstore_from, kinds=(*KINDS, DOCSTORE_KIND))
    if not (Path(docstore_from) / "docstore" / "docstore.json").is_file():
        raise IndexMismatchError(
            f"{docstore_from}: has no docstore/ to reuse; rebuild it with `sleuth index`"
        )
    if corpus_path is not None:
        check_corpus(manifest, docstore_from, corpus_path)
    return {**manifest, "dir": str(Path(docstore_from))}


def _link_docstore(source_dir: Path, out_dir: Path) -> DocStore:
    """Hard links to another index's docstore files (they are never written after their build)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in sorted(source_dir.iterdir()):
        link_or_copy(f, out_dir / f.name)
    return DocStore(out_dir)


def _build_into(
    corpus_path: Path,
    kind: str,
    out_dir: Path,
    *,
    threads: int,
    show_progress: bool,
    source: dict[str, Any] | None = None,
    **params: Any,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    if source is not None:
        fingerprint = source["corpus_fingerprint"]
        docstore = _link_docstore(Path(source["dir"]) / "docstore", out_dir / "docstore")
        if docstore.num_docs != source["num_docs"]:
            raise IndexMismatchError(
                f"{source['dir']}: docstore has {docstore.num_docs} passages, manifest says "
                f"{source['num_docs']}; rebuild that index"
            )
    else:
        fingerprint = corpus_fingerprint(corpus_path)
        docstore = DocStore.build(
            _progress(iter_corpus(corpus_path, unique_ids=True), None, "read corpus", show_progress),
            out_dir / "docstore",
        )
    n = docstore.num_docs
    manifest: dict[str, Any] = {
        "manifest_version": MANIFEST_VERSION,
        "kind": kind,
        "corpus_path": str(corpus_path.resolve()) if source is None else source["corpus_path"],
        "corpus_fingerprint": fingerprint,
        "num_docs": n,
        "sleuth_version": __version__,
    }
    if kind == "bm25":
        # Sharded over processes with bounded memory; the files equal bm25s' own single-pass build.
        build = {k: params.pop(k) for k in list(params) if k in _BM25_BUILD_KEYS}
        build.setdefault("shard_docs", DEFAULT_SHARD_DOCS)
        build.setdefault("workers", 1)
        manifest["bm25"] = build_bm25_sharded(docstore, out_dir / "bm25", **build, **params)
        manifest["bm25_build"] = build
    else:
        manifest.update(
            _build_dense(docstore, out_dir, threads=threads, show_progress=show_progress, **params)
        )
    manifest["build_seconds"] = round(time.perf_counter() - t0, 3)
    manifest["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    atomic_write_json(out_dir / MANIFEST, manifest)
    return manifest


def _build_dense(
    docstore, out_dir: Path, *, threads: int, show_progress: bool, **params: Any
) -> dict[str, Any]:
    _set_torch_threads(threads)
    _set_faiss_threads(threads)
    embeddings = params.pop(_EMBEDDINGS_KEY, None)
    ivf_device = params.pop(_IVF_DEVICE_KEY, None)
    shard_opts = {k: params.pop(k) for k in list(params) if k in _SHARD_KEYS}
    faiss_kind = params.pop("faiss", "flat")
    fparams = faiss_params(faiss_kind, **{k: params.pop(k) for k in list(params) if k in _FAISS_KEYS})
    device = params.pop("device", None)
    name = params.pop("encoder", "minilm")
    if isinstance(name, Encoder):
        # An already loaded encoder (shared across builds); its own config is what gets recorded.
        if params:
            raise ConfigError(f"encoder options {sorted(params)} cannot be combined with a loaded Encoder")
        encoder = name
    else:
        encoder = Encoder(EncoderConfig(name=name, **params), device=device)
    chunk = 1024

    def vectors() -> Iterator:
        if embeddings is not None:
            stored = open_embeddings(embeddings, docstore.num_docs, encoder.dim)
            for start in range(0, docstore.num_docs, 65536):
                yield np.asarray(stored[start : start + 65536], dtype=np.float32)
            return
        batches = _progress(
            docstore.iter_batches(chunk),
            -(-docstore.num_docs // chunk),
            "encode passages",
            show_progress,
            "chunks",
        )
        for batch in batches:
            yield encoder.encode_passages([passage_text(title, text) for _, title, text in batch])

    meta: dict[str, Any] = {"encoder": {**encoder.config.to_dict(), "dim": encoder.dim}, "faiss": fparams}
    if embeddings is not None:
        meta["embeddings"] = str(Path(embeddings).resolve())
    if shard_opts:
        meta.update(
            build_sharded_faiss(
                vectors(),
                docstore.num_docs,
                encoder.dim,
                fparams,
                out_dir,
                ShardBuild(
                    shards=shard_opts.get("shards", 1),
                    train_sample=shard_opts.get("train_sample"),
                    keep_vectors=bool(shard_opts.get("keep_vectors", False)),
                    ivf_device=ivf_device,
                    source_vectors=None if embeddings is None else str(embeddings),
                ),
            )
        )
        return meta
    meta.update(
        build_faiss(vectors(), docstore.num_docs, encoder.dim, fparams, out_dir, ivf_device=ivf_device)
    )
    return meta


def open_embeddings(path: str | Path, num_docs: int, dim: int) -> np.ndarray:
    """A float16 [num_docs, dim] embeddings file (raw rows, as `encode_docstore` writes), memory-mapped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: embeddings file does not exist (write one with encode_docstore)")
    expected = num_docs * dim * 2
    if path.stat().st_size != expected:
        raise IndexMismatchError(
            f"{path}: {path.stat().st_size} bytes, but {num_docs} passages x {dim} dims of float16 are {expected}; "
            "encode this corpus with this encoder again"
        )
    return np.memmap(path, dtype=np.float16, mode="r", shape=(num_docs, dim))


def encode_docstore(
    docstore: DocStore, path: str | Path, encoder: Encoder, *, chunk: int = 16384, show_progress: bool = False
) -> int:
    """Encode every passage (as a dense index build does) into a float16 [N, dim] file, streaming;
    written to a temporary name and renamed when complete. Returns the rows written."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    out = np.memmap(tmp, dtype=np.float16, mode="w+", shape=(max(docstore.num_docs, 1), encoder.dim))
    pos = 0
    batches = _progress(
        docstore.iter_batches(chunk), -(-docstore.num_docs // chunk), "encode", show_progress, "chunks"
    )
    for batch in batches:
        vecs = encoder.encode_passages([passage_text(title, text) for _, title, text in batch])
        out[pos : pos + len(vecs)] = vecs
        pos += len(vecs)
    out.flush()
    del out
    if docstore.num_docs == 0:
        tmp.write_bytes(b"")
    tmp.rename(path)
    return pos


def _set_faiss_threads(threads: int) -> None:
    """faiss' OpenMP threads for k-means training, adding and encoding: `threads` (the build's --threads), not
    whatever OMP_NUM_THREADS the process started with (1 in the bench drivers, for the servers)."""
    import faiss  # deferred: faiss is heavy; only dense builds need it

    faiss.omp_set_num_threads(max(1, threads))


def _set_torch_threads(threads: int) -> None:
    import torch  # deferred: torch is heavy and this module's other paths run without it

    torch.set_num_threads(max(1, threads))


def read_manifest(index_dir: str | Path, kinds: tuple[str, ...] = KINDS) -> dict[str, Any]:
    """The manifest of `index_dir`, or a clear error if the directory is not a complete index (of `kinds`)."""
    index_dir = Path(index_dir)
    if not index_dir.is_dir():
        raise FileNotFoundError(f"{index_dir}: index directory does not exist; build one with `sleuth index`")
    path = index_dir / MANIFEST
    if not path.exists():
        raise IndexMismatchError(
            f"{path}: missing; {index_dir} is not a complete sleuth index (an interrupted build?). "
            "Rebuild it with `sleuth index`"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise IndexMismatchError(
            f"{path}: corrupt manifest ({err}); rebuild the index with `sleuth index`"
        ) from err
    missing = [
        k
        for k in ("kind", "corpus_fingerprint", "num_docs")
        if not isinstance(manifest, dict) or k not in manifest
    ]
    if missing:
        raise IndexMismatchError(f"{path}: manifest lacks {missing}; rebuild the index with `sleuth index`")
    if manifest["kind"] not in kinds:
        if manifest["kind"] == DOCSTORE_KIND:
            raise IndexMismatchError(
                f"{path}: {index_dir} holds only a docstore (no search index); build one "
                f"with `sleuth index --docstore-from {index_dir}`"
            )
        raise IndexMismatchError(
            f"{path}: unknown index kind {manifest['kind']!r}; rebuild with `sleuth index`"
        )
    return manifest


def check_corpus(manifest: dict[str, Any], index_dir: str | Path, corpus: str | Path) -> None:
    """Raise IndexMismatchError if `corpus` is not the corpus the index was built from."""
    corpus = Path(corpus)
    if not corpus.is_file():
        raise FileNotFoundError(f"{corpus}: corpus file does not exist")
    actual = corpus_fingerprint(corpus)
    if actual != manifest["corpus_fingerprint"]:
        raise IndexMismatchError(
            f"index {index_dir} was built from {manifest.get('corpus_path')} ({manifest['corpus_fingerprint']}), "
            f"but the corpus given is {corpus} ({actual}), a different file. "
            f"Rebuild the index with `sleuth index {corpus} --out {index_dir} --overwrite`"
        )


def load_retriever(index_dir: str | Path, corpus: str | Path | None = None, **overrides: Any) -> Retriever:
    """Load the retriever an index directory holds (BM25Retriever, DenseRetriever or ShardedDenseRetriever).

    `corpus`, if given, is checked against the manifest's fingerprint. Overrides: `threads` (both);
    dense also `ef_search`, `nprobe`, `batch_size`, `device` and `encoder` (an already loaded `Encoder`
    to share; it must match the one the index was built with); sharded dense also `rerank`
    (candidates re-scored exactly) and `gpus` (GPU ids for the shards, faiss-gpu only).
    """
    index_dir = Path(index_dir)
    manifest = read_manifest(index_dir)
    if corpus is not None:
        check_corpus(manifest, index_dir, corpus)
    kind = manifest["kind"]
    unknown = set(overrides) - _LOAD_KEYS[kind]
    if unknown:
        raise ConfigError(
            f"{kind} index: unknown load option(s) {sorted(unknown)}; allowed: {sorted(_LOAD_KEYS[kind])}"
        )
    threads = int(overrides.pop("threads", 1))
    docstore = DocStore(index_dir / "docstore")
    if docstore.num_docs != manifest["num_docs"]:
        raise IndexMismatchError(
            f"{index_dir}: docstore has {docstore.num_docs} passages, manifest says {manifest['num_docs']}; rebuild"
        )
    if kind == "bm25":
        return BM25Retriever(
            index_dir / "bm25", docstore, stemmer=manifest.get("bm25", {}).get("stemmer"), threads=threads
        )
    return _load_dense(index_dir, manifest, docstore, threads, **overrides)


def _load_dense(index_dir: Path, manifest: dict, docstore, threads: int, **overrides: Any):
    enc_meta = dict(manifest["encoder"])
    dim = enc_meta.pop("dim")
    encoder = overrides.pop("encoder", None)
    device = overrides.pop("device", None)
    if "batch_size" in overrides:
        enc_meta["batch_size"] = int(overrides.pop("batch_size"))
    if encoder is None:
        encoder = Encoder(EncoderConfig(**enc_meta), device=device)
    else:
        for key in ("name", "query_prefix", "passage_prefix", "normalize"):
            if getattr(encoder.config, key) != enc_meta[key]:
                raise IndexMismatchError(
                    f"{index_dir}: the encoder passed has {key}={getattr(encoder.config, key)!r} but the index "
                    f"was built with {key}={enc_meta[key]!r}"
                )
    if encoder.dim != dim:
        raise IndexMismatchError(f"{index_dir}: encoder dimension {encoder.dim} != index dimension {dim}")
    _set_torch_threads(threads)
    fparams = manifest["faiss"]
    search_params = {k: overrides.get(k, fparams.get(k)) for k in ("ef_search", "nprobe") if k in fparams}
    if "shards" in manifest:
        return load_sharded(
            index_dir,
            manifest,
            encoder,
            docstore,
            threads=threads,
            rerank=overrides.get("rerank"),
            gpus=overrides.get("gpus"),
            **search_params,
        )
    for key in ("rerank", "gpus"):
        if overrides.get(key):
            raise ConfigError(f"{index_dir}: {key} needs a sharded dense index (build with shards=...)")
    index = read_faiss(index_dir / FAISS_FILE)
    return DenseRetriever(
        index, encoder, docstore, faiss_type=fparams["type"], threads=threads, **search_params
    )


def load_hybrid(
    index_dirs: Sequence[str | Path],
    corpus: str | Path | None = None,
    weights: Sequence[float] | None = None,
    rrf_k: float = 60.0,
    depth: int | None = None,
    **overrides: Any,
):
    """A HybridRetriever over several index directories of the same corpus (checked by fingerprint)."""
    if not index_dirs:
        raise ValueError("load_hybrid needs at least one index directory")
    manifests = [read_manifest(d) for d in index_dirs]
    known = set().union(*(_LOAD_KEYS[m["kind"]] for m in manifests))
    if set(overrides) - known:
        raise ConfigError(
            f"unknown load option(s) {sorted(set(overrides) - known)}; allowed: {sorted(known)}"
        )
    fingerprints = {m["corpus_fingerprint"] for m in manifests}
    if len(fingerprints) > 1:
        listing = ", ".join(
            f"{d} ({m['corpus_fingerprint'][:19]}...)" for d, m in zip(index_dirs, manifests, strict=True)
        )
        raise IndexMismatchError(
            f"hybrid indexes were built from different corpora: {listing}; rebuild them from one"
        )
    retrievers = []
    for d, m in zip(index_dirs, manifests, strict=True):
        opts = {k: v for k, v in overrides.items() if k in _LOAD_KEYS[m["kind"]]}
        retrievers.append(load_retriever(d, corpus if d == index_dirs[0] else None, **opts))
    return HybridRetriever(retrievers, weights=weights, rrf_k=rrf_k, depth=depth)
