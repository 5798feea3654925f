"""Trainer batching: left-padded prompts + right-padded responses give the same per-token log-probs
and values as running each trajectory alone, and the mask covers exactly the policy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sleuth.agent.trajectory import Trajectory
from sleuth.rl.trainer import ValueModel, collate, critic_values, forward_logprobs


def _traj(prompt: list[int], response: list[int], mask: list[int]) -> Trajectory:
    return Trajectory(question_id="q", question="q", golden_answers=["a"], method="t",
                      prompt_ids=prompt, response_ids=response, loss_mask=mask, logprobs=[0.0] * len(response))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModel, AutoModelForCausalLM

    from sleuth.llm.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    critic = ValueModel(AutoModel.from_pretrained(path, dtype=torch.float64), model.config.hidden_size).double()
    torch.nn.init.normal_(critic.value_head.weight)  # a non-trivial head so values differ per position
    return Path(path), model, critic


def test_collate_layout_by_hand() -> None:
    batch = collate([_traj([5, 6, 7], [8, 9], [1, 0]), _traj([5], [8, 9, 10], [1, 1, 0])], pad_id=0)
    # S = 3 prompt columns, R = 3 response columns
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [0, 0, 5, 8, 9, 10]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert batch.action_mask.tolist() == [[1, 0, 0], [1, 1, 0]]
    truncated = _traj([5], [8], [1])
    truncated.finish_reason = "length"
    assert collate([truncated], pad_id=0, drop_truncated=True).action_mask.tolist() == [[0.0]]


def test_batched_logprobs_and_values_equal_single_sequences(tiny) -> None:
    _, model, critic = tiny
    trajs = [_traj([11, 12, 13, 14], [20, 21], [1, 1]), _traj([11], [22, 23, 24, 25], [1, 0, 0, 1])]
    batch = collate(trajs, pad_id=0)
    with torch.no_grad():
        logprobs, entropy = forward_logprobs(model, batch, temperature=0.7, with_entropy=True)
        values = critic_values(critic, batch)
    for i, t in enumerate(trajs):
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1] / 0.7
            hidden = critic.backbone(input_ids=ids).last_hidden_state
        P, R = len(t.prompt_ids), len(t.response_ids)
        expected = torch.log_softmax(logits, -1)[P - 1 :].gather(-1, ids[0, P:, None]).squeeze(-1)
        torch.testing.assert_close(logprobs[i, :R], expected, rtol=1e-9, atol=1e-9)
        probs = torch.softmax(logits[P - 1 :], -1)
        torch.testing.assert_close(entropy[i, :R], -(probs * probs.log()).sum(-1), rtol=1e-9, atol=1e-9)
        expected_v = critic.value_head(hidden[0, P - 1 : P + R - 1]).squeeze(-1)
        torch.testing.assert_close(values[i, :R], expected_v, rtol=1e-9, atol=1e-9)
