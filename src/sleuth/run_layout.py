"""The layout of a run directory and of a searcher checkpoint: every file name, written once.

    runs/<name>/
      run.json                      recipe, model path, device (RUN_INFO)
      metrics.jsonl                 one line per step (METRICS)
      validation.jsonl              one line per validation on data.dev (VALIDATION)
      validation/step_000010.jsonl  that validation's question-by-question results (validation_records)
      guards.jsonl                  one line per guard event: step, guard, numbers, what was done (GUARDS)
      sft/                          a cold-start SFT run, laid out the same way (SFT_DIR), sft.json for run.json
      checkpoints/latest            name of the newest complete checkpoint (LATEST)
      checkpoints/step_000012/      one checkpoint (checkpoint_dir):
        policy/                     weights or LoRA adapters + tokenizer (POLICY_DIR)
        critic.pt, state.pt         critic; optimizer, scheduler and RNG states
        trainer_state.json          step, data cursor, stage
        searcher.json               what serving and evaluation need (SearcherInfo)
        manifest.json               size and sha256 of every file, written last

An export (`sleuth export`) is a Hugging Face model directory that also holds `searcher.json`
(with `policy_dir: "."`). This module needs no torch, so the agent floor can read checkpoints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sleuth.errors import ConfigError, DataFormatError

RUN_INFO = "run.json"
SFT_INFO = "sft.json"  # an SFT run's summary: records, steps, final checkpoint, recipe (its run.json)
METRICS = "metrics.jsonl"
VALIDATION = "validation.jsonl"
VALIDATION_DIR = "validation"
GUARDS = "guards.jsonl"
SFT_DIR = "sft"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
TRAINING_STATE = "state.pt"
CRITIC = "critic.pt"
POLICY_DIR = "policy"
SEARCHER_FILE = "searcher.json"


# metrics.jsonl keys of the step's reward: over the groups kept for the update, and over every rollout
REWARD_KEPT = "reward/mean"
REWARD_EVERY_ROLLOUT = "reward/mean_before_filter"


def policy_reward(row: dict[str, Any]) -> float:
    """The step's mean reward over every rollout: how the policy did. With DAPO's dynamic sampling the
    kept groups' mean (what the update trains on) drifts towards the middle of the reward range as
    more groups become all-correct, so alone it would hide learning. Older metrics hold only the latter."""
    return row.get(REWARD_EVERY_ROLLOUT, row[REWARD_KEPT])


def groups_filtered(row: dict[str, Any]) -> bool:
    """Whether dynamic sampling dropped groups at this step (the two means differ)."""
    every, kept = row.get(REWARD_EVERY_ROLLOUT), row.get(REWARD_KEPT)
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (every, kept))
    return numbers and abs(every - kept) > 1e-9


def validation_records(run_dir: str | Path, step: int) -> Path:
    """Per-question results of the validation after `step` updates (0: before training)."""
    return Path(run_dir) / VALIDATION_DIR / f"step_{step:06d}.jsonl"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step_{step:06d}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run (the `latest` pointer's, else the newest with a trainer state)."""
    root = checkpoints_dir(run_dir)
    pointer = root / LATEST
    if pointer.exists():
        path = root / pointer.read_text().strip()
        if (path / TRAINER_STATE).exists():
            return path
    # The pointer is written after the rename; fall back to the newest complete directory.
    done = sorted(p for p in root.glob("step_*") if (p / TRAINER_STATE).exists())
    return done[-1] if done else None


def is_searcher_checkpoint(path: str | Path) -> bool:
    """A checkpoint or export (holding searcher.json), or a run directory with such a checkpoint."""
    path = Path(path)
    if (path / SEARCHER_FILE).exists():
        return True
    root = checkpoints_dir(path)
    return root.is_dir() and any(root.glob(f"step_*/{SEARCHER_FILE}"))


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint dir, or a run dir (its newest checkpoint)."""
    path = Path(path)
    if (path / SEARCHER_FILE).exists():
        return path
    ckpt = latest_checkpoint(path) if path.is_dir() else None
    if ckpt is None or not (ckpt / SEARCHER_FILE).exists():
        raise ConfigError(
            f"{path}: not a sleuth checkpoint (no {SEARCHER_FILE}) nor a run directory with checkpoints; "
            "pass runs/<name>/checkpoints/step_N or runs/<name>"
        )
    return ckpt


@dataclass
class SearcherInfo:
    """searcher.json: how to rebuild and run the searcher a checkpoint or export holds."""

    loop: str
    loop_options: dict[str, Any] = field(default_factory=dict)
    base_model: str | None = None
    lora: bool = False
    recipe: str | None = None
    max_new_tokens_per_turn: int | None = None
    max_obs_tokens: int | None = None
    max_response_tokens: int | None = None
    step: int | None = None
    policy_dir: str = POLICY_DIR  # relative to the checkpoint; "." for an export
    # modules registering the method's loop / reward outside sleuth: loaded again to evaluate or serve it
    plugins: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # provenance: trained_with, exported_from, dtype ...

    def to_json(self) -> dict[str, Any]:
        out = {
            "recipe": self.recipe,
            "loop": self.loop,
            "loop_options": self.loop_options,
            "base_model": self.base_model,
            "lora": self.lora,
            "max_new_tokens_per_turn": self.max_new_tokens_per_turn,
            "max_obs_tokens": self.max_obs_tokens,
            "max_response_tokens": self.max_response_tokens,
        }
        if self.policy_dir != POLICY_DIR:
            out["policy_dir"] = self.policy_dir
        if self.plugins:
            out["plugins"] = list(self.plugins)
        out.update(self.extra)
        if self.step is not None:
            out["step"] = self.step
        return out

    @classmethod
    def from_json(cls, data: Any, source: str | Path) -> SearcherInfo:
        if not isinstance(data, dict) or not isinstance(data.get("loop"), str):
            raise DataFormatError(str(source), None, "expected a JSON object with a string 'loop'")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        kwargs = {k: v for k, v in data.items() if k in known}
        return cls(**kwargs, extra={k: v for k, v in data.items() if k not in known})

    @classmethod
    def read(cls, ckpt: str | Path) -> SearcherInfo:
        path = Path(ckpt) / SEARCHER_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise DataFormatError(str(path), None, f"unreadable searcher info ({err})") from None
        return cls.from_json(data, path)

    def write(self, ckpt: str | Path) -> None:
        (Path(ckpt) / SEARCHER_FILE).write_text(json.dumps(self.to_json(), indent=2) + "\n")
