"""Tree-GRPO (plugins/sleuth_tree_grpo.py) trains through `sleuth train` with no edit to sleuth: the trainer rolls
out with the method's own rollout (`Method.rollout`: tree rollouts), and the `tree_grpo` estimator reads the trees
from the batch's trajectories. A reward that depends only on a trajectory's place in its tree makes the trained
batch's advantages known by hand."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

import sleuth.rl.trainer as trainer_module
from plugin_install import installed
from sleuth.agent.trajectory import Trajectory
from sleuth.cli import app
from sleuth.rewards.base import Reward, RewardResult, RewardServices, register_reward

PATTERN = (
    1.0,
    0.0,
    1.0,
    1.0,
)  # reward of samples 0..3 of a question: chains 0, 1 (trees 0, 1), then a branch each
# per question: inter-tree (r - 0.75) / 0.5 = (0.5, -1.5, 0.5, 0.5); intra-tree: tree 0 {1, 1} -> 0,
# tree 1 {0, 1}: (r - 0.5) / 0.7071 -> (-0.7071, +0.7071); A = inter + intra
WANT = (0.5, -1.5 - 2**-0.5, 0.5, 0.5 + 2**-0.5)


@register_reward("test_tree_pattern")
@dataclass
class TreePatternReward(Reward):
    """PATTERN[sample]: the reward of a trajectory is fixed by where it sits in its question's tree."""

    def __call__(
        self, trajs: Sequence[Trajectory], services: RewardServices | None = None
    ) -> list[RewardResult]:
        return [RewardResult(total=PATTERN[t.sample], components={}) for t in trajs]


def test_tree_grpo_trains_two_steps_with_the_hand_computed_advantages(
    small_world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches = []
    real = trainer_module.make_batch

    def recording(run, trajs, scores, behaviour=False):
        batch = real(run, trajs, scores, behaviour)
        batches.append(batch)
        return batch

    monkeypatch.setattr(trainer_module, "make_batch", recording)
    with installed("sleuth_tree_grpo") as tg:
        recipe = tg.recipe(str(small_world / "train.jsonl"))
        recipe["agent"].update(
            max_turns=2,
            top_k=2,
            max_new_tokens_per_turn=8,
            max_response_tokens=96,
            max_obs_tokens=48,
            options={"tree_expansions": 1, "tree_branches": 1},
        )
        recipe.update(
            retriever={"index": str(small_world / "bm25")},
            model={"policy": "tiny"},
            reward={"name": "test_tree_pattern"},
            trainer={"total_steps": 2, "save_every": 2, "out_dir": str(tmp_path / "run")},
        )
        recipe["algorithm"].update(n=2, prompts_per_step=2, minibatch_size=8, micro_batch_size=4)
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe))
        res = CliRunner().invoke(app, ["train", str(path)])
        assert res.exit_code == 0, res.output
        _evaluate_and_serve(tmp_path / "run", small_world, tmp_path / "eval", monkeypatch)
    assert len(batches) == 2
    for batch in batches:
        trajs = batch.trajs
        # an untrained policy writes no action: every chain reaches a turn boundary, so each tree gets its branch
        assert [t.sample for t in trajs] == [0, 1, 2, 3] * 2 and [t.group for t in trajs] == [0] * 4 + [1] * 4
        assert [t.extra["tree"] for t in trajs] == [0, 1, 0, 1] * 2
        assert all(t.extra["forked_at_turn"] == 1 for t in trajs if t.sample >= 2)
        mask = batch.tokens.action_mask.bool()
        for row, t in enumerate(trajs):
            got = batch.advantages[row][mask[row]]
            assert got.numel() > 0
            torch.testing.assert_close(got, torch.full_like(got, WANT[t.sample]), atol=1e-5, rtol=0)
        assert torch.all(batch.advantages[~mask] == 0)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(x)["reward/mean"] == pytest.approx(0.75) for x in lines)


def _evaluate_and_serve(run: Path, small_world: Path, out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trained searcher is evaluated and served like any method: one chain per question."""
    import uvicorn
    from fastapi.testclient import TestClient

    args = [
        "eval",
        "--plugin",
        "sleuth_tree_grpo",
        "-m",
        "tree-search",
        "--data",
        str(small_world / "test.jsonl"),
        "--retriever",
        str(small_world / "bm25"),
        "--model",
        str(run),
        "--out",
        str(out),
        "--limit",
        "2",
        "--batch-size",
        "2",
    ]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    records = [json.loads(r) for r in (out / "tree-search" / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["trajectory"]["method"] == "tree_search" for r in records)
    answers = []

    def serve_in_test_client(asgi, **_kwargs):  # instead of binding a port
        with TestClient(asgi) as client:
            answers.append(client.post("/search", json={"question": "Where was Ada born?"}))

    monkeypatch.setattr(uvicorn, "run", serve_in_test_client)
    res = CliRunner().invoke(
        app,
        [
            "serve-searcher",
            "--plugin",
            "sleuth_tree_grpo",
            "--checkpoint",
            str(run),
            "--index",
            str(small_world / "bm25"),
        ],
    )
    assert res.exit_code == 0, res.output
    (resp,) = answers
    assert resp.status_code == 200, resp.text
    assert resp.json()["loop"] == "tree_search"


def test_the_trainer_keeps_whole_groups_of_any_size_and_a_methods_rollout_on_one_process() -> None:
    from types import SimpleNamespace

    from sleuth.errors import ConfigError
    from sleuth.rl import rollouts

    def trajs(groups):  # (sampling round, question) of each trajectory, adjacent per group
        return [
            Trajectory(
                question_id="q", question="?", golden_answers=[], method="m", group=g, sampling_round=r
            )
            for r, g in groups
        ]

    batch = trajs(
        [(1, 0)] * 6 + [(1, 1)] * 4 + [(2, 0)] * 5
    )  # a tree group of 6, one of 4, a refill round's 5
    assert [rollouts._rows_of_first_groups(batch, k) for k in (0, 1, 2, 3, 4)] == [0, 6, 10, 15, 15]
    assert rollouts._groups(batch) == 3
    with installed("sleuth_tree_grpo") as tg:
        run = SimpleNamespace(
            recipe=SimpleNamespace(agent=SimpleNamespace(loop="tree_search")),
            ctx=SimpleNamespace(enabled=False, world_size=1),
        )
        assert rollouts.method_rollout(run) is tg.tree_rollout
        run.ctx = SimpleNamespace(enabled=True, world_size=2)
        with pytest.raises(ConfigError, match="one process only.*2 ranks"):
            rollouts.method_rollout(run)
    run.recipe.agent.loop = "search_r1"
    assert rollouts.method_rollout(run) is rollouts.rollout  # the engine's, on any number of ranks
