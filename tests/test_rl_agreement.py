"""Issue 43 item 6: the rollout/trainer log-prob agreement metric, on real rollouts (the search_r1 loop through
HFGenerator) of a tiny LoRA policy: near zero when the rollouts decode with the trained adapters, large when the
generator decodes the base model (adapters that never reached it), and then the default guard warns."""

from __future__ import annotations

import pytest
import torch

from sleuth.agent import get_loop
from sleuth.agent.engine import RolloutBudget, rollout
from sleuth.data.formats import QAExample
from sleuth.llm.base import SamplingParams
from sleuth.llm.special_tokens import peft_deprecation_silenced
from sleuth.retrieval.base import Hit
from sleuth.rl.agreement import rollout_agreement
from sleuth.rl.batch import collate, forward_logprobs
from sleuth.rl.guard_config import default_guards
from sleuth.rl.guards import GuardMonitor
from sleuth.rl.models import FrozenBaseGenerator

hf = pytest.importorskip("sleuth.llm.hf")
DOCS = [Hit(f"d{i}", f"Title {i}", f"passage number {i} about Varonia and Quellstad", 0.0) for i in range(3)]


class FixedRetriever:
    def search(self, queries, k):
        return [DOCS[:k] for _ in queries]


@pytest.fixture(scope="module")
def lora_policy(tmp_path_factory: pytest.TempPathFactory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sleuth.llm.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with peft_deprecation_silenced():
        policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():  # "trained" adapters: peft starts B at zero, i.e. at the base model
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    return policy, AutoTokenizer.from_pretrained(path)


def _agreement(policy, tokenizer, generator) -> dict[str, float]:
    examples = [
        QAExample("a", "What is the capital of Varonia?", ["Quellstad"]),
        QAExample("b", "Who directed Blue Harbor?", ["Mara Ilves"]),
    ]
    trajs = rollout(
        get_loop("search_r1", max_turns=2),
        generator,
        FixedRetriever(),
        examples,
        SamplingParams(max_new_tokens=10, temperature=0.8, seed=0),
        n=2,
        budget=RolloutBudget(max_obs_tokens=30, max_response_tokens=120),
    )
    batch = collate(trajs, tokenizer.pad_token_id or 0)
    with torch.no_grad():
        trainer, _ = forward_logprobs(policy, batch, 0.8, packed=True)
    return rollout_agreement(trajs, batch.action_mask, trainer)


def test_agreement_is_near_zero_when_the_rollouts_decode_the_trained_adapters(lora_policy) -> None:
    policy, tokenizer = lora_policy
    healthy = _agreement(policy, tokenizer, hf.HFGenerator(policy, tokenizer=tokenizer, device="cpu"))
    assert healthy["rollout/logprob_diff_tokens"] > 10
    assert healthy["rollout/logprob_diff_mean"] < 1e-4 and healthy["rollout/logprob_diff_max"] < 1e-3


def test_agreement_flags_adapters_that_did_not_reach_the_rollout_generator(lora_policy) -> None:
    policy, tokenizer = lora_policy
    stale = FrozenBaseGenerator(
        hf.HFGenerator(policy, tokenizer=tokenizer, device="cpu"), policy
    )  # base only
    metrics = _agreement(policy, tokenizer, stale)
    assert metrics["rollout/logprob_diff_mean"] > 0.1
    monitor = GuardMonitor(default_guards())
    fired = []
    for step in (1, 2, 3):
        monitor.record(step, metrics)
        fired += [e.guard for e in monitor.check(step)]
    assert fired == ["rollout_mismatch"]  # after 3 steps past 0.1


def test_agreement_skips_trajectories_without_log_probs() -> None:
    from sleuth.agent.trajectory import Trajectory

    t = Trajectory(
        question_id="q",
        question="q",
        golden_answers=["a"],
        method="t",
        prompt_ids=[1],
        response_ids=[2, 3],
        loss_mask=[1, 1],
        logprobs=[0.0, 0.0],
        logprobs_missing=True,
    )
    out = rollout_agreement([t], torch.ones(1, 2), torch.full((1, 2), -3.0))
    assert out["rollout/logprob_diff_tokens"] == 0.0 and out["rollout/logprob_diff_mean"] == 0.0
    t.logprobs_missing = False
    out = rollout_agreement([t], torch.tensor([[1.0, 0.0]]), torch.full((1, 2), -3.0))
    assert out == {
        "rollout/logprob_diff_mean": 3.0,
        "rollout/logprob_diff_max": 3.0,
        "rollout/logprob_diff_tokens": 1.0,
    }
