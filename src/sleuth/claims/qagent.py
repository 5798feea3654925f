"""The qagent claim: stage 2 (rewarding a frozen generator's answer) transfers to other generators.

A reader is trained (`sleuth.claims.reader.train_reader`). Stage 1 is end to end (qagent_stage1 reward) for 2N steps;
stage 2 continues stage 1's checkpoint at step N for N steps with the frozen-reader reward (qagent_stage2, the trained
reader), so both arms have 2N RL steps. The other generator, the one stage 2 did not train with, is a reader trained
the same way on another world (other entities and facts, so it reads rather than remembers; the premise checks that
it reads this world's gold passages about as well as its own). The base model, which answers in sentences (1% strict
EM), stays as a further reader. Each arm's documents are read by all three; stage 1 is also scored on its own
answers. Holds when stage 2 beats stage 1 read by the other reader (pooled over seeds, in QAgent's non-strict EM).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sleuth.claims.base import ClaimSpec, ClaimText, DecisiveTest, Stage, predictions, premise_stage
from sleuth.claims.profiles import PLAIN_PROFILES
from sleuth.claims.reader import reader_check
from sleuth.claims.registry import register_claim
from sleuth.claims.reuse import reader_stage
from sleuth.claims.shared import world_and_reader
from sleuth.claims.stats import metric, own_answer_cover_em, paired_on
from sleuth.claims.steps import Arm, build_world, cold_start, evaluate, setting, train_rl

READERS = ("trained_reader", "other_reader", "base_reader")
OTHER_WORLD_SEED = 1  # the other reader's world: the same sizes, another seed
OTHER_READER = "other_reader"


def _half(run_or_profile: Any) -> int:
    """Stage 2 continues stage 1's checkpoint at this step."""
    profile = getattr(run_or_profile, "profile", run_or_profile)
    return max(1, profile.pipeline.train_steps // 2)


def _stage1(run: Any) -> dict[str, Any]:
    half = _half(run)
    arm = Arm(
        "stage1", "qagent", (setting("trainer.total_steps", 2 * half), setting("trainer.save_every", half))
    )
    return train_rl(run, arm, run.result("sft_qagent")["sft_checkpoint"])


def _stage2(run: Any) -> dict[str, Any]:
    half = _half(run)
    arm = Arm(
        "stage2",
        "qagent",
        (
            setting("reward.name", "qagent_stage2"),
            setting("reward.options.hit_weight", 0.5),
            setting("reward.generator", run.result("reader")["reader"]),
            setting("trainer.total_steps", half),
        ),
    )
    midway = str(Path(run.result("train_stage1")["run"]) / "checkpoints" / f"step_{half:06d}")
    return train_rl(run, arm, midway)


def _reader(run: Any, reader_name: str) -> str:
    if reader_name == OTHER_READER:
        return run.result(OTHER_READER)["reader"]
    return run.result("reader")["reader"] if reader_name == READERS[0] else run.profile.pipeline.model


def _template_em(check: dict[str, Any]) -> float:
    """A reader check's EM in QAgent's reader prompt (the first template where that one was not checked)."""
    return (check.get("qagent") or next(iter(check.values())))["em"]


def _other_reader(run: Any) -> dict[str, Any]:
    """A reader trained on another world (seed OTHER_WORLD_SEED), and its gold-passage EM on that world and on this
    one: a reader that learned to read, not the world, scores about the same on both."""
    folder = run.out / OTHER_READER
    world = folder / "world"
    if not (world / "test.jsonl").is_file():
        build_world(world, run.profile, seed=OTHER_WORLD_SEED)
    trained = reader_stage(world, folder, run.profile, None, run.console)
    here = reader_check(
        run.world, trained["reader"], folder / "check_here", "test", run.profile.test_questions
    )
    return {
        "reader": trained["reader"],
        "world_seed": OTHER_WORLD_SEED,
        "gold_passage_em_own_world": _template_em(trained["gold_passage_em"]),
        "gold_passage_em_this_world": _template_em(here),
    }


# QAgent's EM is non-strict (Sec. 4.1: the answer contains a gold answer; its stage-2 reward too). Strict EM and F1
# stay as rows beside it
OTHER_READER_ROW = "non-strict EM read by the other reader (trained on another world)"
GENERALISES = 0.8  # the other reader's gold-passage EM here, at least this share of its EM on its own world
READS = 0.25  # ... and at least this EM: a reader that reads


class QAgentClaim(ClaimSpec):
    def stages(self, profile: str) -> list[Stage]:
        half = _half(self.profile(profile))
        plan = [
            *world_and_reader(),
            Stage(OTHER_READER, _other_reader),
            premise_stage(),
            Stage("sft_qagent", lambda run: cold_start(run, "qagent", None), per_seed=True),
            Stage("train_stage1", _stage1, ("sft_qagent.sft_checkpoint",), per_seed=True),
            Stage(
                "train_stage2",
                _stage2,
                (f"train_stage1.run/checkpoints/step_{half:06d}", "reader.reader"),
                per_seed=True,
            ),
        ]
        for arm in ("stage2", "stage1"):
            for reader_name in READERS:
                name = f"{arm}_{reader_name}"
                loads = (
                    f"train_{arm}.checkpoint",
                    *{READERS[0]: ("reader.reader",), OTHER_READER: (f"{OTHER_READER}.reader",)}.get(
                        reader_name, ()
                    ),
                )
                plan.append(
                    Stage(
                        f"eval_{name}",
                        lambda run, a=arm, r=reader_name, n=name: evaluate(
                            run, "qagent", run.result(f"train_{a}")["checkpoint"], n, _reader(run, r)
                        ),
                        loads,
                        per_seed=True,
                    )
                )
        return plan

    def tests(self, profile: str) -> list[DecisiveTest]:
        return [
            DecisiveTest(
                OTHER_READER_ROW,
                "eval_stage2_other_reader",
                "eval_stage1_other_reader",
                metric("cover_em"),
                "above",
                0.0,
            )
        ]

    def premise(self, run: Any) -> dict[str, Any]:
        other = run.result(OTHER_READER)
        own, here = other["gold_passage_em_own_world"], other["gold_passage_em_this_world"]
        checks = [
            {
                "check": "the other reader's gold-passage EM here vs on its own world",
                "value": f"{here:.3f} vs {own:.3f}",
                "needed": f">= {GENERALISES:g} x its own",
                "met": here >= GENERALISES * own,
            },
            {
                "check": "the other reader's gold-passage EM here",
                "value": f"{here:.3f}",
                "needed": f">= {READS:g}",
                "met": here >= READS,
            },
        ]
        return {
            "met": all(c["met"] for c in checks),
            "checks": checks,
            "note": "The other reader was trained as the trained reader is, on a world of another seed: a reader "
            "stage 2 never trained with, strong enough to read, and one that reads rather than remembers.",
        }

    def table(self, run: Any) -> dict[str, Any]:
        preds = {
            (arm, r): predictions(run, f"eval_{arm}_{r}") for arm in ("stage2", "stage1") for r in READERS
        }
        s2_other, s1_other = preds["stage2", OTHER_READER], preds["stage1", OTHER_READER]
        s2_base, s1_base = preds["stage2", "base_reader"], preds["stage1", "base_reader"]
        s2_trained, s1_trained = preds["stage2", "trained_reader"], preds["stage1", "trained_reader"]
        base = run.profile.pipeline.model
        rows = {
            OTHER_READER_ROW: paired_on(s2_other, s1_other, metric("cover_em")),
            "F1 read by the other reader": paired_on(s2_other, s1_other, metric("f1")),
            "strict EM read by the other reader": paired_on(s2_other, s1_other, metric("em")),
            f"non-strict EM read by the base model ({base})": paired_on(s2_base, s1_base, metric("cover_em")),
            "EM (non-strict) read by stage 2's training reader (trained reader)": paired_on(
                s2_trained, s1_trained, metric("cover_em")
            ),
            "EM (non-strict) with the answerer each trained with (stage 2: trained reader; stage 1: its own answer)": paired_on(
                s2_trained, s1_trained, metric("cover_em"), own_answer_cover_em
            ),
        }
        first = next(iter(rows.values()))
        return {
            "rows": rows,
            "questions": first["n"],
            "rule": "The claim holds when stage 2 minus stage 1, both read by the other reader (trained on "
            "another world; stage 2 never trained with it), has a pooled 95% interval above 0 in non-strict "
            "EM (QAgent's EM: the answer contains a gold answer) that exceeds the noise floor (stage 1 at "
            "two seeds). EM and F1 in points.",
        }


CLAIM = register_claim(
    QAgentClaim(
        text=ClaimText(
            "qagent",
            "stage 2 (rewarding a frozen generator's answer) transfers to other generators",
            "the synthetic world",
            "a trained reader (sleuth train-reader); oracle-trajectory SFT (qagent loop)",
            "qagent stage 2 (frozen trained reader's EM + hit, continuing stage 1 at half its steps) vs stage 1 "
            "(end to end), the same total RL steps",
            "each arm's documents read by the trained reader (stage 2's), by the other reader (trained on another world) "
            "and by the base model; stage 1 also on its own answers; paired",
            "stage 2 minus stage 1, read by the other reader: non-strict EM (QAgent's) interval above 0",
        ),
        profiles=PLAIN_PROFILES,
        columns=("stage 2", "stage 1"),
    )
)
