"""CLI: `sleuth trajectories RECIPE --out FILE`: cold-start trajectories for `sleuth sft`.

It lives on the training floor because it builds its loop, retriever, data and reward services from a
recipe (sleuth.rl.setup); the oracle and teacher sources it drives are sleuth.agent.coldstart."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from sleuth.agent.coldstart import (
    RejectionSampling,
    collect_oracle,
    collect_teacher,
    records_from_messages,
    write_records,
)
from sleuth.errors import ConfigError, SleuthError
from sleuth.llm.base import SamplingParams
from sleuth.rewards.base import get_reward


@dataclass(frozen=True)
class TrajectorySource:
    """Where `sleuth trajectories` gets its records: the oracle, a teacher (rejection sampling) or chat messages."""

    kind: str = "oracle"  # oracle | teacher | messages
    teacher: str | None = None
    threshold: float = 1.0
    n: int = 1
    messages: Path | None = None
    variants: int = 1
    limit: int | None = None
    seed: int = 0


def register(app: typer.Typer) -> None:
    @app.command("trajectories")
    def trajectories_cmd(
        recipe: str = typer.Argument(
            ..., help="Recipe YAML: its loop, retriever, data and token budgets are used"
        ),
        overrides: list[str] = typer.Argument(None, help="key.path=value recipe overrides"),
        out: Path = typer.Option(..., "--out", "-o", help="Output jsonl (written atomically)"),
        source: str = typer.Option(
            "oracle", help="oracle (synthetic world), teacher (rejection sampling) or messages"
        ),
        teacher: str = typer.Option(
            None, help="teacher model spec (alias, dir, openai:URL#model) for --source teacher"
        ),
        threshold: float = typer.Option(1.0, help="teacher: keep trajectories whose reward is >= this"),
        n: int = typer.Option(1, help="teacher: samples per question"),
        messages: Path = typer.Option(None, help="chat-message jsonl to import for --source messages"),
        variants: int = typer.Option(
            1, help="oracle: play each question this many times with other wordings"
        ),
        limit: int = typer.Option(None, help="use the first N questions of data.train"),
        seed: int = typer.Option(0, help="oracle wording / sampling seed"),
    ) -> None:
        """Write SFT trajectories (token ids + loss mask exactly as the RL rollout builds them, plus text)."""
        from rich.console import Console

        console = Console(soft_wrap=True)  # a message or path is one line, never broken at the width
        try:
            stats = make_trajectories(
                recipe,
                overrides or [],
                out,
                TrajectorySource(source, teacher, threshold, n, messages, variants, limit, seed),
            )
        except SleuthError as err:
            console.print(f"[red]error:[/] {err}")
            raise typer.Exit(2) from None
        console.print(f"[green]{stats['kept']}[/] of {stats['played']} trajectories kept -> {out}")


def make_trajectories(
    recipe_path: str, overrides: list[str], out: Path, src: TrajectorySource
) -> dict[str, int]:
    from sleuth.rl.config import load_recipe  # deferred with the rest: it loads torch through the registries

    return recipe_trajectories(load_recipe(recipe_path, overrides), out, src)


def recipe_trajectories(recipe: Any, out: Path, src: TrajectorySource) -> dict[str, int]:
    """Trajectories for `recipe`'s loop, retriever, data and token budgets, written atomically to `out`
    (the CLI, the demo and bench/learning.py all come here). Nothing is written when none is kept."""
    # deferred so that `sleuth --help` does not load torch and transformers
    from transformers import AutoTokenizer

    # deferred: model loading and the recipe's pieces load torch; `sleuth --help` imports this module
    from sleuth.llm.registry import load_generator, resolve_model_path
    from sleuth.rl.setup import (
        build_loop,
        build_retriever,
        build_reward_services,
        load_examples,
        rollout_budget,
    )

    source, teacher, messages, seed = src.kind, src.teacher, src.messages, src.seed
    if source not in ("oracle", "teacher", "messages"):
        raise ConfigError(f"--source must be oracle, teacher or messages, got {source!r}")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(recipe.model.policy))
    if source == "messages":
        if messages is None:
            raise ConfigError("--source messages needs --messages FILE")
        records = records_from_messages(messages, tokenizer, recipe.agent.loop)
        write_records(out, records)
        return {"played": len(records), "kept": len(records)}
    loop = build_loop(recipe)
    retriever = build_retriever(recipe)
    examples = load_examples(recipe)[: src.limit] if src.limit else load_examples(recipe)
    budget = rollout_budget(recipe)
    if source == "oracle":
        records, stats = collect_oracle(
            loop, retriever, tokenizer, examples, seed=seed, variants=src.variants, budget=budget
        )
    else:
        if teacher is None:
            raise ConfigError("--source teacher needs --teacher MODEL")
        if recipe.reward.generator == "policy-base" or recipe.reward.judge == "policy-base":
            raise ConfigError(
                "reward services 'policy-base' need a LoRA policy; name a model for reward.generator"
            )
        for module in recipe.plugins:
            __import__(module)
        teacher_gen = load_generator(teacher)
        services = build_reward_services(recipe, teacher_gen, None, retriever)
        params = SamplingParams(
            max_new_tokens=recipe.agent.max_new_tokens_per_turn,
            temperature=recipe.sampling.temperature,
            top_p=recipe.sampling.top_p,
            seed=seed,
        )
        sampling = RejectionSampling(
            get_reward(recipe.reward.name, **recipe.reward.options),
            services,
            threshold=src.threshold,
            n=src.n,
        )
        records, stats = collect_teacher(
            loop,
            teacher_gen,
            retriever,
            examples,
            sampling,
            params=params,
            budget=budget,
            tokenizer=tokenizer,
        )
    if not records:
        raise ConfigError(
            f"no trajectory passed the filter ({stats['played']} played); nothing written to {out}"
        )
    write_records(out, records)
    return stats
