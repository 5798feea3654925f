"""A knowledge boundary: teach a model a world's known facts, then measure that it knows them.

`sleuth synth --known-fraction F` marks a share of the facts *known* and writes their closed-book
statements to `knowledge.jsonl`. `inject_knowledge` fine-tunes a model on them with sleuth's own SFT
(`sleuth.rl.sft.run_sft`): each statement becomes one record whose prompt is the `direct` baseline's
closed-book prompt for the fact's question and whose target is `<answer> ANSWER </answer>`, so the
injected knowledge is what `direct` evaluation asks for. `boundary_check` evaluates `direct` on a
world's questions grouped by their knowledge type (all-known, mixed, all-unknown): the boundary is
real when direct accuracy on all-known questions is clearly above all-unknown ones.

This module sits on the top floor (like `demo.py`): it chains the SFT trainer and the evaluation
harness, the way `sleuth demo` chains them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from sleuth.agent.coldstart import SFTRecord, write_records
from sleuth.appendlog import read_appended
from sleuth.data.formats import QAExample, read_qa_jsonl, write_qa_jsonl
from sleuth.data.synth import KNOWLEDGE_FILE, KNOWLEDGE_TYPES
from sleuth.errors import ConfigError, DataFormatError, SleuthError
from sleuth.eval.baselines import DIRECT_PROMPT, parse_answer
from sleuth.llm.base import SamplingParams
from sleuth.rewards.metrics import exact_match
from sleuth.utils import atomic_write_json

INJECTION_LOOP = "search_r1"  # the SFT records need a loop label; the direct prompt uses no loop's tags
INJECTED_FILE = "injected.json"  # out/injected.json: the injected checkpoint and its settings
BOUNDARY_FILE = "boundary.json"


@dataclass(frozen=True)
class InjectionSettings:
    model: str = "smollm2-135m-instruct"
    # the staged claim's gpu profile (sleuth.claims.runner): 3 epochs at 3e-4 x 16 taught SmolLM2-135M ~10% of its facts
    epochs: int = 12
    lr: float = 3e-3
    batch_size: int = 128
    lora: bool = True
    seed: int = 0


def read_statements(world: Path) -> list[dict[str, Any]]:
    """The closed-book statements of a world with a knowledge boundary (`knowledge.jsonl`)."""
    path = Path(world) / KNOWLEDGE_FILE
    if not path.exists():
        raise ConfigError(f"{path} does not exist: make the world with `sleuth synth --known-fraction F`")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            row = json.loads(line)
            rows.append(
                {"id": str(row["id"]), "question": str(row["question"]), "answers": list(row["answers"])}
            )
        except (ValueError, KeyError, TypeError) as err:
            raise DataFormatError(str(path), number, f"not a knowledge statement ({err})") from None
    if not rows:
        raise DataFormatError(str(path), None, "no known facts: raise --known-fraction")
    return rows


def injection_records(statements: list[dict[str, Any]], tokenizer: Any) -> list[SFTRecord]:
    """One SFT record per statement: the direct prompt (chat-formatted as evaluation formats it), then the
    answer in tags and the end-of-turn token as the only targets."""
    records = []
    eos = tokenizer.eos_token_id
    for row in statements:
        messages = [{"role": "user", "content": DIRECT_PROMPT.format(question=row["question"].strip())}]
        prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        response_text = f"<answer> {row['answers'][0]} </answer>"
        prompt_ids = list(tokenizer.encode(prompt_text, add_special_tokens=False))
        response_ids = list(tokenizer.encode(response_text, add_special_tokens=False)) + (
            [eos] if eos is not None else []
        )
        records.append(
            SFTRecord(
                loop=INJECTION_LOOP,
                prompt_ids=prompt_ids,
                response_ids=response_ids,
                loss_mask=[1] * len(response_ids),
                source="knowledge",
                question_id=row["id"],
                question=row["question"],
                golden_answers=row["answers"],
                prompt_text=prompt_text,
                response_text=response_text,
            )
        )
    return records


@dataclass(frozen=True)
class WorldSFT:
    """One supervised fine-tuning job on a world's records (the knowledge injection, the trained reader)."""

    name: str  # the recipe's name
    loop: str  # the SFT records need a registered loop label; these prompts use no loop's tags
    records_file: str  # OUT/<records_file>: the records
    recipe_file: str  # OUT/<recipe_file>: the recipe, re-runnable with `sleuth sft`
    micro_cap: int  # micro-batch size at most this (the batch size when smaller)


# On a GPU, passes of up to 128 statements (~100 tokens each; the gradient is the same token mean at any size): an
# H100 step of one 16-statement pass took 0.24 s, two 64-statement passes 0.49 s (2026-11-28), so the cost is per
# pass (dispatch: ~40,000 aten ops a forward/backward), not per token. On a CPU 16: 64 took 18 GB (fp32).
INJECTION_SFT = WorldSFT("inject-knowledge", INJECTION_LOOP, "knowledge_sft.jsonl", "inject_recipe.yaml", 128)
CPU_MICRO_CAP = 16


def world_sft_recipe(world: Path, out: Path, settings: Any, job: WorldSFT) -> dict[str, Any]:
    """The SFT recipe of `job` with `settings`' model, lora, seed, epochs, lr and batch size."""
    import torch

    micro = min(
        settings.batch_size, job.micro_cap if torch.cuda.is_available() else min(job.micro_cap, CPU_MICRO_CAP)
    )
    return {
        "name": job.name,
        "seed": settings.seed,
        "model": {"policy": settings.model, "lora": {"enabled": settings.lora, "r": 16, "alpha": 32}},
        "data": {"train": str(Path(world) / "train.jsonl")},
        "retriever": {"index": str(Path(world) / "bm25")},  # required by the schema; these SFTs never search
        "agent": {"loop": job.loop},
        # these SFTs never score a rollout: the reward is named only so the checkpoint records what it always did
        # (a recipe without one takes the loop's method reward, s3's for the reader)
        "reward": {"name": "search_r1_em"},
        "trainer": {"out_dir": str(out), "total_steps": 1},
        "sft": {
            "data": str(out / job.records_file),
            "epochs": settings.epochs,
            "lr": settings.lr,
            "batch_size": settings.batch_size,
            "micro_batch_size": micro,
            "held_out": 0.0,
            "out_dir": str(out / "sft"),
        },
    }


def run_world_sft(
    world: Path, out: Path, settings: Any, job: WorldSFT, records: list[SFTRecord], console: Any = None
) -> dict[str, Any]:
    """Write `records` and `job`'s recipe into OUT, then run (or resume) sleuth's SFT; its result."""
    # deferred: the recipe schema and SFT load torch; `sleuth --help` imports this module
    from sleuth.rl.config import write_recipe
    from sleuth.rl.sft import run_sft

    recipe_dict = world_sft_recipe(world, out, settings, job)
    write_records(recipe_dict["sft"]["data"], records)
    return run_sft(write_recipe(recipe_dict, out / job.recipe_file), resume=True, console=console)


def inject_knowledge(world: Path, out: Path, settings: InjectionSettings, console: Any = None) -> Path:
    """SFT `settings.model` on the world's known facts; returns the injected checkpoint. Resumable: a
    finished injection (out/injected.json) is returned as is, an interrupted one resumes its SFT."""
    from transformers import AutoTokenizer

    # deferred: model loading (huggingface_hub); `sleuth --help` imports this module
    from sleuth.llm.registry import resolve_model_path

    out = Path(out)
    done = out / INJECTED_FILE
    if done.exists():
        return Path(json.loads(done.read_text())["checkpoint"])
    out.mkdir(parents=True, exist_ok=True)
    statements = read_statements(world)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(settings.model))
    result = run_world_sft(
        world, out, settings, INJECTION_SFT, injection_records(statements, tokenizer), console
    )
    atomic_write_json(
        done,
        {
            "checkpoint": result["checkpoint"],
            "statements": len(statements),
            "settings": settings.__dict__,
            "final_loss": result["metrics"].get("sft/loss"),
        },
    )
    return Path(result["checkpoint"])


def boundary_questions(world: Path, split: str, limit: int | None) -> list[QAExample]:
    """A split's questions, each reported under its knowledge type (`synth --known-fraction` labels)."""
    path = Path(world) / f"{split}.jsonl"
    questions = read_qa_jsonl(path)[:limit]
    for ex in questions:
        kind = ex.metadata.get("knowledge")
        if kind not in KNOWLEDGE_TYPES:
            raise ConfigError(
                f"{path}: question {ex.id} has no knowledge label; make the world with "
                "`sleuth synth --known-fraction F`"
            )
        ex.metadata["dataset"] = kind
    return questions


def boundary_check(
    world: Path, model: str, out: Path, split: str = "test", limit: int | None = None
) -> dict[str, Any]:
    """`direct` (closed-book) accuracy per knowledge type, with 95% bootstrap intervals; written to
    out/boundary.json as {type: {"n", "em", "em_ci"}} plus "known_minus_unknown" (EM points)."""
    # deferred: the harness loads model and hub code; `sleuth --help` imports this module
    from sleuth.eval.harness import EvalConfig, EvalOutput, evaluate

    questions = boundary_questions(world, split, limit)
    summary = evaluate(
        ["direct"],
        questions,
        model=model,
        config=EvalConfig(answer_max_new_tokens=24),
        out_dir=EvalOutput(Path(out) / "eval_direct"),
    )
    rows = summary["methods"]["direct"]
    result: dict[str, Any] = {
        t: {"n": rows[t]["n"], "em": rows[t]["em"], "em_ci": rows[t]["em_ci"]}
        for t in KNOWLEDGE_TYPES
        if t in rows
    }
    if "all-known" in result and "all-unknown" in result:
        result["known_minus_unknown"] = result["all-known"]["em"] - result["all-unknown"]["em"]
    atomic_write_json(Path(out) / BOUNDARY_FILE, {"model": model, "split": split, **result})
    return result


LABELLED_SPLITS = ("train", "test")
KNOWN, NOT_RECALLED = "all-known", "mixed"
LABEL_FILE = "labels.json"


def label_by_model(world: Path, model: str, out: Path, batch_size: int = 64) -> dict[str, Any]:
    """The world's questions labelled by what `model` answers closed-book (the staged paper labels its questions
    by the model's own answers): a question the model answers right (greedy, the `direct` prompt, exact match) is
    all-known; an all-known question of the world's labels that it gets wrong becomes mixed (it holds every fact but
    cannot recall the answer); the others keep their labels. Writes OUT/train.jsonl and OUT/test.jsonl with
    `metadata.knowledge` relabelled and the world's label kept as `metadata.knowledge_by_world`; the corpus and index
    stay the world's. Resumable (the closed-book evaluations resume)."""
    # deferred: the harness loads model and hub code; `sleuth --help` imports this module
    from sleuth.eval.harness import EvalConfig, EvalOutput, evaluate

    out = Path(out)
    done = out / LABEL_FILE
    if done.exists():
        return json.loads(done.read_text())
    counts: dict[str, dict[str, int]] = {}
    for split in LABELLED_SPLITS:
        questions = read_qa_jsonl(Path(world) / f"{split}.jsonl")
        folder = out / f"closed_book_{split}"
        evaluate(
            ["direct"],
            questions,
            model=model,
            config=EvalConfig(answer_max_new_tokens=24, batch_size=batch_size),
            out_dir=EvalOutput(folder),
        )
        right = {
            r["id"]: r["metrics"]["em"] > 0
            for r in read_appended(folder / "direct" / "predictions.jsonl").records
        }
        moved: dict[str, int] = {}
        for ex in questions:
            was = ex.metadata.get("knowledge")
            if was not in KNOWLEDGE_TYPES:
                raise ConfigError(
                    f"{world}/{split}.jsonl: question {ex.id} has no knowledge label; make the world "
                    "with `sleuth synth --known-fraction F`"
                )
            now = KNOWN if right.get(ex.id) else (NOT_RECALLED if was == KNOWN else was)
            ex.metadata["knowledge_by_world"], ex.metadata["knowledge"] = was, now
            moved[f"{was} -> {now}"] = moved.get(f"{was} -> {now}", 0) + 1
        write_qa_jsonl(out / f"{split}.jsonl", questions)
        counts[split] = dict(sorted(moved.items()))
    result = {"questions": str(out), "model": model, "relabelled": counts}
    atomic_write_json(done, result)
    return result


def sampled_closed_book(model: str, questions: list[QAExample], samples: int, temperature: float,
                        seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Closed-book EM (the `direct` prompt) of `samples` samples per question at `temperature`, as RL samples its
    rollouts: a greedy label can overstate what a sampling policy recalls."""
    # deferred: the harness loads model and hub code; `sleuth --help` imports this module
    from sleuth.eval.loading import resolve_generator

    if not questions:
        return {"n": 0, "samples": samples, "em": None}
    generator = resolve_generator(model)
    prompts = [
        [{"role": "user", "content": DIRECT_PROMPT.format(question=q.question.strip())}] for q in questions
    ]
    right = []
    for k in range(samples):
        params = SamplingParams(max_new_tokens=24, temperature=temperature, seed=seed + k)
        gens = generator.generate(prompts, ["</answer>"], params)
        right += [
            exact_match(parse_answer(g.text), q.golden_answers) for g, q in zip(gens, questions, strict=True)
        ]
    return {
        "n": len(questions),
        "samples": samples,
        "temperature": temperature,
        "em": sum(right) / len(right),
    }


def register(app: typer.Typer) -> None:
    @app.command("inject-knowledge")
    def inject_cmd(
        world: Path = typer.Argument(..., help="A world made by `sleuth synth --known-fraction F`."),
        out: Path = typer.Option(
            ..., "--out", help="Run directory (the SFT checkpoint, injected.json, boundary.json)."
        ),
        model: str = typer.Option("smollm2-135m-instruct", help="Base model (alias, directory)."),
        epochs: int = typer.Option(12, min=1, help="SFT epochs over the closed-book statements."),
        lr: float = typer.Option(3e-3, min=0.0, help="SFT learning rate."),
        batch_size: int = typer.Option(128, min=1, help="Statements per optimizer step."),
        lora: bool = typer.Option(True, "--lora/--full", help="LoRA adapters (default) or full fine-tuning."),
        check_split: str = typer.Option(
            "test", help="Split whose questions the boundary check answers closed-book."
        ),
        check_limit: int = typer.Option(
            None, help="At most this many questions in the check (default: all)."
        ),
    ) -> None:
        """Teach a model a world's known facts (SFT), then check direct accuracy on known vs unknown questions."""
        from rich.console import Console

        console = Console()
        try:
            settings = InjectionSettings(model=model, epochs=epochs, lr=lr, batch_size=batch_size, lora=lora)
            ckpt = inject_knowledge(world, out, settings, console)
            result = boundary_check(world, str(ckpt), out, check_split, check_limit)
        except SleuthError as err:
            console.print(f"[red]error:[/] {err}")
            raise typer.Exit(2) from None
        for kind in KNOWLEDGE_TYPES:
            if kind in result:
                row = result[kind]
                lo, hi = row["em_ci"]
                console.print(
                    f"direct EM {kind:12s} n={row['n']:4d}  {100 * row['em']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"
                )
        console.print(f"injected checkpoint: {ckpt}")
