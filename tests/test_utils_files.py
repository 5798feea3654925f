"""sleuth.utils' file helpers shared by checkpoints, corpus fingerprints, docstore links and claim bundles."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from sleuth import utils


def test_sha256_file_equals_hashlib_on_the_whole_bytes(tmp_path: Path) -> None:
    data = bytes(range(256)) * 9000  # > 1 MiB: several read chunks
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert utils.sha256_file(path) == hashlib.sha256(data).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert utils.sha256_file(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()


def test_link_or_copy_links_and_copies_where_no_link_can_be_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(b"abc")
    utils.link_or_copy(src, tmp_path / "linked")
    assert (tmp_path / "linked").stat().st_ino == src.stat().st_ino

    def no_links(*_args: object) -> None:
        raise OSError("EXDEV")

    monkeypatch.setattr(utils.os, "link", no_links)
    utils.link_or_copy(src, tmp_path / "copied")
    assert (tmp_path / "copied").read_bytes() == b"abc"
    assert (tmp_path / "copied").stat().st_ino != src.stat().st_ino
