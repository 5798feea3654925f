"""A reward can score with the policy: teacher-forced log-probs of a string given a prefix, batched
(sleuth.rl.batch.PolicyScorer, RewardServices.policy), equal to a plain forward pass over each row alone."""

from __future__ import annotations

import pytest
import torch

from sleuth.rewards.base import PolicyScorer as PolicyScorerProtocol
from sleuth.rl.batch import PolicyScorer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sleuth.llm.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float64).eval()
    return model, AutoTokenizer.from_pretrained(path)


def reference(model, prefix: list[int], cont: list[int]) -> list[float]:
    """log p(cont_j | prefix, cont_<j) from one unpadded forward pass."""
    ids = torch.tensor([prefix + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    return [logp[len(prefix) + j - 1, t].item() for j, t in enumerate(cont)]


def test_batched_teacher_forced_logprobs_equal_each_row_alone(tiny) -> None:
    model, tok = tiny
    prefixes = [
        tok.encode("Question: where? Turn one", add_special_tokens=False),
        tok.encode("Q", add_special_tokens=False),
    ]
    conts = ["<answer> Quellstad </answer>", "Tarsk"]
    scorer = PolicyScorer(model, tok, micro_batch_size=2)
    assert isinstance(scorer, PolicyScorerProtocol)
    got = scorer.logprobs(prefixes, conts)
    for p, c, row in zip(prefixes, conts, got, strict=True):
        want = reference(model, p, tok.encode(c, add_special_tokens=False))
        assert row == pytest.approx(want, abs=1e-6) and len(row) == len(want)
    assert scorer.logprobs([], []) == []


def test_refusals(tiny) -> None:
    model, tok = tiny
    with pytest.raises(ValueError, match="prefixes"):
        PolicyScorer(model, tok).logprobs([[1]], ["a", "b"])
    with pytest.raises(ValueError, match="at least one token"):
        PolicyScorer(model, tok).logprobs([[1]], [""])
    with pytest.raises(RuntimeError, match="FSDP"):
        PolicyScorer(model, tok, sharded=True).logprobs([[1]], ["a"])
