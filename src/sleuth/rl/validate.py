"""Validation during training: the method's own reward on a fixed set of held-out questions.

A step's training reward is a mean over that step's freshly drawn questions, sampled at the training
temperature, so from step to step it moves with which questions came up about as much as with the policy
(16 questions of mixed difficulty). Validation asks the same `data.dev` questions every time, decodes greedily
(what evaluation and serving do) and scores with the recipe's reward, so two validations differ only by the
policy; their question-by-question results are kept, and `sleuth report` pairs the first with the last.
Like verl's `test_freq` with validation before training: before the first step, every `trainer.eval_every`
steps and after the last.
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch

from sleuth.agent.engine import rollout
from sleuth.appendlog import read_appended
from sleuth.rewards.base import guarded_rewards
from sleuth.rl.config import Recipe
from sleuth.rl.models import autocast
from sleuth.rl.run import Run
from sleuth.rl.setup import rollout_budget
from sleuth.run_layout import VALIDATION, validation_records
from sleuth.utils import atomic_write_text


def validation_due(recipe: Recipe, done: int) -> bool:
    """Whether a validation follows the step that makes `done` updates (0: before training)."""
    every = recipe.trainer.eval_every
    return done in (0, recipe.trainer.total_steps) or (every is not None and done % every == 0)


def already_validated(run: Run, done: int) -> bool:
    """Whether validation.jsonl already logs the validation after `done` updates (a resumed run does not
    redo it). The main rank reads the file, after its loggers dropped the rows a resume redoes, and every
    rank takes its answer: the validation is collective, so all ranks must decide alike."""
    logged = False
    if run.ctx.is_main:
        logged = any(r.get("step") == done for r in read_appended(run.out_dir / VALIDATION).records)
    return run.ctx.all_reduce_sum(torch.tensor([float(logged)])).item() > 0


def validate(run: Run, done: int) -> dict[str, float]:
    """Roll out the validation questions greedily with the current policy, score them with the recipe's
    reward, write each question's result and log the means (collective: every rank calls it)."""
    ctx, n = run.ctx, len(run.val_examples)
    # score with the reward the next step trains on (a two-stage reward switches on the step), or after the
    # last step with the last step's: a validation then opens each stage's series as well as closing it
    run.reward_fn.set_step(min(done, run.recipe.trainer.total_steps - 1))
    mine = run.val_examples[n * ctx.rank // ctx.world_size : n * (ctx.rank + 1) // ctx.world_size]
    greedy = dataclasses.replace(run.sampling, temperature=0.0)
    run.policy.eval()
    t0 = time.perf_counter()
    with autocast(ctx.device):
        trajs = rollout(
            run.loop, run.generator, run.retriever, mine, greedy, n=1, budget=rollout_budget(run.recipe)
        )
    results = guarded_rewards(run.reward_fn, trajs, run.services)
    run.retrieval_logged = run.retriever.totals()  # a step's time/retrieval leaves validation's searches out
    rows = [
        {
            "id": t.question_id,
            "question": t.question,
            "golden_answers": t.golden_answers,
            "answer": t.answer,
            "reward": r.total,
            "components": r.components,
            "retrieval_count": t.retrieval_count,
            "finish_reason": t.finish_reason,
        }
        for t, r in zip(trajs, results, strict=True)
    ]
    rows = ctx.gather_objects(rows)
    seconds = time.perf_counter() - t0
    metrics = {
        "val/reward/mean": sum(r["reward"] for r in rows) / len(rows),
        **{
            f"val/reward/{name}": sum(r["components"].get(name, 0.0) for r in rows) / len(rows)
            for name in sorted({k for r in rows for k in r["components"]})
        },
        "val/retrieval_count": sum(r["retrieval_count"] for r in rows) / len(rows),
        "val/answered": sum(r["answer"] is not None for r in rows) / len(rows),
        "val/examples": float(len(rows)),
        "val/stage": float(run.reward_fn.current_stage),
        "time/validation": seconds,
    }
    if ctx.is_main:
        atomic_write_text(validation_records(run.out_dir, done), "".join(json.dumps(r) + "\n" for r in rows))
        run.log.write_validation(done, metrics)
        run.console.print(
            f"validation after step {done}: reward {metrics['val/reward/mean']:+.3f} on {len(rows)} data.dev "
            f"questions, greedy (retrievals {metrics['val/retrieval_count']:.2f}, {seconds:.1f}s)"
        )
    return metrics
