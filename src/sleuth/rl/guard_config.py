"""The recipe's `trainer.guards`: conditions over the health metrics or validation, each with an action.

    trainer:
      guards:
        - {name: entropy_collapse, kind: below, metric: actor/entropy, value: 0.02, steps: 5, action: rollback,
           lr_factor: 0.5, max_rollbacks: 2}
        - {name: stopped_searching, kind: above, metric: health/no_search, value: 0.9, steps: 5}
        - {name: reward_collapse, kind: drop, window: 5, by_noise: 4.0}
        - {name: validation_drop, kind: validation_drop}
        - {name: nonfinite, kind: count, metric: health/nonfinite_skips, value: 5, steps: 10, action: stop}

Kinds: `below` / `above` (the metric past `value` for `steps` consecutive steps), `drop` (the mean of the last
`window` steps' reward below the best `window`-step mean of the same reward stage, by more than `by` or
`by_noise` step-to-step noise units), `validation_drop` (a validation below the best earlier one of the same
stage, the paired 95% bootstrap interval over questions entirely below `-margin`), `count` (the metric summed
over the last `steps` steps reaches `value`). Actions: `warn`, `stop`, `rollback`. `trainer.guards: []` turns
them off; the defaults are `default_guards()`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

REWARD_METRIC = "reward/mean_before_filter"


class _GuardBase(BaseModel):
    # finite numbers only: a NaN threshold compares false with every value, so its guard never fires
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(min_length=1)
    action: Literal["warn", "stop", "rollback"] = "warn"
    # rollback: the learning rate is multiplied by this at each rollback (1.0 keeps it)
    lr_factor: float = Field(0.5, gt=0.0, le=1.0)
    max_rollbacks: int = Field(2, ge=0)  # past it, a rollback guard stops the run instead
    after_step: int = Field(0, ge=0)  # the guard looks only at steps after this one (a warm-up)


class ThresholdGuard(_GuardBase):
    kind: Literal["below", "above"]
    metric: str
    value: float
    steps: int = Field(1, ge=1)  # consecutive steps


class DropGuard(_GuardBase):
    kind: Literal["drop"]
    metric: str = REWARD_METRIC
    window: int = Field(5, ge=1)
    by: float | None = Field(None, gt=0.0)  # in the metric's units
    by_noise: float | None = Field(None, gt=0.0)  # in step-to-step noise units (median |change| / 0.954)

    @model_validator(mode="after")
    def _one_size(self) -> DropGuard:
        if (self.by is None) == (self.by_noise is None):
            raise ValueError(f"guard {self.name!r}: set exactly one of `by` (metric units) or `by_noise`")
        return self


class ValidationGuard(_GuardBase):
    kind: Literal["validation_drop"]
    margin: float = Field(0.0, ge=0.0)  # the interval's upper end must be below -margin
    resamples: int = Field(2000, ge=100)


class CountGuard(_GuardBase):
    kind: Literal["count"]
    metric: str
    value: float = Field(gt=0.0)
    steps: int = Field(10, ge=1)  # window summed over


GuardConfig = Annotated[
    ThresholdGuard | DropGuard | ValidationGuard | CountGuard, Field(discriminator="kind")
]


def default_guards() -> list[GuardConfig]:
    """Warnings for the collapses users report (entropy, searching stops, reward falls, malformed actions,
    validation falls, rollouts decoding other weights than the trainer's) and a stop for a run whose updates keep being skipped; thresholds checked against the
    committed learning runs (tests/test_rl_guards.py: no alarm there, an alarm on a collapse)."""
    return [
        ThresholdGuard(name="entropy_collapse", kind="below", metric="actor/entropy", value=0.02, steps=5),
        ThresholdGuard(
            name="stopped_searching", kind="above", metric="health/no_search", value=0.95, steps=5
        ),
        ThresholdGuard(
            name="invalid_actions", kind="above", metric="health/invalid_action", value=0.5, steps=5
        ),
        DropGuard(name="reward_collapse", kind="drop", window=5, by_noise=4.0),
        ValidationGuard(name="validation_drop", kind="validation_drop"),
        # rollouts that did not decode with the trainer's weights (e.g. LoRA adapters never merged into the
        # rollout copy): healthy runs stay near 1e-2 (bf16 decoding) or far below (float32), sleuth.rl.agreement
        ThresholdGuard(
            name="rollout_mismatch", kind="above", metric="rollout/logprob_diff_mean", value=0.1, steps=3
        ),
        CountGuard(
            name="nonfinite_updates",
            kind="count",
            metric="health/nonfinite_skips",
            value=5,
            steps=10,
            action="stop",
        ),
    ]
