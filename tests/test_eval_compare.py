"""Statistics in `sleuth eval`: intervals in the summary, the paired comparison with naive-rag, readers
answering with --generator, the oracle and direct-generator rows, `sleuth compare`, and the report.
Scripted generators with the tiny model's tokenizer play the trained model and the frozen reader."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sleuth.data.formats import QAExample, iter_corpus
from sleuth.errors import ConfigError
from sleuth.eval.harness import EvalConfig, evaluate, load_eval_data, summary_rows
from sleuth.eval.stats import bootstrap_ci
from sleuth.llm.scripted import ScriptCall, ScriptedGenerator
from sleuth.rewards.answerer import document_prompt
from test_eval import ANSWERS, EXAMPLES, model_script, question_in, read_jsonl
from toyworld import PASSAGES, ToyRetriever

READER_MARK = "Use the following contexts"  # the s3 frozen-generator prompt


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from sleuth.llm.tiny import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def named(gen: ScriptedGenerator, name: str) -> ScriptedGenerator:
    gen.model_name = name  # what describe() records in method configs
    return gen


def trained_model(tok, prompts: list[str]) -> ScriptedGenerator:
    """The 'trained --model': model_script's answers, and an IRCoT chain that never states an answer."""

    def script(call: ScriptCall) -> str:
        prompts.append(call.prompt_text)
        if "Write only the next single sentence" in call.prompt_text:
            return "I keep looking for the facts."
        return model_script(call)

    return named(ScriptedGenerator(tok, script), "trained")


def frozen_reader(tok, prompts: list[str]) -> ScriptedGenerator:
    """The frozen reader: 'Unknown' without documents, 'Tarsk' (q2's gold) from any documents."""

    def script(call: ScriptCall) -> str:
        prompts.append(call.prompt_text)
        question_in(call.prompt_text)
        if "short answer of a few words and nothing else" in call.prompt_text:
            return "<answer> Unknown </answer>"
        return "Tarsk\nfrom the documents"

    return named(ScriptedGenerator(tok, script), "frozen")


@pytest.fixture(scope="module")
def fair_run(tok, tmp_path_factory):
    out = tmp_path_factory.mktemp("fair")
    model_prompts: list[str] = []
    reader_prompts: list[str] = []
    summary = evaluate(
        ["direct", "direct-generator", "naive-rag", "ircot", "oracle"],
        EXAMPLES,
        ToyRetriever(),
        trained_model(tok, model_prompts),
        generator=frozen_reader(tok, reader_prompts),
        out_dir=out,
        config=EvalConfig(top_k=2, max_turns=1),
    )
    return out, summary, model_prompts, reader_prompts


def predictions(out: Path, method: str) -> list:
    return [r["prediction"] for r in read_jsonl(out / method / "predictions.jsonl")]


# ---------------------------------------------------------------------------------------------------
# one call, fair: every reader is the frozen generator


def test_document_readers_answer_with_the_generator_not_the_trained_model(fair_run):
    out, summary, model_prompts, reader_prompts = fair_run
    assert predictions(out, "naive-rag") == ["Tarsk"] * 3
    assert predictions(out, "oracle") == ["Tarsk"] * 3
    assert predictions(out, "ircot") == ["Tarsk"] * 3  # IRCoT's reasoning by the model, its reader frozen
    assert all(
        r["trajectory"]["extra"]["answer_from"] == "reader"
        for r in read_jsonl(out / "ircot" / "predictions.jsonl")
    )
    assert not any(READER_MARK in p for p in model_prompts)
    assert any("Write only the next single sentence" in p for p in model_prompts)
    assert not any("Write only the next single sentence" in p for p in reader_prompts)
    # contamination check: direct is the trained model's answer, direct-generator the reader's
    assert predictions(out, "direct") == [ANSWERS[ex.question] for ex in EXAMPLES]
    assert predictions(out, "direct-generator") == ["Unknown"] * 3
    direct_gen = read_jsonl(out / "direct-generator" / "predictions.jsonl")
    assert all(r["answer_source"] == "generator" and r["retrieval_count"] == 0 for r in direct_gen)


def test_method_configs_record_who_answers(fair_run):
    _, summary, _, _ = fair_run
    cfgs = summary["method_configs"]
    assert cfgs["direct"]["model"] == "ScriptedGenerator(trained)" and cfgs["direct"]["generator"] is None
    for method in ("direct-generator", "naive-rag", "oracle"):
        assert cfgs[method]["generator"] == "ScriptedGenerator(frozen)" and cfgs[method]["model"] is None, (
            method
        )
    assert cfgs["ircot"]["model"] == "ScriptedGenerator(trained)"
    assert cfgs["ircot"]["generator"] == "ScriptedGenerator(frozen)"
    assert cfgs["oracle"]["answer_template"] == "s3" and cfgs["direct-generator"]["retriever"] is None


def test_resume_with_another_generator_is_refused_for_reader_methods(tok, tmp_path):
    evaluate(
        "naive-rag",
        EXAMPLES[:1],
        ToyRetriever(),
        trained_model(tok, []),
        generator=frozen_reader(tok, []),
        out_dir=tmp_path,
    )
    other = named(frozen_reader(tok, []), "other-reader")
    with pytest.raises(
        ConfigError, match="generator: 'ScriptedGenerator.frozen.' -> 'ScriptedGenerator.other"
    ):
        evaluate(
            "naive-rag", EXAMPLES, ToyRetriever(), trained_model(tok, []), generator=other, out_dir=tmp_path
        )
    # the trained model plays no part in naive-rag: another --model resumes
    evaluate(
        "naive-rag",
        EXAMPLES,
        ToyRetriever(),
        named(trained_model(tok, []), "another-policy"),
        generator=frozen_reader(tok, []),
        out_dir=tmp_path,
    )


# ---------------------------------------------------------------------------------------------------
# intervals and the paired comparison


def test_every_accuracy_has_its_bootstrap_interval(fair_run):
    _, summary, _, _ = fair_run
    direct = summary["methods"]["direct"]
    # direct answers: q1 right, q2 loose (cover-EM only), q3 wrong; F1 1, 0.4, 0
    assert direct["overall"]["em_ci"] == list(bootstrap_ci([1.0, 0.0, 0.0], seed=0))
    assert direct["overall"]["f1_ci"] == list(bootstrap_ci([1.0, 0.4, 0.0], seed=0))
    assert direct["alpha"]["cover_em_ci"] == [1.0, 1.0] and direct["beta"]["cover_em_ci"] == [0.0, 0.0]
    assert direct["overall"]["judge"] is None and direct["overall"]["judge_ci"] is None
    for per_dataset in summary["methods"].values():
        for stats in per_dataset.values():
            for key in ("em", "cover_em", "f1", "span_check", "genacc"):
                lo, hi = stats[f"{key}_ci"]
                assert lo <= stats[key] <= hi
    keys = list(direct["overall"])
    assert keys.index("em_ci") == keys.index("em") + 1  # next to its mean


def test_paired_difference_with_naive_rag_on_the_same_questions(fair_run):
    out, summary, _, _ = fair_run
    paired = summary["paired"]
    assert paired["baseline"] == "naive-rag" and set(paired["methods"]) == {
        "direct",
        "direct-generator",
        "ircot",
        "oracle",
    }
    # naive-rag answers "Tarsk" to all: EM and cover-EM [0, 1, 0]; direct: EM [1, 0, 0], cover-EM [1, 1, 0]
    em = paired["methods"]["direct"]["em"]
    assert em["n"] == 3 and em["diff"] == pytest.approx(0.0)
    assert em["ci"] == list(bootstrap_ci([1.0, -1.0, 0.0], seed=0))
    cem = paired["methods"]["direct"]["cover_em"]
    assert cem["diff"] == pytest.approx(1 / 3) and cem["ci"] == list(bootstrap_ci([1.0, 0.0, 0.0], seed=0))
    assert paired["methods"]["oracle"]["genacc"]["ci"] == [0.0, 0.0]  # same answers as naive-rag
    assert "judge" not in paired["methods"]["direct"]
    md = (out / "summary.md").read_text()
    assert "Paired difference with naive-rag" in md and "| direct | 3 |" in md and "+33.3 [" in md
    assert json.loads((out / "summary.json").read_text())["paired"] == paired


def test_console_rows_show_the_headline_interval_only_and_markdown_every_one(fair_run):
    _, summary, _, _ = fair_run
    header, rows = summary_rows(summary)
    assert header.count("GenAcc % [95% CI]") == 1 and "EM %" in header
    row = next(r for r in rows if r[0] == "direct" and r[1] == "overall")
    lo, hi = summary["methods"]["direct"]["overall"]["genacc_ci"]
    assert row[header.index("GenAcc % [95% CI]")] == f"66.7 [{100 * lo:.1f}, {100 * hi:.1f}]"
    assert row[header.index("EM %")] == "33.3"
    full_header, full_rows = summary_rows(summary, intervals="all")
    assert "EM % [95% CI]" in full_header and "RC" in full_header
    assert full_rows[0][full_header.index("RC")].count("[") == 0


def test_paired_comparison_uses_naive_rag_predictions_of_an_earlier_call(tok, tmp_path):
    evaluate(
        "naive-rag",
        EXAMPLES,
        ToyRetriever(),
        trained_model(tok, []),
        generator=frozen_reader(tok, []),
        out_dir=tmp_path,
    )
    summary = evaluate("direct", EXAMPLES[:2], None, trained_model(tok, []), out_dir=tmp_path)
    em = summary["paired"]["methods"]["direct"]["em"]
    assert em["n"] == 2 and em["diff"] == pytest.approx(0.0)  # this call's questions only: [1-0, 0-1]
    no_baseline = evaluate("direct", EXAMPLES, None, trained_model(tok, []), out_dir=tmp_path / "alone")
    assert "paired" not in no_baseline
    assert "Paired" not in (tmp_path / "alone" / "summary.md").read_text()


# ---------------------------------------------------------------------------------------------------
# the oracle


def test_oracle_hands_exactly_the_gold_passages_to_the_reader(fair_run, tok):
    out, _, _, reader_prompts = fair_run
    by_id = {h.doc_id: h for h in PASSAGES}
    for r, ex in zip(read_jsonl(out / "oracle" / "predictions.jsonl"), EXAMPLES, strict=True):
        served = r["trajectory"]["served_context"]
        assert [h["doc_id"] for h in served] == ex.metadata["supporting_ids"]
        gold = [by_id[d] for d in ex.metadata["supporting_ids"]]
        expected = tok.apply_chat_template(
            document_prompt(ex.question, gold, "s3"), tokenize=False, add_generation_prompt=True
        )
        assert expected in reader_prompts
        assert r["retrieval_count"] == 0 and r["answer_source"] == "generator"


def test_oracle_on_a_synthetic_world_reads_its_supporting_passages_from_the_index(small_world, tok, tmp_path):
    from sleuth.retrieval import load_retriever

    examples = load_eval_data([small_world / "test.jsonl"], limit=4)
    corpus = {p.id: p for p in iter_corpus(small_world / "corpus.jsonl")}  # the reference, not the docstore
    prompts: list[str] = []

    def reader(call: ScriptCall) -> str:
        prompts.append(call.prompt_text)
        return "something"

    evaluate(
        "oracle",
        examples,
        load_retriever(small_world / "bm25"),
        ScriptedGenerator(tok, reader),
        out_dir=tmp_path,
    )
    assert len(prompts) == 4
    for ex in examples:
        gold = [
            {"doc_id": d, "title": corpus[d].title, "text": corpus[d].text, "score": 0.0}
            for d in ex.metadata["supporting_ids"]
        ]
        expected = tok.apply_chat_template(
            document_prompt(ex.question, gold, "s3"), tokenize=False, add_generation_prompt=True
        )
        assert expected in prompts


def test_docstore_get_by_ids_returns_the_corpus_passages_in_order(small_world):
    from sleuth.retrieval.docstore import DocStore

    store = DocStore(small_world / "bm25" / "docstore")
    corpus = list(iter_corpus(small_world / "corpus.jsonl"))
    wanted = [corpus[7].id, "no-such-id", corpus[0].id, corpus[-1].id]
    hits = store.get_by_ids(wanted)
    assert hits[1] is None
    for hit, passage in zip([hits[0], hits[2], hits[3]], [corpus[7], corpus[0], corpus[-1]], strict=True):
        assert (hit.doc_id, hit.title, hit.text) == (passage.id, passage.title, passage.text)
    assert store.get_by_ids([]) == []


def test_passages_by_id_reaches_the_docstore_behind_a_hybrid_retriever(small_world):
    from sleuth.retrieval import load_retriever
    from sleuth.retrieval.docstore import passages_by_id
    from sleuth.retrieval.hybrid import HybridRetriever

    class NoStore:
        def search(self, queries, k):
            return [[] for _ in queries]

    hybrid = HybridRetriever([NoStore(), load_retriever(small_world / "bm25")])
    first = next(iter(iter_corpus(small_world / "corpus.jsonl")))
    (hit,) = passages_by_id(hybrid, [first.id])
    assert (hit.doc_id, hit.title, hit.text) == (first.id, first.title, first.text)
    with pytest.raises(ConfigError, match="HybridRetriever cannot fetch passages by id"):
        passages_by_id(HybridRetriever([NoStore()]), [first.id])


def test_oracle_without_supporting_ids_names_the_data_file(tok, tmp_path):
    data = tmp_path / "plain.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": e.id, "question": e.question, "golden_answers": e.golden_answers}) + "\n"
            for e in EXAMPLES
        )
    )
    examples = load_eval_data([data])
    with pytest.raises(
        ConfigError, match=f"supporting_ids.*question 'q1' of data file {re.escape(str(data))} has none"
    ):
        evaluate(
            ["naive-rag", "oracle"], examples, ToyRetriever(), trained_model(tok, []), out_dir=tmp_path / "o"
        )
    assert not (tmp_path / "o" / "naive-rag").exists()  # refused before anything ran


def test_oracle_errors_for_unknown_ids_and_retrievers_without_lookup(tok, tmp_path):
    lost = [
        QAExample(
            "q1", EXAMPLES[0].question, ["Quellstad"], {"dataset": "a", "supporting_ids": ["p1", "p99"]}
        )
    ]
    with pytest.raises(ConfigError, match="p99 are not in the index"):
        evaluate("oracle", lost, ToyRetriever(), trained_model(tok, []), out_dir=tmp_path / "a")

    class SearchOnly:
        def search(self, queries, k):
            return [[] for _ in queries]

    with pytest.raises(ConfigError, match="SearchOnly cannot fetch passages by id"):
        evaluate(
            ["naive-rag", "oracle"], EXAMPLES, SearchOnly(), trained_model(tok, []), out_dir=tmp_path / "b"
        )
    assert not (tmp_path / "b" / "naive-rag").exists()  # refused before anything ran


# ---------------------------------------------------------------------------------------------------
# sleuth compare and the report


def test_cli_compare_prints_the_paired_difference_of_two_runs(tok, tmp_path):
    from typer.testing import CliRunner

    from sleuth.cli import app

    evaluate("direct", EXAMPLES, None, trained_model(tok, []), out_dir=tmp_path / "rl")
    evaluate("direct", EXAMPLES, None, frozen_reader(tok, []), out_dir=tmp_path / "sft")
    result_file = tmp_path / "cmp.json"
    res = CliRunner().invoke(
        app,
        [
            "compare",
            str(tmp_path / "rl" / "direct"),
            str(tmp_path / "sft" / "direct"),
            "--json",
            str(result_file),
        ],
        env={"COLUMNS": "200"},
    )
    assert res.exit_code == 0, res.output
    saved = json.loads(result_file.read_text())["metrics"]
    # the model: EM [1, 0, 0], cover-EM [1, 1, 0]; the reader: "Unknown", all 0
    assert saved["em"]["diff"] == pytest.approx(1 / 3) and saved["em"]["ci"] == list(bootstrap_ci([1, 0, 0]))
    assert saved["cover_em"]["diff"] == pytest.approx(2 / 3)
    assert "rl/direct minus sft/direct" in res.output and "+66.7 [" in res.output
    bad = CliRunner().invoke(app, ["compare", str(tmp_path / "nowhere"), str(tmp_path / "sft" / "direct")])
    assert bad.exit_code == 2 and "no predictions file" in bad.output
    typo = CliRunner().invoke(
        app,
        [
            "compare",
            str(tmp_path / "rl" / "direct"),
            str(tmp_path / "sft" / "direct"),
            "--metric",
            "accuracy",
        ],
    )
    assert typo.exit_code == 2 and "unknown --metric accuracy" in typo.output


def test_cli_eval_prints_the_paired_table(tok, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import sleuth.eval.harness as harness
    import sleuth.eval.loading as loading
    from sleuth.cli import app

    monkeypatch.setattr(harness, "resolve_retriever", lambda spec, cache=None: ToyRetriever())
    monkeypatch.setattr(
        loading, "resolve_generator", lambda spec: None if spec is None else trained_model(tok, [])
    )
    data = tmp_path / "mini.jsonl"
    data.write_text("".join(json.dumps(e.to_dict()) + "\n" for e in EXAMPLES))
    res = CliRunner().invoke(
        app,
        [
            "eval",
            "-m",
            "direct,naive-rag,oracle",
            "--data",
            str(data),
            "--retriever",
            "toy",
            "--out",
            str(tmp_path / "out"),
        ],
        env={"COLUMNS": "200"},
    )
    assert res.exit_code == 0, res.output
    assert "minus naive-rag on the same questions" in res.output and "GenAcc Δ" in res.output
    assert "GenAcc % [95% CI]" in res.output


def test_report_shows_intervals_and_the_paired_table(fair_run, tmp_path):
    from sleuth.eval.report import build_report

    out, summary, _, _ = fair_run
    page = build_report(out, out=tmp_path / "report.html").read_text()
    lo, hi = summary["methods"]["direct"]["overall"]["em_ci"]
    assert f'<span class="ci">[{lo:.4f}, {hi:.4f}]</span>' in page
    assert "difference with naive-rag on the same questions" in page
    cem = summary["paired"]["methods"]["direct"]["cover_em"]
    assert f"+33.3 [{100 * cem['ci'][0]:+.1f}, {100 * cem['ci'][1]:+.1f}]" in page
    assert "<th>em_ci</th>" not in page  # intervals sit inside their metric's cells, not as columns


def test_report_intervals_keep_their_decimals_when_the_means_are_whole():
    from sleuth.eval.report import build_table

    table = build_table([("a", {"em": 1.0, "em_ci": [0.85, 1.0], "n": 20}), ("b", {"em": 0.0, "n": 20})], "t")
    assert [c["name"] for c in table["columns"]] == ["em"]
    assert (
        table["rows"][0]["cells"][0]["text"] == "1.0000"
        and table["rows"][0]["cells"][0]["ci"] == "[0.8500, 1.0000]"
    )
    assert table["rows"][1]["cells"][0]["ci"] == ""
