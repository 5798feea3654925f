"""Issue 43 item 3: under LoRA with a KL loss the reference log-probs come from the base model (adapters disabled)
inside each update micro-batch, not from a pass over the whole batch before the update. In float64 on the tiny
model with trained adapters, against an independent reference (each row alone through the base model's full
logits and torch's log_softmax): the reference log-probs, the logged KL, the losses and the gradients equal the
separate-pass path; the model runs exactly one base forward per micro-batch (none in make_batch, none in a second
epoch); the KL reward penalty keeps its pass before the advantages; the rollout agreement metric still works."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sleuth.agent.trajectory import Trajectory
from sleuth.llm.special_tokens import peft_deprecation_silenced
from sleuth.rl import losses as loss_fns
from sleuth.rl import trainer
from sleuth.rl.agreement import rollout_agreement
from sleuth.rl.config import recipe_from_dict
from sleuth.rl.dist import DistContext

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def lora_policy(tmp_path_factory: pytest.TempPathFactory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from sleuth.llm.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa")
    with peft_deprecation_silenced():
        policy = get_peft_model(
            base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
        )
    with torch.no_grad():  # "trained" adapters: peft starts B at zero, i.e. at the base model
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    return policy


def _traj(group: int, prompt: list[int], response: list[int], mask: list[int]) -> Trajectory:
    return Trajectory(
        question_id=f"q{group}",
        question="q",
        golden_answers=["a"],
        method="t",
        group=group,
        prompt_ids=prompt,
        response_ids=response,
        loss_mask=mask,
        logprobs=[0.0] * len(response),
    )


def _trajs() -> list[Trajectory]:
    # two groups of three: ragged prompts and responses, inserted (mask 0) spans
    return [
        _traj(0, [11, 12, 13, 14], [20, 21, 30, 31, 22], [1, 1, 0, 0, 1]),
        _traj(0, [11, 12, 13, 14], [22, 23, 24, 25], [1, 0, 0, 1]),
        _traj(0, [11, 12, 13, 14], [26, 27], [0, 1]),
        _traj(1, [18, 19], [28, 29, 40, 41, 42, 43, 44], [1, 1, 1, 0, 0, 1, 1]),
        _traj(1, [18, 19], [45, 46, 47], [1, 1, 1]),
        _traj(1, [18, 19], [48, 20, 21, 22], [1, 1, 0, 1]),
    ]


SCORES = [1.0, 0.0, 0.5, 0.2, 1.0, 0.0]


def _row_logprobs(model, trajs: list[Trajectory]) -> torch.Tensor:
    """Each row alone, full logits, torch's log_softmax: (B, R) at policy positions, 0 elsewhere."""
    R = max(len(t.response_ids) for t in trajs)
    out = torch.zeros(len(trajs), R, dtype=torch.float64)
    with torch.no_grad():
        for i, t in enumerate(trajs):
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1] / TEMPERATURE, -1)[
                len(t.prompt_ids) - 1 :
            ]
            picked = logp.gather(-1, ids[0, len(t.prompt_ids) :, None]).squeeze(-1)
            out[i, : len(t.response_ids)] = picked * torch.tensor(t.loss_mask, dtype=torch.float64)
    return out


def _base_logprobs(policy, trajs: list[Trajectory]) -> torch.Tensor:
    with policy.disable_adapter():
        return _row_logprobs(policy, trajs)


def _run(policy, *, mode: str = "loss", epochs: int = 1, minibatch: int = 6, packing: str = "padded"):
    recipe = recipe_from_dict(
        {
            "name": "t",
            "model": {"policy": "tiny", "lora": {"enabled": True}, "dtype": "float64", "packing": packing},
            "data": {"train": "x.jsonl"},
            "retriever": {"index": "i"},
            "agent": {"loop": "search_r1"},
            "reward": {"name": "search_r1_em"},
            "sampling": {"temperature": TEMPERATURE},
            "optim": {"grad_clip": 1e9},
            "algorithm": {
                "name": "grpo",
                "n": 3,
                "prompts_per_step": 2,
                "minibatch_size": minibatch,
                "micro_batch_size": 2,
                "ppo_epochs": epochs,
                "kl": {"coef": 0.5, "mode": mode, "estimator": "low_var_kl"},
            },
        }
    )
    params = [p for p in policy.parameters() if p.requires_grad]
    # lr 0: the weights stay put, so the two paths compared see the same model and p.grad after update()
    # holds the last minibatch's gradient (zero_grad runs before each minibatch, not after)
    return SimpleNamespace(
        recipe=recipe,
        ctx=DistContext(),
        policy=policy,
        reference=None,
        critic=None,
        tokenizer=SimpleNamespace(pad_token_id=0),
        kl_coef=0.5,
        local_minibatch=minibatch,
        optimizers={"policy": torch.optim.SGD(params, lr=0.0)},
    )


def _update(run, batch) -> tuple[dict[str, list[float]], list[torch.Tensor]]:
    run.policy.train()
    torch.manual_seed(0)  # the minibatch permutation
    stats = trainer.update(run, batch)
    return stats, [p.grad.clone() for p in run.policy.parameters() if p.requires_grad]


def _forwards(model) -> list[bool]:
    """Records, per forward of the policy's base model, whether its LoRA adapters were active."""
    calls: list[bool] = []
    layer = next(
        m for n, m in model.named_modules() if n.endswith("q_proj") and hasattr(m, "disable_adapters")
    )
    model.base_model.model.register_forward_pre_hook(lambda m, a: calls.append(not layer.disable_adapters))
    return calls


@pytest.mark.parametrize(("packing", "epochs"), [("padded", 1), ("packed", 1), ("padded", 2)])
def test_reference_in_the_micro_batch_equals_the_separate_pass(
    lora_policy, packing: str, epochs: int
) -> None:
    policy, trajs = lora_policy, _trajs()
    base = _base_logprobs(policy, trajs)
    policy_lp = _row_logprobs(policy, trajs)
    assert (policy_lp - base).abs().max() > 1e-2  # the adapters matter: a reference with them on would differ
    run = _run(policy, packing=packing, epochs=epochs, minibatch=6 if epochs == 1 else 2)

    fused = trainer.make_batch(run, trajs, SCORES)
    assert (
        fused.ref_rows is not None
        and not fused.ref_rows.any()
        and (fused.old_logprobs is None) == (epochs == 1)
    )
    separate = copy.copy(
        fused
    )  # make_batch before issue 43 item 3: the base model's pass over the whole batch
    separate.ref_logprobs, separate.ref_rows, separate.kl = base.clone(), None, None
    separate.policy_logprobs = torch.zeros_like(fused.policy_logprobs)

    s_fused, g_fused = _update(run, fused)
    s_sep, g_sep = _update(run, separate)
    assert policy.training  # the base model's eval-mode forward gave the mode back
    assert fused.ref_rows.all()
    torch.testing.assert_close(fused.ref_logprobs, base, rtol=1e-10, atol=1e-12)
    mask = fused.tokens.action_mask
    expected_kl = loss_fns.kl_penalty(policy_lp, base, "low_var_kl") * mask
    torch.testing.assert_close(fused.kl * mask, expected_kl, rtol=1e-9, atol=1e-12)
    assert float((fused.kl * mask).sum()) > 1e-3
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "update/micro_batches"):
        assert s_fused[key] == pytest.approx(s_sep[key], rel=1e-10, abs=1e-13), key
    assert s_fused["actor/kl_loss"][0] > 1e-3 and sum(s_fused["update/micro_batches"]) == 3 * epochs
    for a, b in zip(g_fused, g_sep, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert max(float(g.abs().max()) for g in g_fused) > 0


def test_the_kl_term_reaches_the_gradient(lora_policy) -> None:
    """The comparison above is not vacuous: a reference off by a little gives other gradients."""
    policy, trajs = lora_policy, _trajs()
    run = _run(policy)
    batch = trainer.make_batch(run, trajs, SCORES)
    shifted = copy.copy(batch)
    shifted.ref_logprobs, shifted.ref_rows, shifted.kl = _base_logprobs(policy, trajs) + 0.05, None, None
    _, g_fused = _update(run, batch)
    _, g_shifted = _update(run, shifted)
    assert max(float((a - b).abs().max()) for a, b in zip(g_fused, g_shifted, strict=True)) > 1e-4


def test_one_base_forward_per_micro_batch_and_none_before_the_update(lora_policy) -> None:
    policy, trajs = lora_policy, _trajs()
    calls = _forwards(policy)
    for epochs, minibatch in ((1, 6), (2, 2)):
        run = _run(policy, epochs=epochs, minibatch=minibatch)
        calls.clear()
        batch = trainer.make_batch(run, trajs, SCORES)
        # off-policy epochs keep their old-log-prob pass (adapters on); no reference pass in either case
        assert calls == ([] if epochs == 1 else [True] * 3)
        calls.clear()
        _update(run, batch)
        micro = 3 * epochs
        assert calls.count(False) == 3  # the base model once per micro-batch of the first epoch, then reused
        assert calls.count(True) == micro
        torch.testing.assert_close(batch.ref_logprobs, _base_logprobs(policy, trajs), rtol=1e-10, atol=1e-12)
        if epochs == 2:  # KL(old || ref) with the old side from the separate pass
            expected = loss_fns.kl_penalty(batch.old_logprobs, batch.ref_logprobs, "low_var_kl")
            torch.testing.assert_close(
                batch.kl * batch.tokens.action_mask, expected * batch.tokens.action_mask
            )


def test_the_kl_penalty_keeps_its_pass_before_the_advantages(lora_policy) -> None:
    """A reward penalty shapes the advantages, so its reference log-probs are needed before the update: the
    separate pass stays, and the update runs no base forward."""
    policy, trajs = lora_policy, _trajs()
    run = _run(policy, mode="penalty")
    calls = _forwards(policy)
    batch = trainer.make_batch(run, trajs, SCORES)
    assert batch.ref_rows is None and calls.count(False) == 3 and batch.old_logprobs is not None
    base = _base_logprobs(policy, trajs)
    torch.testing.assert_close(batch.ref_logprobs, base, rtol=1e-10, atol=1e-12)
    mask = batch.tokens.action_mask
    torch.testing.assert_close(
        batch.kl * mask,
        loss_fns.kl_penalty(_row_logprobs(policy, trajs), base, "low_var_kl") * mask,
        rtol=1e-9,
        atol=1e-12,
    )
    calls.clear()
    stats, _ = _update(run, batch)
    assert False not in calls and "actor/kl_loss" not in stats


def test_rollout_agreement_after_the_fused_update(lora_policy) -> None:
    """The on-policy forward (adapters on again after the base model's) fills the agreement metric's side."""
    policy, trajs = lora_policy, _trajs()
    policy_lp = _row_logprobs(policy, trajs)
    for i, t in enumerate(trajs):
        t.logprobs = policy_lp[i, : len(t.response_ids)].tolist()
    run = _run(policy)
    batch = trainer.make_batch(run, trajs, SCORES)
    _update(run, batch)
    metrics = rollout_agreement(trajs, batch.tokens.action_mask, batch.policy_logprobs)
    assert metrics["rollout/logprob_diff_tokens"] == float(batch.tokens.action_mask.sum())
    assert metrics["rollout/logprob_diff_max"] < 1e-6  # float32 storage of the trainer's side
    stale = rollout_agreement(
        trajs, batch.tokens.action_mask, batch.ref_logprobs
    )  # what the base model gives
    assert stale["rollout/logprob_diff_mean"] > 1e-2


def test_a_lora_training_step_with_a_kl_loss_equals_the_separate_pass_step(
    small_world, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end (train(): rollouts, make_batch, update, log), float64 and seeded sampling so both runs roll out
    the same trajectories: two GRPO steps of a LoRA policy with a KL loss log the same losses, gradient norms and
    KL whether the reference log-probs come from the update's micro-batches or from a pass before the update (the
    second step's: peft starts at the base model, so the first step's KL is 0)."""
    import json

    from sleuth.rl.batch import batched_logprobs
    from sleuth.rl.dist import unwrap

    sys_path = str(Path(__file__).parent / "plugins")
    monkeypatch.syspath_prepend(sys_path)
    real_make_batch = trainer.make_batch

    def separate_pass(run, trajs, scores, behaviour=False):  # make_batch before issue 43 item 3
        batch = real_make_batch(run, trajs, scores, behaviour=behaviour)
        with unwrap(run.policy).disable_adapter():
            batch.ref_logprobs = batched_logprobs(
                run.policy, batch.tokens, TEMPERATURE, batch.plan, run.ctx.device
            )
        batch.ref_rows, batch.kl = None, None
        return batch

    rows = {}
    for name in ("fused", "separate"):
        if name == "separate":
            monkeypatch.setattr(trainer, "make_batch", separate_pass)
        recipe = {
            "name": "t",
            "seed": 0,
            "model": {"policy": "tiny", "dtype": "float64", "lora": {"enabled": True, "r": 4, "alpha": 8}},
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
            "sampling": {"temperature": TEMPERATURE},
            "optim": {"lr": 1e-2},
            "algorithm": {
                "name": "grpo",
                "n": 4,
                "prompts_per_step": 2,
                "minibatch_size": 8,
                "micro_batch_size": 4,
                "kl": {"coef": 0.5, "mode": "loss", "estimator": "low_var_kl"},
            },
            "trainer": {"total_steps": 2, "save_every": 1000, "out_dir": str(tmp_path / name)},
        }
        trainer.train(recipe_from_dict(recipe))
        rows[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    for fused, separate in zip(rows["fused"], rows["separate"], strict=True):
        assert fused["reward/std"] > 0 and fused["update/micro_batches"] == 2
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "reward/mean"):
            assert fused[key] == pytest.approx(separate[key], rel=1e-9, abs=1e-12), key
        # the logged KL: the token mean of KL(old || ref), where the separate pass falls back to the loss term
        assert fused["actor/kl"] == pytest.approx(separate["actor/kl"], rel=1e-9, abs=1e-15)
        assert fused["rollout/logprob_diff_tokens"] > 0 and fused["rollout/logprob_diff_mean"] < 1e-6
    assert rows["fused"][1]["actor/kl"] > 1e-6 and rows["fused"][1]["actor/kl_loss"] > 1e-6
