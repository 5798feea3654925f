"""`sleuth.retrieval.mapped`: read-only maps whose pages a server lets go of after each read."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from sleuth.data.formats import Passage
from sleuth.retrieval.docstore import DocStore
from sleuth.retrieval.mapped import MappedFile

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
    passages = [Passage(id=f"p{i}", title=f"title {i}", text=f"passage {i} " + "x" * 2000) for i in range(12000)]
    store = DocStore.build(passages, tmp_path / "docstore")  # ~24 MB of strings
    before = rss_file_kib()
    rows = np.arange(0, len(passages), 3)
    got = store.get(rows)
    assert [g[0] for g in got[:3]] == ["p0", "p3", "p6"] and got[1][2] == passages[3].text
    assert store.ids([11999]) == ["p11999"]
    assert rss_file_kib() - before < 2 * 1024  # the ~24 MB read are not this process's any more
