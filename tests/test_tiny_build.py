"""The tiny test model is built atomically: processes sharing a cache (parallel test workers) never read a half-written
build, and a directory holding something else is refused, never replaced."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sleuth.errors import ConfigError
from sleuth.llm.tiny import STAMP, build_tiny_model

BUILD = "import sys; from sleuth.llm.tiny import build_tiny_model; build_tiny_model(sys.argv[1], seed=3)"


def test_two_processes_building_one_directory_leave_one_whole_build(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(out)]) for _ in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    assert json.loads((out / STAMP).read_text())["seed"] == 3
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left behind
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # loads whole
    assert build_tiny_model(out, seed=3) == out  # reused, not rebuilt


def test_another_spec_replaces_a_tiny_build_but_never_other_files(tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path / "tiny", seed=1)
    build_tiny_model(out, seed=2)
    assert json.loads((out / STAMP).read_text())["seed"] == 2
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not empty and not a tiny model"):
        build_tiny_model(mine)
    assert (mine / "notes.txt").read_text() == "keep me"
