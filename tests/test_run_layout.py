"""searcher.json as a typed record (sleuth.run_layout.SearcherInfo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sleuth.errors import ConfigError, DataFormatError
from sleuth.run_layout import (
    SEARCHER_FILE,
    SearcherInfo,
    checkpoint_dir,
    latest_checkpoint,
    resolve_checkpoint,
)


def test_searcher_info_round_trip_keeps_provenance_and_step(tmp_path: Path) -> None:
    info = SearcherInfo(
        loop="s3",
        loop_options={"top_k": 3},
        base_model="tiny",
        lora=True,
        recipe="r",
        max_obs_tokens=128,
        step=7,
        extra={"trained_with": "sft", "records": 4},
    )
    info.write(tmp_path)
    data = json.loads((tmp_path / SEARCHER_FILE).read_text())
    assert (
        data["loop"] == "s3"
        and data["trained_with"] == "sft"
        and data["step"] == 7
        and "policy_dir" not in data
    )
    assert SearcherInfo.read(tmp_path) == info


def test_an_export_style_file_reads_its_policy_dir_and_unknown_keys(tmp_path: Path) -> None:
    (tmp_path / SEARCHER_FILE).write_text(
        json.dumps(
            {
                "loop": "search_r1",
                "lora": False,
                "policy_dir": ".",
                "dtype": "float16",
                "loop_config": {"a": 1},
            }
        )
    )
    info = SearcherInfo.read(tmp_path)
    assert (info.policy_dir, info.lora, info.loop_options) == (".", False, {})
    assert info.extra == {"dtype": "float16", "loop_config": {"a": 1}}


@pytest.mark.parametrize("text", ["not json", "[]", '{"lora": true}'])
def test_a_bad_searcher_file_names_the_file(tmp_path: Path, text: str) -> None:
    (tmp_path / SEARCHER_FILE).write_text(text)
    with pytest.raises(DataFormatError, match=SEARCHER_FILE):
        SearcherInfo.read(tmp_path)


def test_a_run_dir_resolves_to_its_newest_complete_checkpoint(tmp_path: Path) -> None:
    for step in (1, 2):
        ckpt = checkpoint_dir(tmp_path, step)
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text("{}")
        SearcherInfo(loop="s3", step=step).write(ckpt)
    checkpoint_dir(tmp_path, 3).mkdir()  # incomplete: no trainer state
    assert latest_checkpoint(tmp_path).name == "step_000002" == resolve_checkpoint(tmp_path).name
    with pytest.raises(ConfigError, match="not a sleuth checkpoint"):
        resolve_checkpoint(tmp_path / "checkpoints" / "step_000003")
