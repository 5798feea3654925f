"""Each reward/metric rule that differs from the upstream code has a switch giving the upstream
behaviour, checked on hand-made cases against small reference readings of the upstream rules
(written here from the behaviour docs/compatibility.md describes, not copied); adaptive KL is
verl's controller, checked by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from sleuth.agent.search_r1 import SEARCH_R1_USER_TEMPLATE
from sleuth.errors import ConfigError
from sleuth.llm.base import SamplingParams
from sleuth.rewards import RewardServices, get_reward
from sleuth.rewards.answerer import judge_contains, judge_verdict
from sleuth.rewards.metrics import extract_answer, f1_score
from test_rewards import OBS, FakeGenerator, hit, make_traj

PROMPT = SEARCH_R1_USER_TEMPLATE.format(question="What is the capital of Varonia?")


def upstream_extract(text: str) -> str | None:
    """Search-R1's reading: every `<answer>(.*?)</answer>` match of the whole decoded text; None
    for fewer than two (the prompt's own two), else the last, stripped."""
    found = list(re.finditer(r"<answer>(.*?)</answer>", text, re.DOTALL))
    return found[-1].group(1).strip() if len(found) > 1 else None


RESPONSES = [
    "<think>no idea</think>",  # no answer: upstream reads "Beijing"
    "<think>x</think><answer>Quellstad</answer>",
    "<answer>  Quellstad \n</answer>",  # whitespace inside the tags
    "<answer>\n\n</answer>",  # only whitespace
    "<answer> Beijing </answer> then <answer>\tQuellstad\t</answer>",
    "<answer>Quellstad",  # unclosed
    "< answer >Quellstad</ answer >",  # not a tag for either
]


@pytest.mark.parametrize("response", RESPONSES)
def test_search_r1_upstream_answer_source_reads_like_extract_solution(response: str) -> None:
    from sleuth.rewards.search_r1 import search_r1_answer

    traj = make_traj([("policy", response)], ["Quellstad"], prompt_text=PROMPT)
    assert search_r1_answer(traj, "upstream") == upstream_extract(PROMPT + response)
    policy = search_r1_answer(traj, "policy")
    if "</answer>" in response:  # a response with its own answer: both readings agree
        assert policy == upstream_extract(PROMPT + response)
    else:
        assert policy is None


def test_search_r1_rewards_score_a_missing_answer_as_the_prompts_example_under_upstream() -> None:
    traj = make_traj([("policy", "<think>I do not know</think>")], ["Beijing"], prompt_text=PROMPT)
    assert get_reward("search_r1_em")([traj])[0].total == 0.0
    assert get_reward("search_r1_em", answer_source="upstream")([traj])[0].total == 1.0
    # format EM: no answer and an invalid sequence gives 0; upstream reads "Beijing" -> correct but
    # invalid -> score - structure_format_score = 0.8
    assert get_reward("search_r1_format_em")([traj])[0].total == 0.0
    assert get_reward("search_r1_format_em", answer_source="upstream")([traj])[0].total == pytest.approx(0.8)
    with pytest.raises(ConfigError, match="answer_source"):
        get_reward("search_r1_em", answer_source="prompt")


JUDGE_REPLIES = [  # (reply, sleuth strict, s3's upstream rule)
    ("Yes", True, True),
    ("no", False, False),
    ("No, it does not say yes.", False, True),
    ("The response does not contain the golden answers (yes/no): no", False, True),
    ("eyes", False, True),
    ("YES.", True, True),
    ("maybe", False, False),
]


@pytest.mark.parametrize(("reply", "strict", "upstream"), JUDGE_REPLIES)
def test_judge_rules(reply: str, strict: bool, upstream: bool) -> None:
    assert judge_verdict(reply, "strict") is strict
    assert judge_verdict(reply, "upstream") is upstream == ("yes" in reply.lower())


def test_s3_genacc_and_eval_take_the_upstream_judge_rule() -> None:
    from sleuth.eval.harness import EvalConfig, score_predictions

    judge = FakeGenerator(lambda p: "No, it does not say yes.")
    generator = FakeGenerator(lambda p: "Lehman")
    traj = make_traj(
        [("policy", "<search_complete>True</search_complete>")],
        ["Countrywide"],
        served_context=[hit("1", "T", "Bank of America bought Countrywide.")],
    )
    services = RewardServices(generator=generator, judge=judge)
    assert get_reward("s3_genacc")([traj], services)[0].total == 0.0
    assert get_reward("s3_genacc", judge_rule="upstream")([traj], services)[0].total == 1.0
    strict = score_predictions(["q"], [["Countrywide"]], ["Lehman"], judge)
    upstream = score_predictions(["q"], [["Countrywide"]], ["Lehman"], judge, "upstream")
    assert (strict[0]["genacc"], upstream[0]["genacc"]) == (0.0, 1.0)
    with pytest.raises(ConfigError, match="judge_rule"):
        EvalConfig(judge_rule="lenient")


class ReplayJudge(FakeGenerator):
    """Replies from a queue per prompt (the first call's reply, then the second's), recording the params."""

    def __init__(self, replies: list[str]):
        super().__init__(lambda p: "")
        self.queue = list(replies)
        self.params: list[SamplingParams | None] = []

    def generate(self, batch, stop=None, params=None):
        self.params.append(params)
        self.rule = lambda p: self.queue.pop(0)
        return super().generate(batch, stop, params)


def s3_reference(first: str, second: str) -> bool:
    """s3's `check_if_response_is_correct_llm` on its judge's two possible replies (the second asked only when
    the first holds neither word), as docs/compatibility.md describes it: "yes" anywhere lowercased, else "no"
    anywhere, else ask again and read the second reply the same way (neither: no). The reply is what its
    `call_llm` returns: the message text stripped, reasoning included."""
    for reply in (first.strip(), second.strip()):
        if "yes" in reply.lower():
            return True
        if "no" in reply.lower():
            return False
    return False


JUDGE_PAIRS = [  # (first reply, second reply if asked again)
    ("<think>yes</think> no", ""),  # the case: 1 upstream, 0 in sleuth on main
    ("<think>no</think> Yes", ""),
    ("<think>The answer is there", ""),  # an unterminated reasoning block
    ("maybe", "yes"),  # neither word: asked again
    ("maybe", "NO"),
    ("", "Yes."),
    ("I cannot tell", "still unsure"),
    ("  Yes  ", ""),
    *[(reply, "") for reply, _, _ in JUDGE_REPLIES],
]


@pytest.mark.parametrize(("first", "second"), JUDGE_PAIRS)
def test_upstream_judge_reads_the_raw_reply_and_asks_again_like_s3(first: str, second: str) -> None:
    judge = ReplayJudge([first, second])
    said = judge_contains(judge, ["q"], [["Countrywide"]], ["Lehman"], rule="upstream")
    assert said == [s3_reference(first, second)]
    asked_again = "yes" not in first.lower() and "no" not in first.lower()
    assert len(judge.batches) == 1 + asked_again
    # s3's call: at most 10 tokens, temperature 0
    assert all(p.max_new_tokens == 10 and p.temperature == 0.0 for p in judge.params)


def test_the_strict_judge_drops_reasoning_and_asks_once() -> None:
    judge = ReplayJudge(["<think>yes</think> no", "maybe"])
    assert judge_contains(judge, ["q", "q"], [["a"], ["a"]], ["b", "b"]) == [False, False]
    assert len(judge.batches) == 1 and judge.params[0].max_new_tokens == 16


def test_s3_reward_under_the_upstream_judge_rule_scores_the_reasoning_yes() -> None:
    """Through the reward: on main s3_genacc with judge_rule: upstream scored `<think>yes</think> no` as 0."""
    traj = make_traj(
        [("policy", "<search_complete>True</search_complete>")],
        ["Countrywide"],
        served_context=[hit("1", "T", "Bank of America bought Countrywide.")],
    )
    services = RewardServices(
        generator=FakeGenerator(lambda p: "Lehman"), judge=FakeGenerator(lambda p: "<think>yes</think> no")
    )
    assert get_reward("s3_genacc", judge_rule="upstream")([traj], services)[0].total == 1.0
    assert get_reward("s3_genacc")([traj], services)[0].total == 0.0


@pytest.mark.parametrize("response", [*RESPONSES, "<answer>Quellstad</answer>"])
def test_extract_answer_upstream_rule_is_extract_solution(response: str) -> None:
    """The public helper `sleuth.rewards.extract_answer` has Search-R1's reading as a switch: on the decoded
    prompt + response, as the rewards' `answer_source: upstream` reads it; on main it had none."""
    assert extract_answer(PROMPT + response, "upstream") == upstream_extract(PROMPT + response)
    # without the prompt's two example blocks, a response's lone answer is no answer upstream
    assert extract_answer(response, "upstream") == upstream_extract(response)
    found = re.findall(r"<answer>(.*?)</answer>", response, re.DOTALL)
    assert extract_answer(response) == (found[-1].strip() if found else None)
    with pytest.raises(ValueError, match="answer rule"):
        extract_answer(response, "prompt")


def test_r_search_upstream_f1_rounding_and_yes_no() -> None:
    # "Countrywide" vs "Countrywide Financial": P = 1, R = 1/2, F1 = 2/3
    assert f1_score("Countrywide", ["Countrywide Financial"]) == pytest.approx(2 / 3)
    assert f1_score("Countrywide", ["Countrywide Financial"], yes_no_rule=False, digits=2) == 0.67
    # "yes it is" vs "yes": P = 1/3, R = 1, F1 = 0.5 without FlashRAG's yes/no rule
    assert f1_score("yes it is", ["yes"]) == 0.0
    assert f1_score("yes it is", ["yes"], yes_no_rule=False, digits=2) == 0.5


def test_r_search_rules_upstream_in_the_reward() -> None:
    evidence = "<original_evidence>Bank of America bought Countrywide in 2008.</original_evidence>"
    spans = [("policy", "<search>q</search>"), ("env", OBS), ("policy", f"{evidence}<answer>and</answer>")]
    answer_only = [
        ("policy", "<search>q</search>"),
        ("env", OBS),
        ("policy", f"{evidence}<answer>Countrywide</answer>"),
    ]
    trajs = [make_traj(spans, ["Countrywide Financial"]), make_traj(answer_only, ["Countrywide Financial"])]
    gen = FakeGenerator(lambda p: "Countrywide")
    ours = get_reward("r_search")(trajs, RewardServices(generator=gen))
    theirs = get_reward("r_search", rules="upstream")(trajs, RewardServices(generator=gen))
    # "<answer>and</answer>": 0.4 (evidence + answer) in sleuth, 0.2 (evidence only) upstream
    assert ours[0].components["format"] == pytest.approx(0.4)
    assert theirs[0].components["format"] == pytest.approx(0.2)
    assert ours[1].components["answer_f1"] == pytest.approx(2 / 3)
    assert theirs[1].components["answer_f1"] == 0.67 and theirs[1].components["evidence_f1"] == 0.67
    assert theirs[1].total == pytest.approx(0.67 + 0.67 + 0.4)
    with pytest.raises(ConfigError, match="rules"):
        get_reward("r_search", rules="paper")


# ---------------------------------------------------------------- adaptive KL (verl)


def test_adaptive_kl_coef_by_hand() -> None:
    from sleuth.rl.losses import adaptive_kl_coef, sequence_mean_kl

    # KL 0.15 over target 0.1: error 0.5 clipped to 0.2; 16 sequences over a horizon of 10000
    assert adaptive_kl_coef(0.001, 0.15, 0.1, 10000, 16) == pytest.approx(0.001 * (1 + 0.2 * 16 / 10000))
    # KL 0.09: error -0.1, not clipped
    assert adaptive_kl_coef(0.001, 0.09, 0.1, 10000, 16) == pytest.approx(0.001 * (1 - 0.1 * 16 / 10000))
    # KL 0: error -1 clipped to -0.2; horizon 10 moves it fast
    assert adaptive_kl_coef(0.5, 0.0, 0.1, 10, 5) == pytest.approx(0.5 * (1 - 0.2 * 5 / 10))
    kl = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 1, 1]])
    assert sequence_mean_kl(kl, mask).tolist() == [1.5, 0.0, 8.5]


def test_adaptive_kl_needs_the_reward_penalty() -> None:
    from sleuth.rl.config import recipe_from_dict

    base = {
        "name": "t",
        "model": {"policy": "tiny"},
        "data": {"train": "x.jsonl"},
        "retriever": {"index": "x"},
    }
    with pytest.raises(ConfigError, match="algorithm.kl.mode: penalty"):
        recipe_from_dict({**base, "algorithm": {"kl": {"type": "adaptive"}}})
    recipe = recipe_from_dict(
        {
            **base,
            "algorithm": {
                "kl": {"type": "adaptive", "mode": "penalty", "coef": 0.01, "target_kl": 0.05, "horizon": 100}
            },
        }
    )
    assert (recipe.algorithm.kl.target_kl, recipe.algorithm.kl.horizon) == (0.05, 100)


def test_adaptive_kl_moves_the_coefficient_each_step_and_resumes_it(
    small_world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sleuth.rl import losses
    from sleuth.rl.checkpoint import latest_checkpoint
    from sleuth.rl.config import recipe_from_dict
    from sleuth.rl.trainer import train
    from test_rl_trainer import _recipe

    used: list[float] = []
    real = losses.apply_kl_penalty
    monkeypatch.setattr(
        losses, "apply_kl_penalty", lambda r, kl, beta, m: (used.append(beta), real(r, kl, beta, m))[1]
    )
    algorithm = {
        "name": "grpo",
        "n": 2,
        "prompts_per_step": 1,
        "minibatch_size": 2,
        "micro_batch_size": 2,
        "kl": {"type": "adaptive", "mode": "penalty", "coef": 0.1, "target_kl": 1e-9, "horizon": 4},
    }
    data = _recipe(small_world, tmp_path / "run", algorithm, steps=2)
    data["model"]["lora"] = {"enabled": False}
    data["trainer"]["save_every"] = 2
    train(recipe_from_dict(data))
    # step 1: the policy is the reference, KL 0, error -1 clipped to -0.2: 0.1 * (1 - 0.2 * 2 / 4) = 0.09;
    # step 2: the updated policy's KL is far above the 1e-9 target: +0.2 -> 0.09 * 1.1
    assert used == pytest.approx([0.1, 0.09])
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["actor/kl_coef_next"] for m in metrics] == pytest.approx([0.09, 0.099])
    state = json.loads((latest_checkpoint(tmp_path / "run") / "trainer_state.json").read_text())
    assert state["kl_coef"] == pytest.approx(0.099)
    # a resumed run starts from the saved coefficient, not the recipe's
    data["trainer"]["total_steps"] = 3
    train(recipe_from_dict(data), resume=True)
    assert used[2] == pytest.approx(0.099)
