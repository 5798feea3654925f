"""Build a docstore from a corpus jsonl with several processes (the files `DocStore.build` writes, byte for byte).

The corpus is cut into byte ranges at line ends. Each process parses its ranges (the same parser and
errors as `iter_corpus`) into a part: the UTF-8 bytes of its passages' fields and their end offsets
within the part, plus a stable 64-bit hash of every id. The parent then knows each part's place in
`strings.bin`; the processes copy their parts there in parallel (`os.copy_file_range`, a kernel-side
copy), and the parent writes the offsets (each part's shifted by the bytes before it) and, last,
`docstore.json`. Everything is written in a sibling temporary directory renamed at the end, so a
reader never sees a half-built docstore.

Ids must be unique, as `iter_corpus(unique_ids=True)` checks: when two hashes are equal, the corpus is
read once more serially, which raises that function's own error naming both lines (or passes, for a
hash collision). At 21M passages this replaces one process parsing ~15 GB of JSON (about 100k
passages/s on the development box) by `workers` of them.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from sleuth import __version__
from sleuth.data.formats import (
    BLANK_LINE,
    corpus_fingerprint,
    iter_corpus,
    parse_json_line,
    passage_from_record,
)
from sleuth.errors import ConfigError, DataFormatError
from sleuth.retrieval.docstore import DocStore, strings_path, write_offsets_and_meta
from sleuth.retrieval.index import DOCSTORE_KIND, MANIFEST, MANIFEST_VERSION
from sleuth.utils import atomic_write_json, give_normal_permissions

# Ranges per worker: the unit of load balance (a range of long passages costs more than one of short).
RANGES_PER_WORKER = 4


def line_ranges(path: str | Path, parts: int) -> list[tuple[int, int]]:
    """[start, end) byte ranges covering the file, each starting at a line start; at most `parts`."""
    size = Path(path).stat().st_size
    bounds = [0]
    with open(path, "rb") as f:
        for k in range(1, parts):
            target = size * k // parts
            if target <= bounds[-1]:
                continue
            f.seek(target - 1)
            f.readline()  # to the end of the line holding byte target - 1: the next line starts a range
            pos = f.tell()
            if bounds[-1] < pos < size:
                bounds.append(pos)
    bounds.append(size)
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def _stable_hash(text: str) -> int:
    # Python's hash() of a str differs between processes (PYTHONHASHSEED), so ids hashed in different
    # workers are compared through a hash that does not.
    return int.from_bytes(
        hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little", signed=True
    )


def _lines_before(path: str, offset: int) -> int:
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n")


def _parse_range(path: str, start: int, end: int, part_dir: str, k: int) -> dict[str, Any]:
    """Write part k (fields' bytes and their ends within the part); returns its sizes and id hashes."""
    ends: list[int] = []
    hashes: list[int] = []
    pos = 0
    first_line = 1 if start == 0 else 2  # only the file's first line may open with a byte-order mark
    try:
        with open(path, "rb") as f, open(Path(part_dir) / f"part-{k:06d}.bin", "wb") as out:
            f.seek(start)
            at = start
            for local, raw in enumerate(f, start=first_line):
                if at >= end:
                    break
                at += len(raw)
                rec = parse_json_line(path, local, raw, "corpus file")
                if rec is BLANK_LINE:
                    continue
                passage = passage_from_record(path, local, rec)
                for field in (passage.id, passage.title, passage.text):
                    b = field.encode("utf-8")
                    out.write(b)
                    pos += len(b)
                    ends.append(pos)
                hashes.append(_stable_hash(passage.id))
    except DataFormatError as err:
        # Renumber the line from the range's to the file's (counted only now, on the error path).
        # Returned, not raised: DataFormatError does not survive the pickling back to the parent.
        line = None if err.line is None else err.line - first_line + 1 + _lines_before(path, start)
        return {"k": k, "error": (err.path, line, err.message)}
    return {"k": k, "bytes": pos, "ends": np.asarray(ends, np.int64), "hashes": np.asarray(hashes, np.int64)}


def _copy_part(part: str, dest: str, offset: int, nbytes: int) -> None:
    with open(part, "rb") as src, open(dest, "r+b") as dst:
        copied = 0
        while copied < nbytes:
            try:
                n = os.copy_file_range(
                    src.fileno(), dst.fileno(), nbytes - copied, offset_dst=offset + copied
                )
            except (
                AttributeError,
                OSError,
            ):  # no copy_file_range (old kernel, other file systems): plain copy
                src.seek(copied)
                dst.seek(offset + copied)
                shutil.copyfileobj(src, dst, 1 << 24)
                return
            if n == 0:
                raise OSError(f"{part}: copy stopped at {copied} of {nbytes} bytes")
            copied += n


def build_docstore_parallel(corpus: str | Path, directory: str | Path, workers: int) -> DocStore:
    """Write the docstore of `corpus` into `directory` with `workers` processes; returns it opened.

    The files equal `DocStore.build(iter_corpus(corpus, unique_ids=True), directory)`'s; errors too (a bad
    line names the file and line, a repeated id both lines, an empty corpus says so)."""
    corpus, directory = Path(corpus), Path(directory)
    if workers < 1:
        raise ConfigError(f"docstore build: workers must be >= 1, got {workers}")
    if not corpus.is_file():
        raise DataFormatError(str(corpus), None, "corpus file does not exist")
    directory.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.building-"))
    try:
        _build_into(corpus, building, workers)
        give_normal_permissions(building)  # mkdtemp made it 0700
        if directory.exists():
            shutil.rmtree(directory)
        building.rename(directory)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return DocStore(directory)


def _build_into(corpus: Path, out: Path, workers: int) -> None:
    ranges = line_ranges(corpus, workers * RANGES_PER_WORKER)
    parts_dir = out / "parts"
    parts_dir.mkdir()
    ctx = mp.get_context("spawn")  # no fork of a parent that may hold threads
    with ctx.Pool(min(workers, max(1, len(ranges)))) as pool:
        parts = pool.starmap(
            _parse_range, [(str(corpus), a, b, str(parts_dir), k) for k, (a, b) in enumerate(ranges)]
        )
        parts.sort(key=lambda p: p["k"])
        failed = next((p["error"] for p in parts if "error" in p), None)
        if failed is not None:  # the first bad line of the file (ranges are in file order)
            raise DataFormatError(*failed)
        hashes = np.sort(np.concatenate([np.zeros(0, np.int64), *(p["hashes"] for p in parts)]))
        if hashes.size == 0:
            list(iter_corpus(corpus))  # raises iter_corpus' own error for a corpus without passages
        if np.any(hashes[1:] == hashes[:-1]):
            for _ in iter_corpus(corpus, unique_ids=True):  # raises the error naming both lines
                pass
        bases = np.cumsum([0, *(p["bytes"] for p in parts)])
        strings = strings_path(out)
        with open(strings, "wb") as f:
            f.truncate(int(bases[-1]))
        pool.starmap(
            _copy_part,
            [
                (str(parts_dir / f"part-{p['k']:06d}.bin"), str(strings), int(base), p["bytes"])
                for p, base in zip(parts, bases[:-1], strict=True)
            ],
        )
    offsets = np.concatenate(
        [np.zeros(1, np.int64), *(p["ends"] + base for p, base in zip(parts, bases, strict=False))]
    )
    shutil.rmtree(parts_dir)
    write_offsets_and_meta(out, offsets)


def build_docstore_index(corpus: str | Path, out_dir: str | Path, workers: int) -> dict[str, Any]:
    """`out_dir/docstore` (built with `workers` processes) and a manifest of kind "docstore": what a dense
    build's `docstore_from` reads (`sleuth index --kind dense --docstore-from out_dir`) when no BM25 index
    of the corpus is built. The corpus fingerprint (sha256, serial) is hashed in a thread meanwhile
    (hashlib releases the GIL). Returns the manifest."""
    corpus, out_dir = Path(corpus), Path(out_dir)
    t0 = time.perf_counter()
    fingerprint: list[str] = []
    hasher = threading.Thread(target=lambda: fingerprint.append(corpus_fingerprint(corpus)), daemon=True)
    if corpus.is_file():
        hasher.start()
    (out_dir / MANIFEST).unlink(missing_ok=True)  # the manifest, written last, says the directory is complete
    store = build_docstore_parallel(corpus, out_dir / "docstore", workers)
    hasher.join()
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "kind": DOCSTORE_KIND,
        "corpus_path": str(corpus.resolve()),
        "corpus_fingerprint": fingerprint[0],
        "num_docs": store.num_docs,
        "sleuth_version": __version__,
        "docstore_build": {"workers": workers},
        "build_seconds": round(time.perf_counter() - t0, 3),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    atomic_write_json(out_dir / MANIFEST, manifest)
    return manifest
