"""The Python API (`sleuth.api`) and its README section: every python block of the section runs, in
order, as a notebook would (on a small synthetic world with the tiny model), and every YAML block
validates against the schema it documents."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

import sleuth.api as sl
from sleuth.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("## Python API", "## Export, trackers, search tools")


def readme_blocks(language: str) -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = []
    for title in SECTIONS:
        start = text.index(title + "\n")
        end = text.find("\n## ", start + len(title))
        body = text[start : end if end != -1 else len(text)]
        blocks += re.findall(rf"```{language}\n(.*?)```", body, flags=re.DOTALL)
    return blocks


@pytest.mark.slow
def test_readme_python_examples_run(small_world: Path, tmp_path: Path, monkeypatch) -> None:
    torch.set_num_threads(1)
    (tmp_path / "runs").mkdir()
    shutil.copytree(small_world, tmp_path / "runs" / "world")
    shutil.copytree(ROOT / "recipes", tmp_path / "recipes")
    monkeypatch.chdir(tmp_path)
    blocks = readme_blocks("python")
    assert len(blocks) == 4
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in blocks:
            exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - our own README

    printed = out.getvalue().splitlines()
    assert printed[0] == "search_r1 2"
    run = namespace["run"]
    assert (
        Path(run["checkpoint"]).name == "step_000001" and (Path(run["checkpoint"]) / "searcher.json").exists()
    )
    summary = json.loads((tmp_path / "runs" / "api_eval" / "summary.json").read_text())
    assert list(summary["methods"]) == ["naive-rag", "search-r1"]
    rows = sl.compare(summary, metrics=["em", "f1", "retrieval_count"])
    assert [str(r) for r in rows] == [line for line in printed if line.startswith("{'method'")]
    assert all(r["n"] == 4 for r in rows) and rows[0]["em"] >= rows[1]["em"]
    result = namespace["result"]  # the searcher's two prints come last (the trainer logs its steps before)
    assert printed[-2:] == [
        str(result["trajectory"]["queries"]),
        str([doc["title"] for doc in result["context"]]),
    ]
    assert result["retrieval_count"] == len(result["trajectory"]["queries"])
    assert result["loop"] == "search_r1"
    assert type(namespace["model"]).__name__ == "Qwen2ForCausalLM"  # the export, loaded by transformers


def test_readme_yaml_examples_validate() -> None:
    from sleuth.rl.config import RetrieverConfig, TrainerConfig

    blocks = [yaml.safe_load(b) for b in readme_blocks("yaml")]
    assert len(blocks) == 3
    trainer = TrainerConfig.model_validate(blocks[0]["trainer"])
    assert trainer.loggers == ["jsonl", "tensorboard", "wandb", "mlflow"] and trainer.wandb.mode == "offline"
    mcp = RetrieverConfig.model_validate(blocks[1]["retriever"]).mcp
    assert mcp.tool == "search" and mcp.response.results == "context"
    http = RetrieverConfig.model_validate(blocks[2]["retriever"]).http
    assert http.response.text == "description" and http.params == {"q": "{query}", "count": "{k}"}


def test_overrides_as_dict_or_strings_are_the_same(tmp_path: Path) -> None:
    path = ROOT / "recipes" / "cpu" / "s3.yaml"
    a = sl.load_recipe(
        path, {"algorithm.n": 3, "agent.options": {"use_selection": False}, "model.policy": "tiny"}
    )
    b = sl.load_recipe(path, ["algorithm.n=3", "agent.options={use_selection: false}", "model.policy=tiny"])
    assert a == b and a.algorithm.n == 3 and a.agent.options == {"use_selection": False}
    c = sl.override(a, {"trainer.total_steps": 7})
    assert c.trainer.total_steps == 7 and a.trainer.total_steps != 7  # a copy; the original is unchanged
    with pytest.raises(ConfigError, match="algorithm.n"):
        sl.override(a, {"algorithm.n": 0})
    with pytest.raises(ConfigError, match="dict or a list"):
        sl.override(a, "algorithm.n=2")


def test_compare_orders_by_the_first_metric_and_names_unknowns() -> None:
    summary = {
        "methods": {
            "a": {"overall": {"n": 2, "em": 0.5, "f1": 0.6}},
            "b": {"overall": {"n": 2, "em": 1.0, "f1": 0.1}},
            "c": {"overall": {"n": 2, "em": None, "f1": 0.9}},
        }
    }
    assert [r["method"] for r in sl.compare(summary, ["em", "f1"])] == ["b", "a", "c"]
    assert [r["method"] for r in sl.compare(summary, ["f1"])] == ["c", "a", "b"]
    assert sl.compare(summary, ["f1"])[0] == {"method": "c", "n": 2, "f1": 0.9}
    with pytest.raises(ConfigError, match="unknown metric.*bleu"):
        sl.compare(summary, ["bleu"])
    with pytest.raises(ConfigError, match="no dataset 'nq'"):
        sl.compare(summary, ["em"], dataset="nq")
