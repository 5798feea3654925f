"""Recipe -> retriever, spec -> generator and the document hand-over are each written once
(issue 12): training, evaluation and serving reach the same function, with what differs explicit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sleuth.data.formats import QAExample
from sleuth.errors import ConfigError
from sleuth.eval.baselines import BaselineSettings, read_documents
from sleuth.eval.harness import resolve_generator, resolve_retriever
from sleuth.llm import registry
from sleuth.llm.base import Generation
from sleuth.llm.openai_http import OpenAIGenerator
from sleuth.llm.registry import open_generator
from sleuth.retrieval.bm25 import BM25Retriever
from sleuth.retrieval.client import RemoteRetriever
from sleuth.retrieval.sources import open_retriever
from sleuth.retrieval.tools import HTTPSearchRetriever, ToolRetrieverConfig
from sleuth.rewards.answerer import answer_from_documents, document_prompt, hand_over_documents
from sleuth.rl.config import recipe_from_dict
from sleuth.rl.setup import build_retriever
from sleuth.run_layout import SEARCHER_FILE
from sleuth.serve.loading import load_retriever_from
from sleuth.utils import RetryPolicy

HIT = {"doc_id": "d1", "title": "Paris", "text": "Paris is the capital of France.", "score": 1.0}


class EchoGenerator:
    """Replies with a fixed text; records every prompt it was sent."""

    def __init__(self, reply: str):
        self.reply = reply
        self.prompts: list = []

    def generate(self, batch, stop=None, params=None):
        self.prompts.extend(batch)
        return [Generation(text=self.reply, finish_reason="eos") for _ in batch]


# -- retriever ---------------------------------------------------------------------------------------


def test_open_retriever_takes_exactly_one_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="exactly one of index, url, tool or location; got none"):
        open_retriever()
    with pytest.raises(ConfigError, match=r"got \['index', 'url'\]"):
        open_retriever(index=tmp_path, url="http://127.0.0.1:1")


def test_each_caller_keeps_its_own_missing_index_message(tmp_path: Path) -> None:
    missing = tmp_path / "no-index"
    with pytest.raises(ConfigError, match="neither an index directory nor an http"):
        resolve_retriever(missing)
    with pytest.raises(ConfigError, match=f"--index {missing} does not exist"):
        load_retriever_from(missing, None)
    with pytest.raises(ConfigError, match="neither an index directory nor an http"):
        open_retriever(index=missing)  # no message given: the index backend's own


def test_training_evaluation_and_serving_open_the_same_index(small_world: Path) -> None:
    index = small_world / "bm25"
    recipe = recipe_from_dict(
        {
            "name": "x",
            "data": {"train": "t.jsonl"},
            "retriever": {"index": str(index), "corpus": str(small_world / "corpus.jsonl")},
        }
    )
    served, name = load_retriever_from(index, None)
    opened = [build_retriever(recipe), resolve_retriever(str(index)), served]
    assert name == f"index:{index}" and all(isinstance(r, BM25Retriever) for r in opened)
    results = [[h.doc_id for h in r.search(["capital"], 3)[0]] for r in opened]
    assert results[0] == results[1] == results[2] and len(results[0]) == 3


def test_server_retry_policy_is_the_callers_choice() -> None:
    recipe = recipe_from_dict(
        {
            "name": "x",
            "data": {"train": "t.jsonl"},
            "retriever": {"url": "http://127.0.0.1:1"},
            "services": {"retry": {"max_attempts": 3, "budget_s": 7.0}},
        }
    )
    trained = build_retriever(recipe)
    assert isinstance(trained, RemoteRetriever)
    assert (trained.retry_policy.max_attempts, trained.retry_policy.budget_s) == (3, 7.0)
    evaluated = resolve_retriever("http://127.0.0.1:1")
    served, _ = load_retriever_from(None, "http://127.0.0.1:1")
    for client in (evaluated, served):  # RemoteRetriever's own default: 4 attempts, no time budget
        assert (client.retry_policy.max_attempts, client.retry_policy.budget_s) == (4, float("inf"))


def test_tool_source_as_spec_or_parsed_config(tmp_path: Path) -> None:
    http = {
        "url": "http://127.0.0.1:1/search",
        "params": {"q": "{query}"},
        "response": {"results": "items", "text": "body"},
    }
    spec = tmp_path / "tool.yaml"
    spec.write_text(json.dumps({"http": http}), encoding="utf-8")  # JSON is YAML
    assert isinstance(open_retriever(tool=str(spec)), HTTPSearchRetriever)
    assert isinstance(
        open_retriever(tool=ToolRetrieverConfig.model_validate({"http": http})), HTTPSearchRetriever
    )


# -- generator ---------------------------------------------------------------------------------------


def test_open_generator_passes_objects_and_none_through() -> None:
    gen = EchoGenerator("x")
    assert open_generator(None) is None and open_generator(gen) is gen


def test_named_specs_and_checkpoints_are_the_callers(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(registry, "load_generator", lambda spec, **kw: ("load_generator", spec, kw))
    held = EchoGenerator("held")
    assert open_generator("policy-base", named={"policy-base": lambda: held}) is held
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / SEARCHER_FILE).write_text("{}", encoding="utf-8")
    loaded: list[Path] = []
    from_ckpt = EchoGenerator("trained")

    def load(path: Path) -> EchoGenerator:
        loaded.append(path)
        return from_ckpt

    assert open_generator(str(ckpt), checkpoint=load) is from_ckpt and loaded == [ckpt]
    plain = tmp_path / "plain"
    plain.mkdir()
    assert open_generator(str(plain), checkpoint=load) == ("load_generator", str(plain), {})
    assert open_generator(str(ckpt)) == ("load_generator", str(ckpt), {})  # no loader: a plain model dir
    assert open_generator("policy-base") == ("load_generator", "policy-base", {})
    assert loaded == [ckpt]


def test_remote_specs_get_the_callers_retry_policy() -> None:
    policy = RetryPolicy(max_attempts=2, budget_s=5.0)
    gen = open_generator("openai:http://127.0.0.1:9/v1#m", retry=policy, service="reward judge")
    assert isinstance(gen, OpenAIGenerator) and gen.retry_policy is policy and gen.service == "reward judge"
    default = open_generator({"backend": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m"})
    assert default.retry_policy.max_attempts == 4 and default.service == "model server"
    evaluated = resolve_generator("openai:http://127.0.0.1:9/v1#m")
    assert evaluated.retry_policy.max_attempts == 4


# -- document hand-over ------------------------------------------------------------------------------


def test_hand_over_gives_raw_replies_and_answer_cleans_them() -> None:
    gen = EchoGenerator("<think>hmm</think>  Paris \n")
    assert hand_over_documents(gen, ["Capital of France?"], [[HIT]], "qagent") == [
        "<think>hmm</think>  Paris \n"
    ]
    assert answer_from_documents(gen, ["Capital of France?"], [[HIT]], "qagent") == ["Paris"]
    assert gen.prompts == [document_prompt("Capital of France?", [HIT], "qagent")] * 2
    with pytest.raises(ValueError, match="1 questions but 2 document lists"):
        hand_over_documents(gen, ["q"], [[HIT], [HIT]])


def test_evaluation_reader_sends_the_same_prompt_as_rewards() -> None:
    gen = EchoGenerator("<answer>Paris</answer>")
    preds, texts, counts = read_documents(
        gen,
        [QAExample(id="1", question="  Capital of France? ", golden_answers=["Paris"])],
        [[HIT]],
        BaselineSettings(),
        "s3",
    )
    assert preds == ["Paris"] and texts == ["<answer>Paris</answer>"] and len(counts) == 1
    assert gen.prompts == [document_prompt("Capital of France?", [HIT], "s3")]
