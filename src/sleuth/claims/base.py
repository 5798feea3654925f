"""What a claim is, written once: its texts, sizes, arms, stages, premise check, decisive tests and table.

A claim module (one per paper: `sleuth.claims.staged`, `.r_search`, `.qagent`, `.s3`) subclasses `ClaimSpec` and
registers an instance (`sleuth.claims.registry.register_claim`). Everything else reads the spec: the runner runs
`stages()` in order (`sleuth.claims.runner`), `--arms` picks stages by their `arm`, a rerun skips recorded stages,
a claim bundle carries what `Stage.loads` names (`bench/claim_bundle.py`), and the report pools `tests()` over seeds
(`sleuth.claims.stats`). A fifth claim is one module and one registration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sleuth.appendlog import read_appended
from sleuth.claims.profiles import ClaimProfile
from sleuth.errors import ConfigError


@dataclass(frozen=True)
class ClaimText:
    """The claim as the report and `--help` state it."""

    method: str
    claim: str
    world: str
    cold_start: str
    arms: str
    evaluation: str
    test: str


def seeded_name(name: str, seed: int, base_seed: int) -> str:
    """A per-seed stage's recorded name: plain for the run's first seed, NAME.seed<s> for the others."""
    return name if seed == base_seed else f"{name}.seed{seed}"


@dataclass
class ClaimRun:
    """One claim run as its stages see it: where it writes, its sizes, and the results of the stages run so far.
    `at(seed)` is the same run seen from another training seed (its own folders and per-seed results)."""

    out: Path
    spec: ClaimSpec
    profile_name: str
    profile: ClaimProfile
    console: Any = None
    reuse: Path | None = None
    base_seed: int = 0
    seed: int = 0
    seeds: tuple[int, ...] = (0,)
    per_seed: frozenset[str] = frozenset()
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    # predictions files read so far, by path: the table, the verdict and the figures read the same evaluations
    # (shared by every `at(seed)` view)
    read_predictions: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict, repr=False)

    @property
    def world(self) -> Path:
        """The claim's world: corpus, index and the world's own question splits."""
        return self.out / "world"

    @property
    def questions(self) -> Path:
        """Where the arms' train.jsonl and test.jsonl come from: a stage named QUESTIONS that relabelled them (the
        staged claim labels knowledge by the injected model's answers), else the world's."""
        relabelled = self.results.get(QUESTIONS)
        return Path(relabelled["questions"]) if relabelled else self.world

    @property
    def root(self) -> Path:
        """Where this seed's arms and evaluations live: OUT for the first seed, OUT/seed<s> for the others."""
        return self.out if self.seed == self.base_seed else self.out / f"seed{self.seed}"

    def name(self, stage_name: str) -> str:
        return (
            seeded_name(stage_name, self.seed, self.base_seed) if stage_name in self.per_seed else stage_name
        )

    def result(self, stage_name: str) -> dict[str, Any]:
        return self.results[self.name(stage_name)]

    def at(self, seed: int) -> ClaimRun:
        return replace(self, seed=seed)


@dataclass(frozen=True)
class Stage:
    """One resumable step of a claim: its record is OUT/stages/<name>.json (`sleuth.claims.stages`)."""

    name: str
    run: Callable[[ClaimRun], dict[str, Any]]
    # what it loads from earlier stages' results: "stage.key" (a path in that result) or "stage.key/sub/path";
    # a claim bundle carries exactly these for the stages still to run
    loads: tuple[str, ...] = ()
    arms: tuple[str, ...] = ()  # the `--arms` names whose runs run it; (): shared by every arm
    per_seed: bool = False  # run again for every training seed (cold starts, RL, evaluations); else run once


PREMISE = "premise"
QUESTIONS = "labels"  # a stage whose result names another folder of question splits (ClaimRun.questions)


def premise_stage() -> Stage:
    """The claim's premise check as a shared stage: after the shared models, before any arm trains."""
    return Stage(PREMISE, lambda run: run.spec.premise(run))


def predictions(run: ClaimRun, eval_stage: str) -> dict[str, dict[str, Any]]:
    """The per-question records an evaluation stage wrote, by question id (of the run's current seed); read once."""
    path = run.result(eval_stage)["predictions"]
    if path not in run.read_predictions:
        run.read_predictions[path] = {r["id"]: r for r in read_appended(path).records}
    return run.read_predictions[path]


@dataclass(frozen=True)
class DecisiveTest:
    """One paired comparison a verdict rests on: `treated` minus `baseline` (evaluation stages, paired by
    question), of `value` over the questions `keep` admits, claimed to lie on `side` of `threshold`.
    The noise floor of a test is the same measure between the baseline arm of two seeds."""

    row: str
    treated: str  # an evaluation stage's name (its per-seed copy is taken for each seed)
    baseline: str
    value: Callable[[dict[str, Any]], float]
    side: str  # "above" or "below"
    threshold: float = 0.0
    points: bool = True  # a share shown in points (x100); else a count shown as it is
    keep: Callable[[dict[str, Any]], bool] | None = None

    def __post_init__(self) -> None:
        if self.side not in ("above", "below"):
            raise ValueError(f"DecisiveTest {self.row!r}: side must be 'above' or 'below', got {self.side!r}")


@dataclass
class ClaimSpec:
    """A paper's claim; subclasses fill in the methods below."""

    text: ClaimText
    profiles: dict[str, ClaimProfile]
    columns: tuple[str, str]  # the two compared arms as the claim table heads them
    # HTML shown after the claim tables (a figure, a per-type table), from the run and its table
    figure_html: Callable[[ClaimRun, dict[str, Any]], str] = field(default=lambda run, table: "")

    @property
    def method(self) -> str:
        return self.text.method

    def profile(self, name: str) -> ClaimProfile:
        if name not in self.profiles:
            raise ConfigError(f"--profile must be {' or '.join(self.profiles)}, got {name!r}")
        return self.profiles[name]

    def arms(self, profile: str) -> tuple[str, ...]:
        """The names `--arms` takes: arms that train and evaluate independently; () when each needs the last."""
        return ()

    def arm_cost(self, arm: str, profile: str) -> int:
        """An arm's GRPO rollouts (steps x prompts x samples), its cost relative to other claims' arms too: a GPU
        plan starts the costliest first."""
        pipeline = self.profile(profile).pipeline
        return self.arm_steps(arm, profile) * pipeline.prompts_per_step * pipeline.n

    def arm_steps(self, arm: str, profile: str) -> int:
        """An arm's GRPO steps; the default: the profile's, the same for every arm."""
        return self.profile(profile).pipeline.train_steps

    def stages(self, profile: str) -> list[Stage]:
        raise NotImplementedError

    def premise(self, run: ClaimRun) -> dict[str, Any]:
        """The claim's premise, checked before any arm trains: {"met": bool, "checks": [{"check", "value",
        "needed", "met"}], "note"}. The default: nothing to check."""
        return {"met": True, "checks": [], "note": "this claim states no premise to check before its arms"}

    def tests(self, profile: str) -> list[DecisiveTest]:
        raise NotImplementedError

    def table(self, run: ClaimRun) -> dict[str, Any]:
        """The descriptive rows of the run's first seed ({"rows", "questions", "rule", ...})."""
        raise NotImplementedError
