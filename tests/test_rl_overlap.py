"""Issue 43 item 5: `trainer.overlap: one_step` (sleuth.rl.overlap). Step k+1's rollouts come from the weights
step k started with; the generator's recorded log-probs are the ratio's old side (staleness 1, logged)."""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from sleuth.rl.config import recipe_from_dict

PLUGINS = Path(__file__).parent / "plugins"
sys.path.insert(0, str(PLUGINS))  # the test reward plugin

ALGO = {"name": "grpo", "n": 4, "prompts_per_step": 2, "minibatch_size": 8, "micro_batch_size": 8}
# what may differ between two runs computing the same thing: wall times, memory, throughput
NOISY = ("time/", "memory/", "tokens/policy_per_s", "compile", "retrieval", "rss", "trend")


def _recipe(small_world: Path, out_dir: Path, steps: int, overlap: str = "off", **algorithm) -> dict:
    return {
        "name": "test",
        "seed": 0,
        "model": {"policy": "tiny", "dtype": "float64"},
        "data": {"train": str(small_world / "train.jsonl")},
        "retriever": {"index": str(small_world / "bm25")},
        "agent": {
            "loop": "search_r1",
            "max_turns": 1,
            "max_new_tokens_per_turn": 12,
            "max_response_tokens": 96,
            "max_obs_tokens": 32,
        },
        "plugins": ["sleuth_test_rewards"],
        "reward": {"name": "test_token_fraction"},
        "algorithm": {**ALGO, **algorithm},
        "optim": {"lr": 1e-2},
        "trainer": {
            "total_steps": steps,
            "save_every": 1,
            "keep_checkpoints": 5,
            "out_dir": str(out_dir),
            "overlap": overlap,
        },
    }


def _rows(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(out_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """A checkpoint's policy weights: the adapters under LoRA, else the whole model."""
    from safetensors.torch import load_file

    policy = out_dir / "checkpoints" / f"step_{step:06d}" / "policy"
    name = (
        "adapter_model.safetensors"
        if (policy / "adapter_model.safetensors").exists()
        else "model.safetensors"
    )
    return load_file(policy / name)


def _questions(out_dir: Path, step: int) -> list[str]:
    lines = (out_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()
    return [json.loads(line)["question_id"] for line in lines]


def _cursor(out_dir: Path, step: int) -> dict:
    state = json.loads((out_dir / "checkpoints" / f"step_{step:06d}" / "trainer_state.json").read_text())
    return state["cursor"]


def test_overlap_at_staleness_zero_equals_the_synchronous_trainer(small_world: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The overlapped path made to wait for the update before rolling out (staleness 0): 2 steps in float64 give
    the synchronous trainer's losses, metrics, checkpointed data cursor and weights."""
    from sleuth.rl import overlap
    from sleuth.rl.trainer import train

    train(recipe_from_dict(_recipe(small_world, tmp_path / "sync", 2)))
    monkeypatch.setattr(overlap, "WAIT_FOR_UPDATE", True)
    train(recipe_from_dict(_recipe(small_world, tmp_path / "waited", 2, overlap="one_step")))
    sync, waited = _rows(tmp_path / "sync"), _rows(tmp_path / "waited")
    assert [r["rollout/staleness"] for r in waited] == [0.0, 0.0] and "rollout/staleness" not in sync[0]
    assert sync[0]["reward/std"] > 0 and sync[1]["actor/grad_norm"] > 0
    for a, b in zip(sync, waited, strict=True):
        keys = [k for k in a if not any(n in k for n in NOISY)]
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    for step in (1, 2):
        assert _cursor(tmp_path / "sync", step) == _cursor(tmp_path / "waited", step)
        wa, wb = _weights(tmp_path / "sync", step), _weights(tmp_path / "waited", step)
        for k in wa:
            assert torch.equal(wa[k], wb[k]), k


def test_overlap_trains_on_the_pre_update_rollouts_with_their_recorded_logprobs(
        small_world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Staleness 1: step 2 trains on rollouts made from the weights step 1 started with. Their recorded log-probs
    equal a forward of those weights (not of the updated ones), and they are the policy loss's old log-probs."""
    from sleuth.rl import losses, trainer
    from sleuth.rl.batch import forward_logprobs

    seen: dict[str, object] = {}
    real_make_batch, real_get_loss = trainer.make_batch, losses.get_policy_loss

    def make_batch(run, trajs, scores, behaviour=False):
        batch = real_make_batch(run, trajs, scores, behaviour=behaviour)
        if not behaviour:  # step 1: the weights it starts with are the ones that roll out step 2
            seen["w0"] = copy.deepcopy(run.policy.state_dict())
            return batch
        mask = batch.tokens.action_mask != 0
        with torch.no_grad():
            updated, _ = forward_logprobs(run.policy, batch.tokens, run.recipe.sampling.temperature)
            now = copy.deepcopy(run.policy.state_dict())
            run.policy.load_state_dict(seen["w0"])
            before, _ = forward_logprobs(run.policy, batch.tokens, run.recipe.sampling.temperature)
            run.policy.load_state_dict(now)
        seen.update(mask=mask, recorded=batch.old_logprobs.clone(), before=before, updated=updated)
        return batch

    def get_policy_loss(name):
        fn = real_get_loss(name)

        def wrapped(old, logprobs, *args, **kwargs):
            seen.setdefault("old", []).append(old.detach().clone())
            return fn(old, logprobs, *args, **kwargs)

        return wrapped

    monkeypatch.setattr(trainer, "make_batch", make_batch)
    monkeypatch.setattr(losses, "get_policy_loss", get_policy_loss)
    trainer.train(recipe_from_dict(_recipe(small_world, tmp_path / "run", 2, overlap="one_step")))
    rows = _rows(tmp_path / "run")
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0]
    mask, recorded = seen["mask"], seen["recorded"]
    assert mask.sum() > 0
    gap = (recorded - seen["before"])[mask].abs().max().item()
    moved = (seen["updated"] - seen["before"])[mask].abs().max().item()
    assert gap < 1e-5 < moved  # the rollout of step 2 is the pre-update policy's
    assert (recorded - seen["updated"])[mask].abs().max().item() > 1e-5
    old = seen["old"][-1]  # one micro-batch, its rows in the update's shuffled order: the ratio's old side
    assert old.shape == recorded.shape
    assert all(any(torch.equal(row, r) for r in recorded) for row in old)
    assert (
        rows[1]["rollout/logprob_diff_tokens"] == 0.0
    )  # not measured at staleness 1 (no forward of those weights)


def test_overlap_resume_keeps_the_data_cursor(small_world: Path, tmp_path: Path) -> None:
    """3 steps uninterrupted, and the same run resumed after step 1: every step trains the same prompts and every
    checkpoint holds the same data cursor. What differs: the resumed run rolls step 2 out again from step 1's
    checkpoint (staleness 0, new samples), since a checkpoint does not keep the pending rollouts."""
    from sleuth.rl.trainer import train

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train(recipe_from_dict(_recipe(small_world, whole, 3, overlap="one_step")))
    shutil.copytree(whole, resumed)
    for step in (2, 3):
        shutil.rmtree(resumed / "checkpoints" / f"step_{step:06d}")
    (resumed / "checkpoints" / "latest").write_text("step_000001\n")
    data = _recipe(small_world, resumed, 3, overlap="one_step")
    train(recipe_from_dict(data), resume=True)
    a, b = _rows(whole), _rows(resumed)
    assert [r["rollout/staleness"] for r in a] == [0.0, 1.0, 1.0]
    assert [r["rollout/staleness"] for r in b] == [0.0, 0.0, 1.0]
    for step in (1, 2, 3):
        assert sorted(_questions(whole, step)) == sorted(_questions(resumed, step)), step
        assert _cursor(whole, step) == _cursor(resumed, step), step


def test_a_time_limit_stop_with_overlap_saves_the_cursor_before_the_pending_draw(small_world: Path,
                                                                                  tmp_path: Path) -> None:  # fmt: skip
    """Stopped after step 1 with step 2's rollouts already made: the checkpoint's cursor is the one before their
    draw (an uninterrupted run's after step 1), so the resumed run trains the same prompts at step 2."""
    from sleuth.rl.trainer import train

    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    train(recipe_from_dict(_recipe(small_world, whole, 2, overlap="one_step")))
    data = _recipe(small_world, stopped, 2, overlap="one_step")
    data["trainer"].update(time_limit_minutes=1e-6, save_every=1000)  # past the limit after the first step
    result = train(recipe_from_dict(data))
    assert result["steps_done"] == 1 and result["stopped_at_time_limit"]
    assert _cursor(stopped, 1) == _cursor(whole, 1)
    data["trainer"]["time_limit_minutes"] = None
    assert train(recipe_from_dict(data), resume=True)["steps_done"] == 2
    assert sorted(_questions(stopped, 2)) == sorted(_questions(whole, 2))
    assert [r["rollout/staleness"] for r in _rows(stopped)] == [0.0, 0.0]


@pytest.mark.parametrize(
    "algorithm",
    [
        {"minibatch_size": 4, "micro_batch_size": 4, "kl": {"coef": 0.05, "mode": "penalty"}},
        {"name": "ppo", "kl": {"coef": 0.0}},
    ],
    ids=["grpo_two_minibatches_kl_penalty", "ppo_critic"],
)
def test_overlap_runs_with_minibatches_kl_penalty_and_a_critic(small_world: Path, tmp_path: Path,
                                                             algorithm: dict) -> None:  # fmt: skip
    """Smoke: the stale steps' old log-probs (the recorded ones) serve several minibatches, the KL reward penalty
    and PPO's critic; every logged loss is finite."""
    import math

    from sleuth.rl.trainer import train

    train(recipe_from_dict(_recipe(small_world, tmp_path / "run", 2, overlap="one_step", **algorithm)))
    rows = _rows(tmp_path / "run")
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0]
    assert all(math.isfinite(v) for r in rows for k, v in r.items() if k.startswith(("actor/", "critic/")))


@pytest.mark.parametrize(
    "algorithm, why",
    [
        ({"dynamic_sampling": True, "max_sampling_rounds": 2}, "algorithm.dynamic_sampling"),
        ({"ppo_epochs": 2}, "algorithm.ppo_epochs 2"),
    ],
    ids=["dapo_dynamic_sampling", "ppo_epochs"],
)
def test_overlap_is_refused_where_it_cannot_apply(
    small_world: Path, tmp_path: Path, algorithm: dict, why: str
) -> None:
    from sleuth.errors import ConfigError
    from sleuth.rl.trainer import train

    with pytest.raises(ConfigError) as err:
        train(recipe_from_dict(_recipe(small_world, tmp_path / "run", 2, overlap="one_step", **algorithm)))
    assert "\n" not in str(err.value) and why in str(err.value) and "trainer.overlap: off" in str(err.value)
    assert not (tmp_path / "run").exists()  # nothing left behind


def test_overlap_is_refused_on_several_ranks(small_world: Path) -> None:
    from sleuth.errors import ConfigError
    from sleuth.rl.dist import DistContext
    from sleuth.rl.overlap import check_overlap

    recipe = recipe_from_dict(_recipe(small_world, small_world / "unused", 2, overlap="one_step"))
    ctx = DistContext(rank=0, world_size=2)
    with pytest.raises(ConfigError, match="2 ranks"):
        check_overlap(recipe, ctx)
    check_overlap(
        recipe.model_copy(update={"trainer": recipe.trainer.model_copy(update={"overlap": "off"})}), ctx
    )


def test_overlap_reads_yaml_off_and_refuses_other_values(small_world: Path) -> None:
    import yaml

    recipe = _recipe(small_world, small_world / "unused", 2)
    recipe["trainer"].update(yaml.safe_load("overlap: off"))  # YAML 1.1: false
    assert recipe_from_dict(recipe).trainer.overlap == "off"
    recipe["trainer"]["overlap"] = "two_step"
    with pytest.raises(Exception, match="overlap"):
        recipe_from_dict(recipe)


def test_a_service_failure_in_the_next_steps_rollout_checkpoints_this_steps_start(
        small_world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Step 2 rolls step 3 out before its update; a retriever past its retry budget there saves step 1's end (the
    weights and data cursor step 2 started from), as the synchronous trainer does when step 2's own rollout fails."""
    from sleuth.errors import ServiceError
    from sleuth.rl import rollouts
    from sleuth.rl.trainer import train

    train(recipe_from_dict(_recipe(small_world, tmp_path / "one", 1, overlap="one_step")))
    real, calls = rollouts.collect_rollouts, []

    def collect(run):
        calls.append(run.cursor.state())
        if len(calls) == 3:  # step 1's own, step 2's (made in step 1), step 3's (made in step 2): fails
            raise ServiceError("retriever down")
        return real(run)

    monkeypatch.setattr(rollouts, "collect_rollouts", collect)
    data = _recipe(small_world, tmp_path / "run", 3, overlap="one_step")
    data["trainer"]["save_every"] = 1000  # no checkpoint but the failure's
    with pytest.raises(ServiceError, match="checkpoint of step 1 written"):
        train(recipe_from_dict(data))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == ["step_000001"]
    assert _cursor(tmp_path / "run", 1) == _cursor(tmp_path / "one", 1) == calls[1]
    a, b = _weights(tmp_path / "run", 1), _weights(tmp_path / "one", 1)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-12)
