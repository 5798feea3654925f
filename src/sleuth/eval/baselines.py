"""Untrained baselines the papers compare against, run batched: direct, CoT, naive RAG, IRCoT.

Prompts (the papers do not fix them for these baselines; ours are written here):
- direct: answer from parametric knowledge, the short answer inside `<answer>` tags (the
  harness runs it with the trained model as "direct" and with the frozen reader as
  "direct-generator": a contamination check);
- cot: "think step by step", then the short answer inside `<answer>` tags;
- naive-rag: top-k for the question, then the s3 frozen-generator prompt
  (the hand-over `sleuth.rewards.answerer.hand_over_documents`, template "s3" by default);
- ircot: IRCoT (Trivedi et al., 2023), simplified. Retrieve top-k for the question;
  then up to T times: the model sees the documents collected so far, the question
  and its reasoning so far, and writes the next reasoning sentence (one line, first
  sentence kept); a sentence stating "the answer is X" ends the chain with answer X,
  any other sentence becomes the next retrieval query (top-k, deduplicated into the
  collection, capped at `ircot_max_docs`). A chain that never states its answer is
  read by IRCoT's "direct reader": the same model answers from the collected
  documents with the frozen-generator prompt (the harness passes its frozen generator as
  that reader, so a trained --model does not answer for the baseline);
- oracle: no search; the question's gold supporting passages (`metadata["supporting_ids"]` of
  a synthetic world), fetched by id from the index, go to the frozen reader with the s3
  hand-over prompt. Its score is the ceiling of any searcher handing documents to that reader.

Answers are taken from the last `<answer>` block when the prompt asks for one, with
a fallback to the first non-empty line ("the answer is X" on it gives X; CoT: "the answer is X"
anywhere, then the last line).

Token counts: input tokens are the prompt tokens of every generation call made for a
question (a prompt re-read on a later call counts again), output tokens the generated
ones. Backends without a tokenizer fall back to whitespace words (marked approximate).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sleuth.agent.registry import Reader
from sleuth.agent.trajectory import Trajectory
from sleuth.data.formats import QAExample
from sleuth.errors import ConfigError
from sleuth.llm.base import Generation, Generator, Prompt, SamplingParams
from sleuth.retrieval.base import Hit, Retriever, format_docs
from sleuth.retrieval.docstore import passages_by_id
from sleuth.rewards.answerer import DEFAULT_READER, clean_generation, hand_over_documents

DIRECT_PROMPT = (
    "Answer the following question with a short answer of a few words and nothing else. "
    "Put the answer between <answer> and </answer>, for example <answer> Beijing </answer>.\n"
    "Question: {question}"
)
COT_PROMPT = (
    "Answer the following question. First think step by step, then give the short final answer "
    "(a few words) between <answer> and </answer>, for example <answer> Beijing </answer>.\n"
    "Question: {question}"
)
IRCOT_STEP_PROMPT = (
    "Answer the question by reasoning step by step with the help of the documents (some may be irrelevant).\n\n"
    "Documents:\n{documents}\n\n"
    "Question: {question}\n"
    "Reasoning so far: {reasoning}\n\n"
    "Write only the next single sentence of the reasoning. When you know the answer, write a sentence of "
    'the form "So the answer is: <short answer>."'
)

_ANSWER_IS_RE = re.compile(
    r"(?:(?:so|thus|therefore|hence),?\s+)?(?:the\s+)?(?:final\s+)?answer(?: to (?:this|the) question)? is\s*:?\s*",
    re.IGNORECASE,
)
_SENTENCE_RE = re.compile(r"^(.+?[.!?])(?=\s|$)", re.DOTALL)
_PREFIX_RE = re.compile(r"^(?:final answer|answer)\s*:\s*", re.IGNORECASE)


# -- answer parsing -------------------------------------------------------------------------------


def _tidy(answer: str) -> str | None:
    answer = _PREFIX_RE.sub("", answer.strip()).strip()
    answer = answer.strip("*").strip()
    if answer.endswith(".") and not answer.endswith(".."):
        answer = answer[:-1].rstrip()
    return answer or None


def _non_empty_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def parse_answer(text: str, fallback: str = "first_line") -> str | None:
    """The answer in a generation: last complete `<answer>` block, else an unclosed `<answer>` (cut by
    the token limit), else the fallback: "first_line" (first non-empty line) or "answer_is" ("the
    answer is X" if stated, else the last non-empty line). None when nothing is left."""
    if fallback not in ("first_line", "answer_is"):
        raise ValueError(f"fallback must be 'first_line' or 'answer_is', got {fallback!r}")
    text = clean_generation(text)
    blocks = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
    if blocks:
        return _tidy(blocks[-1])
    if "<answer>" in text:
        lines = _non_empty_lines(text.rsplit("<answer>", 1)[1])
        return _tidy(lines[0]) if lines else None
    lines = _non_empty_lines(text)
    if not lines:
        return None
    if fallback == "answer_is":
        stated = answer_stated(text)
        return stated if stated is not None else _tidy(lines[-1])
    stated = answer_stated(lines[0])  # "The answer is: X" on the first line
    return stated if stated is not None else _tidy(lines[0])


def answer_stated(sentence: str) -> str | None:
    """X in "... the answer is: X." (after the last such phrase that is followed by text), or None."""
    matches = list(_ANSWER_IS_RE.finditer(sentence))
    if not matches:
        return None
    ends = [m.start() for m in matches[1:]] + [len(sentence)]
    for m, end in reversed(list(zip(matches, ends, strict=True))):
        lines = _non_empty_lines(sentence[m.end() : end])
        answer = _tidy(lines[0]) if lines else None
        if answer is not None:
            return answer
    return None


def first_sentence(text: str) -> str:
    """The first sentence of the first non-empty line (IRCoT keeps one sentence per step)."""
    lines = _non_empty_lines(clean_generation(text))
    if not lines:
        return ""
    m = _SENTENCE_RE.match(lines[0])
    return (m.group(1) if m else lines[0]).strip()


# -- token accounting -----------------------------------------------------------------------------


def _chat_text(tokenizer: Any, messages: list[dict]) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n".join(str(m.get("content", "")) for m in messages)


def prompt_token_count(generator: Any, prompt: Prompt) -> int:
    """Prompt tokens as the backend sees them; whitespace words when it exposes no tokenizer."""
    if prompt and isinstance(prompt, list) and isinstance(prompt[0], int):
        return len(prompt)
    if hasattr(generator, "prompt_ids"):
        return len(generator.prompt_ids(prompt))
    tok = getattr(generator, "tokenizer", None)
    if isinstance(prompt, str):
        text = prompt
    else:
        text = (
            _chat_text(tok, list(prompt))
            if tok is not None
            else " ".join(str(m.get("content", "")) for m in prompt)
        )
    if tok is not None:
        return len(tok.encode(text, add_special_tokens=False))
    return len(text.split())


def output_token_count(generator: Any, gen: Generation) -> int:
    if gen.token_ids:
        return len(gen.token_ids)
    tok = getattr(generator, "tokenizer", None)
    if tok is not None:
        return len(tok.encode(gen.text, add_special_tokens=False)) if gen.text else 0
    return len(gen.text.split())


class CountingGenerator:
    """Wraps a Generator and records (input tokens, output tokens) per item of its latest call."""

    def __init__(self, inner: Generator):
        self.inner = inner
        self.last: list[tuple[int, int]] = []

    def generate(
        self,
        batch: list[Prompt],
        stop: list[str] | list[list[str]] | None = None,
        params: SamplingParams | None = None,
    ) -> list[Generation]:
        outs = self.inner.generate(batch, stop, params)
        self.last = [
            (prompt_token_count(self.inner, p), output_token_count(self.inner, o))
            for p, o in zip(batch, outs, strict=True)
        ]
        return outs

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# -- what one method produces for one question ---------------------------------------------------


@dataclass
class MethodOutput:
    prediction: str | None
    retrieval_count: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    trajectory: Trajectory | None = None
    answer_source: str = "self"  # "self": the method answered; "generator": a frozen generator did
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class BaselineSettings:
    top_k: int = 3
    max_turns: int = 4  # IRCoT reasoning/retrieval steps
    max_new_tokens: int = 256  # CoT
    answer_max_new_tokens: int = 64  # direct answers and document readers
    ircot_sentence_tokens: int = 64
    ircot_max_docs: int = 15  # IRCoT caps the paragraphs it keeps at 15
    answer_template: str = DEFAULT_READER  # a registered reader prompt (sleuth.agent.registry.get_reader)
    seed: int | None = 0


def _params(max_new_tokens: int, seed: int | None) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, seed=seed)


def _base_traj(ex: QAExample, method: str) -> Trajectory:
    return Trajectory(
        question_id=str(ex.id), question=ex.question, golden_answers=list(ex.golden_answers), method=method
    )


def _user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def _search(retriever: Retriever, queries: list[str], k: int) -> list[list[Hit]]:
    if not queries:
        return []
    results = retriever.search(queries, k)
    if len(results) != len(queries):
        raise RuntimeError(f"retriever returned {len(results)} result lists for {len(queries)} queries")
    return [list(r)[:k] for r in results]


def _prompted(
    method: str,
    template: str,
    fallback: str,
    max_new_tokens: int,
    model: Generator,
    examples: Sequence[QAExample],
    settings: BaselineSettings,
) -> list[MethodOutput]:
    counter = CountingGenerator(model)
    prompts = [_user(template.format(question=ex.question.strip())) for ex in examples]
    gens = counter.generate(prompts, ["</answer>"], _params(max_new_tokens, settings.seed))
    outs = []
    for ex, prompt, gen, (n_in, n_out) in zip(examples, prompts, gens, counter.last, strict=True):
        pred = parse_answer(gen.text, fallback)
        traj = _base_traj(ex, method)
        traj.prompt_text, traj.response_text, traj.answer = prompt[0]["content"], gen.text, pred
        traj.num_turns, traj.finish_reason = 1, "answer"
        outs.append(MethodOutput(pred, 0, n_in, n_out, traj))
    return outs


def run_direct(model: Generator, examples: Sequence[QAExample], settings: BaselineSettings,
               method: str = "direct") -> list[MethodOutput]:  # fmt: skip
    return _prompted(
        method, DIRECT_PROMPT, "first_line", settings.answer_max_new_tokens, model, examples, settings
    )


def run_cot(
    model: Generator, examples: Sequence[QAExample], settings: BaselineSettings
) -> list[MethodOutput]:
    return _prompted("cot", COT_PROMPT, "answer_is", settings.max_new_tokens, model, examples, settings)


def read_documents(
    reader: Generator,
    examples: Sequence[QAExample],
    docs: Sequence[Sequence[Hit | Mapping[str, Any]]],
    settings: BaselineSettings,
    template: str | Reader | None = None,
) -> tuple[list[str | None], list[str], list[tuple[int, int]]]:
    """A frozen reader answers each question from its documents in one call.

    Returns (parsed answers, raw texts, (input, output) tokens per question)."""
    if not examples:
        return [], [], []
    counter = CountingGenerator(reader)
    texts = hand_over_documents(
        counter,
        [ex.question.strip() for ex in examples],
        docs,
        template or settings.answer_template,
        _params(settings.answer_max_new_tokens, settings.seed),
    )
    return [parse_answer(t, "first_line") for t in texts], texts, list(counter.last)


def run_naive_rag(
    model: Generator, retriever: Retriever, examples: Sequence[QAExample], settings: BaselineSettings
) -> list[MethodOutput]:
    hits = _search(retriever, [ex.question.strip() for ex in examples], settings.top_k)
    preds, texts, counts = read_documents(model, examples, hits, settings)
    outs = []
    for ex, h, pred, text, (n_in, n_out) in zip(examples, hits, preds, texts, counts, strict=True):
        traj = _base_traj(ex, "naive-rag")
        traj.queries = [ex.question.strip()]
        traj.retrieved = [[x.to_dict() for x in h]]
        traj.served_context = [x.to_dict() for x in h]
        traj.retrieval_count, traj.num_turns, traj.finish_reason = 1, 1, "answer"
        traj.response_text, traj.answer = text, pred
        outs.append(MethodOutput(pred, 1, n_in, n_out, traj))
    return outs


def _merge_docs(collected: list[Hit], new: Sequence[Hit], cap: int) -> None:
    seen = {h.doc_id for h in collected} | {(h.title, h.text) for h in collected}
    for h in new:
        if len(collected) >= cap:
            return
        if h.doc_id in seen or (h.title, h.text) in seen:
            continue
        collected.append(h)
        seen |= {h.doc_id, (h.title, h.text)}


def run_ircot(
    model: Generator,
    retriever: Retriever,
    examples: Sequence[QAExample],
    settings: BaselineSettings,
    reader: Generator | None = None,
) -> list[MethodOutput]:
    """IRCoT, simplified (see the module docstring); every step is one batched generate and one search.
    `model` writes the reasoning; `reader` (default: `model`) answers chains that state no answer."""
    counter = CountingGenerator(model)
    n = len(examples)
    trajs = [_base_traj(ex, "ircot") for ex in examples]
    docs: list[list[Hit]] = [[] for _ in range(n)]
    chains: list[list[str]] = [[] for _ in range(n)]
    answers: list[str | None] = [None] * n
    tokens = [[0, 0] for _ in range(n)]

    def record_search(indices: list[int], queries: list[str]) -> None:
        for i, q, hits in zip(indices, queries, _search(retriever, queries, settings.top_k), strict=True):
            trajs[i].queries.append(q)
            trajs[i].retrieved.append([h.to_dict() for h in hits])
            trajs[i].retrieval_count += 1
            _merge_docs(docs[i], hits, settings.ircot_max_docs)

    record_search(list(range(n)), [ex.question.strip() for ex in examples])
    active = list(range(n))
    for _ in range(settings.max_turns):
        if not active:
            break
        prompts = [
            _user(
                IRCOT_STEP_PROMPT.format(
                    documents=format_docs(docs[i]),
                    question=examples[i].question.strip(),
                    reasoning=" ".join(chains[i]) or "(none yet)",
                )
            )
            for i in active
        ]
        gens = counter.generate(prompts, ["\n"], _params(settings.ircot_sentence_tokens, settings.seed))
        next_active, queries = [], []
        for i, gen, (n_in, n_out) in zip(active, gens, counter.last, strict=True):
            tokens[i][0] += n_in
            tokens[i][1] += n_out
            trajs[i].num_turns += 1
            sentence = first_sentence(gen.text)
            if not sentence:
                trajs[i].finish_reason = "no_action"
                continue
            chains[i].append(sentence)
            stated = answer_stated(sentence)
            if stated is not None:
                answers[i] = stated
                trajs[i].finish_reason = "answer"
                continue
            next_active.append(i)
            queries.append(sentence)
        record_search(next_active, queries)
        active = next_active
    for i in active:
        trajs[i].finish_reason = "max_turns"

    unanswered = [i for i in range(n) if answers[i] is None]
    preds, _, counts = read_documents(
        reader or model, [examples[i] for i in unanswered], [docs[i] for i in unanswered], settings
    )
    for i, pred, (n_in, n_out) in zip(unanswered, preds, counts, strict=True):
        answers[i] = pred
        tokens[i][0] += n_in
        tokens[i][1] += n_out
    read = set(unanswered)
    outs = []
    for i, traj in enumerate(trajs):
        traj.response_text = " ".join(chains[i])
        traj.served_context = [h.to_dict() for h in docs[i]]
        traj.answer = answers[i]
        traj.extra["answer_from"] = "reader" if i in read else "chain"
        outs.append(MethodOutput(answers[i], traj.retrieval_count, tokens[i][0], tokens[i][1], traj))
    return outs


def gold_passages(retriever: Any, examples: Sequence[QAExample]) -> list[list[Hit]]:
    """Each question's `metadata["supporting_ids"]` passages, fetched from the retriever's store."""
    ids = [[str(d) for d in ex.metadata.get("supporting_ids") or []] for ex in examples]
    found = iter(passages_by_id(retriever, [d for group in ids for d in group]))
    out = []
    for ex, group in zip(examples, ids, strict=True):
        hits = [next(found) for _ in group]
        missing = [d for d, h in zip(group, hits, strict=True) if h is None]
        if missing:
            raise ConfigError(
                f"question {ex.id!r}: supporting passage(s) {', '.join(missing)} are not in the index; "
                "was the index built from this world's corpus.jsonl?"
            )
        out.append([h for h in hits if h is not None])
    return out


def run_oracle(
    reader: Generator,
    retriever: Any,
    examples: Sequence[QAExample],
    settings: BaselineSettings,
    template: str,
) -> list[MethodOutput]:
    """The frozen reader answers from each question's gold supporting passages (no search)."""
    docs = gold_passages(retriever, examples)
    preds, texts, counts = read_documents(reader, examples, docs, settings, template)
    outs = []
    for ex, d, pred, text, (n_in, n_out) in zip(examples, docs, preds, texts, counts, strict=True):
        traj = _base_traj(ex, "oracle")
        traj.served_context = [x.to_dict() for x in d]
        traj.num_turns, traj.finish_reason = 1, "answer"
        traj.response_text, traj.answer = text, pred
        outs.append(MethodOutput(pred, 0, n_in, n_out, traj, answer_source="generator"))
    return outs
