"""The trainer end to end on CPU: it learns a learnable task under GRPO and PPO, and resumes after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sleuth.rl.config import recipe_from_dict

PLUGINS = Path(__file__).parent / "plugins"
sys.path.insert(0, str(PLUGINS))  # the in-process runs import the test reward plugin too


def _recipe(small_world: Path, out_dir: Path, algorithm: dict, steps: int, **extra) -> dict:
    return {
        "name": "test",
        "seed": 0,
        "model": {"policy": "tiny"},
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
        "algorithm": algorithm,
        "optim": {"lr": 1e-2, "critic_lr": 1e-2},
        "trainer": {"total_steps": steps, "save_every": 1000, "out_dir": str(out_dir)},
        **extra,
    }


def _rewards(out_dir: Path) -> list[float]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["reward/mean"] for line in lines]


@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "grpo", "n": 4, "prompts_per_step": 2, "minibatch_size": 8, "micro_batch_size": 8},
        {
            "name": "ppo",
            "n": 2,
            "prompts_per_step": 4,
            "minibatch_size": 8,
            "micro_batch_size": 8,
            "kl": {"coef": 0.0},
        },
    ],
    ids=["grpo", "ppo"],
)
def test_mean_reward_rises(small_world: Path, tmp_path: Path, algorithm: dict) -> None:
    from sleuth.rl.trainer import train

    torch.set_num_threads(1)
    recipe = recipe_from_dict(_recipe(small_world, tmp_path / "run", algorithm, steps=24))
    train(recipe)
    rewards = _rewards(tmp_path / "run")
    assert len(rewards) == 24
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    # A random policy scores ~0.25; the margin is several times the step-to-step noise; seeds 1-3 gave +0.31 to +0.71 (GRPO) and +0.62 to +0.71 (PPO).
    assert first < 0.45
    assert last > first + 0.2, rewards


def test_resume_after_sigkill(small_world: Path, tmp_path: Path) -> None:
    """Kill a run mid-way with SIGKILL; --resume finishes it with every step logged exactly once
    and ends at the same weights as an uninterrupted run."""
    import yaml

    algorithm = {"name": "grpo", "n": 2, "prompts_per_step": 2, "minibatch_size": 4, "micro_batch_size": 4}
    steps = 6
    killed_dir, clean_dir = tmp_path / "killed", tmp_path / "clean"
    for out in (killed_dir, clean_dir):
        data = _recipe(small_world, out, algorithm, steps)
        data["reward"] = {"name": "search_r1_em"}
        data["trainer"]["save_every"] = 1
        (out.parent / f"{out.name}.yaml").write_text(yaml.safe_dump(data))

    # the plugins beside any PYTHONPATH already set (a checkout run with PYTHONPATH=src imports its own sleuth)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(PLUGINS), os.environ.get("PYTHONPATH")) if p),
    }
    cmd = [sys.executable, "-m", "sleuth.cli", "train"]
    proc = subprocess.Popen(
        [*cmd, str(tmp_path / "killed.yaml")], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 300
    while not (killed_dir / "checkpoints" / "step_000003").exists():
        assert proc.poll() is None, "training exited before it could be killed"
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    subprocess.run(
        [*cmd, str(tmp_path / "killed.yaml"), "--resume"], env=env, check=True, capture_output=True
    )
    subprocess.run([*cmd, str(tmp_path / "clean.yaml")], env=env, check=True, capture_output=True)

    steps_logged = [
        json.loads(line)["step"] for line in (killed_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps_logged == list(range(1, steps + 1))
    state = json.loads((killed_dir / "checkpoints" / "step_000006" / "trainer_state.json").read_text())
    assert state["step"] == steps

    from safetensors.torch import load_file

    a = load_file(killed_dir / "checkpoints" / "step_000006" / "policy" / "model.safetensors")
    b = load_file(clean_dir / "checkpoints" / "step_000006" / "policy" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=f"weights differ after resume at {k}")


def test_reference_model_is_the_starting_model_after_resume(small_world: Path, tmp_path: Path) -> None:
    """With full fine-tuning and a KL term, a resumed run must compare against the model it started
    from, not against the resumed (already trained) weights."""
    from sleuth.rl.trainer import train

    data = _recipe(
        small_world,
        tmp_path / "run",
        {
            "name": "grpo",
            "n": 2,
            "prompts_per_step": 2,
            "minibatch_size": 4,
            "micro_batch_size": 4,
            "kl": {"coef": 0.1, "mode": "loss"},
        },
        steps=2,
    )
    data["trainer"]["save_every"] = 1
    train(recipe_from_dict(data))
    data["trainer"]["total_steps"] = 3
    train(recipe_from_dict(data), resume=True)
    kl = [json.loads(x)["actor/kl"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(kl) == 3
    # after two updates at lr 1e-2 the policy has moved: the KL to the starting model is clearly > 0
    assert kl[2] > 1e-3, kl


def test_save_every_zero_writes_no_checkpoint(small_world: Path, tmp_path: Path) -> None:
    from sleuth.rl.checkpoint import latest_checkpoint
    from sleuth.rl.trainer import train

    algorithm = {"name": "grpo", "n": 2, "prompts_per_step": 1, "minibatch_size": 2, "micro_batch_size": 2}
    data = _recipe(small_world, tmp_path / "run", algorithm, steps=2)
    data["trainer"]["save_every"] = 0
    result = train(recipe_from_dict(data))
    assert len(_rewards(tmp_path / "run")) == 2
    assert result["checkpoint"] is None and latest_checkpoint(tmp_path / "run") is None


def test_nonfinite_gradient_skips_the_update(
    small_world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NaN gradient must not reach the optimizer: that step is skipped and counted, the weights
    stay finite and later steps update as usual."""
    import sleuth.rl.run as run_mod
    import sleuth.rl.trainer as trainer_mod

    real_load = run_mod.load_policy
    poisoned = {"calls": 0}

    def load_with_one_nan_gradient(*args, **kwargs):
        tokenizer, model, path = real_load(*args, **kwargs)
        param = next(p for p in model.parameters() if p.requires_grad)

        def hook(grad: torch.Tensor) -> torch.Tensor:
            poisoned["calls"] += 1
            return grad * float("nan") if poisoned["calls"] == 1 else grad

        param.register_hook(hook)
        return tokenizer, model, path

    monkeypatch.setattr(run_mod, "load_policy", load_with_one_nan_gradient)
    algorithm = {"name": "grpo", "n": 4, "prompts_per_step": 2, "minibatch_size": 8, "micro_batch_size": 8}
    data = _recipe(small_world, tmp_path / "run", algorithm, steps=3)
    data["trainer"]["save_every"] = 3
    trainer_mod.train(recipe_from_dict(data))
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["actor/skipped_nonfinite_grad"] for m in metrics] == [1.0, 0.0, 0.0]
    assert "actor/grad_norm" not in metrics[0] and metrics[1]["actor/grad_norm"] > 0
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "run" / "checkpoints" / "step_000003" / "policy" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    # the offending minibatch is kept for offline reproduction (plain tensors: loads with weights_only)
    saved = torch.load(tmp_path / "run" / "debug" / "nonfinite_step_000001_rank0.pt", weights_only=True)
    assert saved["batch"]["input_ids"].shape[0] == 8 and saved["advantages"].shape[0] == 8
    assert saved["nonfinite_parameters"]


def test_clip_ratio_c_reaches_the_policy_loss(
    small_world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recipe `algorithm.clip_ratio_c` (verl's dual-clip constant) is what every policy-loss call gets."""
    from sleuth.rl import losses
    from sleuth.rl.trainer import train

    seen: list[float | None] = []
    real_policy_loss = losses.policy_loss

    def recording_policy_loss(*args, **kwargs):
        seen.append(kwargs["clip"].dual_clip_c)
        return real_policy_loss(*args, **kwargs)

    # the trainer calls the recipe's policy loss through the registry
    monkeypatch.setitem(losses.POLICY_LOSSES, "ppo_clip", recording_policy_loss)
    algorithm = {
        "name": "grpo",
        "n": 2,
        "prompts_per_step": 1,
        "minibatch_size": 2,
        "micro_batch_size": 2,
        "clip_ratio_c": 3.0,
    }
    train(recipe_from_dict(_recipe(small_world, tmp_path / "run", algorithm, steps=1)))
    assert seen and set(seen) == {3.0}


def test_time_limit_stops_after_a_step_with_a_checkpoint_and_resume_continues(
    small_world: Path, tmp_path: Path
) -> None:
    from sleuth.rl.checkpoint import latest_checkpoint
    from sleuth.rl.trainer import train

    algorithm = {"name": "grpo", "n": 2, "prompts_per_step": 1, "minibatch_size": 2, "micro_batch_size": 2}
    data = _recipe(small_world, tmp_path / "run", algorithm, steps=4)
    data["trainer"]["time_limit_minutes"] = 1e-6  # past the limit after the first step
    data["data"]["dev"] = str(small_world / "dev.jsonl")
    data["trainer"].update(eval_every=2, eval_examples=2)
    result = train(recipe_from_dict(data))
    assert result["steps_done"] == 1 and result["stopped_at_time_limit"]
    assert len(_rewards(tmp_path / "run")) == 1
    assert latest_checkpoint(tmp_path / "run").name.endswith("1")  # saved although save_every is 1000
    assert sorted(_validation(tmp_path / "run")) == [0, 1]  # the stop closes the validation series
    data["trainer"]["time_limit_minutes"] = None
    result = train(recipe_from_dict(data), resume=True)
    assert result["steps_done"] == 4 and not result["stopped_at_time_limit"]
    assert [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
        4,
    ]
    assert sorted(_validation(tmp_path / "run")) == [0, 1, 2, 4]


def test_every_step_logs_memory(small_world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory is in every step's metrics: host peak RSS always, and on a GPU the card's memory in use
    and PyTorch's peak (checked with a stand-in for the CUDA queries)."""
    from sleuth.rl import step_metrics
    from sleuth.rl.trainer import train

    algorithm = {"name": "grpo", "n": 2, "prompts_per_step": 1, "minibatch_size": 2, "micro_batch_size": 2}
    train(recipe_from_dict(_recipe(small_world, tmp_path / "run", algorithm, steps=2)))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(0.01 < r["memory/host_peak_rss_gib"] < 1024 for r in rows)

    monkeypatch.setattr(step_metrics.torch.cuda, "mem_get_info", lambda device: (30 * 2**30, 80 * 2**30))
    monkeypatch.setattr(step_metrics.torch.cuda, "max_memory_allocated", lambda device: 12 * 2**29)
    gpu = step_metrics.memory_metrics(torch.device("cuda"))
    assert gpu["memory/device_in_use_gib"] == 50.0 and gpu["memory/peak_allocated_gib"] == 6.0


def _validation(out_dir: Path) -> dict[int, dict]:
    lines = (out_dir / "validation.jsonl").read_text().splitlines()
    return {json.loads(line)["step"]: json.loads(line) for line in lines}


def test_validation_scores_the_same_dev_questions_before_during_and_after(
    small_world: Path, tmp_path: Path
) -> None:
    """Validation on data.dev at steps 0, 2 and 4: each logs the mean of its question-by-question rewards, the
    last equals an independent greedy rollout of the final checkpoint scored by the reward itself, and it rose."""
    from sleuth_test_rewards import TokenFractionReward

    from sleuth.agent.engine import RolloutBudget, rollout
    from sleuth.agent.searcher import load_searcher
    from sleuth.data.formats import load_qa
    from sleuth.llm.base import SamplingParams
    from sleuth.retrieval import load_retriever
    from sleuth.rl.trainer import train

    torch.set_num_threads(1)
    algorithm = {"name": "grpo", "n": 4, "prompts_per_step": 2, "minibatch_size": 8, "micro_batch_size": 8}
    data = _recipe(small_world, tmp_path / "run", algorithm, steps=4)
    data["data"]["dev"] = str(small_world / "dev.jsonl")
    data["reward"]["options"] = {"mode": "residue"}  # greedy trajectories of a tiny model differ under it
    data["trainer"].update(eval_every=2, eval_examples=5, save_every=4)
    train(recipe_from_dict(data))

    logged = _validation(tmp_path / "run")
    assert sorted(logged) == [0, 2, 4]
    dev = load_qa(small_world / "dev.jsonl")[:5]
    for step, row in logged.items():
        records = [
            json.loads(line) for line in (tmp_path / "run" / "validation" / f"step_{step:06d}.jsonl").open()
        ]
        assert [r["id"] for r in records] == [q.id for q in dev]
        assert row["val/examples"] == 5
        assert row["val/reward/mean"] == pytest.approx(sum(r["reward"] for r in records) / 5)
        assert row["val/reward/residue"] == pytest.approx(row["val/reward/mean"])
    assert (
        len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 4
    )  # one line per training step

    searcher = load_searcher(tmp_path / "run" / "checkpoints" / "step_000004", device="cpu")
    trajs = rollout(
        searcher.loop,
        searcher.generator,
        load_retriever(small_world / "bm25"),
        dev,
        SamplingParams(max_new_tokens=12, temperature=0.0),
        budget=RolloutBudget(32, 96),
    )
    expected = [r.total for r in TokenFractionReward(mode="residue")(trajs)]
    final = [
        json.loads(line)["reward"] for line in (tmp_path / "run" / "validation" / "step_000004.jsonl").open()
    ]
    assert final == pytest.approx(expected, abs=1e-6)
    # the policy changed what validation measures (so the check above tells the final weights from the first),
    # and in the direction the reward trains it: seed 0 gives 0.667 before training, 1.0 after
    assert logged[4]["val/reward/mean"] > logged[0]["val/reward/mean"] + 0.1


def test_resume_redoes_a_validation_the_stop_missed(small_world: Path, tmp_path: Path) -> None:
    from sleuth.rl.trainer import train

    torch.set_num_threads(1)
    algorithm = {"name": "grpo", "n": 2, "prompts_per_step": 2, "minibatch_size": 4, "micro_batch_size": 4}
    data = _recipe(small_world, tmp_path / "run", algorithm, steps=4)
    data["data"]["dev"] = str(small_world / "dev.jsonl")
    data["trainer"].update(eval_every=2, eval_examples=3, save_every=2, keep_checkpoints=3)
    train(recipe_from_dict(data))
    run = tmp_path / "run"
    # as if stopped right after step 2's checkpoint: steps 3-4 and step 2's validation never happened
    lines = (run / "validation.jsonl").read_text().splitlines()
    (run / "validation.jsonl").write_text(lines[0] + "\n")
    import shutil

    shutil.rmtree(run / "checkpoints" / "step_000004")
    (run / "checkpoints" / "latest").write_text("step_000002")
    train(recipe_from_dict(data), resume=True)
    steps = [json.loads(line)["step"] for line in (run / "validation.jsonl").read_text().splitlines()]
    assert steps == [0, 2, 4]

    train(recipe_from_dict({**data, "trainer": {**data["trainer"], "out_dir": str(tmp_path / "fresh")}}))
    (tmp_path / "again").mkdir()
    shutil.copy(run / "validation.jsonl", tmp_path / "again" / "validation.jsonl")  # an earlier run's rows
    train(recipe_from_dict({**data, "trainer": {**data["trainer"], "out_dir": str(tmp_path / "again")}}))
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "again" / "validation.jsonl").read_text().splitlines()
    ]
    assert steps == [0, 2, 4]  # a fresh run validates anew, it does not keep another run's rows


def test_eval_every_without_dev_questions_is_refused(small_world: Path, tmp_path: Path) -> None:
    from sleuth.errors import ConfigError

    algorithm = {"name": "grpo", "n": 2, "prompts_per_step": 2, "minibatch_size": 4, "micro_batch_size": 4}
    data = _recipe(small_world, tmp_path / "run", algorithm, steps=2)
    data["trainer"]["eval_every"] = 1
    with pytest.raises(ConfigError, match=r"trainer\.eval_every=1.*data\.dev"):
        recipe_from_dict(data)


def test_validation_scores_with_the_reward_the_next_step_trains_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A two-stage reward (stage 2 from trainer step index 10): the validation after 10 updates already scores
    with stage 2's reward, so stage 2 has a first and a last validation to pair; the one before training with
    stage 1's; the one after the last step with the last step's."""
    from types import SimpleNamespace

    from sleuth.agent.trajectory import Trajectory
    from sleuth.data.formats import QAExample
    from sleuth.llm.base import SamplingParams
    from sleuth.retrieval.timed import TimedRetriever
    from sleuth.rewards.base import RewardResult
    from sleuth.rl import validate as validation
    from sleuth.rl.dist import DistContext

    class TwoStage:
        name = "two_stage"
        step = None

        def set_step(self, step: int) -> None:
            self.step = step

        @property
        def current_stage(self) -> int:
            return 1 if self.step < 10 else 2

        def __call__(self, trajs, services=None):
            return [
                RewardResult(float(self.current_stage), {"stage_seen": float(self.current_stage)})
                for _ in trajs
            ]

    def fake_rollout(loop, generator, retriever, examples, params, n=1, *, budget=None, tokenizer=None):
        assert params.temperature == 0.0 and n == 1  # greedy, one answer per question
        return [
            Trajectory(
                question_id=e.id, question=e.question, golden_answers=e.golden_answers, method="x", answer="a"
            )
            for e in examples
        ]

    monkeypatch.setattr(validation, "rollout", fake_rollout)
    logged: dict[int, dict] = {}
    run = SimpleNamespace(
        ctx=DistContext(),
        val_examples=[QAExample(f"q{i}", f"question {i}", ["a"]) for i in range(3)],
        sampling=SamplingParams(temperature=1.0),
        policy=torch.nn.Linear(1, 1),
        loop=None,
        generator=None,
        retriever=TimedRetriever(None),
        reward_fn=TwoStage(),
        services=None,
        out_dir=tmp_path,
        console=SimpleNamespace(print=print),
        recipe=SimpleNamespace(
            trainer=SimpleNamespace(total_steps=20),
            agent=SimpleNamespace(max_obs_tokens=8, max_response_tokens=16),
        ),
        log=SimpleNamespace(write_validation=lambda step, metrics: logged.__setitem__(step, metrics)),
    )
    stages = {done: validation.validate(run, done)["val/stage"] for done in (0, 9, 10, 20)}
    assert stages == {0: 1.0, 9: 1.0, 10: 2.0, 20: 2.0}
    assert logged[10]["val/reward/mean"] == 2.0 and logged[10]["val/reward/stage_seen"] == 2.0
    assert (tmp_path / "validation" / "step_000010.jsonl").read_text().count("\n") == 3


def test_a_lora_adapter_from_another_machine_names_the_base_loaded_here(
    tmp_path: Path, small_world: Path
) -> None:
    """A committed adapter names its base by the training machine's path; loading it to train on (and saving
    again) uses and records the base found here, so peft does not warn that the base config is missing."""
    import warnings

    from sleuth.rl.models import load_policy

    algorithm = {"name": "grpo", "n": 2, "prompts_per_step": 1, "minibatch_size": 2, "micro_batch_size": 2}
    recipe = recipe_from_dict(
        _recipe(
            small_world,
            tmp_path / "run",
            algorithm,
            steps=1,
            model={"policy": "tiny", "lora": {"enabled": True, "r": 2, "alpha": 4}},
        )
    )
    _, model, base_path = load_policy(recipe, torch.device("cpu"))
    model.save_pretrained(tmp_path / "adapter")
    config_file = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = (
        "/gpu-box/models/gone"  # as in checkpoints/*/policy/adapter_config.json
    )
    config_file.write_text(json.dumps(config))

    _, model, _ = load_policy(recipe, torch.device("cpu"), adapter_dir=tmp_path / "adapter")
    assert model.peft_config["default"].base_model_name_or_path == str(base_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.save_pretrained(tmp_path / "again")
    assert not [w for w in caught if "Could not find a config file" in str(w.message)]
    assert json.loads((tmp_path / "again" / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ] == str(base_path)


def test_steps_report_the_rollouts_retrieval_time(
    small_world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 24: `time/retrieval` is the seconds the step's rollout spent in its retriever (part of
    `time/rollout`) and `retrieval/queries` the queries it asked, whatever the retriever is: here one that
    takes 50 ms a call, under a loop that searches every turn (the paper-scale rehearsal's). Validation's
    searches (every step here, before and after) are left out: they are time/validation's."""
    import sleuth.rl.run as run_module
    from sleuth.rl.trainer import train

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the rehearsal loop's plugin
    calls: list[int] = []
    build = run_module.build_retriever

    class SlowRetriever:
        def __init__(self, inner):
            self.inner = inner

        def search(self, queries: list[str], k: int):
            time.sleep(0.05)
            calls.append(len(queries))
            return self.inner.search(queries, k)

    monkeypatch.setattr(run_module, "build_retriever", lambda recipe: SlowRetriever(build(recipe)))
    algorithm = {"name": "grpo", "n": 2, "prompts_per_step": 2, "minibatch_size": 4, "micro_batch_size": 4}
    recipe = _recipe(
        small_world,
        tmp_path / "run",
        algorithm,
        steps=2,
        plugins=["sleuth_test_rewards", "sleuth_rehearsal"],
        agent={
            "loop": "search_r1_rehearsal",
            "max_turns": 2,
            "max_new_tokens_per_turn": 8,
            "max_response_tokens": 96,
            "max_obs_tokens": 32,
        },
    )
    recipe["data"]["dev"] = str(small_world / "dev.jsonl")
    recipe["trainer"].update(eval_every=1, eval_examples=3)
    validation_calls: list[int] = []
    from sleuth.rl import validate as validate_module

    def counted_validate(run, done):
        before = len(calls)
        result = real_validate(run, done)
        validation_calls.extend(calls[before:])
        del calls[before:]
        return result

    real_validate = validate_module.validate
    monkeypatch.setattr(validate_module, "validate", counted_validate)
    import sleuth.rl.trainer as trainer_module

    if hasattr(trainer_module, "validate"):
        monkeypatch.setattr(trainer_module, "validate", counted_validate)
    train(recipe_from_dict(recipe))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and calls and validation_calls
    assert sum(r["retrieval/queries"] for r in rows) == sum(calls)
    assert sum(r["time/retrieval"] for r in rows) >= 0.05 * len(calls)
    assert all(0 < r["time/retrieval"] <= r["time/rollout"] for r in rows)


def test_packed_token_budget_step_equals_the_padded_step(small_world: Path, tmp_path: Path) -> None:
    """Issue 43: one GRPO step (float64, seeded sampling, so both runs roll out the same trajectories) with the 8
    trajectories padded into one micro-batch, and packed under a token budget that splits them: the same losses,
    gradient norm and entropy. The step also logs the rollout/trainer agreement, ~0 when both decode one model."""
    from sleuth.rl.trainer import train

    algorithm = {"name": "grpo", "n": 4, "prompts_per_step": 2, "minibatch_size": 8, "micro_batch_size": 8}
    rows = {}
    for name, packing, budget in (("padded", "padded", None), ("packed", "packed", 150)):
        recipe = _recipe(small_world, tmp_path / name, {**algorithm, "micro_batch_tokens": budget}, steps=1)
        recipe["model"].update(dtype="float64", packing=packing)
        train(recipe_from_dict(recipe))
        rows[name] = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
    padded, packed = rows["padded"], rows["packed"]
    assert padded["reward/std"] > 0  # advantages are not all zero: the gradient carries signal
    assert (
        packed["reward/mean"] == padded["reward/mean"] and packed["update/tokens"] == padded["update/tokens"]
    )
    assert (padded["update/packed"], packed["update/packed"]) == (0.0, 1.0)
    assert padded["update/micro_batches"] == 1 and packed["update/micro_batches"] > 1
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-9, abs=1e-12), key
    assert padded["actor/grad_norm"] > 0
    for row in rows.values():
        assert row["rollout/logprob_diff_tokens"] > 0 and row["rollout/logprob_diff_mean"] < 1e-6
