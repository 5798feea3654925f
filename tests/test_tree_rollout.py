"""Forking a trajectory at a turn boundary (sleuth.agent.engine.rollout_tree, Tree-GRPO's sampling): with greedy
decoding on the HF/CPU path a branch's tokens, loss mask and log-probs equal the chain it forked from."""

from __future__ import annotations

import pytest
import torch

from plugin_install import installed
from sleuth.agent import get_loop
from sleuth.agent.engine import TreeSpec, rollout, rollout_tree
from sleuth.data.formats import QAExample
from sleuth.errors import ConfigError
from sleuth.llm.base import SamplingParams
from sleuth.llm.hf import HFGenerator
from toyworld import ToyRetriever

EXAMPLES = [QAExample(id="q1", question="What is the capital of Varonia?", golden_answers=["Quellstad"]),
            QAExample(id="q2", question="Where was the director of Blue Harbor born?", golden_answers=["Tarsk"])]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sleuth.llm.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float64).eval()
    return HFGenerator(model, tokenizer=AutoTokenizer.from_pretrained(path), device="cpu", cache="dynamic")


def test_a_greedy_branch_equals_the_chain_it_forked_from(gen) -> None:
    # an untrained model writes no action: every turn ends with the invalid-action feedback, a turn boundary
    loop = get_loop("search_r1", max_turns=3)
    trajs = rollout_tree(loop, gen, ToyRetriever(), EXAMPLES, GREEDY, TreeSpec(trees=1, expansions=2, branches=2))
    for group in (0, 1):
        rows = [t for t in trajs if t.group == group]
        chain, branches = rows[0], rows[1:]
        assert chain.num_turns >= 2 and len(branches) == 4  # 2 rounds x 2 nodes of the one tree
        assert {b.extra["forked_at_turn"] for b in branches} <= set(range(1, chain.num_turns + 1))
        for b in branches:
            assert b.response_ids == chain.response_ids and b.loss_mask == chain.loss_mask
            assert b.logprobs == pytest.approx(chain.logprobs, abs=1e-9)
            assert b.prompt_ids == chain.prompt_ids and b.extra["tree"] == 0
    # the chain itself is what a plain rollout gives
    (plain, _) = rollout(loop, gen, ToyRetriever(), EXAMPLES, GREEDY)
    assert plain.response_ids == trajs[0].response_ids and plain.loss_mask == trajs[0].loss_mask


def test_tree_ids_and_samples(gen) -> None:
    trajs = rollout_tree(get_loop("search_r1", max_turns=2), gen, ToyRetriever(), EXAMPLES[:1], GREEDY,
                         TreeSpec(trees=2, expansions=1, branches=1))
    assert [t.sample for t in trajs] == [0, 1, 2, 3]
    assert [t.extra["tree"] for t in trajs] == [0, 1, 0, 1] and "forked_at_turn" not in trajs[0].extra
    with pytest.raises(ConfigError, match="TreeSpec"):
        rollout_tree(get_loop("search_r1"), gen, ToyRetriever(), EXAMPLES, GREEDY, TreeSpec(trees=0))


def test_tree_grpo_advantage_by_hand(gen) -> None:
    with installed("sleuth_tree_grpo") as tg:
        _check_tree_grpo(tg, gen)


def _check_tree_grpo(tg, gen) -> None:
    # rewards (1, 0, 1, 1), one question, trees (0, 0, 1, 1). Inter: mean 0.75, unbiased std 0.5 ->
    # (0.5, -1.5, 0.5, 0.5); intra: tree 0 {1, 0} mean 0.5 std 0.7071 -> (0.7071, -0.7071), tree 1 equal -> 0
    mask = torch.ones(4, 2)
    adv, _ = tg.tree_grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), [0, 0, 0, 0], [0, 0, 1, 1], mask)
    want = torch.tensor([0.5 + 2**-0.5, -1.5 - 2**-0.5, 0.5, 0.5])
    torch.testing.assert_close(adv, want[:, None].expand(4, 2).float(), atol=1e-5, rtol=0)
    trajs = rollout_tree(get_loop("tree_search", max_turns=2), gen, ToyRetriever(), EXAMPLES[:1], GREEDY,
                         TreeSpec(trees=2, expansions=1, branches=1))
    assert tg.tree_ids(trajs) == [(1, 0, 0), (1, 0, 1), (1, 0, 0), (1, 0, 1)]
