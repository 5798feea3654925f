"""Per-turn rewards at turn boundaries and the turn-level advantage estimators, against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from sleuth.agent import get_loop
from sleuth.agent.engine import rollout
from sleuth.data.formats import QAExample
from sleuth.llm.base import SamplingParams
from sleuth.llm.scripted import ScriptedGenerator
from sleuth.rewards.base import Reward, RewardResult, guarded_rewards
from sleuth.rl import advantages as adv
from sleuth.rl.batch import collate, token_rewards
from toyworld import ToyRetriever

Q = "What is the capital of Varonia?"


def close(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(
        actual.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-4, rtol=0
    )


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from sleuth.llm.tiny import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def test_turn_rewards_sit_on_the_last_token_of_each_turn() -> None:
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0]], dtype=torch.float32)
    out = adv.turn_token_rewards(torch.tensor([1.0]), mask, [[2, 7]], [[0.5, -0.2]])
    # turn 0 ends at position 1, turn 1 (the last, which also carries the outcome 1.0) at position 6
    close(out, [[0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.8, 0.0]])
    # outcome-only rows are exactly outcome_to_token_rewards
    assert torch.equal(
        adv.turn_token_rewards(torch.tensor([1.0]), mask, [[2, 7]], [[]]),
        adv.outcome_to_token_rewards(torch.tensor([1.0]), mask),
    )


def test_turn_rewards_that_cannot_land_are_refused() -> None:
    mask = torch.tensor([[1, 1, 0, 1]], dtype=torch.float32)
    with pytest.raises(ValueError, match="2 turn rewards for 1 policy turns"):
        adv.turn_token_rewards(torch.tensor([0.0]), mask, [[2]], [[0.1, 0.2]])
    with pytest.raises(ValueError, match="no policy token"):
        adv.turn_token_rewards(torch.tensor([0.0]), mask, [[3]], [[0.1]])  # position 2 is inserted


def test_policy_turn_ids_split_at_inserted_tokens() -> None:
    mask = torch.tensor([[0, 1, 1, 0, 1, 0, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0]])
    assert adv.policy_turn_ids(mask).tolist() == [[-1, 0, 0, -1, 1, -1, 2, 2], [0, 0, 0, 0, -1, -1, -1, -1]]


# Row A: two turns, rewards 0.5 (turn 0, position 1) and 1.0 (turn 1, position 4); row B: one turn, reward 0.
MASK = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.float32)
REWARDS = torch.tensor([[0.0, 0.5, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])


def test_turn_grpo_by_hand() -> None:
    # group turn rewards {0.5, 1.0, 0.0}: mean 0.5, unbiased std sqrt((0 + .25 + .25) / 2) = 0.5
    # normalised: A = (0, 1), B = (-1); gamma 1: A_0 = 0 + 1 = 1, A_1 = 1, B_0 = -1
    a, _ = adv.compute_advantages(
        "turn_grpo", token_rewards=REWARDS, response_mask=MASK, group_ids=[0, 0], epsilon=0.0
    )
    close(a, [[1, 1, 0, 1, 1], [-1, -1, -1, 0, 0]])
    # gamma 0.5: A_0 = 0 + 0.5 * 1 = 0.5
    a, _ = adv.compute_advantages(
        "turn_grpo", token_rewards=REWARDS, response_mask=MASK, group_ids=[0, 0], epsilon=0.0, gamma=0.5
    )
    close(a, [[0.5, 0.5, 0, 1, 1], [-1, -1, -1, 0, 0]])
    # groups apart: each row alone has nothing to compare with on B's side; A's own two turns still differ
    a, _ = adv.compute_advantages(
        "turn_grpo", token_rewards=REWARDS, response_mask=MASK, group_ids=[0, 1], epsilon=0.0
    )
    # A alone: {0.5, 1.0} mean 0.75, std sqrt(2 * 0.0625 / 1) = 0.35355: (-0.7071, 0.7071), summed: (0, 0.7071)
    close(a, [[0, 0, 0, 0.70711, 0.70711], [0, 0, 0, 0, 0]])


def test_turn_reinforce_by_hand() -> None:
    # returns (gamma 1): A = (1.5, 1.0), B = (0.0); turn-0 mean 0.75 -> A_0 = 0.75, B_0 = -0.75; turn 1 only A: 0
    a, ret = adv.compute_advantages(
        "turn_reinforce", token_rewards=REWARDS, response_mask=MASK, group_ids=[0, 0]
    )
    close(a, [[0.75, 0.75, 0, 0, 0], [-0.75, -0.75, -0.75, 0, 0]])
    close(ret, [[1.5, 1.5, 0, 1.0, 1.0], [0, 0, 0, 0, 0]])
    a, _ = adv.compute_advantages(
        "turn_reinforce", token_rewards=REWARDS, response_mask=MASK, group_ids=[0, 0], gamma=0.5
    )
    close(a, [[0.5, 0.5, 0, 0, 0], [-0.5, -0.5, -0.5, 0, 0]])  # A_0 = 0.5 + 0.5 = 1.0


def test_turn_estimators_refuse_rewards_on_inserted_tokens() -> None:
    bad = REWARDS.clone()
    bad[0, 2] = 1.0
    with pytest.raises(ValueError, match="masked positions"):
        adv.compute_advantages("turn_grpo", token_rewards=bad, response_mask=MASK, group_ids=[0, 0])


class PerTurn(Reward):
    """0.1 times the turn's index per policy turn, outcome 1."""

    def __call__(self, trajs, services=None):
        return [
            RewardResult(1.0, turn_rewards=[0.1 * i for i in range(len(t.policy_turn_ends()))]) for t in trajs
        ]


def test_a_rollouts_turn_rewards_land_on_its_turns_last_policy_tokens(tok) -> None:
    """The trainer's path: a rollout, the reward's turn rewards recorded on the trajectory, collate, then
    `sleuth.rl.batch.token_rewards` (make_batch's call)."""
    script = {
        Q: [
            "<search> capital of Varonia </search>",
            "<search> Varonia </search>",
            "<answer> Quellstad </answer>",
        ]
    }
    gen = ScriptedGenerator(tok, script)
    (traj,) = rollout(
        get_loop("search_r1"),
        gen,
        ToyRetriever(),
        [QAExample(id="q", question=Q, golden_answers=["x"])],
        SamplingParams(max_new_tokens=50),
    )
    guarded_rewards(PerTurn(), [traj])
    ends = traj.policy_turn_ends()
    assert len(ends) == 3 and traj.turn_rewards == pytest.approx([0.0, 0.1, 0.2])
    batch = collate([traj], tok.pad_token_id)
    out = token_rewards([traj], torch.tensor([1.0]), batch.action_mask)
    nonzero = out[0].nonzero()[:, 0].tolist()
    assert nonzero == [ends[1] - 1, ends[2] - 1]  # turn 0's reward is 0.0; the last turn holds 0.2 + 1.0
    assert out[0, ends[1] - 1].item() == pytest.approx(0.1) and out[0, ends[2] - 1].item() == pytest.approx(
        1.2
    )
    for end in ends:  # each is the last token before the environment's insertion (or the response's end)
        assert batch.action_mask[0, end - 1] == 1 and (
            end == len(traj.response_ids) or traj.loss_mask[end] == 0
        )
