"""`sleuth.retrieval.mapped`: read-only maps whose pages a server lets go of after each read, and row files read
with positional reads that map nothing."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from sleuth.data.formats import Passage
from sleuth.errors import IndexMismatchError
from sleuth.retrieval import mapped
from sleuth.retrieval.docstore import DocStore
from sleuth.retrieval.mapped import MappedFile, RowFile

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


def rss_file_kib() -> int:
    """This process's resident pages of mapped files (kB), as the kernel counts them."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile line in /proc/self/status")


def test_release_unmaps_the_pages_read_and_keeps_the_data(tmp_path):
    path = tmp_path / "vectors.f16"
    data = np.arange(16 * 1024 * 1024, dtype=np.float16).reshape(-1, 64)  # 32 MiB
    data.tofile(path)
    mapped = MappedFile(path)
    array = mapped.array(np.float16, data.shape)
    rows = np.arange(0, len(data), 7)  # every 7th row: touches every page of the file
    before = rss_file_kib()
    first = array[rows].astype(np.float32).sum()
    touched = rss_file_kib() - before
    assert touched > 16 * 1024  # more than half of the 32 MiB now counts as this process's
    mapped.release()
    assert rss_file_kib() - before < touched / 8  # let go of (the page cache may still hold them)
    assert array[rows].astype(np.float32).sum() == first == data[rows].astype(np.float32).sum()


def test_docstore_lookups_leave_no_pages_of_the_strings_mapped(tmp_path):
    """A server's passage lookups touch the strings file all over; afterwards none of it counts as resident."""
    passages = [
        Passage(id=f"p{i}", title=f"title {i}", text=f"passage {i} " + "x" * 2000) for i in range(12000)
    ]
    store = DocStore.build(passages, tmp_path / "docstore")  # ~24 MB of strings
    before = rss_file_kib()
    rows = np.arange(0, len(passages), 3)
    got = store.get(rows)
    assert [g[0] for g in got[:3]] == ["p0", "p3", "p6"] and got[1][2] == passages[3].text
    assert store.ids([11999]) == ["p11999"]
    assert rss_file_kib() - before < 2 * 1024  # the ~24 MB read are not this process's any more


def _vectors(tmp_path, rows=40_000, dim=48):
    data = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float16)
    path = tmp_path / "vectors.f16"
    data.tofile(path)
    return path, data


@pytest.mark.parametrize("compiled", [True, False])
def test_row_file_reads_the_rows_numpy_reads(tmp_path, monkeypatch, compiled):
    """Against numpy's own indexing of the file: any order, repeats, a 2-D id block, negative ids, slices."""
    path, data = _vectors(tmp_path)
    if not compiled:  # the pure-Python path (no libc pread for numba)
        monkeypatch.setattr(mapped, "_gather_kernel", None)
        monkeypatch.setattr(mapped, "_PREAD", None)
    rows = RowFile(path, "float16", data.shape)
    assert (rows._kernel is not None) == compiled and len(rows) == 40_000 and rows.shape == (40_000, 48)
    ids = np.random.default_rng(1).integers(0, len(data), size=(16, 64))
    np.testing.assert_array_equal(rows[ids], data[ids])
    np.testing.assert_array_equal(rows[np.array([5, 5, 39_999, 0])], data[[5, 5, 39_999, 0]])
    np.testing.assert_array_equal(rows[np.array([-1, -40_000])], data[[-1, -40_000]])
    np.testing.assert_array_equal(rows[7], data[7])
    np.testing.assert_array_equal(rows[10:20:3], data[10:20:3])
    assert rows[np.array([], dtype=np.int64)].shape == (0, 48)


@pytest.mark.parametrize("compiled", [True, False])
def test_row_file_says_what_is_wrong(tmp_path, monkeypatch, compiled):
    path, data = _vectors(tmp_path, rows=100)
    if not compiled:  # the pure-Python path reports a file cut short the same way
        monkeypatch.setattr(mapped, "_gather_kernel", None)
        monkeypatch.setattr(mapped, "_PREAD", None)
    with pytest.raises(ValueError, match=r"vectors.f16: 9600 bytes, expected 9696"):
        RowFile(path, "float16", (101, 48))
    rows = RowFile(path, "float16", data.shape)
    with pytest.raises(IndexError, match=r"row ids must lie in \[0, 100\)"):
        rows[np.array([3, 100])]
    with pytest.raises(TypeError, match="integer ids"):
        rows[np.array([0.5])]
    os.truncate(path, 50 * 96)  # the file shrank under the reader
    with pytest.raises(OSError, match="could not read row 60"):
        rows[np.array([1, 60])]


def test_row_file_reads_map_nothing(tmp_path):
    """Reading every page's rows leaves this process's mapped-file pages as they were (a map would hold them)."""
    path, data = _vectors(tmp_path, rows=400_000, dim=32)  # 25 MiB
    rows = RowFile(path, "float16", data.shape)
    rows[np.arange(0, 1000, 7)]  # the kernel compiled and loaded before measuring
    before = rss_file_kib()
    got = rows[np.arange(0, len(data), 11)]
    assert rss_file_kib() - before < 2 * 1024
    np.testing.assert_array_equal(got, data[::11])


@pytest.mark.parametrize("positional", [True, False])
def test_docstore_reads_the_same_passages_with_or_without_pread(tmp_path, monkeypatch, positional):
    """Lookups in any order, repeated rows, runs of consecutive rows (one read) and ids alone return the passages
    written, non-ASCII and empty fields included, through pread and through the map fallback."""
    if not positional:
        monkeypatch.delattr(os, "pread")
    passages = [
        Passage(id=f"p{i}", title="" if i % 5 == 0 else f"tïtle {i}", text=f"passage {i} " + "ü" * (i % 7))
        for i in range(3000)
    ]
    DocStore.build(passages, tmp_path / "docstore")
    store = DocStore(tmp_path / "docstore")
    assert (store._fd >= 0) == positional
    want = [(p.id, p.title, p.text) for p in passages]
    rows = np.random.default_rng(0).integers(0, len(passages), 400)
    assert store.get(rows) == [want[r] for r in rows]
    assert store.get(np.arange(1000, 1400)) == want[1000:1400]  # consecutive: one read on the pread path
    assert store.get([7, 7, 2999, 0]) == [want[7], want[7], want[2999], want[0]]
    assert store.get([5]) == [want[5]] and store.get([]) == []
    assert store.ids(rows) == [want[r][0] for r in rows]
    assert [b for b, _ in zip(store.iter_batches(512), range(100), strict=False)][-1] == want[2560:]


def test_docstore_says_when_its_strings_file_is_cut_short(tmp_path):
    passages = [Passage(id=f"p{i}", title="t", text="x" * 100) for i in range(50)]
    DocStore.build(passages, tmp_path / "docstore")
    store = DocStore(tmp_path / "docstore")
    os.truncate(tmp_path / "docstore" / "strings.bin", 1000)  # cut after the store was opened
    assert store.get([2])[0][0] == "p2"
    with pytest.raises(IndexMismatchError, match="strings.bin: bytes 4150-4254 are missing"):
        store.get([40])
