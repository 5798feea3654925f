"""Several queries in one turn (ParallelSearch 2508.09303): `max_queries_per_turn` on the search-or-answer loops.
`<search> q1 ## q2 </search>` runs both queries in one batched retriever call and inserts one observation with a
header per query, in query order; the default (1) keeps every loop exactly as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plugin_install import installed
from sleuth.agent import get_loop
from sleuth.agent.base import fair_shares
from sleuth.agent.engine import RolloutBudget, rollout
from sleuth.agent.r_search import R_SEARCH_INVALID_ACTION
from sleuth.agent.search_r1 import SEARCH_R1_INVALID_ACTION
from sleuth.data.formats import QAExample
from sleuth.errors import ConfigError
from sleuth.llm.base import SamplingParams
from sleuth.llm.scripted import ScriptedGenerator
from sleuth.retrieval.base import format_docs
from sleuth.rewards import get_reward
from sleuth.rewards.base import RewardServices
from sleuth.rewards.search_r1 import search_r1_valid_sequence
from toyworld import ToyRetriever

Q1 = "What is the capital of Varonia?"
Q2 = "Where was the director of Blue Harbor born?"
EX1 = QAExample(id="q1", question=Q1, golden_answers=["Quellstad"])
EX2 = QAExample(id="q2", question=Q2, golden_answers=["Tarsk"])
TWO = "<think> two things </think> <search> capital of Varonia ## Mara Ilves born </search>"
ANSWER = "<think> found </think> <answer> Quellstad </answer>"


@pytest.fixture(scope="module")
def tok(tiny_tokenizer):
    return tiny_tokenizer


def run(tok, loop_name, script, examples=(EX1,), **loop_cfg):
    budget = RolloutBudget(max_obs_tokens=loop_cfg.pop("max_obs_tokens", 512))
    gen, ret = ScriptedGenerator(tok, script), ToyRetriever()
    trajs = rollout(
        get_loop(loop_name, **loop_cfg),
        gen,
        ret,
        list(examples),
        SamplingParams(max_new_tokens=200),
        budget=budget,
    )
    return trajs, gen, ret


def enc(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def policy_outputs(gen: ScriptedGenerator) -> list[list[int]]:
    return [list(o.token_ids) for outs in gen.outputs for o in outs]


@pytest.mark.parametrize("loop_name", ["search_r1", "staged", "r_search", "stepsearch"])
def test_default_and_single_query_turns_are_unchanged(tok, loop_name) -> None:
    if loop_name == "stepsearch":  # a plugin's loop on search_or_answer (through SearchR1Loop.act)
        with installed("sleuth_stepsearch"):
            _check_unchanged(tok, loop_name)
    else:
        _check_unchanged(tok, loop_name)


def _check_unchanged(tok, loop_name) -> None:
    k = get_loop(loop_name).top_k
    script = {Q1: ["<think> a </think> <search> capital of Varonia </search>", ANSWER]}
    (base,), _, _ = run(tok, loop_name, script)
    (multi,), _, ret = run(tok, loop_name, script, max_queries_per_turn=3)
    assert multi.response_ids == base.response_ids and multi.loss_mask == base.loss_mask
    assert (
        multi.logprobs == base.logprobs
        and multi.turns == base.turns
        and ret.calls == [(["capital of Varonia"], k)]
    )
    # by default "##" is part of the one query, as before
    (traj,), _, ret = run(tok, loop_name, {Q1: [TWO, ANSWER]})
    assert traj.queries == ["capital of Varonia ## Mara Ilves born"] and traj.retrieval_count == 1
    assert len(ret.calls) == 1 and len(ret.calls[0][0]) == 1


def test_two_query_turn_one_batched_call_documents_in_order_and_masks(tok) -> None:
    (traj,), gen, ret = run(tok, "search_r1", {Q1: [TWO, ANSWER]}, max_queries_per_turn=2)
    assert ret.calls == [(["capital of Varonia", "Mara Ilves born"], 3)]  # one call, both queries, in order
    assert traj.queries == ["capital of Varonia", "Mara Ilves born"] and traj.retrieval_count == 2
    assert traj.invalid_actions == 0 and traj.answer == "Quellstad" and traj.num_turns == 2
    hits1, hits2 = ToyRetriever().search(["capital of Varonia", "Mara Ilves born"], 3)
    assert [h["doc_id"] for h in traj.retrieved[0]] == [h.doc_id for h in hits1]
    assert [h["doc_id"] for h in traj.retrieved[1]] == [h.doc_id for h in hits2]
    env = [t for t in traj.turns if t.role == "env"]
    assert len(env) == 1  # one observation for the turn
    want = (
        enc(tok, "\n\n<information>")
        + enc(tok, "Query 1: capital of Varonia\n")
        + enc(tok, format_docs(hits1))
        + enc(tok, "\n\nQuery 2: Mara Ilves born\n")
        + enc(tok, format_docs(hits2))
        + enc(tok, "</information>\n\n")
    )
    assert traj.response_ids[env[0].start : env[0].end] == want
    text = tok.decode(want)
    assert (
        text.index("Query 1: capital of Varonia")
        < text.index("Varonia is a country")
        < text.index("Query 2: Mara Ilves born")
        < text.index("Mara Ilves was born in Tarsk")
    )
    # masks from ids: the policy's generated ids are exactly the mask-1 tokens, in order; every inserted one is 0
    outs = policy_outputs(gen)
    assert [i for i, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m == 1] == outs[0] + outs[1]
    assert traj.response_ids == outs[0] + want + outs[1]
    assert traj.loss_mask == [1] * len(outs[0]) + [0] * len(want) + [1] * len(outs[1])
    assert traj.logprobs[len(outs[0]) : len(outs[0]) + len(want)] == [0.0] * len(want)


def test_several_trajectories_share_one_retriever_call(tok) -> None:
    script = {
        Q1: [TWO, ANSWER],
        Q2: ["<search> Blue Harbor director ## Tarsk </search>", "<answer> Tarsk </answer>"],
    }
    trajs, _, ret = run(tok, "search_r1", script, examples=(EX1, EX2), max_queries_per_turn=2)
    assert ret.calls == [(["capital of Varonia", "Mara Ilves born", "Blue Harbor director", "Tarsk"], 3)]
    assert [t.retrieval_count for t in trajs] == [2, 2]


@pytest.mark.parametrize(
    ("loop_name", "message"), [("search_r1", SEARCH_R1_INVALID_ACTION), ("r_search", R_SEARCH_INVALID_ACTION)]
)
def test_over_the_limit_is_an_invalid_action_with_the_loops_message(tok, loop_name, message) -> None:
    script = {Q1: ["<search> a ## b ## c </search>", ANSWER]}
    (traj,), _, ret = run(tok, loop_name, script, max_queries_per_turn=2)
    assert ret.calls == [] and traj.retrieval_count == 0 and traj.invalid_actions == 1
    assert traj.extra["too_many_queries"] == 1
    assert [t.text for t in traj.turns if t.role == "env"] == [message]
    # empty parts are dropped; all empty is the empty-query invalid action
    (traj,), _, ret = run(
        tok, loop_name, {Q1: ["<search> a ##  ## </search>", ANSWER]}, max_queries_per_turn=2
    )
    assert ret.calls == [(["a"], 3)] and traj.queries == ["a"]
    (traj,), _, ret = run(tok, loop_name, {Q1: ["<search> ## </search>", ANSWER]}, max_queries_per_turn=2)
    assert ret.calls == [] and traj.invalid_actions == 1 and traj.extra["empty_queries"] == 1


def test_r_search_headers_inside_its_observation(tok) -> None:
    (traj,), _, _ = run(tok, "r_search", {Q1: [TWO, ANSWER]}, max_queries_per_turn=2)
    (env,) = [t.text for t in traj.turns if t.role == "env"]
    assert env.startswith("\n\n<observation>Query 1: capital of Varonia\n(Title:")
    assert "\n\nQuery 2: Mara Ilves born\n(Title:" in env and env.endswith("</observation>\n\n")


def test_fair_shares() -> None:
    assert fair_shares([10, 2, 10], 12) == [5, 2, 5]
    assert fair_shares([3, 4], 100) == [3, 4]
    assert fair_shares([9, 9], 5) == [2, 3]
    assert fair_shares([5, 5], 0) == [0, 0]


def test_truncation_is_shared_fairly_across_queries(tok) -> None:
    limit = 60
    (traj,), _, _ = run(tok, "search_r1", {Q1: [TWO, ANSWER]}, max_queries_per_turn=2, max_obs_tokens=limit)
    hits1, hits2 = ToyRetriever().search(["capital of Varonia", "Mara Ilves born"], 3)
    pre, suf = enc(tok, "\n\n<information>"), enc(tok, "</information>\n\n")
    h1, h2 = enc(tok, "Query 1: capital of Varonia\n"), enc(tok, "\n\nQuery 2: Mara Ilves born\n")
    d1, d2 = enc(tok, format_docs(hits1)), enc(tok, format_docs(hits2))
    room = limit - len(pre) - len(suf) - len(h1) - len(h2)
    assert 0 < room < len(d1) + len(d2)
    n1, n2 = fair_shares([len(d1), len(d2)], room)
    assert abs(n1 - n2) <= 1 and n1 > 0 and n2 > 0  # both queries keep documents
    (env,) = [t for t in traj.turns if t.role == "env"]
    assert traj.response_ids[env.start : env.end] == pre + h1 + d1[:n1] + h2 + d2[:n2] + suf
    assert env.end - env.start <= limit and traj.obs_truncated_tokens == len(d1) + len(d2) - n1 - n2


def test_the_option_is_refused_where_the_loop_does_not_read_it() -> None:
    with pytest.raises(ConfigError, match="max_queries_per_turn"):
        get_loop("search_r1", max_queries_per_turn=0)
    for name in ("qagent", "s3"):
        with pytest.raises(ConfigError, match="max_queries_per_turn"):
            get_loop(name, max_queries_per_turn=2)
        assert get_loop(name).max_queries_per_turn == 1


class _Encoder:
    def encode(self, texts):
        return np.array([[1.0, 0.0] if "Varonia" in t else [0.0, 1.0] for t in texts], dtype=np.float32)


def test_rewards_read_the_retrieval_count_as_queries(tok) -> None:
    # retrieval_count counts queries, not search turns: a two-query turn is RC 2 for the staged reward, which
    # then scores those two queries' diversity; Search-R1's format reward sees one search and one information
    script = {
        Q1: [
            "<think> two </think> <search> capital of Varonia ## Mara Ilves born </search>",
            "<reflect> found </reflect> <answer> Quellstad </answer>",
        ]
    }
    (traj,), _, _ = run(tok, "staged", script, max_queries_per_turn=2)
    assert traj.extra["rc"] == traj.retrieval_count == 2 and traj.extra["format_ok"] is True
    res = get_reward("staged", stage=1, correctness="em")([traj], RewardServices(encoder=_Encoder()))[0]
    assert res.components["rc"] == 2.0 and res.components["avg_sim"] == pytest.approx(0.0)
    assert res.components["r_a"] == 1.0 and res.components["r_f"] == 1.0
    (traj,), _, _ = run(tok, "search_r1", {Q1: [TWO, ANSWER]}, max_queries_per_turn=2)
    assert search_r1_valid_sequence(traj)
    res = get_reward("search_r1_format_em")([traj])[0]
    assert (
        res.components["format_valid"] == 1.0 and res.components["retrieval_hit"] == 1.0 and res.total == 1.0
    )


def test_a_recipe_sets_it_through_agent_options() -> None:
    from sleuth.agent.registry import get_method
    from sleuth.rl.config import load_recipe
    from sleuth.rl.setup import loop_options

    recipe = load_recipe(
        Path(__file__).resolve().parents[1] / "recipes" / "staged.yaml",
        ["agent.options.max_queries_per_turn=3"],
    )
    loop = get_method(recipe.agent.loop).build_loop(**loop_options(recipe))
    assert loop.name == "staged" and loop.max_queries_per_turn == 3
