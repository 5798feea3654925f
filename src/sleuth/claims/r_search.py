"""The r_search claim: evidence (the `<original_evidence>` block and its rewards) improves over answering without it
(the paper's ablation, Sec. 5.2 and Table 3: "w/o Evidence" removes the evidence from the rollout and its terms from
the evidence and format rewards).

A trained reader is the frozen evidence model (the paper's is a strong model; the base model scored exact evidence at
F1 0.07-0.29 on a GPU run). Three GRPO arms with the same steps and seed: r_search as published; the paper's ablation
(`agent.options.evidence_block=false`, no evidence reward, no evidence format term), with its own cold start from
oracle trajectories without the block; and the reward-term ablation alone (the block kept, `use_evidence_reward`
off), which shares r_search's cold start. Holds when r_search's F1 beats the paper's ablation (pooled over seeds,
beyond the noise floor); the reward-term ablation is reported beside it.
"""

from __future__ import annotations

from typing import Any

from sleuth.claims.base import ClaimSpec, ClaimText, DecisiveTest, Stage, predictions
from sleuth.claims.profiles import PLAIN_PROFILES
from sleuth.claims.registry import register_claim
from sleuth.claims.shared import world_and_reader
from sleuth.claims.stats import metric, paired_on
from sleuth.claims.steps import Arm, cold_start, evaluate, setting, train_rl

NO_BLOCK = (setting("agent.options.evidence_block", False),)
ARMS = (
    Arm("with_evidence", "r_search"),
    Arm("without_evidence", "r_search", (setting("reward.options.use_evidence_reward", False),)),
    Arm(
        "no_evidence_block",
        "r_search",
        (
            *NO_BLOCK,
            setting("reward.options.use_evidence_reward", False),
            setting("reward.options.use_evidence_format", False),
        ),
    ),
)
COLD_STARTS = {"no_evidence_block": "sft_no_evidence_block"}  # the other arms share sft_r_search
SHARED_SFT = "sft_r_search"


def _sft_of(arm: Arm) -> str:
    return COLD_STARTS.get(arm.name, SHARED_SFT)


def _train(run: Any, arm: Arm) -> dict[str, Any]:
    reader = setting("reward.generator", run.result("reader")["reader"])
    return train_rl(
        run, Arm(arm.name, arm.method, (*arm.overrides, reader)), run.result(_sft_of(arm))["sft_checkpoint"]
    )


DECISIVE_ROW = "F1 vs the paper's ablation (no evidence block)"


class RSearchClaim(ClaimSpec):
    def arms(self, profile: str) -> tuple[str, ...]:
        return tuple(arm.name for arm in ARMS)

    def stages(self, profile: str) -> list[Stage]:
        shared = tuple(arm.name for arm in ARMS if arm.name not in COLD_STARTS)
        plan = [
            *world_and_reader(),
            Stage(SHARED_SFT, lambda run: cold_start(run, "r_search", None), arms=shared, per_seed=True),
            # its own folder: an arm's RL run directory is its name's
            *(
                Stage(
                    sft,
                    lambda run, n=sft: cold_start(run, "r_search", None, NO_BLOCK, n),
                    arms=(name,),
                    per_seed=True,
                )
                for name, sft in COLD_STARTS.items()
            ),
        ]
        for arm in ARMS:
            plan += [
                Stage(
                    f"train_{arm.name}",
                    lambda run, a=arm: _train(run, a),
                    (f"{_sft_of(arm)}.sft_checkpoint", "reader.reader"),
                    arms=(arm.name,),
                    per_seed=True,
                ),
                Stage(
                    f"eval_{arm.name}",
                    lambda run, a=arm: evaluate(
                        run, a.method, run.result(f"train_{a.name}")["checkpoint"], a.name
                    ),
                    (f"train_{arm.name}.checkpoint",),
                    arms=(arm.name,),
                    per_seed=True,
                ),
            ]
        return plan

    def tests(self, profile: str) -> list[DecisiveTest]:
        return [
            DecisiveTest(
                DECISIVE_ROW, "eval_with_evidence", "eval_no_evidence_block", metric("f1"), "above", 0.0
            )
        ]

    def table(self, run: Any) -> dict[str, Any]:
        with_ev, without, no_block = (predictions(run, f"eval_{arm.name}") for arm in ARMS)
        rows = {
            DECISIVE_ROW: paired_on(with_ev, no_block, metric("f1")),
            "EM vs the paper's ablation (no evidence block)": paired_on(with_ev, no_block, metric("em")),
            "F1 vs the evidence reward term off (block kept)": paired_on(with_ev, without, metric("f1")),
            "EM vs the evidence reward term off (block kept)": paired_on(with_ev, without, metric("em")),
        }
        return {
            "rows": rows,
            "questions": rows[DECISIVE_ROW]["n"],
            "rule": "The claim holds when r_search's F1 minus the paper's ablation's (no evidence block, no "
            "evidence rewards) has a pooled 95% interval above 0 and exceeds the noise floor (the "
            "ablation at two seeds). F1 and EM in points.",
        }


CLAIM = register_claim(
    RSearchClaim(
        text=ClaimText(
            "r_search",
            "evidence (the block and its rewards) improves over answering without it (the paper's ablation)",
            "the synthetic world",
            "a trained reader (sleuth train-reader) as the frozen evidence model; "
            "oracle-trajectory SFT (r_search loop; without the evidence block for the ablation arm)",
            "r_search vs the paper's w/o Evidence (no block, no evidence rewards) vs the evidence reward term off, same "
            "steps and seeds",
            "held-out questions: F1 and EM of the agent's answer, paired",
            "r_search minus the paper's ablation: F1 interval above 0",
        ),
        profiles=PLAIN_PROFILES,
        columns=("with_evidence", "the other arm"),
    )
)
