"""The r_search claim: the evidence reward improves over an answer-only reward (the paper's ablation).

A trained reader is the frozen evidence model (the paper's is a strong model; the base model scored exact evidence at
F1 0.07-0.29 on a GPU run); one oracle-trajectory SFT, then GRPO arms with the same steps and seed, the reward with
and without its evidence term (`use_evidence_reward`); holds when with-evidence F1 is higher (paired).
"""

from __future__ import annotations

from typing import Any

from sleuth.claims.base import ClaimSpec, ClaimText, DecisiveTest, Stage, predictions
from sleuth.claims.profiles import PLAIN_PROFILES
from sleuth.claims.registry import register_claim
from sleuth.claims.shared import world_and_reader
from sleuth.claims.stats import metric, paired_on
from sleuth.claims.steps import Arm, cold_start, evaluate, setting, train_rl

ARMS = (Arm("with_evidence", "r_search"),
        Arm("without_evidence", "r_search", (setting("reward.options.use_evidence_reward", False),)))


def _train(run: Any, arm: Arm) -> dict[str, Any]:
    reader = setting("reward.generator", run.result("reader")["reader"])
    return train_rl(run, Arm(arm.name, arm.method, (*arm.overrides, reader)),
                    run.result("sft_r_search")["sft_checkpoint"])


class RSearchClaim(ClaimSpec):
    def arms(self, profile: str) -> tuple[str, ...]:
        return tuple(arm.name for arm in ARMS)

    def stages(self, profile: str) -> list[Stage]:
        plan = [*world_and_reader(),
                Stage("sft_r_search", lambda run: cold_start(run, "r_search", None), per_seed=True)]
        for arm in ARMS:
            plan += [
                Stage(f"train_{arm.name}", lambda run, a=arm: _train(run, a),
                      ("sft_r_search.sft_checkpoint", "reader.reader"), arms=(arm.name,), per_seed=True),
                Stage(f"eval_{arm.name}", lambda run, a=arm: evaluate(
                    run, a.method, run.result(f"train_{a.name}")["checkpoint"], a.name),
                      (f"train_{arm.name}.checkpoint",), arms=(arm.name,), per_seed=True),
            ]
        return plan

    def tests(self, profile: str) -> list[DecisiveTest]:
        return [DecisiveTest("F1, all questions", "eval_with_evidence", "eval_without_evidence", metric("f1"),
                             "above", 0.0)]

    def table(self, run: Any) -> dict[str, Any]:
        with_ev, without = (predictions(run, f"eval_{arm.name}") for arm in ARMS)
        rows = {"F1, all questions": paired_on(with_ev, without, metric("f1")),
                "EM, all questions": paired_on(with_ev, without, metric("em"))}
        return {"rows": rows, "questions": rows["F1, all questions"]["n"],
                "rule": "The claim holds when the with-evidence arm's F1 minus the without-evidence arm's has a "
                        "pooled 95% interval above 0 and exceeds the noise floor. F1 and EM in points."}


CLAIM = register_claim(RSearchClaim(
    text=ClaimText(
        "r_search", "the evidence reward improves over an answer-only reward (the paper's ablation)",
        "the synthetic world", "a trained reader (sleuth train-reader) as the frozen evidence model; "
        "oracle-trajectory SFT (r_search loop), shared by both arms",
        "r_search reward with vs without the evidence term, same steps and seeds",
        "held-out questions: F1 and EM of the agent's answer, paired",
        "with-evidence minus without: F1 interval above 0"),
    profiles=PLAIN_PROFILES, columns=tuple(arm.name for arm in ARMS)))
