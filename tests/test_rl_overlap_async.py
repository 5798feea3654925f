"""Issue 43 item 5, concurrent: `trainer.overlap: one_step_async` runs step k+1's rollout on a background thread
while step k updates, decoding a frozen snapshot of the pre-update weights (sleuth.rl.overlap). The reference it
must equal is the deterministic interleaving, `one_step`, which rolls the same prompts out on the main thread
before the update. Float64 tiny model; the background rollout is made to start decoding only after the main
thread's optimizer step has changed the policy (the worst case a snapshot has to survive)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
import torch
from tests.test_rl_overlap import _rows, _weights

from sleuth.rl.config import recipe_from_dict

PLUGINS = Path(__file__).parent / "plugins"
sys.path.insert(0, str(PLUGINS))  # the test reward plugin

ALGO = {"name": "grpo", "n": 4, "prompts_per_step": 2, "minibatch_size": 8, "micro_batch_size": 8}
# what may differ between two runs computing the same thing: wall times, memory, throughput
NOISY = ("time/", "memory/", "tokens/policy_per_s", "compile", "retrieval", "rss", "trend")
# what a trajectory record holds that the two schedules must agree on
TRAJECTORY_KEYS = (
    "question_id",
    "prompt_ids",
    "response_ids",
    "loss_mask",
    "logprobs",
    "rewards",
    "response_text",
)
LORA = {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0}


def _recipe(small_world: Path, out_dir: Path, steps: int, overlap: str, lora: bool = False) -> dict:
    model: dict = {"policy": "tiny", "dtype": "float64"}
    if lora:
        model["lora"] = LORA
    return {
        "name": "test",
        "seed": 0,
        "model": model,
        "data": {"train": str(small_world / "train.jsonl")},
        "retriever": {"index": str(small_world / "bm25")},
        "agent": {
            "loop": "search_r1",
            "max_turns": 2,
            "max_new_tokens_per_turn": 12,
            "max_response_tokens": 96,
            "max_obs_tokens": 32,
        },
        "plugins": ["sleuth_test_rewards"],
        "reward": {"name": "test_token_fraction"},
        "algorithm": dict(ALGO),
        "optim": {"lr": 5e-2},
        "trainer": {
            "total_steps": steps,
            "save_every": 1,
            "keep_checkpoints": 5,
            "out_dir": str(out_dir),
            "overlap": overlap,
        },
    }


def _trajectories(out_dir: Path, step: int) -> list[dict]:
    lines = (out_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()
    return [{k: json.loads(line)[k] for k in TRAJECTORY_KEYS} for line in lines]


def _cursor(out_dir: Path, step: int) -> dict:
    state = json.loads((out_dir / "checkpoints" / f"step_{step:06d}" / "trainer_state.json").read_text())
    return state["cursor"]


@pytest.fixture
def decode_after_the_update(monkeypatch: pytest.MonkeyPatch) -> dict:
    """The background rollout waits until the main thread's update (optimizer step included) has returned, then
    records how far the live trainable weights have moved from the snapshot it decodes."""
    from sleuth.rl import rollouts, trainer

    updated, seen = threading.Event(), {"moved": [], "threads": set()}
    real_update, real_collect, real_start = trainer.update, rollouts.collect_rollouts, trainer.start_next

    def start_next(run, step):
        updated.clear()  # on the main thread, before the background rollout starts
        return real_start(run, step)

    def update(run, batch):
        stats = real_update(run, batch)  # its optimizer step has changed the live weights
        updated.set()
        return stats

    def collect(run):
        if threading.current_thread() is not threading.main_thread():
            seen["threads"].add(threading.current_thread().name)
            assert updated.wait(timeout=120), "the update never finished"
            live = dict(run.policy.named_parameters())
            frozen = dict(run.snapshot.model.named_parameters())
            seen["moved"].append(
                max((live[k] - frozen[k]).abs().max().item() for k in frozen if live[k].requires_grad)
            )
        return real_collect(run)

    monkeypatch.setattr(trainer, "update", update)
    monkeypatch.setattr(trainer, "start_next", start_next)
    monkeypatch.setattr(rollouts, "collect_rollouts", collect)
    return seen


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_concurrent_rollout_equals_the_interleaving(small_world: Path, tmp_path: Path, lora: bool,
                                                        decode_after_the_update: dict) -> None:  # fmt: skip
    """3 steps: the same trajectories (tokens, log-probs, rewards), metrics (losses, KL, gradient norm, staleness),
    data cursors and weights, bit for bit, while the live weights had moved before the background rollout
    decoded."""
    from sleuth.rl.trainer import train

    inter, conc = tmp_path / "interleaved", tmp_path / "concurrent"
    train(recipe_from_dict(_recipe(small_world, inter, 3, "one_step", lora)))
    train(recipe_from_dict(_recipe(small_world, conc, 3, "one_step_async", lora)))
    seen = decode_after_the_update
    assert seen["threads"] == {"sleuth-rollout-step2", "sleuth-rollout-step3"}
    assert len(seen["moved"]) == 2 and min(seen["moved"]) > 1e-4  # the update really ran first
    a, b = _rows(inter), _rows(conc)
    assert [r["rollout/staleness"] for r in b] == [0.0, 1.0, 1.0]
    assert b[1]["rollout/logprob_diff_tokens"] == 0.0  # not measured at staleness 1, as under one_step
    assert all(r["time/overlap_wait"] >= 0 for r in b[:2]) and "time/overlap_wait" not in a[0]
    assert a[1]["reward/std"] > 0 and a[2]["actor/grad_norm"] > 0
    for x, y in zip(a, b, strict=True):
        keys = [k for k in x if not any(n in k for n in NOISY)]
        assert {k: x[k] for k in keys} == {k: y[k] for k in keys}
    for step in (1, 2, 3):
        assert _trajectories(inter, step) == _trajectories(conc, step), step
        assert _cursor(inter, step) == _cursor(conc, step), step
        wa, wb = _weights(inter, step), _weights(conc, step)
        assert wa.keys() == wb.keys()
        for k in wa:
            assert torch.equal(wa[k], wb[k]), (step, k)


def test_a_failure_in_the_background_rollout_surfaces_in_the_main_thread(
    small_world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sleuth.rl import rollouts
    from sleuth.rl.trainer import train

    real = rollouts.collect_rollouts

    def collect(run):
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("boom in the rollout thread")
        return real(run)

    monkeypatch.setattr(rollouts, "collect_rollouts", collect)
    with pytest.raises(RuntimeError, match="background rollout of step 2 failed") as err:
        train(recipe_from_dict(_recipe(small_world, tmp_path / "run", 3, "one_step_async")))
    assert "ValueError: boom in the rollout thread" in str(err.value)
    assert isinstance(err.value.__cause__, ValueError)
    assert not [t for t in threading.enumerate() if t.name.startswith("sleuth-rollout")]


def test_a_failure_in_the_update_waits_for_the_background_rollout(
    small_world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The main thread's error is the one raised, after the thread that still decodes from the run has ended."""
    from sleuth.rl import trainer

    real, calls = trainer.update, []

    def update(run, batch):
        calls.append(1)
        if len(calls) == 2:
            raise FloatingPointError("update failed")
        return real(run, batch)

    monkeypatch.setattr(trainer, "update", update)
    with pytest.raises(FloatingPointError, match="update failed"):
        trainer.train(recipe_from_dict(_recipe(small_world, tmp_path / "run", 3, "one_step_async")))
    assert not [t for t in threading.enumerate() if t.name.startswith("sleuth-rollout")]


def test_a_service_failure_in_the_background_rollout_keeps_the_step(
    small_world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 3's rollout, made on the thread during step 2, finds the retriever down: step 2 finishes, is logged and
    checkpointed with the cursor from before step 3's draw (an uninterrupted run's after step 2), then the run
    stops naming the checkpoint, as the synchronous trainer stops when its own rollout fails."""
    from sleuth.errors import ServiceError
    from sleuth.rl import rollouts
    from sleuth.rl.trainer import train

    train(recipe_from_dict(_recipe(small_world, tmp_path / "whole", 3, "one_step")))
    real, calls = rollouts.collect_rollouts, []

    def collect(run):
        calls.append(threading.current_thread().name)
        if len(calls) == 3:  # step 1's own, step 2's (during step 1), step 3's (during step 2): fails
            raise ServiceError("retriever down")
        return real(run)

    monkeypatch.setattr(rollouts, "collect_rollouts", collect)
    data = _recipe(small_world, tmp_path / "run", 3, "one_step_async")
    data["trainer"]["save_every"] = 1000  # no checkpoint but the failure's
    with pytest.raises(ServiceError, match="checkpoint of step 2 written"):
        train(recipe_from_dict(data))
    assert calls[1:] == ["sleuth-rollout-step2", "sleuth-rollout-step3"]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == ["step_000002"]
    assert _cursor(tmp_path / "run", 2) == _cursor(tmp_path / "whole", 2)
    assert len(_rows(tmp_path / "run")) == 2


def test_the_snapshot_shares_a_lora_base_and_freezes_the_adapters(tmp_path: Path) -> None:
    """Under LoRA only the adapters are copied (the base tensors are the policy's own); the copy moves only when
    refreshed, and a forward of the snapshot equals the policy's at the weights it was refreshed with."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from sleuth.llm.special_tokens import peft_deprecation_silenced
    from sleuth.llm.tiny import build_tiny_model
    from sleuth.rl.overlap import WeightSnapshot

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "tiny"), dtype=torch.float64)
    with peft_deprecation_silenced():
        policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    policy.train()
    snap = WeightSnapshot(policy)
    live, frozen = dict(policy.named_parameters()), dict(snap.model.named_parameters())
    assert live.keys() == frozen.keys()
    for k, p in live.items():
        assert (frozen[k].data_ptr() == p.data_ptr()) == (not p.requires_grad), k
        assert not frozen[k].requires_grad
    trainable = sum(p.numel() * p.element_size() for p in live.values() if p.requires_grad)
    assert snap.copied_bytes == trainable < sum(p.numel() * p.element_size() for p in live.values()) / 4
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        before = policy(input_ids=ids).logits
        for k, p in live.items():
            if "lora_B" in k:
                p.add_(0.5)  # what an optimizer step does, in place
        after = policy(input_ids=ids).logits
        assert not torch.equal(before, after)
        assert torch.equal(snap.model(input_ids=ids).logits, before)  # not reached by the update
        snap.refresh()
        assert torch.equal(snap.model(input_ids=ids).logits, after)


def test_the_seeded_generator_gives_each_call_its_own_stream() -> None:
    from sleuth.llm.base import SamplingParams
    from sleuth.rl.overlap import SeededGenerator

    class Recorder:
        tokenizer = "tok"

        def __init__(self) -> None:
            self.seeds: list[int | None] = []

        def generate(self, batch, stop=None, params=None):
            self.seeds.append(params.seed)
            return []

    a, b = SeededGenerator(Recorder(), 11), SeededGenerator(Recorder(), 11)
    for gen in (a, b):
        gen.generate(["x"], None, SamplingParams(temperature=1.0))
        gen.generate(["x"], None, SamplingParams(temperature=1.0))
    assert a.inner.seeds == b.inner.seeds and len(set(a.inner.seeds)) == 2 and None not in a.inner.seeds
    assert a.tokenizer == "tok"  # everything else is the wrapped generator's


@pytest.mark.parametrize(
    "algorithm, parallel, why",
    [({"ppo_epochs": 2}, None, "algorithm.ppo_epochs 2"), ({}, "fsdp", "model.parallel fsdp")],
    ids=["ppo_epochs", "fsdp"],
)
def test_the_concurrent_mode_is_refused_where_it_cannot_apply(small_world: Path, algorithm: dict, parallel: str | None,
                                                              why: str) -> None:  # fmt: skip
    from sleuth.errors import ConfigError
    from sleuth.rl.dist import DistContext
    from sleuth.rl.overlap import check_overlap

    data = _recipe(small_world, small_world / "unused", 2, "one_step_async")
    data["algorithm"].update(algorithm)
    if parallel:
        data["model"]["parallel"] = parallel
    with pytest.raises(ConfigError) as err:
        check_overlap(recipe_from_dict(data), DistContext())
    assert "\n" not in str(err.value) and why in str(err.value)
    assert "trainer.overlap: one_step_async cannot apply" in str(err.value)
