"""Rewards on hand-built trajectories, with fake frozen models whose outputs are fixed.

Each trajectory is a list of (role, text) spans, exactly what an agent loop records in
`traj.turns`; expected values are computed by hand in the comments.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from sleuth.agent.trajectory import Trajectory, Turn
from sleuth.errors import ConfigError
from sleuth.llm.base import Generation
from sleuth.retrieval.base import Hit
from sleuth.rewards import RewardServices, available_rewards, get_reward, score_batch
from sleuth.rewards.answerer import (
    document_prompt,
    gen_acc,
    judge_contains,
    parse_yes_no,
)
from sleuth.rewards.r_search import rsearch_format_reward
from sleuth.rewards.staged import ConcisenessRule, average_pairwise_similarity
from sleuth.rewards.structure import parse_response, policy_answer

# ---------------------------------------------------------------- helpers


def make_traj(spans, golds, question="What?", qid="q1", **kw) -> Trajectory:
    turns, pos = [], 0
    for role, text in spans:
        turns.append(Turn(start=pos, end=pos + len(text), role=role, text=text))
        pos += len(text)
    mask = [1 if role == "policy" else 0 for role, text in spans for _ in text]
    return Trajectory(
        question_id=qid,
        question=question,
        golden_answers=list(golds),
        method="test",
        turns=turns,
        loss_mask=mask,
        response_text="".join(t for _, t in spans),
        **kw,
    )


def hit(doc_id: str, title: str, text: str) -> dict:
    return Hit(doc_id, title, text, 1.0).to_dict()


def prompt_text(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(m["content"] for m in prompt)


class FakeGenerator:
    """Answers with `rule(prompt_text)`; records every batch it was sent."""

    def __init__(self, rule):
        self.rule = rule
        self.batches: list[list] = []

    @property
    def num_prompts(self) -> int:
        return sum(len(b) for b in self.batches)

    def generate(self, batch, stop=None, params=None):
        self.batches.append(list(batch))
        return [Generation(text=self.rule(prompt_text(p)), finish_reason="eos") for p in batch]


class FakeRetriever:
    def __init__(self, docs_by_query: dict[str, list[Hit]]):
        self.docs_by_query = docs_by_query
        self.calls: list[tuple[list[str], int]] = []

    def search(self, queries, k):
        self.calls.append((list(queries), k))
        return [self.docs_by_query.get(q, [])[:k] for q in queries]


class FakeCache:
    def __init__(self):
        self.values: dict[str, float] = {}
        self.saves = 0

    def get(self, qid):
        return self.values.get(qid)

    def set(self, qid, value):
        self.values[qid] = value

    def save(self):
        self.saves += 1


class FakeEncoder:
    def __init__(self, table: dict[str, list[float]]):
        self.table = table
        self.calls = 0

    def encode(self, texts):
        self.calls += 1
        return np.array([self.table[t] for t in texts], dtype=np.float32)


# ---------------------------------------------------------------- registry and helpers


def test_registry_names_and_config_errors() -> None:
    assert set(available_rewards()) >= {
        "search_r1_em",
        "search_r1_format_em",
        "s3_gbr",
        "s3_genacc",
        "r_search",
        "staged",
        "qagent_stage1",
        "qagent_stage2",
    }
    with pytest.raises(ConfigError, match="unknown reward 'nope'"):
        get_reward("nope")
    with pytest.raises(ConfigError, match="no option.*betta.*valid options.*beta"):
        get_reward("staged", betta=0.5)
    with pytest.raises(ConfigError, match="form='both'"):
        get_reward("s3_gbr", form="both")
    assert get_reward("r_search", gamma_e=0.5).gamma_e == 0.5


def test_missing_service_is_a_config_error() -> None:
    traj = make_traj([("policy", "<answer>x</answer>")], ["x"], served_context=[])
    with pytest.raises(ConfigError, match="needs a generator"):
        get_reward("s3_genacc")([traj], RewardServices())


def test_score_batch_records_components() -> None:
    traj = make_traj([("policy", "<think>t</think><answer>Paris</answer>")], ["Paris"])
    score_batch(get_reward("search_r1_em"), [traj])
    assert traj.rewards == {"total": 1.0, "em": 1.0, "has_answer": 1.0}


@pytest.mark.parametrize(
    ("reply", "verdict"),
    [
        ("Yes", True),
        ("yes.", True),
        ("YES → match", True),
        ("  No.", False),
        ("The answer is yes", True),
        ("I cannot tell, no", False),
        ("yes and no", True),  # the first word decides
        ("<think>hmm, no idea</think>Yes", True),  # reasoning block dropped
        ("garbage ###", False),
        ("", False),
    ],
)
def test_parse_yes_no(reply: str, verdict: bool) -> None:
    assert parse_yes_no(reply) is verdict


def test_judge_prompt_and_gen_acc() -> None:
    judge = FakeGenerator(lambda p: "yes" if "twenty-five" in p else "no")
    out = judge_contains(judge, ["q1", "q2"], [["25"], ["Paris"]], ["It is twenty-five.", "Marseille"])
    assert out == [True, False]
    sent = prompt_text(judge.batches[0][0])
    assert "It is twenty-five." in sent and "Golden answers: ['25']" in sent and "'yes' or 'no'" in sent
    assert gen_acc("It is twenty-five.", ["25"], True) == 1.0  # judge rescues the span miss
    assert gen_acc("Barack Obama won", ["Barack Obama"], None) == 1.0  # span alone
    assert gen_acc("Marseille", ["Paris"], False) == 0.0


def test_document_prompt_is_s3_public_code_format() -> None:
    msgs = document_prompt("Who?", [hit("1", "Earthship", "A house."), Hit("2", "Tires", "Packed.", 0.5)])
    # s3's local_inst.format_qa_chat_messages with rag_2's "Doc {i} (Title: {title})\n{text}\n\n" context
    assert msgs == [
        {
            "role": "system",
            "content": "Use the following contexts (some might be irrelevant) on demand:\nContexts:\n"
            "Doc 1 (Title: Earthship)\nA house.\n\nDoc 2 (Title: Tires)\nPacked.\n\n\n\n"
            "Important: You MUST directly answer the question without any other text and thinking.",
        },
        {"role": "user", "content": "Who?"},
    ]
    with pytest.raises(ValueError, match="lacks field"):
        document_prompt("Who?", [{"title": "x"}])


# ---------------------------------------------------------------- structure parsing


def test_parse_response_keeps_env_opaque_and_flags_nesting() -> None:
    traj = make_traj(
        [
            ("policy", "<think>a</think><search>q</search>"),
            ("env", "\n<information>Doc 1 <answer>Paris</answer></information>\n"),
            ("policy", "<think><answer>x</answer></think>"),
        ],
        ["Paris"],
    )
    parsed = parse_response(traj, tags=("think", "search", "answer"))
    kinds = [(s.kind, s.tag) for s in parsed.segments]
    assert kinds == [("block", "think"), ("block", "search"), ("env", "information"), ("block", "think")]
    assert parsed.errors == ["<answer> inside <think>", "</answer> inside <think>"]


# ---------------------------------------------------------------- Search-R1

DOCS_WITH_GOLD = "\n\n<information>Doc 1(Title: Paris) <answer>Paris</answer> Paris is the capital of France.</information>\n\n"


def test_search_r1_em_reads_last_policy_answer() -> None:
    reward = get_reward("search_r1_em")
    good = make_traj(
        [("policy", "<think>x</think><answer>Lyon</answer> <answer>The Paris</answer>")], ["Paris"]
    )
    assert reward([good])[0].total == 1.0


def test_gold_in_documents_but_not_in_answer_gives_no_em() -> None:
    reward = get_reward("search_r1_em")
    wrong = make_traj(
        [
            ("policy", "<think>x</think><search>capital of france</search>"),
            ("env", DOCS_WITH_GOLD),
            ("policy", "<think>y</think><answer>Lyon</answer>"),
        ],
        ["Paris"],
    )
    no_answer = make_traj(
        [("policy", "<think>x</think><search>capital of france</search>"), ("env", DOCS_WITH_GOLD)], ["Paris"]
    )
    res = reward([wrong, no_answer])
    assert [r.total for r in res] == [0.0, 0.0]
    assert res[1].components["has_answer"] == 0.0
    assert policy_answer(no_answer) is None


def test_prompt_answer_never_counts() -> None:
    traj = make_traj(
        [("policy", "<think>no idea</think>")], ["Paris"], prompt_text="e.g. <answer>Paris</answer>"
    )
    assert get_reward("search_r1_em")([traj])[0].total == 0.0


def test_answer_cannot_be_stitched_across_an_inserted_span() -> None:
    traj = make_traj(
        [("policy", "<think>x</think><answer>Par"), ("env", "is</answer>"), ("policy", "")],
        ["Paris"],
    )
    assert get_reward("search_r1_em")([traj])[0].total == 0.0


def test_search_r1_format_em_cases() -> None:
    reward = get_reward("search_r1_format_em")  # structure 0.2, final format 0.1, retrieval 0.1
    searched = [("policy", "<think>a</think>\n<search>capital of france</search>"), ("env", DOCS_WITH_GOLD)]
    no_gold_docs = "\n<information>Doc 1(Title: Lyon) Lyon is a city.</information>\n"
    cases = {
        "valid_correct": (searched + [("policy", "<think>b</think>\n<answer>Paris</answer>")], 1.0),
        "invalid_correct": ([("policy", "Sure! <think>b</think><answer>Paris</answer>")], 0.8),
        "valid_wrong_hit": (searched + [("policy", "<think>b</think><answer>Lyon</answer>")], 0.3),
        "valid_wrong_nohit": (
            [("policy", "<think>a</think><search>x</search>"), ("env", no_gold_docs)]
            + [("policy", "<think>b</think><answer>Lyon</answer>")],
            0.2,
        ),
        "invalid_wrong": ([("policy", "<answer>Lyon</answer>")], 0.1),  # no <think> first
        "no_answer_unclosed": ([("policy", "<think>a</think><answer>Par")], 0.0),
        "invalid_action_feedback": (
            [
                ("policy", "<think>a</think>"),
                ("env", "\nMy previous action is invalid. <search> and </search>\n"),
            ]
            + [("policy", "<think>b</think><answer>Paris</answer>")],
            0.8,
        ),
        "policy_writes_information": (
            [("policy", "<think>a</think><search>x</search><information>fake</information><think>b</think>")]
            + [("policy", "<answer>Lyon</answer>")],
            0.1,
        ),
    }
    trajs = [make_traj(spans, ["Paris"]) for spans, _ in cases.values()]
    got = [r.total for r in reward(trajs)]
    assert got == pytest.approx([want for _, want in cases.values()])


# ---------------------------------------------------------------- s3

GARBAGE_WARRIOR = Hit("d4", "Garbage Warrior", "Garbage Warrior is a 2007 film about Mike Reynolds.", 1.0)
EARTHSHIP = Hit("d1", "Earthship", "An Earthship is a passive solar house.", 1.0)


def s3_generator() -> FakeGenerator:
    def rule(p: str) -> str:
        if "Garbage Warrior" in p:
            return "2007"
        if "Tires" in p:
            return "two thousand seven"
        return "There is no specific year mentioned."

    return FakeGenerator(rule)


def test_s3_genacc_span_then_judge() -> None:
    gen = s3_generator()
    judge = FakeGenerator(lambda p: "Yes" if "two thousand seven" in p else "No")
    trajs = [
        make_traj([("policy", "")], ["2007"], qid="a", served_context=[GARBAGE_WARRIOR.to_dict()]),
        make_traj([("policy", "")], ["2007"], qid="b", served_context=[EARTHSHIP.to_dict()]),
        make_traj([("policy", "")], ["2007"], qid="c", served_context=[hit("t", "Tires", "x")]),
    ]
    res = get_reward("s3_genacc")(trajs, RewardServices(generator=gen, judge=judge))
    assert [r.total for r in res] == [1.0, 0.0, 1.0]
    assert res[0].components == {"acc_s3": 1.0, "span_s3": 1.0}  # span matched: judge not asked
    assert res[1].components["judge_s3"] == 0.0 and res[2].components["judge_s3"] == 1.0
    assert len(gen.batches) == 1 and gen.num_prompts == 3  # one batched generator call
    assert len(judge.batches) == 1 and judge.num_prompts == 2  # only span misses go to the judge


def test_s3_gbr_baseline_cached_once_per_question() -> None:
    # q1: naive RAG sees Earthship only -> wrong (0); the searcher served Garbage Warrior -> right (1)
    # q2: naive RAG sees Garbage Warrior -> right (1); the searcher served Earthship -> wrong (0)
    retriever = FakeRetriever({"film year?": [EARTHSHIP, GARBAGE_WARRIOR], "film made?": [GARBAGE_WARRIOR]})
    gen = s3_generator()
    cache = FakeCache()
    services = RewardServices(
        generator=gen, judge=FakeGenerator(lambda p: "no"), retriever=retriever, baseline_cache=cache
    )
    reward = get_reward("s3_gbr", rag_k=1)

    def batch():
        return [
            make_traj(
                [("policy", "")],
                ["2007"],
                question="film year?",
                qid="q1",
                served_context=[GARBAGE_WARRIOR.to_dict()],
            ),
            make_traj(
                [("policy", "")],
                ["2007"],
                question="film year?",
                qid="q1",
                served_context=[GARBAGE_WARRIOR.to_dict()],
            ),
            make_traj(
                [("policy", "")],
                ["2007"],
                question="film made?",
                qid="q2",
                served_context=[EARTHSHIP.to_dict()],
            ),
        ]

    first = reward(batch(), services)
    assert [r.total for r in first] == [1.0, 1.0, -1.0]  # GBR = acc_s3 - acc_rag
    assert first[0].components["acc_rag"] == 0.0 and first[2].components["acc_rag"] == 1.0
    assert retriever.calls == [(["film year?", "film made?"], 1)]  # one batched search, deduplicated
    assert cache.values == {"q1": 0.0, "q2": 1.0} and cache.saves == 1
    prompts_after_first = gen.num_prompts  # 2 baseline + 3 s3
    assert prompts_after_first == 5

    second = reward(batch(), services)
    assert [r.total for r in second] == [1.0, 1.0, -1.0]
    assert len(retriever.calls) == 1 and cache.saves == 1  # baseline not recomputed
    assert gen.num_prompts == prompts_after_first + 3  # only the s3 answers again

    code_form = get_reward("s3_gbr", rag_k=1, form="code")(batch(), services)
    assert [r.total for r in code_form] == [2.0, 2.0, -1.0]  # GBR + acc_s3


def test_s3_gbr_without_cache_memoises_in_the_reward() -> None:
    retriever = FakeRetriever({"film year?": [EARTHSHIP]})
    services = RewardServices(generator=s3_generator(), retriever=retriever)
    reward = get_reward("s3_gbr", use_judge=False)
    traj = make_traj(
        [("policy", "")],
        ["2007"],
        question="film year?",
        qid="q1",
        served_context=[GARBAGE_WARRIOR.to_dict()],
    )
    assert reward([traj], services)[0].total == 1.0
    assert reward([traj], services)[0].total == 1.0
    assert len(retriever.calls) == 1


# ---------------------------------------------------------------- R-Search

OBS = "\n<observation>Doc 1(Title: Countrywide) Bank of America bought Countrywide in 2008.</observation>\n"


def rsearch_generator() -> FakeGenerator:
    return FakeGenerator(lambda p: "Countrywide" if "bought Countrywide" in p else "unknown")


def test_rsearch_format_formula() -> None:
    g = 0.2
    assert rsearch_format_reward(False, True, False, g, g) == pytest.approx(0.4)
    assert rsearch_format_reward(False, False, True, g, g) == pytest.approx(0.2)
    assert rsearch_format_reward(True, True, True, g, g) == pytest.approx(0.4)
    assert rsearch_format_reward(True, True, False, g, g) == pytest.approx(0.2)
    assert rsearch_format_reward(True, False, True, g, g) == pytest.approx(0.2)
    assert rsearch_format_reward(True, False, False, g, g) == 0.0


def test_rsearch_reward_cases() -> None:
    gold = ["Countrywide Financial"]
    evidence = "<original_evidence>Bank of America bought Countrywide in 2008.</original_evidence>"
    cases = [
        # no search, one answer, no evidence: F1("countrywide", gold) = 2/3; format γe + γa = 0.4
        ([("policy", "I recall it. <answer>Countrywide</answer>")], 2 / 3, 0.0, 0.4),
        # search, one evidence, one answer: answer 2/3, cross-model answer "Countrywide" 2/3, format 0.4
        (
            [("policy", "Let me look. <search>countrywide buyer</search>"), ("env", OBS)]
            + [("policy", f"Found. {evidence} <answer>Countrywide</answer>")],
            2 / 3,
            2 / 3,
            0.4,
        ),
        # search without evidence: format γa only
        (
            [
                ("policy", "<search>q</search>"),
                ("env", OBS),
                ("policy", "<answer>Countrywide Financial</answer>"),
            ],
            1.0,
            0.0,
            0.2,
        ),
        # two answer blocks, no search: I_A = 0 -> format γe; answer F1 uses the last block
        ([("policy", "<answer>x</answer> wait <answer>Countrywide Financial</answer>")], 1.0, 0.0, 0.2),
        # search, two evidence blocks: I_E = 0 -> format γa; evidence reward from the last block
        (
            [("policy", "<search>q</search>"), ("env", OBS)]
            + [("policy", f"<original_evidence>none</original_evidence>{evidence}<answer>Lehman</answer>")],
            0.0,
            2 / 3,
            0.2,
        ),
        # evidence text inside an inserted observation is not the policy's evidence
        (
            [("policy", "<search>q</search>"), ("env", f"<observation>{evidence}</observation>")]
            + [("policy", "<answer>Lehman</answer>")],
            0.0,
            0.0,
            0.2,
        ),
    ]
    gen = rsearch_generator()
    trajs = [make_traj(spans, gold, question="Who did BoA buy in 2008?") for spans, *_ in cases]
    res = get_reward("r_search")(trajs, RewardServices(generator=gen))
    for r, (_, ans_f1, ev_f1, fmt) in zip(res, cases, strict=True):
        assert r.components["answer_f1"] == pytest.approx(ans_f1)
        assert r.components["evidence_f1"] == pytest.approx(ev_f1)
        assert r.components["format"] == pytest.approx(fmt)
        assert r.total == pytest.approx(ans_f1 + ev_f1 + fmt)
    assert len(gen.batches) == 1 and gen.num_prompts == 2  # only trajectories with evidence
    sent = prompt_text(gen.batches[0][0])
    assert sent.endswith("Question: Who did BoA buy in 2008?\nAnswer:")
    assert "passages:\nBank of America bought Countrywide in 2008.\n" in sent


def test_rsearch_no_search_evidence_paper_vs_code() -> None:
    spans = [
        (
            "policy",
            "<original_evidence>Bank of America bought Countrywide in 2008.</original_evidence>"
            "<answer>Countrywide Financial</answer>",
        )
    ]
    traj = make_traj(spans, ["Countrywide Financial"])
    paper = get_reward("r_search")([traj], RewardServices(generator=rsearch_generator()))[0]
    assert paper.components["format"] == pytest.approx(0.4)  # (1 - I_S)(γe + γa)
    assert paper.components["evidence_f1"] == pytest.approx(2 / 3)
    code = get_reward("r_search", strict_no_search_evidence=True)([traj], RewardServices())[0]
    assert code.components["format"] == pytest.approx(0.2)
    assert code.components["evidence_f1"] == 0.0
    assert code.total == pytest.approx(1.2)


def test_rsearch_without_evidence_ablation_scores_answers_only() -> None:
    """The paper's "w/o Evidence" (Sec. 5.2): no evidence reward and no evidence part of the format reward, so a
    searched, answered response earns F1 + γa whether or not it wrote an evidence block; without an answer, 0."""
    searched = [("policy", "<search>q</search>"), ("env", "<observation>Doc</observation>")]
    cases = [
        (searched + [("policy", "<answer>Countrywide Financial</answer>")], 1.0 + 0.2),
        (
            searched + [("policy", "<original_evidence>x</original_evidence><answer>Countrywide</answer>")],
            2 / 3 + 0.2,
        ),
        ([("policy", "<answer>Countrywide Financial</answer>")], 1.0 + 0.2),  # no search: γa, not γe + γa
        (searched + [("policy", "no answer")], 0.0),
    ]
    trajs = [make_traj(spans, ["Countrywide Financial"]) for spans, _ in cases]
    ablated = get_reward("r_search", use_evidence_reward=False, use_evidence_format=False)
    for result, (_, total) in zip(
        ablated(trajs, RewardServices()), cases, strict=True
    ):  # no generator needed
        assert result.total == pytest.approx(total) and result.components["evidence_f1"] == 0.0
    # the reward-term ablation alone keeps the evidence part of the format: the first case gets γa only (I_E = 0)
    reward_only = get_reward("r_search", use_evidence_reward=False)(trajs[:1], RewardServices())[0]
    assert reward_only.components["format"] == pytest.approx(0.2) and reward_only.total == pytest.approx(1.2)
    both = get_reward("r_search", use_evidence_reward=False)(trajs[1:2], RewardServices())[0]
    assert both.components["format"] == pytest.approx(0.4)  # γe·I_E + γa·I_A with the block


# ---------------------------------------------------------------- staged reward

INFO = "\n<information>Doc 1(Title: Edward Dickinson) died June 16, 1874.</information>\n"


def staged_judge() -> FakeGenerator:
    return FakeGenerator(lambda p: "YES" if "Prediction: june 16 1874\n" in p else "NO")


def one_search(query: str, answer: str) -> list[tuple[str, str]]:
    return [
        ("policy", f"<think>unsure</think>\n<search>{query}</search>"),
        ("env", INFO),
        ("policy", f"<reflect>doc 1 says so</reflect>\n<answer>{answer}</answer>"),
    ]


def test_conciseness_rule() -> None:
    rule = ConcisenessRule()
    assert rule.is_concise("Edward Dickinson death date")
    assert rule.is_concise("Frederick of Liège father birth date")  # one preposition allowed
    assert rule.violations("when did Lavinia Norcross Dickinson's father die") == [
        "question word 'when'",
        "filler word 'did'",
    ]
    assert not rule.is_concise("Dickinson father death?")
    assert not rule.is_concise("death of father of Lavinia")  # two prepositions
    assert not rule.is_concise("please find Dickinson")
    assert not rule.is_concise(" ".join(["word"] * 11))
    assert not rule.is_concise("   ")
    assert ConcisenessRule(max_prepositions=2).is_concise("death of father of Lavinia")


def test_average_pairwise_similarity_hand_computed() -> None:
    emb = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])  # unnormalised on purpose
    # cosines: (0, 1) = 0, (0, 2) = 1/√2, (1, 2) = 1/√2 -> sum √2
    assert average_pairwise_similarity(emb, "mean") == pytest.approx(math.sqrt(2) / 3)
    assert average_pairwise_similarity(emb, "eq8") == pytest.approx(math.sqrt(2) / 6)
    assert average_pairwise_similarity(emb[:1]) == 0.0


def test_staged_reward_components() -> None:
    no_search = make_traj(
        [("policy", "<think>I know</think>\n<reflect>sure</reflect>\n<answer>June 16, 1874</answer>")],
        ["June 16, 1874"],
    )
    concise = make_traj(
        one_search("Edward Dickinson death date", "June 16, 1874"), ["June 16, 1874"], retrieval_count=1
    )
    verbose_wrong = make_traj(
        one_search("when did Lavinia Norcross Dickinson's father die", "1887"),
        ["June 16, 1874"],
        retrieval_count=1,
    )
    three = make_traj(
        [("policy", "<think>t</think><search>a</search>"), ("env", INFO)]
        + [("policy", "<reflect>r</reflect><search>b</search>"), ("env", INFO)]
        + [("policy", "<reflect>r</reflect><search>c</search>"), ("env", INFO)]
        + [("policy", "<reflect>r</reflect><answer>1887</answer>")],
        ["June 16, 1874"],
        queries=["a", "b", "c"],
        retrieval_count=3,
    )
    encoder = FakeEncoder({"a": [1.0, 0.0], "b": [0.0, 1.0], "c": [1.0, 1.0]})
    services = RewardServices(judge=staged_judge(), encoder=encoder)
    trajs = [no_search, concise, verbose_wrong, three]

    stage1 = get_reward("staged", stage=1)(trajs, services)
    # no_search: r_a 1, r_s 0 (RC 0), r_f 1
    assert stage1[0].total == pytest.approx(2.0)
    assert (stage1[0].components["r_a"], stage1[0].components["r_s"], stage1[0].components["r_f"]) == (
        1.0,
        0.0,
        1.0,
    )
    # concise, correct: 1 + 0 + 1
    assert stage1[1].total == pytest.approx(2.0)
    # verbose, wrong, RC 1: r_a = -1 + 0.3 = -0.7, r_s = -1, r_f = 1
    assert stage1[2].components["r_a"] == pytest.approx(-0.7)
    assert stage1[2].components["r_s"] == -1.0 and stage1[2].components["concise"] == 0.0
    assert stage1[2].total == pytest.approx(-0.7)
    # three searches, wrong: r_a = -1 + 0.9 = -0.1, r_s = -√2/3, r_f = 1 (T S I R S I R S I R A)
    assert stage1[3].components["r_a"] == pytest.approx(-0.1)
    assert stage1[3].components["r_s"] == pytest.approx(-math.sqrt(2) / 3)
    assert stage1[3].components["r_f"] == 1.0
    assert stage1[3].total == pytest.approx(-0.1 - math.sqrt(2) / 3 + 1.0)
    assert encoder.calls == 1

    stage2 = get_reward("staged", stage=2)(trajs, services)
    assert stage2[0].components["r_a"] == 1.0  # correct, RC 0
    assert stage2[1].components["r_a"] == pytest.approx(0.7)  # correct: 1 - 0.3 * 1
    assert stage2[2].components["r_a"] == -1.0
    assert stage2[3].components["r_a"] == -1.0


def test_staged_stage_switch_by_step() -> None:
    traj = make_traj(
        one_search("Edward Dickinson death date", "June 16, 1874"), ["June 16, 1874"], retrieval_count=1
    )
    reward = get_reward("staged", switch_step=10, correctness="em")
    services = RewardServices()
    assert reward([traj], services)[0].components["stage"] == 1.0  # no step told yet: configured stage
    reward.set_step(9)
    assert reward([traj], services)[0].total == pytest.approx(2.0)
    reward.set_step(10)
    res = reward([traj], services)[0]
    assert res.components["stage"] == 2.0 and res.total == pytest.approx(1.7)


@pytest.mark.parametrize(
    "spans",
    [
        [("policy", "Okay. <think>t</think><reflect>r</reflect><answer>x</answer>")],  # text outside blocks
        [("policy", "<reflect>r</reflect><answer>x</answer>")],  # no think
        [("policy", "<think>t</think><answer>x</answer>")],  # no reflect
        [
            (
                "policy",
                "<think>t</think><search>q</search><information>mine</information><reflect>r</reflect><answer>x</answer>",
            )
        ],
        [
            ("policy", "<think>t</think><search>q</search>"),
            ("env", "Invalid action."),
            ("policy", "<reflect>r</reflect><answer>x</answer>"),
        ],
        [
            ("policy", "<think>t</think><search>q</search>"),
            ("env", INFO),
            ("policy", "<answer>x</answer><reflect>r</reflect>"),
        ],
        [("policy", "<think>t</think><reflect>r</reflect><answer>x")],  # unclosed
    ],
)
def test_staged_format_violations(spans) -> None:
    traj = make_traj(spans, ["x"])
    res = get_reward("staged", correctness="em")([traj], RewardServices(encoder=FakeEncoder({"q": [1.0]})))[0]
    assert res.components["r_f"] == -1.0


def test_staged_f1_correctness_and_judge_requirement() -> None:
    traj = make_traj(
        one_search("Dickinson death", "Edward died June 16, 1874"), ["June 16, 1874"], retrieval_count=1
    )
    # F1: pred tokens [edward, died, june, 16, 1874], gold [june, 16, 1874]: P=3/5, R=1 -> 0.75
    assert get_reward("staged", correctness="f1", f1_threshold=0.7)([traj])[0].components["correct"] == 1.0
    assert get_reward("staged", correctness="f1", f1_threshold=0.8)([traj])[0].components["correct"] == 0.0
    with pytest.raises(ConfigError, match="needs a judge"):
        get_reward("staged")([traj], RewardServices())


def test_staged_judge_sees_normalised_prediction() -> None:
    judge = staged_judge()
    traj = make_traj(
        one_search("Dickinson death", "The June 16, 1874."), ["June 16, 1874"], retrieval_count=1
    )
    assert get_reward("staged")([traj], RewardServices(judge=judge))[0].components["correct"] == 1.0
    assert "Reference Answers: ['june 16 1874']" in prompt_text(judge.batches[0][0])


# ---------------------------------------------------------------- QAgent

QINFO = "\n<information>Doc 1(Title: France) Paris is the capital of France.</information>\n"


def qagent_spans(search_block: str, tail: str = "<reflection>ok</reflection><answer>Paris</answer>"):
    return [("policy", f"<plan>find capital</plan>\n{search_block}"), ("env", QINFO), ("policy", tail)]


@pytest.mark.parametrize(
    ("spans", "format_ok", "total"),
    [
        (
            qagent_spans("<search>\n<query>capital France</query>\n<query>France seat</query>\n</search>"),
            1.0,
            1.0,
        ),
        ([("policy", "<answer>Paris</answer>")], 1.0, 1.0),  # direct answer
        (
            qagent_spans("<search><query>a</query><query>b</query><query>c</query><query>d</query></search>"),
            0.0,
            0.0,
        ),
        (qagent_spans("<search>capital France</search>"), 0.0, 0.0),  # no <query>
        (qagent_spans("<search><query>a</query> and more</search>"), 0.0, 0.0),
        (
            qagent_spans("<search><query>a</query></search>", "<answer>Paris</answer>"),
            0.0,
            0.0,
        ),  # no reflection
        (
            qagent_spans("<search><query>a</query></search>", "<reflect>ok</reflect><answer>Paris</answer>"),
            1.0,
            1.0,
        ),
        (
            qagent_spans(
                "<search><query>a</query></search>",
                "<reflection>ok</reflection><answer>Paris, France</answer>",
            ),
            1.0,
            0.0,
        ),
        (
            [
                ("policy", "I will think."),
                ("env", "\nPlease rethink and use the tags.\n"),
                ("policy", "<answer>Paris</answer>"),
            ],
            0.0,
            0.0,
        ),
    ],
)
def test_qagent_stage1(spans, format_ok: float, total: float) -> None:
    res = get_reward("qagent_stage1")([make_traj(spans, ["Paris"])])[0]
    assert res.components["format_ok"] == format_ok
    assert res.total == total


def test_qagent_stage2_generator_em_plus_hit() -> None:
    gen = FakeGenerator(lambda p: "It is Paris." if "capital of France" in p else "Lyon")
    paris = hit("1", "France", "Paris is the capital of France.")
    lyon = hit("2", "Lyon", "Lyon is a city.")
    trajs = [
        # generator right (cover EM: "paris" in "it is paris") and gold retrieved: 1 + 0.5
        make_traj(
            qagent_spans("<search><query>a</query></search>"),
            ["Paris"],
            retrieved=[[paris]],
            served_context=[paris],
        ),
        # gold retrieved but not served: generator wrong, hit 0.5
        make_traj(
            qagent_spans("<search><query>a</query></search>"),
            ["Paris"],
            retrieved=[[paris], [lyon]],
            served_context=[lyon],
        ),
        # gold only in the policy's own text: no hit by default
        make_traj(
            [("policy", "<plan>maybe Paris</plan><answer>Paris</answer>")],
            ["Paris"],
            retrieved=[[lyon]],
            served_context=[lyon],
        ),
    ]
    reward = get_reward("qagent_stage2")
    res = reward(trajs, RewardServices(generator=gen))
    assert [r.total for r in res] == [1.5, 0.5, 0.0]
    assert res[0].components == {"generator_cover_em": 1.0, "hit": 1.0}
    assert len(gen.batches) == 1
    sent = gen.batches[0][0]
    assert sent[0]["role"] == "system" and sent[0]["content"].endswith(
        '\n\nDoc 1(Title: "France") Paris is the capital of France.\n'
    )
    loose = get_reward("qagent_stage2", hit_scope="response")(trajs[2:], RewardServices(generator=gen))
    assert loose[0].total == 0.5


def test_turnless_trajectory_only_when_nothing_was_inserted() -> None:
    plain = Trajectory("q", "Q?", ["Paris"], "direct", response_text="<answer>Paris</answer>")
    assert get_reward("search_r1_em")([plain])[0].total == 1.0
    inserted = Trajectory(
        "q", "Q?", ["Paris"], "x", response_text="<information>Paris</information>", retrieval_count=1
    )
    with pytest.raises(ValueError, match="has inserted text but no turns"):
        get_reward("search_r1_em")([inserted])


def test_the_stage_is_declared_by_every_reward() -> None:
    """The trainer reads `Reward.current_stage` (no getattr fallback): one stage unless a reward has a schedule."""
    from sleuth.rewards.base import Reward

    assert Reward.current_stage.__doc__ and get_reward("search_r1_em").current_stage == 1
    from sleuth.rewards.base import register_reward

    with pytest.raises(TypeError, match="must subclass sleuth.rewards.base.Reward"):
        register_reward("not_a_reward")(
            type("NotAReward", (), {"__call__": lambda self, trajs, services=None: []})
        )
    staged = get_reward("staged", switch_step=3, correctness="em")
    staged.set_step(2)
    assert staged.current_stage == 1
    staged.set_step(3)
    assert staged.current_stage == 2
