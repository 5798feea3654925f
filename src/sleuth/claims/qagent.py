"""The qagent claim: stage 2 (rewarding a frozen generator's answer) transfers to other generators.

A reader is trained (`sleuth.claims.reader.train_reader`). Stage 1 is end to end (qagent_stage1 reward) for 2N steps;
stage 2 continues stage 1's checkpoint at step N for N steps with the frozen-reader reward (qagent_stage2, the trained
reader), so both arms have 2N RL steps. Each arm's documents are read by the trained reader and by the base model
(the other reader); stage 1 is also scored on its own answers. Holds when stage 2 beats stage 1 with the reader it
did not train with (paired, in QAgent's non-strict EM).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sleuth.claims.base import ClaimSpec, ClaimText, DecisiveTest, Stage, predictions
from sleuth.claims.profiles import PLAIN_PROFILES
from sleuth.claims.registry import register_claim
from sleuth.claims.shared import world_and_reader
from sleuth.claims.stats import metric, own_answer_cover_em, paired_on
from sleuth.claims.steps import Arm, cold_start, evaluate, setting, train_rl

READERS = ("trained_reader", "base_reader")


def _half(run_or_profile: Any) -> int:
    """Stage 2 continues stage 1's checkpoint at this step."""
    profile = getattr(run_or_profile, "profile", run_or_profile)
    return max(1, profile.pipeline.train_steps // 2)


def _stage1(run: Any) -> dict[str, Any]:
    half = _half(run)
    arm = Arm("stage1", "qagent", (setting("trainer.total_steps", 2 * half), setting("trainer.save_every", half)))
    return train_rl(run, arm, run.result("sft_qagent")["sft_checkpoint"])


def _stage2(run: Any) -> dict[str, Any]:
    half = _half(run)
    arm = Arm("stage2", "qagent", (setting("reward.name", "qagent_stage2"), setting("reward.options.hit_weight", 0.5),
                                   setting("reward.generator", run.result("reader")["reader"]),
                                   setting("trainer.total_steps", half)))
    midway = str(Path(run.result("train_stage1")["run"]) / "checkpoints" / f"step_{half:06d}")
    return train_rl(run, arm, midway)


def _reader(run: Any, reader_name: str) -> str:
    return run.result("reader")["reader"] if reader_name == READERS[0] else run.profile.pipeline.model


# QAgent's EM is non-strict (Sec. 4.1: the answer contains a gold answer; its stage-2 reward too): the base model
# answers in sentences, strict EM ~1% whatever the searcher. Strict EM and F1 stay as rows beside it
OTHER_READER_ROW = "non-strict EM read by the other reader (the base model)"


class QAgentClaim(ClaimSpec):
    def stages(self, profile: str) -> list[Stage]:
        half = _half(self.profile(profile))
        plan = [*world_and_reader(),
                Stage("sft_qagent", lambda run: cold_start(run, "qagent", None), per_seed=True),
                Stage("train_stage1", _stage1, ("sft_qagent.sft_checkpoint",), per_seed=True),
                Stage("train_stage2", _stage2, (f"train_stage1.run/checkpoints/step_{half:06d}", "reader.reader"),
                      per_seed=True)]
        for arm in ("stage2", "stage1"):
            for reader_name in READERS:
                name = f"{arm}_{reader_name}"
                loads = (f"train_{arm}.checkpoint", *(("reader.reader",) if reader_name == READERS[0] else ()))
                plan.append(Stage(f"eval_{name}", lambda run, a=arm, r=reader_name, n=name: evaluate(
                    run, "qagent", run.result(f"train_{a}")["checkpoint"], n, _reader(run, r)), loads,
                                  per_seed=True))
        return plan

    def tests(self, profile: str) -> list[DecisiveTest]:
        return [DecisiveTest(OTHER_READER_ROW, "eval_stage2_base_reader", "eval_stage1_base_reader",
                             metric("cover_em"), "above", 0.0)]

    def table(self, run: Any) -> dict[str, Any]:
        preds = {(arm, r): predictions(run, f"eval_{arm}_{r}") for arm in ("stage2", "stage1") for r in READERS}
        s2_base, s1_base = preds["stage2", "base_reader"], preds["stage1", "base_reader"]
        s2_trained, s1_trained = preds["stage2", "trained_reader"], preds["stage1", "trained_reader"]
        base = run.profile.pipeline.model
        rows = {
            f"non-strict EM read by the other reader ({base}, the base model)": paired_on(
                s2_base, s1_base, metric("cover_em")),
            "F1 read by the other reader": paired_on(s2_base, s1_base, metric("f1")),
            "strict EM read by the other reader": paired_on(s2_base, s1_base, metric("em")),
            "EM (non-strict) read by stage 2's training reader (trained reader)": paired_on(
                s2_trained, s1_trained, metric("cover_em")),
            "EM (non-strict) with the answerer each trained with (stage 2: trained reader; stage 1: its own answer)":
                paired_on(s2_trained, s1_trained, metric("cover_em"), own_answer_cover_em),
        }
        first = next(iter(rows.values()))
        return {"rows": rows, "questions": first["n"],
                "rule": "The claim holds when stage 2 minus stage 1, both read by the reader stage 2 did not train "
                        "with, has a pooled 95% interval above 0 in non-strict EM (QAgent's EM: the answer contains "
                        "a gold answer) that exceeds the noise floor. EM and F1 in points."}


CLAIM = register_claim(QAgentClaim(
    text=ClaimText(
        "qagent", "stage 2 (rewarding a frozen generator's answer) transfers to other generators",
        "the synthetic world", "a trained reader (sleuth train-reader); oracle-trajectory SFT (qagent loop)",
        "qagent stage 2 (frozen trained reader's EM + hit, continuing stage 1 at half its steps) vs stage 1 "
        "(end to end), the same total RL steps",
        "each arm's documents read by the trained reader (stage 2's) and by the base model (the other reader); "
        "stage 1 also on its own answers; paired",
        "stage 2 minus stage 1, read by the other reader: non-strict EM (QAgent's) interval above 0"),
    profiles=PLAIN_PROFILES, columns=("stage 2", "stage 1")))
