"""A memory-mapped passage store: ids, titles and texts without Python strings per passage.

Layout of a docstore directory (built once by streaming the corpus):

- `strings.bin`   UTF-8 bytes of every passage's id, title and text, back to back
- `offsets.npy`   int64, shape (3 * N + 1,): field j of passage i spans
                  `strings[offsets[3*i + j] : offsets[3*i + j + 1]]` (j = 0 id, 1 title, 2 text)
- `docstore.json` {"num_docs", "format"}

At 21M passages the offsets are ~500 MB on disk and the page cache holds only what
lookups touch. A lookup reads just the requested rows' bytes with positional reads (`os.pread`: one a passage,
or one for a run of consecutive rows), so nothing of the 15 GB strings file stays mapped in the process; where
there is no `pread` it slices a map of the file and lets go of its pages afterwards (`sleuth.retrieval.mapped`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sleuth.data.formats import Passage, iter_corpus
from sleuth.errors import ConfigError, IndexMismatchError
from sleuth.retrieval.base import Hit
from sleuth.retrieval.mapped import MappedFile, pread_full
from sleuth.utils import atomic_write_json

DOCSTORE_FORMAT = "sleuth-docstore-v1"
_FIELDS = 3  # id, title, text


def _offsets_path(d: Path) -> Path:
    return d / "offsets.npy"


def strings_path(d: Path) -> Path:
    return d / "strings.bin"


def write_offsets_and_meta(directory: Path, offsets: np.ndarray) -> None:
    """What follows `strings.bin`: the field end offsets, then (last, so a reader sees a complete docstore)
    docstore.json. Shared by `DocStore.build` and the parallel builder (`docstore_build`)."""
    np.save(_offsets_path(directory), offsets)
    atomic_write_json(
        directory / "docstore.json", {"format": DOCSTORE_FORMAT, "num_docs": (offsets.size - 1) // _FIELDS}
    )


class DocStore:
    """Read-only passage store over memory-mapped files; `get(indices)` returns (id, title, text) rows."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        meta_path = self.directory / "docstore.json"
        if not meta_path.exists():
            raise IndexMismatchError(
                f"{self.directory}: not a docstore (no docstore.json); rebuild the index with `sleuth index`"
            )
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("format") != DOCSTORE_FORMAT:
            raise IndexMismatchError(
                f"{meta_path}: unknown docstore format {meta.get('format')!r} (expected {DOCSTORE_FORMAT!r}); "
                "rebuild the index with `sleuth index`"
            )
        self.num_docs = int(meta["num_docs"])
        self._row_of_id: dict[str, int] | None = None  # built on the first get_by_ids
        self._offsets = np.load(_offsets_path(self.directory), mmap_mode="r")
        if self._offsets.shape != (_FIELDS * self.num_docs + 1,):
            raise IndexMismatchError(
                f"{self.directory}: offsets.npy has shape {self._offsets.shape}, expected "
                f"({_FIELDS * self.num_docs + 1},); the docstore is corrupt, rebuild it with `sleuth index`"
            )
        size = strings_path(self.directory).stat().st_size
        if int(self._offsets[-1]) != size:
            raise IndexMismatchError(
                f"{self.directory}: strings.bin is {size} bytes but offsets end at {int(self._offsets[-1])}; "
                "the docstore is corrupt, rebuild it with `sleuth index`"
            )
        # Positional reads where the system has them: through a map every page fault also maps 15 neighbouring
        # pages (fault-around), which each lookup then had to release (bench/rerank_read_cost.py measures the
        # same for vectors: 4-5x slower). Elsewhere, slices of a map (an np.memmap slice costs ~4 us a field,
        # more than a BM25 search of the passages), released after each lookup. An empty file cannot be
        # mapped; an empty corpus has no bytes to read anyway.
        self._fd = os.open(strings_path(self.directory), os.O_RDONLY) if size and hasattr(os, "pread") else -1
        self._map = MappedFile(strings_path(self.directory)) if size and self._fd < 0 else None
        self._strings = memoryview(self._map.buffer) if self._map is not None else memoryview(b"")

    def __len__(self) -> int:
        return self.num_docs

    def get(self, indices: np.ndarray | Iterable[int]) -> list[tuple[str, str, str]]:
        """(id, title, text) for each row index, in the order given."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size == 0:
            return []
        if idx.min() < 0 or idx.max() >= self.num_docs:
            bad = int(idx[(idx < 0) | (idx >= self.num_docs)][0])
            raise IndexError(f"passage index {bad} out of range for a docstore of {self.num_docs} passages")
        # One fancy-indexing gather for all starts/ends, then each passage's bytes, then one slice per field.
        field_starts = (idx * _FIELDS)[:, None] + np.arange(_FIELDS)[None, :]
        starts = self._offsets[field_starts]
        ends = self._offsets[field_starts + 1]
        contiguous = bool(np.array_equal(starts[1:, 0], ends[:-1, -1]))  # consecutive rows: one read
        records = []
        for (s, e), (blob, base) in zip(
            zip(starts.tolist(), ends.tolist(), strict=True),
            self._spans(starts[:, 0], ends[:, -1], contiguous),
            strict=True,
        ):
            records.append(
                (
                    str(blob[s[0] - base : e[0] - base], "utf-8"),
                    str(blob[s[1] - base : e[1] - base], "utf-8"),
                    str(blob[s[2] - base : e[2] - base], "utf-8"),
                )
            )
        self._release()
        return records

    def ids(self, indices: np.ndarray | Iterable[int]) -> list[str]:
        """Passage ids only (cheaper than `get` when texts are not needed)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_docs):
            raise IndexError(f"passage index out of range for a docstore of {self.num_docs} passages")
        starts = self._offsets[idx * _FIELDS]
        ends = self._offsets[idx * _FIELDS + 1]
        # one read per id (a run of consecutive rows would read their titles and texts too)
        found = [
            str(blob[s - base : e - base], "utf-8")
            for (blob, base), s, e in zip(
                self._spans(starts, ends, False), starts.tolist(), ends.tolist(), strict=True
            )
        ]
        self._release()
        return found

    def _spans(self, first: np.ndarray, last: np.ndarray, contiguous: bool) -> Iterator[tuple[Any, int]]:
        """For each span [first, last) of strings.bin: (a buffer holding it, the buffer's file offset)."""
        if self._fd < 0:  # the map (or an empty store): every span is in one buffer at offset 0
            for _ in range(len(first)):
                yield self._strings, 0
        elif contiguous and len(first) > 1:
            start = int(first[0])
            blob = memoryview(self._pread(int(last[-1]) - start, start))
            for _ in range(len(first)):
                yield blob, start
        else:
            for begin, end in zip(first.tolist(), last.tolist(), strict=True):
                yield self._pread(end - begin, begin), begin

    def _pread(self, size: int, offset: int) -> bytes:
        data = pread_full(self._fd, size, offset)
        if len(data) < size:
            raise IndexMismatchError(
                f"{strings_path(self.directory)}: bytes {offset + len(data)}-{offset + size} "
                "are missing (the file is shorter than the offsets say); the docstore is "
                "corrupt, rebuild it with `sleuth index`"
            )
        return data

    def _release(self) -> None:
        if self._map is not None:
            self._map.release()

    def __del__(self) -> None:
        with contextlib.suppress(AttributeError, OSError):  # a half-built store, or interpreter shutdown
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def rows(self, doc_ids: Sequence[str]) -> list[int | None]:
        """Row index of each passage id, in the order given; None for an id the store lacks.

        The first call reads every id once to build an id -> row map: instant for a synthetic
        world, tens of seconds and a few GB of memory for 21M Wikipedia passages."""
        if self._row_of_id is None:
            row_of_id: dict[str, int] = {}
            for start in range(0, self.num_docs, 1 << 16):
                stop = min(start + (1 << 16), self.num_docs)
                row_of_id.update(zip(self.ids(np.arange(start, stop)), range(start, stop), strict=True))
            self._row_of_id = row_of_id
        return [self._row_of_id.get(str(d)) for d in doc_ids]

    def get_by_ids(self, doc_ids: Sequence[str]) -> list[Hit | None]:
        """Passages by id, in the order given (score 0.0); None for an id the store lacks (see `rows`)."""
        rows = self.rows(doc_ids)
        found = self.get([r for r in rows if r is not None])
        passages = iter(Hit(doc_id=i, title=t, text=x, score=0.0) for i, t, x in found)
        return [None if r is None else next(passages) for r in rows]

    def iter_batches(self, batch_size: int = 1024) -> Iterator[list[tuple[str, str, str]]]:
        """All passages in row order, `batch_size` at a time (for encoding a corpus)."""
        for start in range(0, self.num_docs, batch_size):
            yield self.get(np.arange(start, min(start + batch_size, self.num_docs)))

    @staticmethod
    def build(
        passages: Iterable[Passage],
        directory: str | Path,
    ) -> DocStore:
        """Write a docstore from a passage stream; holds only the offsets in memory (8 bytes x 3 per passage)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        offsets = [0]
        pos = 0
        # Offsets accumulate in a growable int64 array chunk by chunk to avoid a 21M-element Python list.
        chunks: list[np.ndarray] = []
        pending: list[int] = []
        with open(strings_path(directory), "wb") as out:
            for p in passages:
                for field in (p.id, p.title, p.text):
                    b = field.encode("utf-8")
                    out.write(b)
                    pos += len(b)
                    pending.append(pos)
                if len(pending) >= 1 << 20:
                    chunks.append(np.asarray(pending, dtype=np.int64))
                    pending = []
        chunks.append(np.asarray(pending, dtype=np.int64))
        write_offsets_and_meta(directory, np.concatenate([np.asarray(offsets, dtype=np.int64), *chunks]))
        return DocStore(directory)

    @staticmethod
    def build_from_corpus(corpus_path: str | Path, directory: str | Path) -> DocStore:
        return DocStore.build(iter_corpus(corpus_path, unique_ids=True), directory)


def passages_by_id(retriever: Any, doc_ids: Sequence[str]) -> list[Hit | None]:
    """Passages by id from a retriever's own store: its `get_by_ids`, its `docstore`, or (hybrid) the
    first of its `retrievers` that has one. A retrieval server cannot look passages up by id."""
    if hasattr(retriever, "get_by_ids"):
        return list(retriever.get_by_ids(list(doc_ids)))
    store = getattr(retriever, "docstore", None)
    if isinstance(store, DocStore):
        return store.get_by_ids(doc_ids)
    for inner in getattr(retriever, "retrievers", None) or []:
        try:
            return passages_by_id(inner, doc_ids)
        except ConfigError:
            continue
    raise ConfigError(
        f"{type(retriever).__name__} cannot fetch passages by id; pass a local index directory "
        "(built with `sleuth index`) as --retriever"
    )
