"""Forking a trajectory at a turn boundary (sleuth.agent.engine.fork / rollout_tree, Tree-GRPO's sampling): with
greedy decoding a branch's tokens, loss mask and log-probs equal the chain it forked from, on the HF dynamic-cache
fallback (the branch's prefix prefilled again) and on the decode engine (the branch continues from its parent's
held keys/values: one new token prefilled per branch turn)."""

from __future__ import annotations

import pytest
import torch

from plugin_install import installed
from sleuth.agent import engine as agent_engine
from sleuth.agent import get_loop
from sleuth.agent.engine import TreeSpec, fork, rollout, rollout_tree
from sleuth.data.formats import QAExample
from sleuth.errors import ConfigError
from sleuth.llm.base import SamplingParams
from sleuth.llm.decode_engine import DecodeEngine
from sleuth.llm.hf import HFGenerator
from sleuth.llm.prefix_cache import Prefix, PrefixStore
from toyworld import ToyRetriever

EXAMPLES = [
    QAExample(id="q1", question="What is the capital of Varonia?", golden_answers=["Quellstad"]),
    QAExample(id="q2", question="Where was the director of Blue Harbor born?", golden_answers=["Tarsk"]),
]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sleuth.llm.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float64).eval()
    return HFGenerator(model, tokenizer=AutoTokenizer.from_pretrained(path), device="cpu", cache="dynamic")


@pytest.fixture(scope="module")
def engine_gen(tmp_path_factory):
    from sleuth.llm.tiny import build_tiny_model

    return HFGenerator(
        build_tiny_model(tmp_path_factory.mktemp("tiny_engine")), device="cpu", cache="engine", sync_every=3
    )


def _check_branches_equal_chains(trajs, abs_tol: float) -> None:
    for group in (0, 1):
        rows = [t for t in trajs if t.group == group]
        chain, branches = rows[0], rows[1:]
        assert chain.num_turns >= 2 and len(branches) == 4  # 2 rounds x 2 nodes of the one tree
        assert {b.extra["forked_at_turn"] for b in branches} <= set(range(1, chain.num_turns + 1))
        assert len({b.extra["forked_at_turn"] for b in branches}) >= 2  # forks at different boundaries
        for b in branches:
            assert b.response_ids == chain.response_ids and b.loss_mask == chain.loss_mask
            assert b.logprobs == pytest.approx(chain.logprobs, abs=abs_tol)
            assert b.prompt_ids == chain.prompt_ids and b.extra["tree"] == 0


def test_a_greedy_branch_equals_the_chain_it_forked_from(gen) -> None:
    # an untrained model writes no action: every turn ends with the invalid-action feedback, a turn boundary
    loop = get_loop("search_r1", max_turns=3)
    trajs = rollout_tree(
        loop, gen, ToyRetriever(), EXAMPLES, GREEDY, TreeSpec(trees=1, expansions=2, branches=2)
    )
    _check_branches_equal_chains(trajs, 1e-9)
    # the chain itself is what a plain rollout gives
    (plain, _) = rollout(loop, gen, ToyRetriever(), EXAMPLES, GREEDY)
    assert plain.response_ids == trajs[0].response_ids and plain.loss_mask == trajs[0].loss_mask


def test_on_the_decode_engine_a_branch_reuses_its_parents_keys_and_equals_the_chain(
    engine_gen, gen, monkeypatch
) -> None:
    """The decode engine on CPU: a branch's first generation prefills one token (its prefix, the parent's, is held in
    the pool, not computed again), its later ones only their own new observation, and the branch still equals its
    chain; the chain equals the plain rollout of the engine and of the dynamic-cache fallback."""
    starts: list[
        tuple[int, list[int]]
    ] = []  # (engine run: 0 the chains, 1.. the expansion rounds, new tokens per row)
    phase = [0]
    real_start, real_run = DecodeEngine.start, agent_engine._Engine.run

    def recording_start(self, prompts, max_new, **kwargs):
        offsets = [f.tokens if f is not None else 0 for f in map(self.prefixes.match, prompts)]
        starts.append((phase[0], [len(p) - o for p, o in zip(prompts, offsets, strict=True)]))
        return real_start(self, prompts, max_new, **kwargs)

    def run_counting_the_phase(self, states, *args, **kwargs):
        out = real_run(self, states, *args, **kwargs)
        phase[0] += 1
        return out

    monkeypatch.setattr(DecodeEngine, "start", recording_start)
    monkeypatch.setattr(agent_engine._Engine, "run", run_counting_the_phase)
    loop = get_loop("search_r1", max_turns=3)
    reused_before = engine_gen.engine.reused_tokens
    trajs = rollout_tree(
        loop, engine_gen, ToyRetriever(), EXAMPLES, GREEDY, TreeSpec(trees=1, expansions=2, branches=2)
    )
    monkeypatch.setattr(agent_engine._Engine, "run", real_run)
    monkeypatch.setattr(DecodeEngine, "start", real_start)
    _check_branches_equal_chains(trajs, 1e-5)
    chains_first = starts[0][1]
    assert starts[0][0] == 0 and min(chains_first) > 250  # the chains' prompts were prefilled whole
    for round_ in (1, 2):
        first, *later = [rows for p, rows in starts if p == round_]
        assert first == [1, 1, 1, 1]  # 2 questions x 2 forks: only each prompt's last token
        assert all(0 < n < 130 for rows in later for n in rows)  # a next turn: the observation and a token
    shared = sum(b.extra["shared_policy_tokens"] for b in trajs if "forked_at_turn" in b.extra)
    assert engine_gen.engine.reused_tokens - reused_before > len(trajs[0].prompt_ids) * 8 + shared
    assert not engine_gen.engine.prefixes.hold and not engine_gen.engine.prefixes.rows()  # the hold ended
    plain_engine = rollout(loop, engine_gen, ToyRetriever(), EXAMPLES, GREEDY)
    plain_dynamic = rollout(loop, gen, ToyRetriever(), EXAMPLES, GREEDY)
    for t, a, b in zip([t for t in trajs if t.sample == 0], plain_engine, plain_dynamic, strict=True):
        assert (
            t.response_ids == a.response_ids == b.response_ids and t.loss_mask == a.loss_mask == b.loss_mask
        )
        assert t.logprobs == pytest.approx(a.logprobs, abs=1e-5)  # (the dynamic path's model is float64)


def test_fork_copies_a_state_at_a_turn_boundary(gen) -> None:
    engine, states = agent_engine._prepared(
        get_loop("search_r1", max_turns=3),
        gen,
        ToyRetriever(),
        EXAMPLES[:1],
        GREEDY,
        1,
        agent_engine.RolloutBudget(),
        None,
    )
    engine.fork_points = []
    engine.run(states)
    point = engine.fork_points[0]
    copies = fork(point, 3, first_sample=5)
    assert [c.sample for c in copies] == [5, 6, 7] and [c.traj.sample for c in copies] == [5, 6, 7]
    assert all(c.traj.extra["forked_at_turn"] == point.turns_taken == 1 for c in copies)
    assert all(c.traj.extra["shared_policy_tokens"] == sum(point.traj.loss_mask) > 0 for c in copies)
    assert all(c.traj.extra["shared_retrievals"] == point.traj.retrieval_count for c in copies)
    copies[0].traj.response_ids.append(-1)  # independent: the state and the other copies are untouched
    assert copies[1].traj.response_ids == point.traj.response_ids and "forked_at_turn" not in point.traj.extra
    with pytest.raises(ConfigError, match="finished"):
        fork(states[0], 1, 1)


def test_the_prefix_store_in_hold_mode_matches_common_prefixes_and_drops_rows_continued_whole() -> None:
    store = PrefixStore()
    store.hold = True
    store.remember([[1, 2, 3, 4, 5, 6], [1, 2, 9, 7]], [0, 10])
    assert store.match([1, 2, 3, 7]) == Prefix(start=0, tokens=3)  # shares 1 2 3 with the first row
    assert store.match([1, 2, 3, 4]) == Prefix(start=0, tokens=3)  # a prefix of a row: all but its last token
    assert store.match([1, 2, 9, 9, 9]) == Prefix(start=10, tokens=3)  # the longest common prefix wins
    assert store.match([1, 2, 9, 7, 9]) == Prefix(start=10, tokens=3)  # a row's last token has no keys
    assert store.match([5, 1]) is None
    store.remember([[1, 2, 9, 7, 8]], [20])  # continues the second row whole: that one goes
    assert [start for _, start in store.rows()] == [0, 20]
    store.hold = False
    store.clear()
    store.remember([[1, 2, 3]], [0])
    assert store.match([1, 2, 4]) is None and not store.rows()  # outside hold: whole rows only


def test_tree_ids_and_samples(gen) -> None:
    trajs = rollout_tree(
        get_loop("search_r1", max_turns=2),
        gen,
        ToyRetriever(),
        EXAMPLES[:1],
        GREEDY,
        TreeSpec(trees=2, expansions=1, branches=1),
    )
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
    trajs = rollout_tree(
        get_loop("tree_search", max_turns=2),
        gen,
        ToyRetriever(),
        EXAMPLES[:1],
        GREEDY,
        TreeSpec(trees=2, expansions=1, branches=1),
    )
    assert tg.tree_ids(trajs) == [(1, 0, 0), (1, 0, 1), (1, 0, 0), (1, 0, 1)]


def test_budget_counts_charge_a_branch_only_what_it_generated_after_its_fork() -> None:
    from sleuth.agent.trajectory import Trajectory

    def traj(mask, retrievals, initial=0, **extra):
        return Trajectory(
            question_id="q",
            question="?",
            golden_answers=[],
            method="tree_search",
            response_ids=list(range(len(mask))),
            loss_mask=mask,
            retrieval_count=retrievals,
            initial_queries=initial,
            extra=extra,
        )

    chain = traj([1, 1, 1, 0, 0, 1, 1, 0, 1], 3, initial=1)  # 6 policy tokens, 2 of the policy's own searches
    branch = traj([1, 1, 1, 0, 0, 1, 1, 1], 3, forked_at_turn=1, shared_policy_tokens=3, shared_retrievals=2)
    with installed("sleuth_tree_grpo") as tg:
        got = tg.budget_counts([chain, branch])
    # tokens 6 + (6 - 3) = 9; searches 2 + (3 - 2) = 3; per 1k tokens: 2 / 9 * 1000 and 3 / 9 * 1000
    assert got == {
        "trajectories": 2.0,
        "generated_tokens": 9.0,
        "tool_calls": 3.0,
        "trajectories_per_1k_tokens": pytest.approx(2000 / 9),
        "tool_calls_per_1k_tokens": pytest.approx(3000 / 9),
        "tool_calls_per_trajectory": 1.5,
    }
