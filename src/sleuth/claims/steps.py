"""The steps claims share, written once: the world, an arm's recipe, the oracle-trajectory cold start, GRPO of an arm
and the evaluation of a checkpoint on the claim's held-out questions.

An arm's recipe is the demo's recipe for its method (`sleuth.demo.demo_recipe`) changed through the same
`key.path=value` overrides as `sleuth train` takes on its command line (`Arm.overrides`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sleuth.agent.registry import get_method
from sleuth.claims.base import ClaimRun
from sleuth.claims.knowledge import boundary_questions
from sleuth.claims.profiles import ClaimProfile
from sleuth.data.synth import generate_world, write_world
from sleuth.demo import DemoSize, demo_recipe, held_out_questions, write_oracle_trajectories
from sleuth.retrieval import build_index
from sleuth.run_layout import latest_checkpoint

if TYPE_CHECKING:
    from sleuth.eval.harness import EvalConfig


def setting(key: str, value: Any) -> str:
    """One `key.path=value` override; the value written as JSON, which YAML reads back unchanged (paths included)."""
    return f"{key}={json.dumps(value)}"


@dataclass(frozen=True)
class Arm:
    """One compared arm: GRPO of `method` with the demo's recipe, changed by `overrides` (`key.path=value`)."""

    name: str  # its run directory <root>/<name> and its label
    method: str
    overrides: tuple[str, ...] = ()


def build_world(world: Path, profile: ClaimProfile, seed: int = 0) -> dict[str, Any]:
    """The claim's world from its seed (questions, corpus, BM25 index) under `world`: the same bytes every time
    but for the index manifest's build time and corpus path (a claim bundle rebuilds it rather than carrying it).
    Another seed makes another world of the same sizes: other entities, other facts."""
    size = profile.pipeline
    summary = write_world(
        generate_world(
            size.passages, size.questions, hops=size.hops, seed=seed, known_fraction=profile.known_fraction
        ),
        world,
        splits=profile.splits,
    )
    build_index(world / "corpus.jsonl", "bm25", world / "bm25")
    return {
        "world": str(world),
        "splits": summary["splits"],
        **{k: summary[k] for k in ("knowledge_distribution", "known_statements") if k in summary},
    }


def arm_recipe(run: ClaimRun, method: str, init_from: str | None, name: str | None = None,
               overrides: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
    """The demo's recipe for `method` under <root>/<name or method>, on the claim's world, at the run's seed,
    starting from the checkpoint `init_from` (None: the profile's base model), then `overrides`."""
    # deferred here and below: the recipe schema loads torch, which `sleuth --help` (it lists the claims) need not
    from sleuth.rl.config import apply_overrides

    profile = run.profile
    recipe = demo_recipe(run.root / (name or method), profile.pipeline, method)
    recipe["name"] = f"reproduce-{name or method}"
    recipe["seed"] = run.seed  # the arms' training seed; the world, reader and injection keep theirs
    recipe["data"]["train"] = str(run.questions / "train.jsonl")
    recipe["retriever"]["index"] = str(run.world / "bm25")
    recipe["model"]["lora"]["enabled"] = profile.lora
    if init_from is not None:
        recipe["model"]["init_from"] = init_from
    return apply_overrides(recipe, list(overrides))


def cold_start(run: ClaimRun, method: str, init_from: str | None, overrides: tuple[str, ...] = (),
               name: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Oracle trajectories of `method` (its loop changed by `overrides`, e.g. `agent.options.x=...`) -> SFT from
    `init_from` (None: the base model) under <root>/<name or method>; returns the SFT checkpoint."""
    from sleuth.rl.config import write_recipe
    from sleuth.rl.sft import run_sft

    folder = run.root / (name or method)
    recipe = write_recipe(arm_recipe(run, method, init_from, name, overrides), folder / "recipe.yaml")
    kept = write_oracle_trajectories(folder, recipe, run.profile.pipeline)
    sft = run_sft(recipe, resume=True, console=run.console)
    return {"sft_checkpoint": sft["checkpoint"], "trajectories": kept.get("kept", 0)}


def arm_rl_recipe(run: ClaimRun, arm: Arm, init_from: str) -> dict[str, Any]:
    """The GRPO recipe of one arm: the demo's recipe for its method, changed by the arm's overrides."""
    from sleuth.rl.config import apply_overrides

    recipe = arm_recipe(run, arm.method, init_from, arm.name)
    recipe.pop("sft")
    apply_overrides(recipe, list(arm.overrides))
    trainer = recipe["trainer"]
    if not any(o.startswith("trainer.save_every=") for o in arm.overrides):
        trainer["save_every"] = max(1, min(trainer["total_steps"], 5))
    return recipe


def train_rl(run: ClaimRun, arm: Arm, init_from: str) -> dict[str, Any]:
    """GRPO of one arm from `init_from` (an SFT or RL checkpoint), resumable; returns its last checkpoint."""
    from sleuth.rl.config import write_recipe
    from sleuth.rl.trainer import train

    recipe = write_recipe(arm_rl_recipe(run, arm, init_from), run.root / arm.name / "rl_recipe.yaml")
    resumable = latest_checkpoint(Path(recipe.trainer.out_dir)) is not None
    result = train(recipe, resume=resumable, overwrite=not resumable, console=run.console)
    return {
        "checkpoint": str(result["checkpoint"]),
        "run": recipe.trainer.out_dir,
        "steps": recipe.trainer.total_steps,
    }


def eval_config(
    size: DemoSize, method: str, checkpoint: str, hand_over_template: str | None = None
) -> EvalConfig:
    """The `EvalConfig` a claim evaluates `method`'s checkpoint with, at the pipeline `size`'s budgets (also what
    bench/from_committed_timing.py times)."""
    # deferred: the harness loads model and hub code; `sleuth --help` imports this module
    from sleuth.eval.harness import EvalConfig, checkpoint_budgets

    # the loop the checkpoint learned (s3 without selection, r_search without its evidence block), at the claim's budgets
    switches = {
        k: v for k, v in checkpoint_budgets(checkpoint).items() if k in ("loop_method", "loop_options")
    }
    return EvalConfig(
        batch_size=size.eval_batch_size,
        max_new_tokens=size.max_new_tokens * get_method(method).new_tokens_factor,
        answer_max_new_tokens=24,
        top_k=3,
        max_turns=size.max_turns,
        max_response_tokens=2048,
        max_obs_tokens=384,
        hand_over_template=hand_over_template,
        **switches,
    )


def evaluate(run: ClaimRun, method: str, checkpoint: str, name: str, reader: str | None = None,
             hand_over_template: str | None = None) -> dict[str, Any]:  # fmt: skip
    """`method`'s checkpoint on the claim's held-out questions (greedy), under <root>/eval/<name>; a searcher's
    documents go to `reader` (default: the checkpoint itself); with `hand_over_template`, any method's documents
    do, read with that prompt."""
    # deferred: the harness loads model and hub code; `sleuth --help` imports this module
    from sleuth.agent.searcher import load_searcher
    from sleuth.eval.harness import EvalOutput
    from sleuth.eval.harness import evaluate as run_evaluation

    profile = run.profile
    spec = get_method(method)
    cfg = eval_config(profile.pipeline, method, checkpoint, hand_over_template)
    questions = (
        boundary_questions(run.questions, "test", profile.test_questions)
        if profile.known_fraction is not None
        else held_out_questions(run.questions, profile.test_questions)
    )
    folder = run.root / "eval" / name
    summary = run_evaluation(
        [spec.display_name],
        questions,
        run.world / "bm25",
        load_searcher(checkpoint).generator,
        generator=reader,
        config=cfg,
        out_dir=EvalOutput(folder),
    )
    return {
        "predictions": str(folder / spec.display_name / "predictions.jsonl"),
        "reader": reader,
        "retrieval_boundary": summary.get("retrieval_boundary", {}).get(spec.display_name),
    }
