"""Frozen-generator and judge helpers shared by rewards and evaluation.

Reader prompts (a question and documents -> messages) belong to the methods: each method's module
registers its own (`Method.reader`: s3's in sleuth.agent.s3, QAgent's in sleuth.agent.qagent) and
`document_prompt` looks one up by name. The other prompts are the papers' own, as their public code
writes them:
- s3 judge_check: the s3 code's `generator_llms/local_inst.py`;
- R-Search evidence template (paper 001, Table 5; exact string from the public code's
  scripts/evidence.yaml, which adds the line breaks the PDF loses);
- staged-reward judge (paper 002, B.4), which is shown the *normalised* prediction and golds;

Every prompt goes out as chat messages so the backend applies the model's chat template.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from sleuth.agent.registry import Reader, get_reader, reader_names
from sleuth.errors import ConfigError
from sleuth.llm.base import Generator, SamplingParams
from sleuth.retrieval.base import Hit
from sleuth.rewards.metrics import normalize_answer, span_check

S3_JUDGE_PROMPT = (
    "Please check if any of the golden answers is contained in the following response: {response}\n\n"
    "Golden answers: {golden_answers}\n\n"
    "Please directly answer with 'yes' or 'no'."
)
RSEARCH_EVIDENCE_PROMPT = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
    "\n\nThe following are given passages:\n{evidence}\n\nQuestion: {question}\nAnswer:"
)
STAGED_JUDGE_PROMPT = (
    "You are an evaluation assistant. Your task is to determine whether the given prediction semantically "
    "matches any of the reference answers. This is a flexible match: even if the wording is different, if the "
    "meaning is the same, consider it a match.\n"
    "Prediction: {prediction}\n"
    "Reference Answers: {references}\n"
    "Please answer with a single word:\n"
    "- YES → if the prediction expresses the same meaning as any of the reference answers.\n"
    "- NO → otherwise.\n"
    "Only respond with YES or NO."
)
# The reader prompt naive RAG, the oracle baseline and a method without a reader of its own are read with:
# the s3 code's generator prompt, registered by its method module (sleuth.agent.s3).
DEFAULT_READER = "s3"
DEFAULT_GENERATOR_PARAMS = SamplingParams(max_new_tokens=128, temperature=0.0)
# R-Search's public code samples the cross-family model at temperature 0.1, top-p 0.9, 512 tokens.
RSEARCH_EVIDENCE_PARAMS = SamplingParams(max_new_tokens=512, temperature=0.1, top_p=0.9)
DEFAULT_JUDGE_PARAMS = SamplingParams(max_new_tokens=16, temperature=0.0)
# s3's judge call (`generator_llms/local_inst.py` `call_llm`): temperature 0, at most 10 tokens
UPSTREAM_JUDGE_PARAMS = SamplingParams(max_new_tokens=10, temperature=0.0)

_THINK_RE = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)


def clean_generation(text: str) -> str:
    """Drop reasoning blocks (`<think>...</think>`, or an unterminated one) and outer whitespace."""
    return _THINK_RE.sub("", text).strip()


def _as_hits(docs: Sequence[Hit | Mapping[str, Any]]) -> list[Hit]:
    hits = []
    for d in docs:
        if isinstance(d, Hit):
            hits.append(d)
        elif isinstance(d, Mapping):
            try:
                hits.append(Hit.from_dict(d))
            except KeyError as err:
                raise ValueError(f"document {dict(d)!r} lacks field {err}; expected a Hit dict") from err
        else:
            raise TypeError(f"a document must be a Hit or a hit dict, got {type(d).__name__}")
    return hits


def document_prompt(
    question: str, docs: Sequence[Hit | Mapping[str, Any]], template: str | Reader = DEFAULT_READER
) -> list[dict]:
    """Chat messages asking a frozen generator to answer `question` from `docs`, with the reader prompt
    `template` (a `Reader`, or a registered reader's name: each method's module registers its own)."""
    hits = _as_hits(docs)
    reader = template if isinstance(template, Reader) else get_reader(template)
    return reader.prompt(question, hits)


def check_reader(field_name: str, name: str) -> None:
    """A reward option naming a reader prompt: one that is registered (each method registers its own)."""
    choices = reader_names()
    if name not in choices:
        raise ConfigError(f"reward option {field_name}={name!r} is invalid; choose one of {choices}")


def _replies(generator: Generator, prompts: list[list[dict]], params: SamplingParams) -> list[str]:
    """One batched call; the raw text of each reply."""
    if not prompts:
        return []
    outs = generator.generate(prompts, None, params)
    if len(outs) != len(prompts):
        raise RuntimeError(f"generator returned {len(outs)} completions for {len(prompts)} prompts")
    return [o.text for o in outs]


def _generate(generator: Generator, prompts: list[list[dict]], params: SamplingParams) -> list[str]:
    return [clean_generation(text) for text in _replies(generator, prompts, params)]


def hand_over_documents(
    generator: Generator,
    questions: Sequence[str],
    docs_per_question: Sequence[Sequence[Hit | Mapping[str, Any]]],
    template: str | Reader = DEFAULT_READER,
    params: SamplingParams | None = None,
) -> list[str]:
    """The hand-over of documents to a frozen generator, written once (rewards, evaluation and serving
    call it): one batched call, the raw reply to each question given its documents. Callers parse the
    reply their own way (`answer_from_documents` cleans it; evaluation extracts the answer)."""
    if len(questions) != len(docs_per_question):
        raise ValueError(f"{len(questions)} questions but {len(docs_per_question)} document lists")
    prompts = [
        document_prompt(q, docs, template) for q, docs in zip(questions, docs_per_question, strict=True)
    ]
    return _replies(generator, prompts, params or DEFAULT_GENERATOR_PARAMS)


def answer_from_documents(
    generator: Generator,
    questions: Sequence[str],
    docs_per_question: Sequence[Sequence[Hit | Mapping[str, Any]]],
    template: str | Reader = DEFAULT_READER,
    params: SamplingParams | None = None,
) -> list[str]:
    """The frozen generator's answer to each question given its documents (reasoning blocks dropped)."""
    return [
        clean_generation(text)
        for text in hand_over_documents(generator, questions, docs_per_question, template, params)
    ]


def answer_from_evidence(
    generator: Generator,
    questions: Sequence[str],
    evidences: Sequence[str],
    params: SamplingParams | None = None,
) -> list[str]:
    """R-Search's cross-family answer: the frozen model sees the question and the evidence only."""
    if len(questions) != len(evidences):
        raise ValueError(f"{len(questions)} questions but {len(evidences)} evidence texts")
    prompts = [
        [{"role": "user", "content": RSEARCH_EVIDENCE_PROMPT.format(evidence=e, question=q)}]
        for q, e in zip(questions, evidences, strict=True)
    ]
    return _generate(generator, prompts, params or RSEARCH_EVIDENCE_PARAMS)


_WORD_RE = re.compile(r"[a-z]+")


# How a judge's reply becomes a verdict. "strict": `parse_yes_no` on the reply without its reasoning blocks.
# "upstream": s3's `check_if_response_is_correct_llm`, switch-exact: the raw reply (a `<think>` block included,
# so "<think>yes</think> no" is yes) of at most 10 tokens is yes when "yes" occurs anywhere in it lowercased
# ("Not yes" and "eyes" count), and a reply holding neither "yes" nor "no" is asked once more, the second
# reply deciding (`judge_contains`).
JUDGE_RULES = ("strict", "upstream")


def judge_verdict(text: str, rule: str = "strict") -> bool:
    """A judge reply read with one of `JUDGE_RULES`."""
    if rule == "upstream":
        return "yes" in text.lower()
    if rule != "strict":
        raise ValueError(f"judge rule {rule!r}: choose one of {list(JUDGE_RULES)}")
    return parse_yes_no(text)


def parse_yes_no(text: str) -> bool:
    """A judge's verdict. Yes only when the reply clearly says yes: its first word is "yes", or it
    contains the word "yes" and never the word "no". Anything else, garbage included, is no."""
    words = _WORD_RE.findall(clean_generation(text).lower())
    if not words:
        return False
    if words[0] in ("yes", "no"):
        return words[0] == "yes"
    return "yes" in words and "no" not in words


def judge_contains(
    judge: Generator,
    questions: Sequence[str],
    golden_answers: Sequence[Sequence[str]],
    responses: Sequence[str],
    params: SamplingParams | None = None,
    rule: str = "strict",
) -> list[bool]:
    """s3 judge_check: "does the response contain any of the golden answers?" (one batched call).
    `questions` only fixes the batch shape: the s3 prompt does not show the question. `rule`: how
    the reply is read (`JUDGE_RULES`)."""
    if not (len(questions) == len(golden_answers) == len(responses)):
        raise ValueError(
            f"judge_contains: {len(questions)} questions, {len(golden_answers)} gold lists, {len(responses)} responses"
        )
    prompts = [
        [{"role": "user", "content": S3_JUDGE_PROMPT.format(response=r, golden_answers=str(list(g)))}]
        for g, r in zip(golden_answers, responses, strict=True)
    ]
    if rule != "upstream":
        return [judge_verdict(t, rule) for t in _generate(judge, prompts, params or DEFAULT_JUDGE_PARAMS)]
    params = params or UPSTREAM_JUDGE_PARAMS
    replies = _replies(judge, prompts, params)  # raw: s3 reads the reply with its reasoning, stripped only
    undecided = [i for i, r in enumerate(replies) if "yes" not in r.lower() and "no" not in r.lower()]
    for i, again in zip(undecided, _replies(judge, [prompts[i] for i in undecided], params), strict=True):
        replies[i] = again
    return [judge_verdict(t, "upstream") for t in replies]


def judge_semantic_match(
    judge: Generator,
    predictions: Sequence[str],
    golden_answers: Sequence[Sequence[str]],
    params: SamplingParams | None = None,
) -> list[bool]:
    """Staged-reward judge (paper 002, B.4): normalised prediction vs normalised references."""
    if len(predictions) != len(golden_answers):
        raise ValueError(f"{len(predictions)} predictions but {len(golden_answers)} gold lists")
    prompts = [
        [
            {
                "role": "user",
                "content": STAGED_JUDGE_PROMPT.format(
                    prediction=normalize_answer(p), references=str([normalize_answer(g) for g in golds])
                ),
            }
        ]
        for p, golds in zip(predictions, golden_answers, strict=True)
    ]
    return [parse_yes_no(t) for t in _generate(judge, prompts, params or DEFAULT_JUDGE_PARAMS)]


def gen_acc(pred: str | None, golds: Sequence[str], judge_result: bool | None) -> float:
    """s3 GenAcc = span_check OR judge_check. `judge_result` None means the judge was not asked."""
    if span_check(pred, golds):
        return 1.0
    return 1.0 if judge_result else 0.0


def gen_acc_batch(
    judge: Generator | None,
    questions: Sequence[str],
    golden_answers: Sequence[Sequence[str]],
    predictions: Sequence[str | None],
    params: SamplingParams | None = None,
    rule: str = "strict",
) -> tuple[list[float], list[float], list[float | None]]:
    """GenAcc for a batch, asking the judge only where span_check failed (as s3 does).

    Returns (gen_acc, span, judge) per item; judge is None where it was not asked (span matched,
    no prediction, or no judge given -- then GenAcc is span_check alone).
    """
    spans = [span_check(p, g) for p, g in zip(predictions, golden_answers, strict=True)]
    verdicts: list[float | None] = [None] * len(predictions)
    ask = [i for i, (s, p) in enumerate(zip(spans, predictions, strict=True)) if not s and p is not None]
    if judge is not None and ask:
        answers = judge_contains(
            judge,
            [questions[i] for i in ask],
            [golden_answers[i] for i in ask],
            [predictions[i] or "" for i in ask],
            params,
            rule,
        )
        for i, ok in zip(ask, answers, strict=True):
            verdicts[i] = float(ok)
    accs = [
        gen_acc(p, g, None if v is None else bool(v))
        for p, g, v in zip(predictions, golden_answers, verdicts, strict=True)
    ]
    return accs, spans, verdicts
