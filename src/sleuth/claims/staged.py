"""The staged claim ("learning when to search"): a retrieval-count-aware staged reward cuts over-retrieval while
keeping accuracy.

On a knowledge-boundary world (`synth --known-fraction`) the base model is taught the known facts
(`sleuth.claims.knowledge.inject_knowledge`). Its questions are then labelled by what the injected model answers
closed-book, as the paper labels its questions by the model's own answers (`label_by_model`; the world's 45.8%
closed-book EM on its "all-known" questions made searching the better policy on them: see the premise). Each arm gets
an oracle-trajectory SFT cold start from the injected model (answering known questions from memory), then the same
GRPO steps, one with the staged reward and one with search_r1's EM reward, both judging answers by exact match; both
are evaluated on the same held-out questions. The claim holds when staged retrieves less on all-known questions
(pooled difference below 0) at an accuracy not lower (the EM difference above -margin), each beyond the noise floor.

The premise, checked before the arms: on the known held-out questions, the expected staged answer reward of skipping
search (closed-book accuracy sampled at the RL temperature) against searching once (a naive-RAG probe), in stage 1 and
in stage 2.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sleuth.claims.base import (
    PREMISE,
    QUESTIONS,
    ClaimSpec,
    ClaimText,
    DecisiveTest,
    Stage,
    predictions,
    premise_stage,
)
from sleuth.claims.knowledge import boundary_questions, label_by_model, sampled_closed_book
from sleuth.claims.profiles import CPU_PIPELINE, GPU_PIPELINE, StagedProfile
from sleuth.claims.registry import register_claim
from sleuth.claims.report import knowledge_table
from sleuth.claims.reuse import inject_stage
from sleuth.claims.stats import metric, paired_on
from sleuth.claims.steps import Arm, arm_recipe, build_world, cold_start, evaluate, setting, train_rl
from sleuth.data.synth import KNOWLEDGE_TYPES
from sleuth.rewards.staged import staged_answer_reward

PROFILES = {
    "cpu": StagedProfile(
        pipeline=CPU_PIPELINE,
        known_fraction=0.5,
        splits=(0.6, 0.1, 0.3),
        inject_epochs=40,
        inject_lr=3e-3,
        inject_batch=8,
        lora=False,
        test_questions=30,
        accuracy_margin=0.02,
        enforce_premise=False,
    ),
    # Injection calibrated on SmolLM2-135M (knowledge_injection_calibration_cpu.json in bench/results): direct EM known
    # vs unknown 0.97 vs 0.05 at 12 epochs x 3e-3 x 128 (LoRA r16); 0.10 vs 0.03 at 3 x 3e-4 x 16
    # 16 rollouts a prompt (8 prompts a step): skipping search must be sampled often enough to be learned (at 5 a
    # prompt, the 2026-11-28 runs sampled it in at most 6% of stage-2 rollouts)
    "gpu": StagedProfile(
        pipeline=replace(GPU_PIPELINE, n=16, prompts_per_step=8),
        known_fraction=0.5,
        splits=(0.8, 0.1, 0.1),
        inject_epochs=12,
        inject_lr=3e-3,
        inject_batch=128,
        lora=True,
        test_questions=500,
        accuracy_margin=0.02,
        seeds=3,
    ),
}
ARMS = ("staged", "search_r1")  # the claim's method first, then the baseline it is compared with
# one correctness rule in both arms: search_r1's reward is exact match, so staged's answer term is too (its default,
# F1 >= 0.5, would pay staged for answers search_r1's reward calls wrong)
ARM_OVERRIDES = {"staged": (setting("reward.options.correctness", "em"),), "search_r1": ()}
ALL_KNOWN = "all-known"


def _all_known(record: dict[str, Any]) -> bool:
    return record.get("knowledge") == ALL_KNOWN


def _retrievals(record: dict[str, Any]) -> float:
    return float(record["retrieval_count"])


def _train_arm(run: Any, method: str) -> dict[str, Any]:
    """Oracle trajectories -> SFT from the injected model -> GRPO (one arm, one stage)."""
    sft = cold_start(run, method, run.result("inject")["checkpoint"])
    rl = train_rl(run, Arm(method, method, ARM_OVERRIDES[method]), sft["sft_checkpoint"])
    return {**sft, "checkpoint": rl["checkpoint"], "run": rl["run"]}


def expected_rewards(
    closed_book: float, searched: float, beta: float, retrievals: float = 1.0
) -> dict[str, float]:
    """The staged answer reward (Eqs. 10-11) expected on a known question by a policy that skips search and is right
    with probability `closed_book`, and by one that searches `retrievals` times and is right with probability
    `searched`, in each stage. Format and query rewards are the same for both (a well-formed turn, a concise query),
    so they cancel in the comparison."""

    def expect(right: float, rc: float, stage: int) -> float:
        return right * staged_answer_reward(True, rc, stage, beta) + (1 - right) * staged_answer_reward(
            False, rc, stage, beta
        )

    return {
        f"stage{stage}_{kind}": expect(right, rc, stage)
        for stage in (1, 2)
        for kind, right, rc in (("skip", closed_book, 0), ("search", searched, retrievals))
    }


def premise_checks(
    closed_book: float, searched: float, beta: float, retrievals: float = 1.0
) -> dict[str, Any]:
    """The staged claim's premise on known questions: skipping search must pay at least as much as searching in
    stage 1 (else RL removes skipping before stage 2 can reward it) and more in stage 2 (where the claim's cut comes
    from). A world where searching is right more often than memory fails it: there, searching is optimal and the
    reward is right to keep it."""
    e = expected_rewards(closed_book, searched, beta, retrievals)
    checks = [
        {
            "check": "stage 1: expected reward of skipping vs searching on known questions",
            "value": f"{e['stage1_skip']:+.3f} vs {e['stage1_search']:+.3f}",
            "needed": "skipping >= searching",
            "met": e["stage1_skip"] >= e["stage1_search"],
        },
        {
            "check": "stage 2: expected reward of skipping vs searching on known questions",
            "value": f"{e['stage2_skip']:+.3f} vs {e['stage2_search']:+.3f}",
            "needed": "skipping > searching",
            "met": e["stage2_skip"] > e["stage2_search"],
        },
    ]
    note = (
        f"Known (all-known) held-out questions: the injected model answers {100 * closed_book:.1f}% closed-book "
        f"(sampled as RL samples) and {100 * searched:.1f}% after {retrievals:g} search(es) (greedy naive RAG); "
        f"staged answer reward with beta "
        f"{beta:g}, format and query rewards equal for both."
    )
    return {
        "met": all(c["met"] for c in checks),
        "checks": checks,
        "expected": e,
        "note": note,
        "closed_book": closed_book,
        "searched": searched,
    }


def premise_as_trained(
    rows: dict[str, dict[str, Any]], closed_book: float, beta: float
) -> dict[str, Any] | None:
    """The premise again after the arms, with the trained staged policy's own accuracy where it searched a known
    question (its evaluation rows), against the same closed-book accuracy: the probe before the arms reads with the
    injected model, which a trained searcher can far outread, so a premise met there can fail here (2026-11-29: 31% by
    the probe, 92% by the trained policy, and the policy never skipped). None when it searched no known question."""
    searched = [r for r in rows.values() if _all_known(r) and _retrievals(r) >= 1]
    if not searched:
        return None
    accuracy = sum(metric("em")(r) for r in searched) / len(searched)
    retrievals = sum(_retrievals(r) for r in searched) / len(searched)
    checked = premise_checks(closed_book, accuracy, beta, retrievals)
    known = sum(1 for r in rows.values() if _all_known(r))
    checked["note"] = (
        f"After the arms, with the trained staged policy's own search: on {len(searched)} of {known} known held-out "
        f"questions it searched ({retrievals:.2f} times on average) and answered {100 * accuracy:.1f}% right; "
        f"closed-book {100 * closed_book:.1f}% as before the arms. Where searching beats skipping here, stage 1 "
        "rewards the search and skipping cannot be learned from this cold start."
    )
    return {**checked, "known": known, "searched_known": len(searched)}


def _staged_recipe(run: Any) -> dict[str, Any]:
    """The staged arm's recipe as it trains (its sampling temperature and reward's beta set the premise)."""
    return arm_recipe(run, ARMS[0], None, overrides=ARM_OVERRIDES[ARMS[0]])


def _known_test_questions(run: Any) -> list:
    return [
        q
        for q in boundary_questions(run.questions, "test", run.profile.test_questions)
        if q.metadata.get("knowledge") == ALL_KNOWN
    ]


def _search_probe(run: Any) -> dict[str, Any]:
    """The injected model answering all-known held-out questions from one search (naive RAG, top 3, greedy): the
    accuracy a known question gets by searching once. Greedy favours searching over the sampled closed-book side."""
    # deferred: the harness loads model and hub code; `sleuth --help` imports this module
    from sleuth.eval.harness import EvalConfig, EvalOutput, evaluate

    known = _known_test_questions(run)
    if not known:
        return {"n": 0, "em": None, "retrievals": 1}
    summary = evaluate(
        ["naive-rag"],
        known,
        run.world / "bm25",
        model=run.result("inject")["checkpoint"],
        config=EvalConfig(answer_max_new_tokens=24, top_k=3),
        out_dir=EvalOutput(run.out / "premise" / "search_probe"),
    )
    return {"n": len(known), "em": summary["methods"]["naive-rag"][ALL_KNOWN]["em"], "retrievals": 1}


def claim_table(first: dict[str, dict[str, Any]], second: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The staged claim's rows from two arms' predictions by question id: paired retrievals on all-known and on
    other questions, paired EM on all."""

    def mixed_or_unknown(record: dict[str, Any]) -> bool:
        return record.get("knowledge") in KNOWLEDGE_TYPES and not _all_known(record)

    rows = {
        "retrievals per question, all-known": paired_on(first, second, _retrievals, keep=_all_known),
        "retrievals per question, mixed / all-unknown": paired_on(
            first, second, _retrievals, keep=mixed_or_unknown
        ),
        "EM, all questions": paired_on(first, second, metric("em")),
    }
    return {"rows": rows, "questions": rows["EM, all questions"]["n"]}


class StagedClaim(ClaimSpec):
    def arms(self, profile: str) -> tuple[str, ...]:
        return ARMS

    def stages(self, profile: str) -> list[Stage]:
        plan = [
            Stage("world", lambda run: build_world(run.world, run.profile)),
            Stage(
                "inject",
                lambda run: inject_stage(run.world, run.out / "inject", run.profile, run.reuse, run.console),
            ),
        ]
        if self.profile(profile).label_by_model:
            plan.append(
                Stage(
                    QUESTIONS,
                    lambda run: label_by_model(
                        run.world,
                        run.result("inject")["checkpoint"],
                        run.out / QUESTIONS,
                        run.profile.pipeline.eval_batch_size,
                    ),
                    ("inject.checkpoint",),
                )
            )
        plan.append(premise_stage())
        for method in ARMS:
            plan += [
                Stage(
                    f"train_{method}",
                    lambda run, m=method: _train_arm(run, m),
                    ("inject.checkpoint",),
                    arms=(method,),
                    per_seed=True,
                ),
                Stage(
                    f"eval_{method}",
                    lambda run, m=method: evaluate(run, m, run.result(f"train_{m}")["checkpoint"], m),
                    (f"train_{method}.checkpoint",),
                    arms=(method,),
                    per_seed=True,
                ),
            ]
        return plan

    def premise(self, run: Any) -> dict[str, Any]:
        known = _known_test_questions(run)
        if not known:
            return {
                "met": False,
                "checks": [{"check": "all-known test questions", "value": 0, "needed": ">= 1", "met": False}],
                "note": "no held-out question is known to the model",
            }
        recipe = _staged_recipe(run)
        temperature = float(recipe.get("sampling", {}).get("temperature", 1.0))
        closed = sampled_closed_book(
            run.result("inject")["checkpoint"], known, run.profile.premise_samples, temperature, seed=run.seed
        )
        probe = _search_probe(run)
        beta = float(recipe["reward"]["options"]["beta"])
        return {
            **premise_checks(closed["em"], probe["em"], beta),
            "probe": probe,
            "closed_book_probe": closed,
        }

    def tests(self, profile: str) -> list[DecisiveTest]:
        margin = self.profile(profile).accuracy_margin
        return [
            DecisiveTest(
                "retrievals per question, all-known",
                "eval_staged",
                "eval_search_r1",
                _retrievals,
                "below",
                0.0,
                points=False,
                keep=_all_known,
            ),
            DecisiveTest(
                "EM, all questions", "eval_staged", "eval_search_r1", metric("em"), "above", -margin
            ),
        ]

    def table(self, run: Any) -> dict[str, Any]:
        first, second = (predictions(run, f"eval_{m}") for m in ARMS)
        margin = run.profile.accuracy_margin
        premise = run.results.get(PREMISE) or {}
        as_trained = None
        if premise.get("closed_book") is not None:
            beta = float(_staged_recipe(run)["reward"]["options"]["beta"])
            as_trained = premise_as_trained(first, premise["closed_book"], beta)
        return {
            **claim_table(first, second),
            "premise_as_trained": as_trained,
            "accuracy_margin": margin,
            "rule": "The claim holds when staged retrieves less than search_r1 on all-known questions (pooled "
            f"interval below 0) at an EM difference above -{100 * margin:.1f} points, each beyond the "
            "noise floor. EM in points; retrievals per question.",
        }


def _figure(run: Any, table: dict[str, Any]) -> str:
    return knowledge_table(
        run.result("inject")["boundary"], {m: run.result(f"eval_{m}").get("retrieval_boundary") for m in ARMS}
    )


CLAIM = register_claim(
    StagedClaim(
        text=ClaimText(
            "staged",
            "a retrieval-count-aware staged reward cuts over-retrieval while keeping accuracy",
            "synth --known-fraction: a share of facts known, questions all-known / mixed / all-unknown",
            "knowledge injection (closed-book SFT of the known facts), then oracle-trajectory SFT per arm",
            "staged reward vs search_r1 EM reward, same RL steps and seed",
            "the same held-out questions: retrievals per question (known / unknown) and EM, paired",
            "staged minus search_r1 retrievals on all-known questions: 95% interval below 0; EM difference: "
            "interval above -margin",
        ),
        profiles=PROFILES,
        columns=ARMS,
        figure_html=_figure,
    )
)
