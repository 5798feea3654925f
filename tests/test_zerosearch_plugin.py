"""ZeroSearch as a plugin (plugins/sleuth_zerosearch.py): the simulated search engine receives each query's
question, answers, turn and training step (RetrievalContext), and follows the paper's noise curriculum."""

from __future__ import annotations

import pytest

from plugin_install import installed
from sleuth.agent import get_loop
from sleuth.agent.engine import rollout
from sleuth.agent.registry import RunShape, get_method
from sleuth.data.formats import QAExample
from sleuth.errors import ConfigError
from sleuth.llm.base import SamplingParams
from sleuth.llm.scripted import ScriptCall, ScriptedGenerator
from sleuth.retrieval.backends import open_location
from sleuth.retrieval.base import RetrievalContext, StepStamped, wants_context
from sleuth.retrieval.timed import TimedRetriever
from sleuth.rewards.base import get_reward
from sleuth.rl.run import _stepped
from toyworld import ToyRetriever

Q1, Q2 = "What is the capital of Varonia?", "Where was the director of Blue Harbor born?"
EXAMPLES = [
    QAExample(id="q1", question=Q1, golden_answers=["Quellstad", "Q-stad"]),
    QAExample(id="q2", question=Q2, golden_answers=["Tarsk"]),
]


@pytest.fixture(scope="module", autouse=True)
def zs():
    """The plugin installed (imported) for this module only, as a recipe's `plugins:` list does."""
    with installed("sleuth_zerosearch") as module:
        yield module


@pytest.fixture(scope="module")
def tok(tiny_tokenizer):
    return tiny_tokenizer


def test_noise_curriculum_by_hand(zs) -> None:
    # p = 0 + (4^(i/100) - 1) / 3 * 0.5: step 0 -> 0, step 50 -> (2 - 1) / 3 * 0.5 = 1/6, step 100 -> 0.5
    assert zs.noise_probability(0, 100) == 0.0
    assert zs.noise_probability(50, 100) == pytest.approx(1 / 6)
    assert zs.noise_probability(100, 100) == 0.5 and zs.noise_probability(250, 100) == 0.5
    assert zs.noise_probability(None, 100) == 0.5  # evaluation: the end of the curriculum
    assert zs.noise_probability(25, 100, start=0.2, end=0.8, base=10) == pytest.approx(
        0.2 + (10**0.25 - 1) / 9 * 0.6
    )


def test_parse_documents_cuts_at_doc_k_plus_one(zs) -> None:
    text = "Doc 1: alpha one\n\nDoc 2: beta two\nDoc 3: gamma"
    assert zs.parse_documents(text, 2) == ["alpha one", "beta two"]
    assert zs.parse_documents("just prose", 3) == ["just prose"]


def simulator(tok, seen: list[str]) -> ScriptedGenerator:
    def write(call: ScriptCall) -> str:
        seen.append(call.prompt_text)
        kind = "useful" if "Useful Output" in call.prompt_text else "noisy"
        return f"Doc 1: {kind} one\nDoc 2: {kind} two\nDoc 3: {kind} three"

    return ScriptedGenerator(tok, write)


def policy(tok) -> ScriptedGenerator:
    return ScriptedGenerator(
        tok,
        {
            Q1: ["<search> Varonia capital </search>", "<answer> Quellstad </answer>"],
            Q2: ["<search> Varonia capital </search>", "<answer> Tarsk </answer>"],
        },
    )


def test_the_simulated_engine_receives_question_answer_and_step_in_training(zs, tok) -> None:
    seen: list[str] = []
    engine = zs.SimulatedSearchEngine(
        simulator(tok, seen), total_steps=10, start_threshold=0.0, end_threshold=1.0
    )
    reward = get_reward("zerosearch_f1")
    retriever = TimedRetriever(_stepped(engine, reward))  # as the trainer's setup builds it
    assert wants_context(retriever)
    reward.set_step(10)  # the trainer's step signal; at step 10 of 10 p = 1: every query is noisy
    trajs = rollout(
        get_loop("zerosearch", top_k=2), policy(tok), retriever, EXAMPLES, SamplingParams(max_new_tokens=40)
    )
    # the same query from two questions is asked twice, each with its own question and first gold answer
    assert len(seen) == 2
    assert f'"{Q1}" whose answer is Quellstad' in seen[0] and f'"{Q2}" whose answer is Tarsk' in seen[1]
    assert all("Query: Varonia capital" in s and "Noisy Output" in s for s in seen)
    assert engine.draws == [("q1", 10, "noisy"), ("q2", 10, "noisy")]
    for t in trajs:
        assert [h["doc_id"] for h in t.retrieved[0]] == [
            f"zerosearch:noisy:{t.question_id}:1",
            f"zerosearch:noisy:{t.question_id}:2",
        ]  # top_k 2
        assert "Doc 1: noisy one\nDoc 2: noisy two" in t.response_text
    reward.set_step(0)  # p = 0 at the start: every query useful
    rollout(get_loop("zerosearch"), policy(tok), retriever, EXAMPLES[:1], SamplingParams(max_new_tokens=40))
    assert engine.draws[-1] == ("q1", 0, "useful") and "Useful Output" in seen[-1]
    assert [r.total for r in reward(trajs)] == [1.0, 1.0]  # F1 of the exact answers


def test_the_curriculum_draws_noise_at_its_rate(zs, tok) -> None:
    from sleuth.retrieval.base import RetrievalContext

    engine = zs.SimulatedSearchEngine(simulator(tok, []), total_steps=100, seed=3)
    ctx = RetrievalContext("q1", Q1, ("Quellstad",), turn=0, step=50)  # p = 1/6
    engine.search(["x"] * 600, 1, [ctx] * 600)
    noisy = sum(kind == "noisy" for _, _, kind in engine.draws) / 600
    assert abs(noisy - 1 / 6) < 0.05


def test_a_plain_search_is_refused_and_a_plain_retriever_is_not_stamped(zs, tok) -> None:
    engine = zs.SimulatedSearchEngine(simulator(tok, []), total_steps=10)
    with pytest.raises(ConfigError, match="RetrievalContext"):
        engine.search(["q"], 3)

    plain = ToyRetriever()
    assert _stepped(plain, get_reward("zerosearch_f1")) is plain and isinstance(
        _stepped(engine, get_reward("zerosearch_f1")), StepStamped
    )
    with pytest.raises(ConfigError, match="mode"):
        zs.SimulatedSearchEngine(simulator(tok, []), total_steps=10, mode="google")


def test_the_simulator_is_a_retriever_location_written_by_a_local_model(zs) -> None:
    """`zerosearch:MODEL?total_steps=N&...` (a generated run's training retriever, `run_sections`) opens a simulated
    engine over a local generator (the tiny model here, the policy's frozen base on a GPU) with those options."""
    engine = open_location("zerosearch:tiny?total_steps=4&max_new_tokens=6&seed=1&end_threshold=1.0")
    assert isinstance(engine, zs.SimulatedSearchEngine)
    assert (engine.total_steps, engine.end, engine.params.max_new_tokens) == (4, 1.0, 6)
    ctx = RetrievalContext(question=Q1, golden_answers=("Quellstad",), question_id="q1", turn=0, step=4)
    (hits,) = engine.search(["capital of Varonia"], 3, [ctx])
    assert engine.draws == [("q1", 4, zs.NOISY)]  # from step total_steps on, p = end_threshold = 1: noisy
    assert len(hits) <= 3 and all(h.doc_id.startswith("zerosearch:noisy:q1:") for h in hits)
    with pytest.raises(ConfigError, match="unknown option 'steps'.*total_steps"):
        open_location("zerosearch:tiny?steps=4")
    with pytest.raises(ConfigError, match=r"zerosearch:MODEL\?total_steps=N"):
        open_location("zerosearch:tiny")
    with pytest.raises(ConfigError, match="total_steps='x' is not a int"):
        open_location("zerosearch:tiny?total_steps=x")


def test_a_generated_run_trains_against_the_frozen_base_and_cold_starts_from_search_r1(zs) -> None:
    sections = zs.run_sections(RunShape(model="m.gguf", total_steps=30, prompts_per_step=16, n=5))
    assert sections == {
        "retriever": {"index": None, "location": "zerosearch:m.gguf?total_steps=30&max_new_tokens=192"}
    }
    assert get_method("zerosearch").oracle() is get_method("search_r1").oracle_planner
