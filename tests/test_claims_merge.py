"""bench/claims_merge.py: a claim's seeds run in two leases, merged into one run whose report pools them all."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sleuth.cli import app

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _merge_module():
    spec = importlib.util.spec_from_file_location("claims_merge", BENCH / "claims_merge.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reproduce(out: Path, *extra: str) -> None:
    argv = ["reproduce", "r_search", "--profile", "cpu", "--out", str(out), *extra]
    result = CliRunner().invoke(app, argv, terminal_width=300)
    assert result.exit_code == 0, result.output


def test_seeds_run_apart_and_merged_report_as_one_run(tmp_path: Path, r_search_cpu_claim: Path) -> None:
    """Seed 1 trained in its own run ("the second lease"), merged into the seed-0 run: the merged run's report pools
    the same seeds with the same per-seed rows, pooled interval and floor as the run that trained both."""
    merge = _merge_module().merge
    both, first = tmp_path / "both", tmp_path / "first"
    shutil.copytree(r_search_cpu_claim, both)
    shutil.copytree(r_search_cpu_claim, first)
    _reproduce(both, "--seeds", "2", "--only-seed", "1")  # trains seed 1 beside the finished seed 0
    copied = merge(both, first, [1])
    assert copied["seeds"] == 2 and "seed1" in copied["folders"] and copied["stages"]
    assert all(name.endswith(".seed1") for name in copied["stages"])
    expected = json.loads((both / "report.json").read_text())["table"]["seeds"]
    shutil.rmtree(both)  # the merged run stands alone: nothing of it is read from where seed 1 was trained
    _reproduce(first)  # every stage recorded: only the report is written
    pooled = [expected, json.loads((first / "report.json").read_text())["table"]["seeds"]]
    assert pooled[0]["seeds"] == pooled[1]["seeds"] == [0, 1]
    assert pooled[0]["tests"] == pooled[1]["tests"]


def test_a_merge_refuses_seeds_of_another_world_or_unfinished(
    tmp_path: Path, r_search_cpu_claim: Path
) -> None:
    merge = _merge_module().merge
    src, dest = tmp_path / "src", tmp_path / "dest"
    shutil.copytree(r_search_cpu_claim, src)
    shutil.copytree(r_search_cpu_claim, dest)
    claim = json.loads((src / "claim.json").read_text())
    (src / "claim.json").write_text(json.dumps({**claim, "seeds": 2}))
    with pytest.raises(SystemExit, match="has not finished"):  # seed 1 never trained in src
        merge(src, dest, [1])
    with pytest.raises(SystemExit, match="first seed"):
        merge(src, dest, [0])
    premise = src / "stages" / "premise.json"  # measured again in another lease: kept from dest, not refused
    checked = json.loads(premise.read_text())
    checked["result"]["note"] = "measured again"
    premise.write_text(json.dumps(checked))
    with pytest.raises(SystemExit, match="has not finished"):
        merge(src, dest, [1])
    world = src / "stages" / "world.json"
    record = json.loads(world.read_text())
    record["result"]["splits"] = {"train": 1}  # another world
    world.write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="shared stages world"):
        merge(src, dest, [1])
