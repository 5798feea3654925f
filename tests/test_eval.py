"""Evaluation harness: every method, the output layout, hand-computed metrics, the submodule setting,
resumability and bad inputs. A scripted generator with the tiny model's real tokenizer plays the model."""

from __future__ import annotations

import json

import pytest

from sleuth.data.formats import QAExample
from sleuth.errors import ConfigError, DataFormatError
from sleuth.eval.baselines import answer_stated, first_sentence, parse_answer
from sleuth.eval.harness import (
    METHODS,
    EvalConfig,
    evaluate,
    load_eval_data,
    load_predictions,
    parse_methods,
    score_predictions,
)
from sleuth.eval.search_o1 import boxed_answer
from sleuth.llm.scripted import ScriptCall, ScriptedGenerator
from sleuth.rewards.answerer import document_prompt
from toyworld import ToyRetriever

Q1 = "What is the capital of Varonia?"
Q2 = "Where was the director of Blue Harbor born?"
Q3 = "Which river flows through Quellstad?"
# supporting_ids: the gold chain of each question in toyworld.PASSAGES (what the oracle reads)
EXAMPLES = [
    QAExample("q1", Q1, ["Quellstad"], {"dataset": "alpha", "supporting_ids": ["p1"]}),
    QAExample("q2", Q2, ["Tarsk"], {"dataset": "alpha", "supporting_ids": ["p3", "p4"]}),
    QAExample("q3", Q3, ["the Vell", "Vell river"], {"dataset": "beta", "supporting_ids": ["p6"]}),
]
# What the scripted model answers: right, a loose answer (cover-EM and span only), wrong.
ANSWERS = {Q1: "Quellstad", Q2: "born in Tarsk town", Q3: "Quellstad"}
# hand-computed per question: (em, cover_em, f1, span_check); F1 of q2 = 2 * (1/4 * 1) / (1/4 + 1) = 0.4
EXPECTED = {"q1": (1.0, 1.0, 1.0, 1.0), "q2": (0.0, 1.0, 0.4, 1.0), "q3": (0.0, 0.0, 0.0, 0.0)}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from sleuth.llm.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def question_in(text: str) -> str:
    found = [q for q in ANSWERS if q in text]
    assert found, f"no question in prompt {text[:300]!r}"
    return max(found, key=len)


def model_script(call: ScriptCall) -> str:
    """One scripted 'model' that speaks every method's protocol and gives ANSWERS[question]."""
    p = call.prompt_text
    q = question_in(p)
    a = ANSWERS[q]
    t = call.turn_index
    if "search copilot" in p:  # s3 searcher: keep doc 2 of the initial window, done
        return "<important_info>[2]</important_info>\n<search_complete>True</search_complete>"
    if "Search for information to answer the given question" in p:  # QAgent
        return [
            "<plan> look it up </plan>\n<search>\n<query>" + q + "</query>\n</search>",
            "<reflection> found </reflection>\n<answer> agent says " + a + " </answer>",
        ][min(t, 1)]
    if "structured reasoning protocol" in p:  # staged
        return [
            "<think> unsure </think>\n<search> " + q + " </search>",
            "<reflect> ok </reflect>\n<answer> " + a + " </answer>",
        ][min(t, 1)]
    if "You must conduct reasoning inside <think>" in p:  # Search-R1
        return [
            "<think> need facts </think>\n<search> " + q + " </search>",
            "<think> got it </think>\n<answer> " + a + " </answer>",
        ][min(t, 1)]
    if "solve the given question step by step" in p:  # R-Search
        return [
            "Let me search. <search> " + q + " </search>",
            "<original_evidence> " + a + " is it </original_evidence>\n<answer> " + a + " </answer>",
        ][min(t, 1)]
    if "<|begin_search_query|> your query here" in p:  # Search-o1
        return [
            "I should look this up. <|begin_search_query|>" + q + "<|end_search_query|>",
            "The documents settle it. So the answer is \\boxed{" + a + "}.",
        ][min(t, 1)]
    if "Write only the next single sentence" in p:  # IRCoT step
        if "Reasoning so far: (none yet)" in p:
            return "First I recall the relevant facts. This is ignored.\nand this line too"
        return "So the answer is: " + a + "."
    if "short answer of a few words and nothing else" in p:  # direct
        return "<answer> " + a + " </answer>"
    if "First think step by step" in p:  # CoT
        return "Step one. Step two.\n<answer> " + a + " </answer>"
    # frozen-generator readers (s3 / FlashRAG / evidence prompts): the first line is the answer
    return a + "\nbecause the documents say so"


def scripted(tok, script=model_script) -> ScriptedGenerator:
    return ScriptedGenerator(tok, script)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------------
# every method, the output layout, hand-computed metrics


def test_every_method_runs_and_writes_the_output_layout(tok, tmp_path):
    gen = scripted(tok)
    retriever = ToyRetriever()
    summary = evaluate(
        list(METHODS), EXAMPLES, retriever, gen, out_dir=tmp_path, config=EvalConfig(batch_size=2, top_k=2)
    )
    assert list(summary["methods"]) == list(METHODS)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    md = (tmp_path / "summary.md").read_text()
    for method in METHODS:
        records = read_jsonl(tmp_path / method / "predictions.jsonl")
        assert [r["id"] for r in records] == ["q1", "q2", "q3"]
        for r in records:
            assert set(r) >= {
                "id",
                "question",
                "golden_answers",
                "dataset",
                "method",
                "prediction",
                "metrics",
                "retrieval_count",
                "input_tokens",
                "output_tokens",
                "latency_s",
                "trajectory",
            }
            assert set(r["metrics"]) == {"em", "cover_em", "f1", "span_check", "genacc", "judge"}
            assert r["metrics"]["judge"] is None and r["method"] == method
            assert r["input_tokens"] > 0 and r["output_tokens"] > 0 and r["latency_s"] >= 0
            assert r["trajectory"]["question_id"] == r["id"]
            assert r["trajectory"]["response_ids"] == []  # token ids are dropped unless asked for
        # every method's scripted answer is ANSWERS[q] (qagent's own answer is replaced by the generator's)
        assert [r["prediction"] for r in records] == [ANSWERS[Q1], ANSWERS[Q2], ANSWERS[Q3]], method
        per_ds = summary["methods"][method]
        assert set(per_ds) == {"alpha", "beta", "overall"}
        assert per_ds["alpha"]["n"] == 2 and per_ds["beta"]["n"] == 1 and per_ds["overall"]["n"] == 3
        assert f"| {method} | alpha |" in md and f"| {method} | overall |" in md
    rc = {m: summary["methods"][m]["overall"]["retrieval_count"] for m in METHODS}
    assert rc["direct"] == rc["direct-generator"] == rc["cot"] == 0
    assert rc["oracle"] == 0  # the gold passages are looked up by id, not searched
    assert rc["naive-rag"] == rc["search-r1"] == rc["staged"] == rc["search-o1"] == rc["r-search"] == 1
    assert rc["ircot"] == 2  # the question, then the first reasoning sentence
    assert rc["s3"] == 1 and rc["qagent"] == 1


def test_summary_metrics_equal_hand_computed_values(tok, tmp_path):
    summary = evaluate("direct", EXAMPLES, None, scripted(tok), out_dir=tmp_path)
    per_ds = summary["methods"]["direct"]

    def mean(ids, i):
        return sum(EXPECTED[q][i] for q in ids) / len(ids)

    for name, ids in (("alpha", ["q1", "q2"]), ("beta", ["q3"]), ("overall", ["q1", "q2", "q3"])):
        for i, key in enumerate(("em", "cover_em", "f1", "span_check")):
            assert per_ds[name][key] == pytest.approx(mean(ids, i)), (name, key)
        assert per_ds[name]["genacc"] == pytest.approx(mean(ids, 3))  # no judge: GenAcc = span_check
        assert per_ds[name]["judge"] is None
    assert per_ds["overall"]["f1"] == pytest.approx(1.4 / 3)
    # token counts: the chat-templated prompt and the emitted ids, counted independently here
    records = read_jsonl(tmp_path / "direct" / "predictions.jsonl")
    from sleuth.eval.baselines import DIRECT_PROMPT

    for r, ex in zip(records, EXAMPLES, strict=True):
        text = tok.apply_chat_template(
            [{"role": "user", "content": DIRECT_PROMPT.format(question=ex.question)}],
            tokenize=False,
            add_generation_prompt=True,
        )
        assert r["input_tokens"] == len(tok.encode(text, add_special_tokens=False))
        emitted = tok.encode(f"<answer> {ANSWERS[ex.question]} </answer>", add_special_tokens=False)
        assert r["output_tokens"] == len(emitted)  # stopped at </answer>, no EOS
    assert summary["methods"]["direct"]["overall"]["input_tokens"] == pytest.approx(
        sum(r["input_tokens"] for r in records) / 3
    )


def test_judge_gives_judge_accuracy_and_genacc_is_span_or_judge(tok, tmp_path):
    asked: list[str] = []

    def judge_script(call: ScriptCall) -> str:
        asked.append(call.prompt_text)
        response = call.prompt_text.split("following response: ", 1)[1].split("\n\nGolden answers:", 1)[0]
        return "yes" if "Quellstad" in response else "no"  # a lenient judge: q1 yes, q2 no, q3 yes (wrong)

    summary = evaluate(
        "direct", EXAMPLES, None, scripted(tok), judge=scripted(tok, judge_script), out_dir=tmp_path
    )
    assert len(asked) == 3  # every prediction is judged
    overall = summary["methods"]["direct"]["overall"]
    assert overall["judge"] == pytest.approx(2 / 3)
    assert overall["genacc"] == pytest.approx(1.0)  # q1 span, q2 span, q3 judge
    recs = {r["id"]: r["metrics"] for r in read_jsonl(tmp_path / "direct" / "predictions.jsonl")}
    assert (recs["q2"]["judge"], recs["q2"]["genacc"]) == (0.0, 1.0)
    assert (recs["q3"]["judge"], recs["q3"]["genacc"]) == (1.0, 1.0)


def test_score_predictions_missing_prediction_is_wrong_and_not_sent_to_the_judge(tok):
    calls: list[str] = []
    judge = scripted(tok, lambda c: calls.append(c.prompt_text) or "yes")
    out = score_predictions([Q1, Q2], [["Quellstad"], ["Tarsk"]], [None, "Tarsk"], judge)
    assert out[0] == {"em": 0.0, "cover_em": 0.0, "f1": 0.0, "span_check": 0.0, "genacc": 0.0, "judge": 0.0}
    assert out[1]["judge"] == 1.0 and len(calls) == 1


# ---------------------------------------------------------------------------------------------------
# searcher as submodule


@pytest.mark.parametrize("method,template", [("s3", "s3"), ("qagent", "qagent")])
def test_submodule_hands_exactly_served_context_to_the_frozen_generator(tok, tmp_path, method, template):
    policy = scripted(tok)
    reader_prompts: list[str] = []

    def reader_script(call: ScriptCall) -> str:
        reader_prompts.append(call.prompt_text)
        return "Reader " + ANSWERS[question_in(call.prompt_text)]

    frozen = scripted(tok, reader_script)
    evaluate(
        method,
        EXAMPLES,
        ToyRetriever(),
        policy,
        generator=frozen,
        out_dir=tmp_path,
        config=EvalConfig(top_k=3),
    )
    records = read_jsonl(tmp_path / method / "predictions.jsonl")
    assert len(reader_prompts) == 3
    for r, ex in zip(records, EXAMPLES, strict=True):
        served = r["trajectory"]["served_context"]
        assert served, "the searcher gathered documents"
        expected = tok.apply_chat_template(
            document_prompt(ex.question, served, template), tokenize=False, add_generation_prompt=True
        )
        assert expected in reader_prompts  # the generator saw exactly these documents, nothing else
        assert r["prediction"] == "Reader " + ANSWERS[ex.question]
        assert r["answer_source"] == "generator"
    # s3 keeps only the selected doc (id 2 of the initial window); qagent the top-1 of its query
    if method == "s3":
        first = records[0]["trajectory"]
        assert [h["doc_id"] for h in first["served_context"]] == [first["retrieved"][0][1]["doc_id"]]
    else:
        assert records[0]["extra"]["agent_answer"] == "agent says Quellstad"
    # the frozen generator's tokens are counted with the searcher's
    policy_only = [r["input_tokens"] for r in records]
    assert all(n > 0 for n in policy_only)


def test_r_search_evidence_goes_to_the_frozen_generator_when_asked(tok, tmp_path):
    seen: list[str] = []

    def reader_script(call: ScriptCall) -> str:
        seen.append(call.prompt_text)
        return "Tarsk"

    evaluate(
        "r-search",
        EXAMPLES[:1],
        ToyRetriever(),
        scripted(tok),
        generator=scripted(tok, reader_script),
        out_dir=tmp_path,
        config=EvalConfig(r_search_evidence=True),
    )
    (rec,) = read_jsonl(tmp_path / "r-search" / "predictions.jsonl")
    assert rec["prediction"] == "Tarsk" and rec["answer_source"] == "generator"
    assert len(seen) == 1 and "Quellstad is it" in seen[0]  # the evidence block, not the raw documents
    assert "Its capital is Quellstad" not in seen[0]


def test_a_single_loaded_model_is_shared_when_generator_is_not_given(tok, tmp_path):
    gen = scripted(tok)
    evaluate("s3", EXAMPLES[:1], ToyRetriever(), gen, out_dir=tmp_path)
    prompts = [tok.decode(ids) for batch in gen.calls for ids in batch]
    assert any("Use the following contexts" in p for p in prompts)


# ---------------------------------------------------------------------------------------------------
# resumability


def test_second_run_skips_done_questions(tok, tmp_path):
    evaluate("direct", EXAMPLES[:2], None, scripted(tok), out_dir=tmp_path)
    gen = scripted(tok)
    summary = evaluate("direct", EXAMPLES, None, gen, out_dir=tmp_path)
    fed = [tok.decode(ids) for batch in gen.calls for ids in batch]
    assert len(fed) == 1 and Q3 in fed[0]  # only the new question ran
    assert [r["id"] for r in read_jsonl(tmp_path / "direct" / "predictions.jsonl")] == ["q1", "q2", "q3"]
    assert summary["methods"]["direct"]["overall"]["n"] == 3
    gen = scripted(tok)
    evaluate("direct", EXAMPLES, None, gen, out_dir=tmp_path)
    assert gen.calls == []


def test_truncated_last_line_is_dropped_and_rewritten(tok, tmp_path):
    evaluate("direct", EXAMPLES, None, scripted(tok), out_dir=tmp_path, config=EvalConfig(batch_size=1))
    path = tmp_path / "direct" / "predictions.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[1] + lines[2][: len(lines[2]) // 2])  # a crash mid-write of q3
    gen = scripted(tok)
    summary = evaluate("direct", EXAMPLES, None, gen, out_dir=tmp_path)
    assert sum(len(b) for b in gen.calls) == 1
    records = read_jsonl(path)  # every line parses again
    assert [r["id"] for r in records] == ["q1", "q2", "q3"]
    assert summary["methods"]["direct"]["overall"]["em"] == pytest.approx(1 / 3)


def test_complete_last_line_without_newline_is_kept(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "dataset": "d"}\n{"id": "b", "dataset": "d"}')
    assert sorted(load_predictions(path)) == [("d", "a"), ("d", "b")]
    assert path.read_text().endswith("}\n")


def test_corrupt_middle_line_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "dataset": "d"}\nnot json\n{"id": "b", "dataset": "d"}\n')
    with pytest.raises(DataFormatError, match=r"p\.jsonl:2"):
        load_predictions(path)


def test_resume_with_a_different_configuration_is_refused_unless_fresh(tok, tmp_path):
    evaluate(
        "naive-rag", EXAMPLES[:1], ToyRetriever(), scripted(tok), out_dir=tmp_path, config=EvalConfig(top_k=2)
    )
    with pytest.raises(ConfigError, match="top_k: 2 -> 3"):
        evaluate(
            "naive-rag",
            EXAMPLES[:1],
            ToyRetriever(),
            scripted(tok),
            out_dir=tmp_path,
            config=EvalConfig(top_k=3),
        )
    gen = scripted(tok)
    evaluate(
        "naive-rag",
        EXAMPLES[:1],
        ToyRetriever(),
        gen,
        out_dir=tmp_path,
        config=EvalConfig(top_k=3, fresh=True),
    )
    assert len(gen.calls) == 1


def test_methods_of_earlier_runs_stay_in_the_summary(tok, tmp_path):
    evaluate("direct", EXAMPLES, None, scripted(tok), out_dir=tmp_path)
    summary = evaluate("cot", EXAMPLES, None, scripted(tok), out_dir=tmp_path)
    assert list(summary["methods"]) == ["direct", "cot"]


# ---------------------------------------------------------------------------------------------------
# bad inputs


def test_unknown_method_error_lists_the_methods():
    with pytest.raises(ConfigError) as err:
        parse_methods("direct,magic")
    assert "magic" in str(err.value) and all(m in str(err.value) for m in METHODS)
    assert parse_methods(["search_r1,RAG", "s3", "s3"]) == ["search-r1", "naive-rag", "s3"]


def test_retrieval_methods_without_retriever_are_refused(tok, tmp_path):
    with pytest.raises(ConfigError, match="naive-rag.*retriever"):
        evaluate("direct,naive-rag", EXAMPLES, None, scripted(tok), out_dir=tmp_path)


def test_missing_data_file_and_limit(tmp_path):
    with pytest.raises(ConfigError, match="nope.jsonl"):
        load_eval_data([tmp_path / "nope.jsonl"])
    f = tmp_path / "mini.jsonl"
    f.write_text("".join(json.dumps(e.to_dict() | {"metadata": {}}) + "\n" for e in EXAMPLES))
    loaded = load_eval_data([f], limit=2)
    assert [e.id for e in loaded] == ["q1", "q2"] and {e.metadata["dataset"] for e in loaded} == {"mini"}


def test_duplicate_ids_within_a_dataset_are_refused(tok, tmp_path):
    dup = [EXAMPLES[0], QAExample("q1", Q2, ["Tarsk"], {"dataset": "alpha"})]
    with pytest.raises(ConfigError, match="'q1' appears twice"):
        evaluate("direct", dup, None, scripted(tok), out_dir=tmp_path)


def test_cli_errors_exit_2_with_a_clear_message(tmp_path):
    from typer.testing import CliRunner

    from sleuth.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["eval", "--method", "magic", "--data", str(tmp_path / "x.jsonl")])
    assert res.exit_code == 2 and "unknown method 'magic'" in res.output and "search-o1" in res.output
    res = runner.invoke(app, ["eval", "--method", "direct", "--data", str(tmp_path / "x.jsonl")])
    assert res.exit_code == 2 and "x.jsonl" in res.output and "does not exist" in res.output


# ---------------------------------------------------------------------------------------------------
# answer parsing


def test_answer_parsing_helpers():
    assert parse_answer("<think> hmm </think> x <answer> Paris </answer>") == "Paris"
    assert parse_answer("<answer> a </answer> then <answer> b </answer>") == "b"
    assert parse_answer("<answer> cut off here\nmore") == "cut off here"
    assert parse_answer("\n Answer: Paris.\nsecond line") == "Paris"
    assert parse_answer("The answer is: Skrernheir Holdings\nThe answer is: no") == "Skrernheir Holdings"
    assert parse_answer("I think so. Thus the answer is: Rome.\nok", "answer_is") == "Rome"
    assert parse_answer("step\nlast line", "answer_is") == "last line"
    assert parse_answer("   \n ") is None
    assert answer_stated("So the answer is: Mara Ilves.") == "Mara Ilves"
    assert answer_stated("No answer here") is None
    assert answer_stated("So the answer is: So the answer is: Vell.") == "Vell"
    assert answer_stated("So the answer is: Vell. So the answer is:") == "Vell"
    assert answer_stated("The answer to this question is: Xhaeth Zal") == "Xhaeth Zal"
    assert first_sentence("First one. Second one.\nnext") == "First one."
    assert boxed_answer("x \\boxed{a} y \\boxed{\\text{New {York}}}") == "New {York}"
    assert boxed_answer("none") is None


# ---------------------------------------------------------------------------------------------------
# IRCoT and Search-o1 specifics


def test_ircot_turns_each_reasoning_sentence_into_the_next_query_then_reads(tok, tmp_path):
    def script(call: ScriptCall) -> str:
        if "Write only the next single sentence" in call.prompt_text:
            if "Reasoning so far: (none yet)" in call.prompt_text:
                return "The film Blue Harbor was directed by Mara Ilves. Extra."
            return "Mara Ilves was born in 1950."
        return "Tarsk\nreader"  # IRCoT's direct reader

    retriever = ToyRetriever()
    evaluate(
        "ircot",
        [EXAMPLES[1]],
        retriever,
        scripted(tok, script),
        out_dir=tmp_path,
        config=EvalConfig(max_turns=2, top_k=2),
    )
    assert retriever.calls == [
        ([Q2], 2),
        (["The film Blue Harbor was directed by Mara Ilves."], 2),
        (["Mara Ilves was born in 1950."], 2),
    ]
    (rec,) = read_jsonl(tmp_path / "ircot" / "predictions.jsonl")
    traj = rec["trajectory"]
    assert rec["prediction"] == "Tarsk" and traj["extra"]["answer_from"] == "reader"
    assert rec["retrieval_count"] == 3 and traj["finish_reason"] == "max_turns"
    # the collection is deduplicated across steps
    ids = [h["doc_id"] for h in traj["served_context"]]
    assert len(ids) == len(set(ids)) and set(ids) == {h["doc_id"] for hs in traj["retrieved"] for h in hs}


def test_search_o1_prompt_results_block_and_search_limit(tok, tmp_path):
    gen = scripted(tok)
    evaluate("search-o1", EXAMPLES[:1], ToyRetriever(), gen, out_dir=tmp_path, config=EvalConfig(max_turns=2))
    first_prompt = tok.decode(gen.calls[0][0])
    assert "limited to 2." in first_prompt and "\\boxed{YOUR_ANSWER}" in first_prompt
    (rec,) = read_jsonl(tmp_path / "search-o1" / "predictions.jsonl")
    env = [t["text"] for t in rec["trajectory"]["turns"] if t["role"] == "env"]
    top = ToyRetriever().search([Q1], 3)[0]
    assert len(env) == 1 and env[0].startswith(f'\n\n<|begin_search_result|>\nDoc 1(Title: "{top[0].title}")')
    assert env[0].rstrip().endswith("<|end_search_result|>")
    assert rec["prediction"] == "Quellstad" and rec["trajectory"]["extra"]["answer_source"] == "boxed"


# ---------------------------------------------------------------------------------------------------
# the real tiny HF model, through the CLI


def test_cli_runs_every_method_with_the_tiny_hf_model(tiny_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import sleuth.eval.harness as harness
    from sleuth.cli import app

    monkeypatch.setattr(
        harness, "resolve_retriever", lambda spec, cache=None: ToyRetriever()
    )  # no index build here
    data = tmp_path / "mini.jsonl"
    data.write_text("".join(json.dumps(e.to_dict()) + "\n" for e in EXAMPLES))
    out = tmp_path / "out"
    # --limit is per data source: the first question of alpha (q1) and of beta (q3)
    args = [
        "eval",
        "-m",
        ",".join(METHODS),
        "--data",
        str(data),
        "--retriever",
        "toy",
        "--model",
        str(tiny_dir),
        "--out",
        str(out),
        "--limit",
        "1",
        "--max-new-tokens",
        "6",
        "--answer-max-new-tokens",
        "4",
        "--max-turns",
        "1",
        "--batch-size",
        "2",
    ]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["methods"]) == list(METHODS)
    for method in METHODS:
        records = read_jsonl(out / method / "predictions.jsonl")
        assert [r["id"] for r in records] == ["q1", "q3"]
        assert all(r["output_tokens"] > 0 for r in records)
        assert summary["methods"][method]["overall"]["n"] == 2
        assert 0.0 <= summary["methods"][method]["overall"]["em"] <= 1.0
    assert summary["config"]["limit"] == 1 and summary["config"]["model"] == str(tiny_dir.resolve())
    assert "sleuth eval" in res.output and "| alpha" not in res.output and "search-o1" in res.output


def test_search_o1_without_boxed_answer_falls_back_to_the_last_line(tok, tmp_path):
    def script(call: ScriptCall) -> str:
        return "Let me think.\nQuellstad"

    evaluate("search-o1", EXAMPLES[:1], ToyRetriever(), scripted(tok, script), out_dir=tmp_path)
    (rec,) = read_jsonl(tmp_path / "search-o1" / "predictions.jsonl")
    assert rec["prediction"] == "Quellstad" and rec["retrieval_count"] == 0
    assert rec["trajectory"]["extra"]["answer_source"] == "last_line"


def test_agent_token_counts_reread_the_context_each_turn(tok, tmp_path):
    evaluate(
        "search-r1",
        EXAMPLES[:1],
        ToyRetriever(),
        scripted(tok),
        out_dir=tmp_path,
        config=EvalConfig(keep_token_ids=True),
    )
    (rec,) = read_jsonl(tmp_path / "search-r1" / "predictions.jsonl")
    traj = rec["trajectory"]
    prompt = len(traj["prompt_ids"])
    roles = [t["role"] for t in traj["turns"]]
    assert roles == ["policy", "env", "policy"]
    second_start = traj["turns"][2]["start"]
    assert rec["input_tokens"] == prompt + (prompt + second_start)
    assert (
        rec["output_tokens"]
        == sum(traj["loss_mask"])
        == traj["turns"][0]["end"] + (traj["turns"][2]["end"] - second_start)
    )


class _IndexedToy(ToyRetriever):
    """The toy ranking, standing for a retriever over the index at `index_dir`."""

    def __init__(self, index_dir) -> None:
        super().__init__()
        self.index_dir = index_dir


def test_resume_over_another_index_or_from_another_checkpoint_is_refused(tok, tmp_path):
    first = scripted(tok)
    first.source = "checkpoint A"
    evaluate("naive-rag", EXAMPLES[:1], _IndexedToy(tmp_path / "index_a"), first, out_dir=tmp_path / "out")
    with pytest.raises(ConfigError, match="index_a.*index_b"):
        evaluate(
            "naive-rag", EXAMPLES[:1], _IndexedToy(tmp_path / "index_b"), first, out_dir=tmp_path / "out"
        )
    second = scripted(tok)  # same class, other weights
    second.source = "checkpoint B"
    with pytest.raises(ConfigError, match="checkpoint A.*checkpoint B"):
        evaluate(
            "naive-rag", EXAMPLES[:1], _IndexedToy(tmp_path / "index_a"), second, out_dir=tmp_path / "out"
        )
    # the same index and checkpoint resume: nothing is generated again
    again = scripted(tok)
    again.source = "checkpoint A"
    evaluate("naive-rag", EXAMPLES[:1], _IndexedToy(tmp_path / "index_a"), again, out_dir=tmp_path / "out")
    assert again.calls == []


def test_bm25_indexes_in_other_folders_are_described_apart(tmp_path):
    from sleuth.eval.harness import describe
    from sleuth.retrieval import build_index, load_retriever

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"id": f"d{i}", "contents": f"T{i}\nword{i} text"}) + "\n" for i in range(4))
    )
    for name in ("a", "b"):
        build_index(corpus, "bm25", tmp_path / name)
    a, b = (describe(load_retriever(tmp_path / n, corpus=corpus)) for n in ("a", "b"))
    assert a != b and str((tmp_path / "a").resolve()) in a
    assert describe(load_retriever(tmp_path / "a", corpus=corpus)) == a


def test_resume_with_the_same_ids_but_other_questions_is_refused(tok, tmp_path):
    evaluate("direct", EXAMPLES[:2], None, scripted(tok), out_dir=tmp_path)
    regenerated = [QAExample("q1", Q2, ["Quellstad"], {"dataset": "alpha"})]  # another world, same id
    with pytest.raises(ConfigError, match=r"question id 'q1' of dataset 'alpha'.*--fresh"):
        evaluate("direct", regenerated, None, scripted(tok), out_dir=tmp_path)
    new_key = [QAExample("q1", Q1, ["Quellstad", "Quell"], {"dataset": "alpha", "supporting_ids": ["p1"]})]
    with pytest.raises(ConfigError, match="gold answers"):
        evaluate("direct", new_key, None, scripted(tok), out_dir=tmp_path)
    gen = scripted(tok)
    evaluate("direct", regenerated, None, gen, out_dir=tmp_path, config=EvalConfig(fresh=True))
    assert len(gen.calls) == 1


def test_limit_applies_per_data_source_of_a_merged_search_r1_file(tiny_dir, tmp_path, monkeypatch):
    """Search-R1's merged test parquet lists all nq rows before triviaqa's: `--limit 2` keeps 2 of each
    data source (it used to keep the file's first 2, all nq), says so, and scores every data source."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    import sleuth.eval.harness as harness
    from sleuth.cli import app
    from test_data_formats import _search_r1_row

    rows = [_search_r1_row("nq", f"test_{i}", f"nq question {i}?", ["a"], i) for i in range(4)]
    rows += [_search_r1_row("triviaqa", f"test_{i}", f"tqa question {i}?", ["b"], 4 + i) for i in range(3)]
    data = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    loaded = harness.load_eval_data([data], limit=2)
    assert [(ex.metadata["dataset"], ex.question) for ex in loaded] == [
        ("nq", "nq question 0?"),
        ("nq", "nq question 1?"),
        ("triviaqa", "tqa question 0?"),
        ("triviaqa", "tqa question 1?"),
    ]
    assert harness.count_by_dataset(harness.load_eval_data([data])) == {"nq": 4, "triviaqa": 3}

    monkeypatch.setattr(harness, "resolve_retriever", lambda spec, cache=None: ToyRetriever())
    out = tmp_path / "out"
    args = [
        "eval",
        "-m",
        "direct",
        "--data",
        str(data),
        "--retriever",
        "toy",
        "--model",
        str(tiny_dir),
        "--out",
        str(out),
        "--limit",
        "2",
        "--answer-max-new-tokens",
        "2",
        "--batch-size",
        "4",
    ]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "--limit 2 per data source: nq 2, triviaqa 2" in res.output
    per_dataset = json.loads((out / "summary.json").read_text())["methods"]["direct"]
    assert per_dataset["nq"]["n"] == per_dataset["triviaqa"]["n"] == 2


def test_a_checkpoint_is_evaluated_with_the_loop_it_learned(tmp_path):
    """searcher.json's loop switches (s3 without selection here) reach the evaluation of that method, and only of
    that method; budgets still come from the checkpoint."""
    from sleuth.eval.config import EvalConfig
    from sleuth.eval.loading import checkpoint_budgets
    from sleuth.eval.methods import EvalContext
    from sleuth.run_layout import SearcherInfo

    SearcherInfo(loop="s3", loop_options={"use_selection": False, "top_k": 8}, max_obs_tokens=300).write(
        tmp_path
    )
    found = checkpoint_budgets(tmp_path)
    assert found == {
        "max_obs_tokens": 300,
        "top_k": 8,
        "loop_method": "s3",
        "loop_options": {"use_selection": False},
    }
    ctx = EvalContext(model=None, generator=None, retriever=None, cfg=EvalConfig(**found))
    assert ctx.loop_options("s3") == {"use_selection": False, "top_k": 8}
    assert ctx.loop_options("search_r1") == {"top_k": 8}  # another method: its own defaults
    from sleuth.agent.registry import get_method

    assert get_method("s3").build_loop(**ctx.loop_options("s3")).use_selection is False
