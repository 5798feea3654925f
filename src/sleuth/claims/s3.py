"""The s3 claim: a searcher trained against a frozen generator needs far less data than end-to-end training.

The same trained reader is s3's reward generator and evaluation reader at every size; s3 and search_r1 each get one
SFT, then one GRPO run per number of RL training questions (`data.max_train_examples`, one pass: ceil(size /
prompts_per_step) steps). Holds when s3 at the smallest size is not below search_r1 at the largest (paired EM
interval above -margin).
"""

from __future__ import annotations

import math
from typing import Any

from sleuth.agent.registry import get_method
from sleuth.claims.base import ClaimSpec, ClaimText, DecisiveTest, Stage, predictions
from sleuth.claims.profiles import PLAIN_PROFILES
from sleuth.claims.registry import register_claim
from sleuth.claims.report import curve_figure
from sleuth.claims.shared import world_and_reader
from sleuth.claims.stats import metric, paired_on
from sleuth.claims.steps import Arm, cold_start, evaluate, setting, train_rl
from sleuth.eval.stats import bootstrap_ci

METHODS = ("s3", "search_r1")


def _reads_with_reader(method: str) -> bool:
    """A searcher that hands its documents to a reader trains and is evaluated with the trained reader."""
    return get_method(method).evaluated_by_reader


def _arm(run: Any, method: str, size: int) -> Arm:
    steps = math.ceil(size / run.profile.pipeline.prompts_per_step)
    reader = (setting("reward.generator", run.result("reader")["reader"]),) if _reads_with_reader(method) else ()
    return Arm(f"{method}_{size}", method, (*reader, setting("trainer.total_steps", steps),
                                            setting("data.max_train_examples", size)))


def _evaluate(run: Any, method: str, size: int) -> dict[str, Any]:
    reader = run.result("reader")["reader"] if _reads_with_reader(method) else None
    return evaluate(run, method, run.result(f"train_{method}_{size}")["checkpoint"], f"{method}_{size}", reader)


class S3Claim(ClaimSpec):
    def arms(self, profile: str) -> tuple[str, ...]:
        return tuple(f"{m}_{size}" for size in self.profile(profile).sizes for m in METHODS)

    def arm_cost(self, arm: str, profile: str) -> int:
        return int(arm.rsplit("_", 1)[1])  # RL questions: the largest sizes train longest

    def stages(self, profile: str) -> list[Stage]:
        sizes = self.profile(profile).sizes
        plan = world_and_reader()
        for method in METHODS:  # each cold start runs where one of its arms does: the two run side by side
            plan.append(Stage(f"sft_{method}", lambda run, m=method: cold_start(run, m, None),
                              arms=tuple(f"{method}_{size}" for size in sizes), per_seed=True))
        for size in sizes:
            for method in METHODS:
                reader = ("reader.reader",) if _reads_with_reader(method) else ()
                name = f"{method}_{size}"
                plan += [
                    Stage(f"train_{name}", lambda run, m=method, s=size: train_rl(
                        run, _arm(run, m, s), run.result(f"sft_{m}")["sft_checkpoint"]),
                          (f"sft_{method}.sft_checkpoint", *reader), arms=(name,), per_seed=True),
                    Stage(f"eval_{name}", lambda run, m=method, s=size: _evaluate(run, m, s),
                          (f"train_{name}.checkpoint", *reader), arms=(name,), per_seed=True),
                ]
        return plan

    def _ends(self, profile: str) -> tuple[int, int]:
        sizes = self.profile(profile).sizes
        return min(sizes), max(sizes)

    def tests(self, profile: str) -> list[DecisiveTest]:
        smallest, largest = self._ends(profile)
        return [DecisiveTest(f"EM: s3 on {smallest} questions vs search_r1 on {largest}", f"eval_s3_{smallest}",
                             f"eval_search_r1_{largest}", metric("em"), "above",
                             -self.profile(profile).accuracy_margin)]

    def table(self, run: Any) -> dict[str, Any]:
        sizes = run.profile.sizes
        preds = {(m, size): predictions(run, f"eval_{m}_{size}") for size in sizes for m in METHODS}
        curve: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
        for size in sizes:
            for method in METHODS:
                em = [metric("em")(r) for r in preds[method, size].values()]
                curve[method].append({"questions": size, "em": sum(em) / len(em), "em_ci": list(bootstrap_ci(em))})
        smallest, largest = self._ends(run.profile_name)
        claim_row = f"EM: s3 on {smallest} questions vs search_r1 on {largest}"
        rows = {claim_row: paired_on(preds["s3", smallest], preds["search_r1", largest], metric("em")),
                **{f"EM after RL on {size} training questions": paired_on(preds["s3", size], preds["search_r1", size],
                                                                         metric("em")) for size in sizes}}
        margin = run.profile.accuracy_margin
        return {"rows": rows, "questions": rows[claim_row]["n"], "accuracy_margin": margin, "curve": curve,
                "rule": f"The claim holds when s3 trained on {smallest} questions minus search_r1 trained on "
                        f"{largest} has a pooled 95% EM interval above -{100 * margin:.1f} points, beyond the noise "
                        "floor. EM in points; s3's documents are read by the trained reader at every size."}


CLAIM = register_claim(S3Claim(
    text=ClaimText(
        "s3", "a searcher trained against a frozen generator needs far less data than end-to-end training",
        "the synthetic world", "a trained reader (sleuth train-reader); oracle-trajectory SFT (s3 and search_r1 loops)",
        "s3 vs search_r1, one GRPO run per number of RL training questions (cpu: 2 / 4; gpu: 25 / 100 / 400 / "
        "1,600, a 64-fold range like the paper's 2.4k vs 170k)",
        "held-out EM against training questions; the same trained reader reads s3's documents at every size",
        "s3 at the smallest size minus search_r1 at the largest: EM interval above -margin"),
    profiles=PLAIN_PROFILES, columns=METHODS, figure_html=lambda run, table: curve_figure(table["curve"])))
