"""A stronger frozen reader, built with sleuth: SFT of a base model on (question + gold passages -> answer).

s3 and QAgent hand their documents to a frozen reader (`rewards.answerer.hand_over_documents`, with the
method's `Method.reader`); with the embedded 135M base as that reader, gold passages lift accuracy only a
little, which leaves a searcher little to gain. `train_reader` fine-tunes a base model with sleuth's own SFT
(`sleuth.rl.sft.run_sft`) on a world's training questions: each record's prompt is exactly what the
hand-over sends (the chat messages of `document_prompt` for each of `templates`, chat-formatted as the
generator formats them) over the question's gold passages plus `distractors` BM25 hits that are not gold,
in a seeded random order; the target is the first gold answer and the end-of-turn token, as the reader
prompts ask ("directly answer ... without any other text").

The result is written twice: the SFT checkpoint (LoRA adapters or full weights, resumable) and its export
`OUT/reader` (a plain Hugging Face directory, LoRA merged, with `searcher.json`), the form every frozen-model
spec loads on a CPU: `sleuth eval --generator OUT/reader`, a recipe's `reward.generator: OUT/reader`.
`reader_check` measures it: the `oracle` row (gold passages to the reader) per template, with intervals.

This module sits on the top floor (like `knowledge.py`): it chains the SFT trainer, the export and the
evaluation harness.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import typer

from sleuth.agent.coldstart import SFTRecord
from sleuth.agent.registry import reader_names
from sleuth.claims.knowledge import WorldSFT, run_world_sft
from sleuth.data.formats import QAExample, read_qa_jsonl
from sleuth.errors import ConfigError, SleuthError
from sleuth.eval.baselines import BaselineSettings, gold_passages, read_documents
from sleuth.eval.stats import bootstrap_ci
from sleuth.retrieval.base import Hit
from sleuth.rewards.answerer import document_prompt
from sleuth.rewards.metrics import exact_match
from sleuth.utils import atomic_write_json

READER_LOOP = (
    "s3"  # SFT records and searcher.json need a registered loop; the reader prompt uses no loop tags
)
# one pass a 16-record step on a GPU (the cost is per pass: sleuth.claims.knowledge's INJECTION_SFT)
READER_SFT = WorldSFT("train-reader", READER_LOOP, "reader_sft.jsonl", "reader_recipe.yaml", 16)
READER_FILE = "reader.json"  # OUT/reader.json: the finished reader, its settings and its SFT loss
READER_DIR = "reader"  # OUT/reader: the exported reader (a Hugging Face directory)
CHECK_FILE = "reader_check.json"


def check_templates(templates: Sequence[str]) -> tuple[str, ...]:
    """The reader prompts to use: those named (each must be registered), or every registered one."""
    known = reader_names()
    unknown = [t for t in templates if t not in known]
    if unknown:
        raise ConfigError(f"reader templates {list(templates)}: choose one or more of {known}")
    return tuple(templates) or tuple(known)


@dataclass(frozen=True)
class ReaderSettings:
    model: str = "smollm2-135m-instruct"
    templates: tuple[
        str, ...
    ] = ()  # reader prompts to train on, each question once per prompt (): all registered
    distractors: int = 2  # BM25 hits that are not gold, mixed in so the reader learns to pick
    questions: int | None = None  # at most this many training questions (None: the whole train split)
    epochs: int = 3
    lr: float = 3e-4
    batch_size: int = 16
    lora: bool = True
    seed: int = 0

    def check(self) -> None:
        check_templates(self.templates)
        if self.distractors < 0:
            raise ConfigError(f"--distractors must be >= 0, got {self.distractors}")
        if self.questions is not None and self.questions < 1:
            raise ConfigError(f"--questions must be >= 1, got {self.questions}")


def _world_files(world: Path, split: str) -> tuple[Path, Path]:
    data, index = Path(world) / f"{split}.jsonl", Path(world) / "bm25"
    if not data.exists():
        raise ConfigError(
            f"{data} does not exist: pass a world made by `sleuth synth` (it writes {split}.jsonl)"
        )
    if not (index / "manifest.json").exists():
        raise ConfigError(
            f"{index} is not an index: build it with `sleuth index {Path(world) / 'corpus.jsonl'} "
            f"--kind bm25 --out {index}`"
        )
    return data, index


def gold_questions(path: Path, limit: int | None) -> list[QAExample]:
    """A split's questions, each with the ids of its gold passages (a synthetic world's `supporting_ids`)."""
    questions = read_qa_jsonl(path)[:limit]
    missing = [ex.id for ex in questions if not ex.metadata.get("supporting_ids")]
    if missing:
        raise ConfigError(
            f"{path}: question {missing[0]} (and {len(missing) - 1} more) has no gold passages "
            "(metadata.supporting_ids); train the reader on a world made by `sleuth synth`"
        )
    if not questions:
        raise ConfigError(f"{path} holds no questions")
    return questions


def reader_documents(
    retriever: Any, questions: Sequence[QAExample], distractors: int, seed: int
) -> list[list[Hit]]:
    """Each question's gold passages plus up to `distractors` of its BM25 hits that are not gold, shuffled
    with a generator seeded by `seed` (the same documents every run)."""
    golds = gold_passages(retriever, questions)
    extra: list[list[Hit]] = [[] for _ in questions]
    if distractors:
        hits = retriever.search([ex.question for ex in questions], distractors + max(len(g) for g in golds))
        for i, (gold, found) in enumerate(zip(golds, hits, strict=True)):
            ids = {h.doc_id for h in gold}
            extra[i] = [h for h in found if h.doc_id not in ids][:distractors]
    rng = random.Random(seed)
    docs = []
    for gold, other in zip(golds, extra, strict=True):
        group = list(gold) + other
        rng.shuffle(group)
        docs.append(group)
    return docs


def reader_records(questions: Sequence[QAExample], docs: Sequence[Sequence[Hit]], tokenizer: Any,
                   templates: Sequence[str]) -> list[SFTRecord]:  # fmt: skip
    """One SFT record per question and template: the hand-over's chat prompt, then the first gold answer
    and the end-of-turn token as the only targets."""
    eos = tokenizer.eos_token_id
    records = []
    for template in templates:
        for ex, group in zip(questions, docs, strict=True):
            messages = document_prompt(ex.question.strip(), group, template)
            prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            response_text = ex.golden_answers[0]
            prompt_ids = list(tokenizer.encode(prompt_text, add_special_tokens=False))
            response_ids = list(tokenizer.encode(response_text, add_special_tokens=False)) + (
                [] if eos is None else [eos]
            )
            records.append(
                SFTRecord(
                    loop=READER_LOOP,
                    prompt_ids=prompt_ids,
                    response_ids=response_ids,
                    loss_mask=[1] * len(response_ids),
                    source=f"reader-{template}",
                    question_id=str(ex.id),
                    question=ex.question,
                    golden_answers=list(ex.golden_answers),
                    prompt_text=prompt_text,
                    response_text=response_text,
                )
            )
    return records


def train_reader(world: Path, out: Path, settings: ReaderSettings, console: Any = None) -> Path:
    """SFT `settings.model` as a reader on the world's train split; returns the exported reader directory
    (OUT/reader). Resumable: a finished reader (OUT/reader.json) is returned as is, an interrupted SFT resumes."""
    from transformers import AutoTokenizer

    # deferred: the export, the harness and model loading load hub code; `sleuth --help` imports this module
    from sleuth.agent.searcher import export_searcher
    from sleuth.eval.harness import resolve_retriever
    from sleuth.llm.registry import resolve_model_path

    out = Path(out)
    done = out / READER_FILE
    if done.exists():
        return Path(json.loads(done.read_text())["reader"])
    settings.check()
    data, index = _world_files(world, "train")
    questions = gold_questions(data, settings.questions)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(settings.model))
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"model {settings.model!r} has no chat template; the reader prompts are chat messages"
        )
    docs = reader_documents(resolve_retriever(index), questions, settings.distractors, settings.seed)
    records = reader_records(questions, docs, tokenizer, check_templates(settings.templates))
    result = run_world_sft(world, out, settings, READER_SFT, records, console)
    reader = export_searcher(result["checkpoint"], out / READER_DIR, overwrite=True)
    atomic_write_json(
        done,
        {
            "reader": str(reader),
            "checkpoint": result["checkpoint"],
            "questions": len(questions),
            "settings": asdict(settings),
            "final_loss": result["metrics"].get("sft/loss"),
        },
    )
    return reader


def reader_check(world: Path, reader: str, out: Path, split: str = "test", limit: int | None = None,
                 templates: Sequence[str] = ()) -> dict[str, Any]:  # fmt: skip
    """EM of `reader` answering from each question's gold passages (what `sleuth eval`'s `oracle` row does,
    here for every reader template), with 95% bootstrap intervals; written to OUT/reader_check.json as
    {template: {"n", "em", "em_ci"}}."""
    # deferred: the harness loads model and hub code; `sleuth --help` imports this module
    from sleuth.eval.harness import resolve_generator, resolve_retriever

    templates = check_templates(templates)
    data, index = _world_files(world, split)
    questions = gold_questions(data, limit)
    generator = resolve_generator(reader)
    docs = gold_passages(resolve_retriever(index), questions)
    result: dict[str, Any] = {}
    for template in templates:
        predictions, _, _ = read_documents(
            generator, questions, docs, BaselineSettings(answer_max_new_tokens=24), template
        )
        em = [exact_match(p, ex.golden_answers) for p, ex in zip(predictions, questions, strict=True)]
        lo, hi = bootstrap_ci(em)
        result[template] = {"n": len(em), "em": sum(em) / len(em), "em_ci": [lo, hi]}
    atomic_write_json(Path(out) / CHECK_FILE, {"reader": str(reader), "split": split, **result})
    return result


def register(app: typer.Typer) -> None:
    @app.command("train-reader")
    def train_reader_cmd(
        world: Path = typer.Argument(
            ..., help="A world made by `sleuth synth` with its BM25 index (WORLD/bm25)."
        ),
        out: Path = typer.Option(
            ..., "--out", help="Run directory: the SFT checkpoint, OUT/reader, reader.json."
        ),
        model: str = typer.Option("smollm2-135m-instruct", help="Base model (alias, directory)."),
        templates: str = typer.Option(
            "",
            help="Reader prompts to train on, comma-separated (default: every "
            "registered reader: `sleuth methods` lists the methods that bring one).",
        ),
        distractors: int = typer.Option(2, help="Non-gold BM25 hits mixed into each question's passages."),
        questions: int = typer.Option(None, help="At most this many training questions (default: all)."),
        epochs: int = typer.Option(3, min=1, help="SFT epochs."),
        lr: float = typer.Option(3e-4, min=0.0, help="SFT learning rate."),
        batch_size: int = typer.Option(16, min=1, help="Records per optimizer step."),
        lora: bool = typer.Option(True, "--lora/--full", help="LoRA adapters (default) or full fine-tuning."),
        check_split: str = typer.Option(
            "test", help="Split whose gold passages the check reads ('' skips it)."
        ),
        check_limit: int = typer.Option(
            None, help="At most this many questions in the check (default: all)."
        ),
    ) -> None:
        """Train a frozen reader (question + gold passages -> answer), then check its EM from gold passages."""
        from rich.console import Console

        console = Console()
        try:
            chosen = tuple(t.strip() for t in templates.split(",") if t.strip())
            settings = ReaderSettings(
                model=model,
                templates=chosen,
                distractors=distractors,
                questions=questions,
                epochs=epochs,
                lr=lr,
                batch_size=batch_size,
                lora=lora,
            )
            reader = train_reader(world, out, settings, console)
            result = (
                reader_check(world, str(reader), out, check_split, check_limit, chosen) if check_split else {}
            )
        except SleuthError as err:
            console.print(f"[red]error:[/] {err}")
            raise typer.Exit(2) from None
        for template, row in result.items():
            lo, hi = row["em_ci"]
            console.print(
                f"gold-passage EM, {template} prompt: n={row['n']}  {100 * row['em']:.1f} "
                f"[{100 * lo:.1f}, {100 * hi:.1f}]"
            )
        console.print(f"reader: {reader}  (use as `sleuth eval --generator` or a recipe's reward.generator)")
