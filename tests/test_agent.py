"""Agent rollout engine and the five method loops, driven by a scripted generator with a real tokenizer."""

from __future__ import annotations

import pytest

from sleuth.agent import get_loop, loop_names
from sleuth.agent.engine import RolloutBudget, rollout
from sleuth.agent.qagent import QAGENT_RETHINK, qagent_format_ok
from sleuth.agent.registry import get_method
from sleuth.agent.s3 import S3_INVALID_ACTION, parse_query, parse_selection
from sleuth.agent.search_r1 import SEARCH_R1_INVALID_ACTION
from sleuth.agent.staged import staged_format_ok
from sleuth.agent.trajectory import Trajectory, read_trajectories, write_trajectories
from sleuth.data.formats import QAExample
from sleuth.errors import ConfigError
from sleuth.llm.base import SamplingParams
from sleuth.llm.scripted import ScriptCall, ScriptedGenerator
from toyworld import ToyRetriever

Q_CAPITAL = "What is the capital of Varonia?"
Q_FILM = "Where was the director of Blue Harbor born?"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from sleuth.llm.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    return AutoTokenizer.from_pretrained(path)


def ex(qid: str, question: str, answers: list[str]) -> QAExample:
    return QAExample(id=qid, question=question, golden_answers=answers)


EXAMPLES = [ex("q1", Q_CAPITAL, ["Quellstad"]), ex("q2", Q_FILM, ["Tarsk"])]


def run(loop_name, script, examples=None, n=1, tok=None, loop_cfg=None, **kw):
    gen = ScriptedGenerator(tok, script)
    ret = ToyRetriever()
    loop = get_loop(loop_name, **(loop_cfg or {}))
    budget = RolloutBudget(**kw)  # max_turns, max_obs_tokens, max_response_tokens
    trajs = rollout(
        loop, gen, ret, examples or EXAMPLES[:1], SamplingParams(max_new_tokens=200), n=n, budget=budget
    )
    return trajs, gen, ret


def check_token_view(traj: Trajectory, gen: ScriptedGenerator, tok, docs_must_not_be_trained: bool = True):
    """The invariants every trajectory must satisfy, checked from ids (never from re-tokenised text)."""
    n = len(traj.response_ids)
    assert len(traj.loss_mask) == n == len(traj.logprobs)
    # turns tile the response exactly, and their roles are the mask
    pos = 0
    for t in traj.turns:
        assert t.start == pos and t.end > t.start
        assert set(traj.loss_mask[t.start : t.end]) == {1 if t.role == "policy" else 0}
        assert tok.decode(traj.response_ids[t.start : t.end]) == t.text
        expected_lp = gen.logprob if t.role == "policy" else 0.0
        assert traj.logprobs[t.start : t.end] == [expected_lp] * (t.end - t.start)
        pos = t.end
    assert pos == n
    # exactly the masked-in tokens decode to the concatenated policy text
    policy_ids = [i for i, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m == 1]
    policy_text = tok.decode(policy_ids)
    assert policy_text == "".join(traj.policy_text_spans())
    # and it is what the generator emitted for this trajectory, in order
    full = traj.prompt_ids + traj.response_ids
    # input length -> (input, output): the chain of generations of this trajectory
    fed: dict[int, tuple[list[int], list[int]]] = {}
    for batch_in, outs in zip(gen.calls, gen.outputs, strict=True):
        for i, o in zip(batch_in, outs, strict=True):
            if full[: len(i) + len(o.token_ids)] == i + o.token_ids:
                fed.setdefault(len(i), (i, o.token_ids))
    chain = [fed[k] for k in sorted(fed)]
    assert [t for _, out in chain for t in out] == policy_ids
    if docs_must_not_be_trained:
        for hits in traj.retrieved:
            for h in hits:
                assert h["text"] not in policy_text
    # the first input was the prompt; if the trajectory ends on a generation, prompt + response is
    # exactly the last input plus its output
    assert chain[0][0] == traj.prompt_ids
    if traj.turns[-1].role == "policy":
        last_in, last_out = chain[-1]
        assert full == last_in + last_out
    assert traj.response_text == tok.decode(traj.response_ids)
    assert len(traj.queries) == len(traj.retrieved) == traj.retrieval_count


# ---------------------------------------------------------------------------------------------------
# the scripted generator itself


def test_scripted_generator_honours_stop_strings_eos_and_length(tok):
    gen = ScriptedGenerator(tok, lambda call: "<think> a </think> <search> q one </search> trailing words")
    ids = tok.encode("hello", add_special_tokens=False)
    out = gen.generate([ids], ["</search>"], SamplingParams(max_new_tokens=100))[0]
    assert out.finish_reason == "stop" and out.stop == "</search>"
    assert out.text == "<think> a </think> <search> q one </search>"
    assert "trailing" not in tok.decode(out.token_ids)
    assert len(out.logprobs) == len(out.token_ids)

    out = gen.generate([ids], None, SamplingParams(max_new_tokens=100))[0]
    assert out.finish_reason == "eos" and out.token_ids[-1] == tok.eos_token_id
    assert out.text.endswith("trailing words")

    out = gen.generate([ids], ["</search>"], SamplingParams(max_new_tokens=3))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_scripted_generator_turn_index_follows_the_prompt_chain(tok):
    seen: list[int] = []

    def script(call: ScriptCall) -> str:
        seen.append(call.turn_index)
        return f"<answer> t{call.turn_index} </answer>"

    gen = ScriptedGenerator(tok, script)
    p = tok.encode("prompt", add_special_tokens=False)
    out = gen.generate([p, p], ["</answer>"])
    nxt = p + out[0].token_ids + tok.encode(" obs ", add_special_tokens=False)
    gen.generate([nxt], ["</answer>"])
    assert seen == [0, 0, 1]


# ---------------------------------------------------------------------------------------------------
# Search-R1


def test_search_r1_happy_path(tok):
    script = {
        Q_CAPITAL: [
            "<think> I need to search. </think> <search> capital of Varonia </search> junk after the stop",
            "<think> The document says Quellstad. </think> <answer> Quellstad </answer>",
        ]
    }
    (traj,), gen, ret = run("search_r1", script, tok=tok)
    check_token_view(traj, gen, tok)
    assert traj.method == "search_r1" and traj.question_id == "q1"
    assert traj.answer == "Quellstad" and traj.finish_reason == "answer"
    assert traj.queries == ["capital of Varonia"] and traj.retrieval_count == 1
    assert [h["doc_id"] for h in traj.retrieved[0]] == ["p1", "p5", "p2"]
    assert traj.num_turns == 2
    assert "junk after the stop" not in traj.response_text
    env = [t.text for t in traj.turns if t.role == "env"]
    assert env == [
        # Search-R1's _passages2string: the stored title line keeps its quotes
        '\n\n<information>Doc 1(Title: "Varonia") Varonia is a country. Its capital is Quellstad.\n'
        'Doc 2(Title: "Tarsk") Tarsk is a town on the coast of Varonia.\n'
        'Doc 3(Title: "Quellstad") Quellstad is a river port on the Vell.</information>\n\n'
    ]
    assert [h["doc_id"] for h in traj.served_context] == ["p1", "p5", "p2"]
    assert "Question: What is the capital of Varonia?" in traj.prompt_text
    assert ret.calls == [(["capital of Varonia"], 3)]
    assert gen.stops[0] == [["</search>", "</answer>"]]


def test_search_r1_batches_generation_and_retrieval_per_turn(tok):
    script = {
        Q_CAPITAL: ["<search> capital of Varonia </search>", "<answer> Quellstad </answer>"],
        Q_FILM: [
            "<search> Blue Harbor director </search>",
            "<search> Mara Ilves born </search>",
            "<answer> Tarsk </answer>",
        ],
    }
    trajs, gen, ret = run("search_r1", script, examples=EXAMPLES, n=2, tok=tok)
    assert [t.group for t in trajs] == [0, 0, 1, 1]
    assert [t.sample for t in trajs] == [0, 1, 0, 1]
    assert [t.question_id for t in trajs] == ["q1", "q1", "q2", "q2"]
    assert [len(b) for b in gen.calls] == [4, 4, 2]  # one generate call per turn, all active together
    # one search call per turn; identical queries of the n samples are sent once
    assert ret.calls == [
        (["capital of Varonia", "Blue Harbor director"], 3),
        (["Mara Ilves born"], 3),
    ]
    assert [t.answer for t in trajs] == ["Quellstad", "Quellstad", "Tarsk", "Tarsk"]
    assert trajs[2].queries == ["Blue Harbor director", "Mara Ilves born"]
    for t in trajs:
        check_token_view(t, gen, tok)


@pytest.mark.parametrize(
    "bad_turn",
    [
        "<think> hmm </think> <search> capital of Varonia",  # missing closing tag (ends at EOS)
        "<search>   </search>",  # empty query
        "I will just talk without any tag.",  # no tag at all
        "<answer Quellstad",  # broken tag
    ],
)
def test_search_r1_malformed_turn_gets_the_invalid_action_message(tok, bad_turn):
    script = {Q_CAPITAL: [bad_turn, "<answer> Quellstad </answer>"]}
    (traj,), gen, ret = run("search_r1", script, tok=tok)
    check_token_view(traj, gen, tok)
    assert traj.invalid_actions == 1
    assert [t.text for t in traj.turns if t.role == "env"] == [SEARCH_R1_INVALID_ACTION]
    assert traj.answer == "Quellstad" and ret.calls == []


def test_search_r1_nested_tags_use_the_innermost_block(tok):
    script = {
        Q_CAPITAL: ["<search><search> capital of Varonia </search>", "<answer><answer> Quellstad </answer>"]
    }
    (traj,), gen, _ = run("search_r1", script, tok=tok)
    assert traj.queries == ["capital of Varonia"] and traj.answer == "Quellstad"
    check_token_view(traj, gen, tok)


def test_search_r1_garbage_every_turn_ends_scored_with_no_answer(tok):
    (traj,), gen, _ = run("search_r1", lambda call: "no idea", tok=tok)
    check_token_view(traj, gen, tok)
    assert traj.answer is None and traj.finish_reason == "max_turns"
    assert len(gen.calls) == 5  # 4 rounds + the forced final generation
    assert traj.invalid_actions == 5 and traj.forced_final


def test_search_r1_forced_final_answer_after_max_turns(tok):
    def script(call: ScriptCall) -> str:
        return (
            "<answer> Quellstad </answer>"
            if call.turn_index == 4
            else f"<search> Varonia {call.turn_index} </search>"
        )

    (traj,), gen, ret = run("search_r1", script, tok=tok)
    assert traj.retrieval_count == 4 and len(ret.calls) == 4 and len(gen.calls) == 5
    assert traj.answer == "Quellstad" and traj.finish_reason == "answer" and traj.forced_final
    check_token_view(traj, gen, tok)

    # a search in the forced final generation is not executed
    (traj,), gen, ret = run("search_r1", lambda call: "<search> Varonia </search>", tok=tok, max_turns=2)
    assert traj.retrieval_count == 2 and len(ret.calls) == 2 and len(gen.calls) == 3
    assert traj.finish_reason == "max_turns" and traj.answer is None and traj.search_after_limit
    assert traj.turns[-1].role == "policy"


def test_observation_truncated_in_tokens_keeping_the_closing_tag(tok):
    script = {Q_CAPITAL: ["<search> capital of Varonia </search>", "<answer> Quellstad </answer>"]}
    (traj,), gen, _ = run("search_r1", script, tok=tok, max_obs_tokens=20)
    env = [t for t in traj.turns if t.role == "env"][0]
    assert env.end - env.start == 20
    assert env.text.startswith("\n\n<information>") and env.text.endswith("</information>\n\n")
    assert traj.obs_truncated_tokens > 0
    check_token_view(traj, gen, tok)


def test_response_budget_stops_the_trajectory(tok):
    script = {
        Q_CAPITAL: ["<search> capital of Varonia </search>", "<think> " + "long thought " * 40 + "</think>"]
    }
    (traj,), gen, _ = run("search_r1", script, tok=tok, max_response_tokens=60)
    assert traj.finish_reason == "length" and len(traj.response_ids) <= 60
    assert traj.answer is None
    check_token_view(traj, gen, tok)


# ---------------------------------------------------------------------------------------------------
# s3


S3_CFG = {"top_k": 3}


def test_s3_happy_path_selection_relative_to_window_and_dedup(tok):
    script = {
        Q_FILM: [
            "<important_info>[1, 3]</important_info>\n<search_complete>False</search_complete>\n"
            '<query>{"query": "Mara Ilves born"}</query>',
            "<important_info>[1, 2]</important_info>\n<search_complete>True</search_complete>",
        ]
    }
    (traj,), gen, ret = run("s3", script, examples=[EXAMPLES[1]], tok=tok, loop_cfg=S3_CFG)
    check_token_view(traj, gen, tok)
    # begin with search: the question itself, before the first generation, shown in the prompt
    assert ret.calls[0] == ([Q_FILM], 3)
    assert traj.queries == [Q_FILM, "Mara Ilves born"] and traj.retrieval_count == 2
    w0 = [h["doc_id"] for h in traj.retrieved[0]]
    w1 = [h["doc_id"] for h in traj.retrieved[1]]
    assert w0 == ["p3", "p4", "p5"] and w1 == ["p4", "p3", "p1"]
    # s3's preprocessing: the initial results follow "</question>\n" directly
    assert '</question>\n<information>\nDoc 1(Title: "Blue Harbor")' in traj.prompt_text
    # "</search_complete>" stopped the first generation; it resumed to write the query
    assert [len(b) for b in gen.calls] == [1, 1, 1]
    assert traj.num_turns == 2 and len([t for t in traj.turns if t.role == "policy"]) == 2
    # window 0 ids [1, 3] -> p3, p5; window 1 ids [1, 2] -> p4, p3 (p3 again: deduplicated)
    assert [h["doc_id"] for h in traj.selected] == ["p3", "p5", "p4"]
    assert [h["doc_id"] for h in traj.served_context] == ["p3", "p5", "p4"]
    assert traj.finish_reason == "search_complete" and traj.answer is None
    assert traj.extra["selection_ids"] == [{"window": 0, "ids": [1, 3]}, {"window": 1, "ids": [1, 2]}]


def test_s3_invalid_and_excess_selection_ids_are_ignored_and_recorded(tok):
    script = {
        Q_FILM: [
            '<important_info>[0, 2, 9, "x", 2, 1, 3]</important_info><search_complete>True</search_complete>'
        ]
    }
    (traj,), gen, _ = run("s3", script, examples=[EXAMPLES[1]], tok=tok, loop_cfg={"top_k": 5})
    assert traj.extra["selection_ids"] == [{"window": 0, "ids": [2, 1, 3]}]
    assert traj.extra["invalid_selection_ids"] == [0, 9, "x", 2]
    assert [h["doc_id"] for h in traj.served_context] == [traj.retrieved[0][i]["doc_id"] for i in (1, 0, 2)]
    check_token_view(traj, gen, tok)


def test_s3_window_without_selection_serves_all_its_docs_unless_disabled(tok):
    script = {Q_FILM: ["<search_complete>True</search_complete>"]}
    (traj,), _, _ = run("s3", script, examples=[EXAMPLES[1]], tok=tok, loop_cfg=S3_CFG)
    assert traj.selected == [] and [h["doc_id"] for h in traj.served_context] == ["p3", "p4", "p5"]
    (traj,), _, _ = run(
        "s3",
        script,
        examples=[EXAMPLES[1]],
        tok=tok,
        loop_cfg={**S3_CFG, "include_unselected_windows": False},
    )
    assert traj.served_context == []


def test_s3_ablation_without_selection_serves_everything_retrieved(tok):
    script = {
        Q_FILM: [
            '<important_info>[1]</important_info><search_complete>False</search_complete><query>{"query": "Vell river"}</query>',
            "<important_info>[1]</important_info><search_complete>True</search_complete>",
        ]
    }
    (traj,), _, _ = run(
        "s3", script, examples=[EXAMPLES[1]], tok=tok, loop_cfg={**S3_CFG, "use_selection": False}
    )
    retrieved = [h["doc_id"] for hits in traj.retrieved for h in hits]
    assert [h["doc_id"] for h in traj.served_context] == list(dict.fromkeys(retrieved))
    assert len(traj.served_context) > len(traj.selected) == 2


def test_s3_ablation_without_begin_with_search(tok):
    script = {
        Q_FILM: [
            '<query>{"query": "Blue Harbor director"}</query>',
            "<important_info>[1]</important_info><search_complete>True</search_complete>",
        ]
    }
    (traj,), gen, ret = run(
        "s3", script, examples=[EXAMPLES[1]], tok=tok, loop_cfg={**S3_CFG, "begin_with_search": False}
    )
    assert ret.calls == [(["Blue Harbor director"], 3)]
    assert "Doc 1(Title: Blue Harbor)" not in traj.prompt_text
    assert traj.queries == ["Blue Harbor director"] and [h["doc_id"] for h in traj.served_context] == ["p3"]
    check_token_view(traj, gen, tok)


def test_s3_query_json_fallbacks_and_invalid_turn(tok):
    assert parse_query('{"query": "a b"}') == ("a b", True)
    assert parse_query('{"query": ["a", "b"]}') == ("a", True)
    assert parse_query("plain words") == ("plain words", False)
    assert parse_query('{"query": ') == ('{"query":', False)
    assert parse_query('{"q": 1}') == ('{"q": 1}', False)
    assert parse_selection("[1, 3]", 3, 3) == ([1, 3], [])
    assert parse_selection("1 and 3", 3, 3) == ([1, 3], [])
    assert parse_selection("none", 3, 3) == ([], ["none"])

    script = {
        Q_FILM: [
            "I am not sure what to do.",  # no tag: s3's feedback reopens a <query>
            '{"query": "Mara Ilves born"}</query>',
            '<query>{"query": </query>',  # garbage JSON: the raw text is the query
            "<search_complete>True</search_complete>",
        ]
    }
    (traj,), gen, _ = run("s3", script, examples=[EXAMPLES[1]], tok=tok, loop_cfg=S3_CFG)
    check_token_view(traj, gen, tok)
    assert [t.text for t in traj.turns if t.role == "env"][0] == S3_INVALID_ACTION
    assert traj.queries == [Q_FILM, "Mara Ilves born", '{"query":']
    assert traj.invalid_actions == 1 and traj.extra["query_not_json"] == 1
    assert traj.finish_reason == "search_complete"


def test_s3_max_turns_then_a_final_generation_without_search(tok):
    def script(call: ScriptCall) -> str:
        return (
            f'<search_complete>False</search_complete><query>{{"query": "Varonia {call.turn_index}"}}</query>'
        )

    (traj,), gen, ret = run("s3", script, examples=[EXAMPLES[0]], tok=tok, loop_cfg=S3_CFG)
    assert traj.retrieval_count == 1 + 3 and len(ret.calls) == 4  # initial + max_turns
    # the final generation stops at </search_complete>; with search disabled it is not resumed
    assert traj.finish_reason == "max_turns" and traj.num_turns == 4
    # each round resumes once after "False"
    assert traj.turns[-1].text.endswith("</search_complete>") and len(gen.calls) == 3 * 2 + 1
    check_token_view(traj, gen, tok)


# ---------------------------------------------------------------------------------------------------
# R-Search


def test_r_search_evidence_is_trained_and_observation_masked(tok):
    evidence = "Varonia is a country. Its capital is Quellstad."
    script = {
        Q_CAPITAL: [
            "I should look up Varonia. <search> capital of Varonia </search>",
            f"The observation answers it. <original_evidence> {evidence} </original_evidence> <answer> Quellstad </answer>",
        ]
    }
    (traj,), gen, _ = run("r_search", script, tok=tok)
    check_token_view(traj, gen, tok, docs_must_not_be_trained=False)
    assert traj.prompt_text.count("<original_evidence>") >= 1  # system template (Table 1) is in the prompt
    env = [t for t in traj.turns if t.role == "env"]
    assert (
        len(env) == 1
        and env[0].text.startswith("\n\n<observation>")
        and env[0].text.endswith("</observation>\n\n")
    )
    assert all(m == 0 for m in traj.loss_mask[env[0].start : env[0].end])
    last = traj.turns[-1]
    assert last.role == "policy" and f"<original_evidence> {evidence} </original_evidence>" in last.text
    assert all(m == 1 for m in traj.loss_mask[last.start : last.end])
    assert traj.evidence == evidence and traj.answer == "Quellstad"
    assert traj.served_context == [
        {"doc_id": "q1#evidence", "title": "evidence", "text": evidence, "score": 1.0}
    ]
    assert traj.extra["evidence_ok"] and traj.extra["answer_ok"] and traj.extra["has_search"]


def test_r_search_without_evidence(tok):
    (traj,), gen, _ = run("r_search", {Q_CAPITAL: ["I know it. <answer> Quellstad </answer>"]}, tok=tok)
    assert traj.evidence is None and traj.served_context == [] and traj.extra["has_search"] is False
    assert traj.extra["evidence_ok"] is False and traj.extra["answer_ok"]
    check_token_view(traj, gen, tok)


def test_r_search_without_the_evidence_block_ablation(tok):
    """evidence_block=False (the paper's "w/o Evidence"): the prompt and the invalid-action hint never mention the
    evidence block; the rollout searches and answers as before."""
    script = {Q_CAPITAL: ["<search> capital of Varonia </search>", "<answer> Quellstad </answer>"]}
    (traj,), gen, _ = run("r_search", script, tok=tok, loop_cfg={"evidence_block": False})
    check_token_view(traj, gen, tok)
    assert "original_evidence" not in traj.prompt_text and "<answer> and </answer>" in traj.prompt_text
    loop = get_loop("r_search", evidence_block=False)
    assert "evidence" not in loop.invalid_action_message and loop.evidence_block is False
    assert traj.answer == "Quellstad" and traj.retrieval_count == 1 and traj.evidence is None
    assert get_loop("r_search").system_template.count("<original_evidence>") == 1  # the default keeps Table 1


# ---------------------------------------------------------------------------------------------------
# staged reward


def test_staged_happy_path_and_format_flag(tok):
    script = {
        Q_CAPITAL: [
            "<think> I am not sure. </think> <search> Varonia capital </search>",
            "<reflect> Doc 1 says Quellstad. </reflect> <answer> Quellstad </answer>",
        ]
    }
    (traj,), gen, _ = run("staged", script, tok=tok)
    check_token_view(traj, gen, tok)
    assert traj.answer == "Quellstad" and traj.extra["rc"] == traj.retrieval_count == 1
    assert len(traj.retrieved[0]) == 5  # the paper's top-k 5
    assert traj.extra["format_ok"] is True
    assert "structured reasoning protocol" in traj.prompt_text

    (traj,), _, _ = run(
        "staged",
        {Q_CAPITAL: ["<think> k </think> <reflect> r </reflect> <answer> Quellstad </answer>"]},
        tok=tok,
    )
    assert traj.extra["format_ok"] and traj.retrieval_count == 0
    (traj,), _, _ = run("staged", {Q_CAPITAL: ["<answer> Quellstad </answer>"]}, tok=tok)
    assert traj.extra["format_ok"] is False


def test_structure_checks():
    assert staged_format_ok(
        "<think>a</think><search>q</search><information>d</information><reflect>r</reflect>"
        "<search>q</search><information>d</information><reflect>r</reflect><answer>x</answer>"
    )
    assert not staged_format_ok(
        "<think>a</think><search>q</search><information>d</information><answer>x</answer>"
    )
    assert qagent_format_ok(
        "<plan>p</plan><search><query>q</query></search><information>d</information>"
        "<reflection>r</reflection><answer>x</answer>"
    )
    assert not qagent_format_ok(
        "<search><query>q</query></search><information>d</information><answer>x</answer>"
    )


# ---------------------------------------------------------------------------------------------------
# QAgent


def test_qagent_at_most_three_queries_top1_and_dedup(tok):
    script = {
        Q_FILM: [
            "<plan> find the director, then the birthplace </plan> <search><query>Blue Harbor director</query>"
            "<query>Mara Ilves born Tarsk</query><query>Blue Harbor film</query><query>dropped fourth</query></search>",
            "<reflection> Mara Ilves was born in Tarsk. </reflection> <answer> Tarsk </answer>",
        ]
    }
    (traj,), gen, ret = run("qagent", script, examples=[EXAMPLES[1]], tok=tok)
    check_token_view(traj, gen, tok)
    assert ret.calls == [(["Blue Harbor director", "Mara Ilves born Tarsk", "Blue Harbor film"], 1)]
    assert traj.queries == ["Blue Harbor director", "Mara Ilves born Tarsk", "Blue Harbor film"]
    assert [len(h) for h in traj.retrieved] == [1, 1, 1]
    assert traj.extra["queries_dropped"] == 1
    assert [h["doc_id"] for h in traj.served_context] == ["p3", "p4"]  # p3 twice -> once
    assert traj.answer == "Tarsk" and traj.extra["format_ok"]
    assert "Question: " + Q_FILM in traj.prompt_text


def test_qagent_rethink_prompt_and_max_turns_without_forced_answer(tok):
    script = {Q_FILM: ["Let me think about it.", "<plan> p </plan> <answer> Tarsk </answer>"]}
    (traj,), gen, _ = run("qagent", script, examples=[EXAMPLES[1]], tok=tok)
    assert [t.text for t in traj.turns if t.role == "env"] == [QAGENT_RETHINK]
    assert traj.invalid_actions == 1 and traj.answer == "Tarsk"
    check_token_view(traj, gen, tok)

    always_search = lambda call: "<plan> p </plan> <search><query>Varonia</query></search>"  # noqa: E731
    (traj,), gen, ret = run("qagent", always_search, examples=[EXAMPLES[1]], tok=tok)
    assert len(gen.calls) == 5 and len(ret.calls) == 5 and traj.num_turns == 5
    assert traj.finish_reason == "max_turns" and traj.answer is None
    assert traj.turns[-1].role == "env"  # Algorithm 1 ends after the last information block
    assert [h["doc_id"] for h in traj.served_context] == ["p1"]
    check_token_view(traj, gen, tok)


def test_qagent_search_without_query_tags_and_empty_search(tok):
    script = {
        Q_FILM: [
            "<search> Blue Harbor director </search>",
            "<search><query> </query></search>",
            "<answer> Tarsk </answer>",
        ]
    }
    (traj,), gen, _ = run("qagent", script, examples=[EXAMPLES[1]], tok=tok)
    assert traj.queries == ["Blue Harbor director"]
    assert traj.extra["search_without_query_tags"] == 1 and traj.extra["empty_queries"] == 1
    assert traj.invalid_actions == 1 and traj.answer == "Tarsk"
    check_token_view(traj, gen, tok)


# ---------------------------------------------------------------------------------------------------
# every loop: round trip, registry


@pytest.mark.parametrize("name", ["search_r1", "s3", "r_search", "staged", "qagent"])
def test_every_loop_survives_garbage_and_round_trips(tok, tmp_path, name):
    garbage = ['<search>{"query": <query>', "</answer><answer>", "", "<important_info>[[[</important_info>"]
    (traj,), gen, _ = run(
        name, lambda call: garbage[call.turn_index % len(garbage)], examples=EXAMPLES[:1], tok=tok
    )
    assert traj.finish_reason in {"max_turns", "length", "answer", "search_complete"}
    check_token_view(traj, gen, tok, docs_must_not_be_trained=False)

    def script(call: ScriptCall) -> str:
        return "<search> Varonia </search>" if call.turn_index == 0 else "<answer> Quellstad </answer>"

    trajs, _, _ = run(name, script, examples=EXAMPLES, n=2, tok=tok)
    path = tmp_path / "t.jsonl"
    write_trajectories(path, trajs + [traj])
    back = list(read_trajectories(path))
    assert [t.to_dict() for t in back] == [t.to_dict() for t in trajs + [traj]]


def test_registry_defaults_and_errors():
    # the methods sleuth itself registers (other test modules of this worker may have loaded plugin methods
    # in-process, e.g. the benches' rehearsal loop)
    builtin = [n for n in loop_names() if get_method(n).loop.__module__.startswith("sleuth.")]
    assert builtin == ["qagent", "r_search", "s3", "search_r1", "staged"]
    assert get_loop("search-r1").top_k == 3 and get_loop("search_r1").max_turns == 4
    s3 = get_loop("s3")
    assert (s3.top_k, s3.max_turns, s3.max_selected, s3.use_selection, s3.begin_with_search) == (
        8,
        3,
        3,
        True,
        True,
    )
    qa = get_loop("qagent")
    assert (qa.top_k, qa.max_turns, qa.max_queries, qa.forced_final_answer) == (1, 5, 3, False)
    assert get_loop("staged").top_k == 5
    with pytest.raises(ConfigError, match="unknown agent loop 'nope'"):
        get_loop("nope")
    with pytest.raises(ConfigError, match="no option.*topk"):
        get_loop("s3", topk=3)
    with pytest.raises(ConfigError, match="top_k"):
        get_loop("search_r1", top_k=0)


def test_observation_text_of_each_loop_matches_its_public_code_on_fixed_strings() -> None:
    """Fixed strings written from each project's code: Search-R1 `_passages2string` + `<information>`
    wrapping (also s3, staged, QAgent), R-Search's unnumbered `(Title: ...)` + `<observation>`."""
    from sleuth.agent import get_loop
    from sleuth.data.formats import split_contents
    from sleuth.retrieval.base import Hit

    stored = [
        ("7", '"The Moushxhouth Rivers"\nThe Moushxhouth Rivers flow north.\nA second line.'),
        ("9", '"Quellstad"\nQuellstad is a river port.'),
    ]
    hits = [Hit(doc_id, *split_contents(contents), score=1.0) for doc_id, contents in stored]
    search_r1_block = (
        '\n\n<information>Doc 1(Title: "The Moushxhouth Rivers") The Moushxhouth Rivers flow north.\n'
        'A second line.\nDoc 2(Title: "Quellstad") Quellstad is a river port.</information>\n\n'
    )
    r_search_block = (
        '\n\n<observation>(Title: "The Moushxhouth Rivers") The Moushxhouth Rivers flow north.\n'
        'A second line.\n(Title: "Quellstad") Quellstad is a river port.</observation>\n\n'
    )
    for name, expected in (
        ("search_r1", search_r1_block),
        ("s3", search_r1_block),
        ("staged", search_r1_block),
        ("qagent", search_r1_block),
        ("r_search", r_search_block),
    ):
        obs = get_loop(name).observe(None, None, [hits[:1], hits[1:]])  # type: ignore[arg-type]
        assert obs.prefix + obs.body + obs.suffix == expected, name


def test_engine_fields_are_typed_and_old_files_still_load():
    from sleuth.agent.trajectory import Trajectory

    old = Trajectory("q1", "Q?", ["a"], "search_r1").to_dict()
    for name in ("group", "sample", "invalid_actions", "forced_final", "generation_finish_reasons"):
        del old[name]
    old["extra"] = {
        "group": "2:5",
        "sample": 3,
        "invalid_actions": 4,
        "forced_final": True,
        "generation_finish_reasons": ["stop", "eos"],
        "format_ok": True,
    }
    t = Trajectory.from_dict(old)
    assert (t.sampling_round, t.group, t.sample, t.invalid_actions, t.forced_final) == (2, 5, 3, 4, True)
    assert t.generation_finish_reasons == ["stop", "eos"] and t.extra == {"format_ok": True}
    assert Trajectory.from_dict(t.to_dict()) == t
