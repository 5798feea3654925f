"""StepSearch as a plugin (plugins/sleuth_stepsearch.py): information gain and redundancy per search step, on
the last token of the step's search turn (per-turn rewards), against hand-computed values."""

from __future__ import annotations

import json
import math

import pytest
import torch

from plugin_install import installed
from sleuth.agent import get_loop
from sleuth.agent.engine import rollout
from sleuth.data.formats import QAExample
from sleuth.llm.base import SamplingParams
from sleuth.llm.scripted import ScriptedGenerator
from sleuth.retrieval.sources import open_retriever
from sleuth.retrieval.timed import TimedRetriever
from sleuth.rewards.base import RewardServices, get_reward, guarded_rewards
from sleuth.rl.batch import collate, token_rewards
from toyworld import ToyRetriever

Q = "What is the capital of Varonia?"


@pytest.fixture(scope="module", autouse=True)
def ss():
    """The plugin installed (imported) for this module only, as a recipe's `plugins:` list does."""
    with installed("sleuth_stepsearch") as module:
        yield module


@pytest.fixture(scope="module")
def tok(tiny_tokenizer):
    return tiny_tokenizer


def test_tfidf_cosine_by_hand_and_as_scikit_learn(ss) -> None:
    # fitted on ["aa bb", "aa cc"]: idf(aa) = ln(3/3) + 1 = 1, idf(bb) = idf(cc) = ln(3/2) + 1 = 1.405465;
    # cos = 1 / (1 + 1.405465^2) = 0.336097
    assert ss.tfidf_cosines("aa bb", ["aa cc"]) == pytest.approx([1 / (1 + (math.log(1.5) + 1) ** 2)])
    assert ss.tfidf_cosines("", ["aa"]) == [0.0]
    sklearn = pytest.importorskip("sklearn.feature_extraction.text")
    from sklearn.metrics.pairwise import cosine_similarity

    text, golds = (
        "the river tarsk flows past quellstad",
        ["quellstad is the capital", "tarsk river", "no overlap x"],
    )
    m = sklearn.TfidfVectorizer().fit_transform([text, *golds])
    assert ss.tfidf_cosines(text, golds) == pytest.approx(cosine_similarity(m[0], m[1:]).flatten().tolist())


def test_information_gain_and_redundancy_by_hand(ss) -> None:
    # step 0 finds gold 0 (cos 1) and nothing of gold 1: gain (1 + 0) / 2 = 0.5; step 1 adds gold 1: gain
    # (0 + 1) / 2 = 0.5, and one of its two documents was seen in step 0: redundancy 1/2
    gains, redundancy = ss.information_gain_and_redundancy(
        [["aa bb"], ["aa bb", "cc dd"]], ["aa bb", "cc dd"]
    )
    assert gains == pytest.approx([0.5, 0.5]) and redundancy == pytest.approx([0.0, 0.5])
    assert ss.information_gain_and_redundancy([["aa"]], []) == ([], [])


def test_search_key_score_by_hand(ss) -> None:
    # "capital Varonia" vs "capital of Varonia": p 1, r 2/3 -> F1 0.8 (group 0); "Varonia river" vs "Tarsk river":
    # p 1/2, r 1/2 -> 0.5 beats 0.4 with group 0 (group 1); (0.8 + 0.5) / 2 = 0.65
    keys = [["capital of Varonia"], ["Tarsk river"]]
    assert ss.search_key_score(["capital Varonia", "Varonia river"], keys) == pytest.approx(0.65)
    assert ss.search_key_score([], keys) == 0.0


def test_ends_with_answer(ss) -> None:
    assert ss.ends_with_answer("<search> x </search> <answer> y </answer>\n<|im_end|>")
    assert not ss.ends_with_answer("<answer> y </answer> more")
    assert not ss.ends_with_answer("no answer")


def run(tok, turns: list[str], metadata: dict):
    gen = ScriptedGenerator(tok, {Q: turns})
    ex = QAExample(id="q1", question=Q, golden_answers=["Quellstad"], metadata=metadata)
    (traj,) = rollout(
        get_loop("stepsearch", top_k=1), gen, ToyRetriever(), [ex], SamplingParams(max_new_tokens=60)
    )
    return traj


def test_step_rewards_land_on_the_search_turns(tok) -> None:
    """Search, the same search again, answer: with the first hit as the gold document, step 0 gains 1 (cos 1 with
    it), step 1 gains 0 and repeats its only document (redundancy 1): step rewards 0.6 and -0.6 on the last tokens
    of the two search turns, the outcome F1 1 on the last token."""
    gold = ToyRetriever().search(["capital Varonia"], 1)[0][0].text
    traj = run(
        tok,
        [
            "<search> capital Varonia </search>",
            "<search> capital Varonia </search>",
            "<answer> Quellstad </answer>",
        ],
        {"support_docs": [{"paragraph_text": gold}]},
    )
    (res,) = guarded_rewards(get_reward("stepsearch"), [traj], RewardServices())
    assert res.total == 1.0 and res.turn_rewards == pytest.approx([0.6, -0.6, 0.0])
    assert traj.extra["search_turns"] == [0, 1]
    batch = collate([traj], tok.pad_token_id)
    out = token_rewards([traj], torch.tensor([res.total]), batch.action_mask)[0]
    ends = traj.policy_turn_ends()
    assert out[ends[0] - 1].item() == pytest.approx(0.6) and out[ends[1] - 1].item() == pytest.approx(-0.6)
    assert out[ends[2] - 1].item() == pytest.approx(1.0) and int((out != 0).sum()) == 3
    assert tok.decode(traj.response_ids[ends[0] - 1 : ends[0]]).endswith(">")  # the end of </search>


def test_a_response_that_does_not_end_with_its_answer_scores_minus_one(tok) -> None:
    traj = run(
        tok,
        [
            "<search> capital Varonia </search>",
            "<search> Varonia </search>",
            "<search> x </search>",
            "<search> y </search>",
            "<search> z </search>",
        ],
        {"support_docs": ["anything"]},
    )
    (res,) = get_reward("stepsearch")([traj])
    assert res.total == -1.0 and res.turn_rewards == []


def test_supporting_ids_are_read_from_the_retriever(tok) -> None:
    hit = ToyRetriever().search(["capital Varonia"], 1)[0][0]
    traj = run(
        tok,
        ["<search> capital Varonia </search>", "<answer> Quellstad </answer>"],
        {"supporting_ids": [hit.doc_id], "search_keys": [["capital of Varonia"]]},
    )
    (res,) = get_reward("stepsearch", step_reward_scale=1.6)([traj], RewardServices(retriever=ToyRetriever()))
    # gain 1 x 1.6 (the published code's effective scale); outcome 1 + 0.618 x F1("capital Varonia", key) = 0.8
    assert res.turn_rewards == pytest.approx([1.6, 0.0]) and res.total == pytest.approx(1 + 0.618 * 0.8)


def test_supporting_ids_are_read_from_a_sleuth_index_behind_the_trainers_wrapper(
    ss, tok, small_world
) -> None:
    """The trainer hands the reward its index behind TimedRetriever (a BM25 index has no get_by_ids of its own:
    its DocStore has): the gold documents are the world's passages of those ids."""
    example = json.loads((small_world / "train.jsonl").read_text().splitlines()[0])
    ids = example["metadata"]["supporting_ids"]
    retriever = TimedRetriever(open_retriever(index=str(small_world / "bm25")))
    traj = run(tok, ["<answer> x </answer>"], {"supporting_ids": ids})
    golds = ss._gold_documents(traj, RewardServices(retriever=retriever))
    corpus = {json.loads(x)["id"]: json.loads(x)["contents"] for x in (small_world / "corpus.jsonl").open()}
    assert len(golds) == len(ids) >= 1
    assert all(gold and gold in corpus[i] for gold, i in zip(golds, ids, strict=True))
