"""`sleuth reproduce <claim>`: a registered claim's stages run in order, resumably, for one or more training seeds.

A claim (`sleuth.claims.base.ClaimSpec`, one module per paper) lists its stages; this module runs them:
- shared stages (the world, the trained reader, the injected model, the premise check) run once;
- per-seed stages (cold starts, GRPO arms, evaluations) run once per training seed. The run's first seed (claim.json's
  `seed`, `--seed`) keeps the plain names and folders (OUT/<arm>, stage train_<arm>); seed s after it writes
  OUT/seed<s>/<arm> and stage train_<arm>.seed<s>, so a run can grow from one seed to more in the same OUT;
- the premise check refuses to train arms whose comparison cannot test the claim, unless `--force`;
- `--arms` runs only the stages of those arms (several processes share one OUT); the run that finds every stage
  recorded writes the report.
The report pools the claim's decisive tests over seeds, with the noise floor (`sleuth.claims.stats`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sleuth.claims.base import PREMISE, ClaimRun, Stage, predictions, seeded_name
from sleuth.claims.profiles import ClaimProfile
from sleuth.claims.registry import get_claim
from sleuth.claims.report import write_report
from sleuth.claims.stages import (
    ArmSelection,
    ArmsPending,
    read_claim_file,
    read_stage,
    run_seeds,
    stage,
    write_claim_file,
)
from sleuth.claims.stats import (
    DOES_NOT_HOLD,
    HOLDS,
    NOT_SHOWN,
    claim_verdict,
    paired,
    paired_values,
    pooled_paired_bootstrap,
    verdict_of_test,
)
from sleuth.errors import ConfigError, SleuthError


class PremiseUnmet(SleuthError):
    """The premise check found that the arms' comparison cannot test the claim (`--force` trains them anyway)."""


def expanded(stages: Sequence[Stage], seeds: Sequence[int], base_seed: int) -> list[tuple[Stage, int, str]]:
    """(stage, seed, recorded name) in run order: shared stages once; per-seed stages for every seed, the first
    seed's in the claim's order, each later seed's after them (a lease that ends keeps whole seeds done)."""
    plan = [(s, base_seed, s.name) for s in stages]
    for seed in seeds:
        if seed != base_seed:
            plan += [(s, seed, seeded_name(s.name, seed, base_seed)) for s in stages if s.per_seed]
    return plan


def stage_plan(method: str, profile_name: str, seeds: Sequence[int] = (0,)) -> dict[str, tuple[str, ...]]:
    """A claim's stages in run order, each with what it loads from earlier stages' results ("stage.key" or
    "stage.key/sub/path", named as recorded for its seed): what a claim bundle carries for the stages still to run."""
    spec = get_claim(method)
    stages = spec.stages(profile_name)
    per_seed = {s.name for s in stages if s.per_seed}
    base = seeds[0]
    plan: dict[str, tuple[str, ...]] = {}
    for st, seed, name in expanded(stages, seeds, base):

        def rename(load: str, seed: int = seed) -> str:
            head, sep, rest = load.partition(".")
            return (seeded_name(head, seed, base) if head in per_seed else head) + sep + rest

        plan[name] = tuple(rename(load) for load in st.loads)
    return plan


def claim_arms(method: str, profile_name: str) -> tuple[str, ...]:
    """The names `--arms` takes: arms that train and evaluate independently; () if each needs the last (qagent)."""
    return get_claim(method).arms(profile_name)


def claim_profile(method: str, profile_name: str) -> ClaimProfile:
    """The sizes `method`'s claim runs at under `profile_name` (cpu or gpu)."""
    return get_claim(method).profile(profile_name)


@dataclass(frozen=True)
class RunPart:
    """The part of a claim run one process takes when several share OUT (the rest is left pending for the others;
    the one that finds every stage recorded writes the report): only these `arms` (`claim_arms`), and of the
    per-seed stages only training seed `seed`'s (each seed's arms are independent of the other seeds'). The
    shared stages (world, reader, premise) run in whichever process comes first, once."""

    arms: Sequence[str] | None = None
    seed: int | None = None


WHOLE = RunPart()


def reproduce(method: str, out: Path, profile: str, console: Any = None, part: RunPart = WHOLE,
              reuse: Path | None = None, seeds: range | None = None, force: bool = False) -> Path:  # fmt: skip
    """Run `method`'s claim in OUT, resuming; `part`: this process's share of a run split over processes; `reuse`: a
    folder whose reader/ or injected/ (trained on this world) replaces training one (`sleuth.claims.reuse`); `seeds`:
    the arms' training seeds, consecutive (default: OUT's, or range(profile.seeds) for a new OUT); `force`: train
    the arms though the premise is unmet."""
    arms, only_seed = part.arms, part.seed
    spec = get_claim(method)
    sizes = spec.profile(profile)
    if seeds is None:  # a run directory keeps its seeds; a new one takes the profile's
        seeds = run_seeds(out.resolve()) if read_claim_file(out.resolve()) is not None else range(sizes.seeds)
    if seeds.start < 0:
        raise ConfigError(f"--seed {seeds.start}: give a non-negative training seed (0, 1, ...)")
    if len(seeds) < 1 or seeds.step != 1:
        raise ConfigError(f"--seeds {len(seeds)}: give at least 1 training seed")
    seed, count = seeds.start, len(seeds)
    if only_seed is not None and only_seed not in seeds:
        raise ConfigError(
            f"--only-seed {only_seed}: this run's training seeds are {seeds.start}..{seeds.stop - 1}; "
            "give one of them, or more --seeds"
        )
    independent = spec.arms(profile)
    if arms is not None and not independent:
        raise ConfigError(
            f"--arms: the {method} claim's arms run one after another (stage 2 continues stage 1), "
            "so they cannot be split over runs; leave --arms out"
        )
    selection = ArmSelection(arms, independent, method)
    out = out.resolve()  # one spelling of OUT in every stage's paths, whatever the working directory
    write_claim_file(out, method, profile, seed, count)
    stages = spec.stages(profile)
    run = ClaimRun(
        out=out,
        spec=spec,
        profile_name=profile,
        profile=sizes,
        console=console,
        reuse=reuse,
        base_seed=seed,
        seed=seed,
        seeds=tuple(range(seed, seed + count)),
        per_seed=frozenset(s.name for s in stages if s.per_seed),
    )
    out.mkdir(parents=True, exist_ok=True)
    pending = []
    for st, at_seed, name in expanded(stages, run.seeds, seed):
        other_seed = only_seed is not None and st.per_seed and at_seed != only_seed
        if other_seed or (st.arms and not any(selection.runs(a) for a in st.arms)):
            recorded = read_stage(out, name)
            if recorded is None:
                pending.append(name)
            else:
                run.results[name] = recorded
            continue
        run.results[name] = stage(out, name, lambda st=st, s=at_seed: st.run(run.at(s)), console)
        if name == PREMISE and not run.results[name]["met"]:
            _refuse_or_force(run.results[name], force, run.profile.enforce_premise, console)
    if pending:
        raise ArmsPending(
            f"stages left to other runs: {', '.join(pending)}; the run that finds them done "
            f"(or one without --arms) writes the report"
        )
    table = spec.table(run)
    table["seeds"] = verdict_table(run)
    return write_report(run, table)


def _refuse_or_force(premise: dict[str, Any], force: bool, enforced: bool, console: Any) -> None:
    unmet = "; ".join(
        f"{c['check']}: {c['value']} (needed: {c['needed']})" for c in premise["checks"] if not c["met"]
    )
    if enforced and not force:
        raise PremiseUnmet(
            f"the claim's premise is not met, so its arms cannot test it: {unmet}. Fix the protocol "
            f"or rerun with --force to train the arms anyway (the report records the premise)"
        )
    if console is not None:
        why = "--force" if enforced else "this profile reports the premise without enforcing it"
        console.print(
            f"[yellow]premise not met ({unmet}); {why}: training the arms anyway[/]", highlight=False
        )


def verdict_table(run: ClaimRun) -> dict[str, Any]:
    """Each decisive test per seed, pooled over seeds, its noise floor (the baseline of the first two seeds against
    each other) and its verdict; then the claim's verdict (`sleuth.claims.stats`)."""
    tests = []
    for test in run.spec.tests(run.profile_name):
        per_seed, diffs = [], []
        baselines = {s: predictions(run.at(s), test.baseline) for s in run.seeds}
        for s in run.seeds:
            a, b = paired_values(
                predictions(run.at(s), test.treated), baselines[s], test.value, keep=test.keep
            )
            per_seed.append({"seed": s, **paired(a, b)})
            diffs.append([x - y for x, y in zip(a, b, strict=True)])
        if any(not d for d in diffs):
            raise ConfigError(
                f"test {test.row!r}: a seed has no question to compare; check the evaluation split"
            )
        diff, lo, hi = pooled_paired_bootstrap(diffs)
        floor = None
        if len(run.seeds) >= 2:
            first, second = run.seeds[:2]
            # the second seed's baseline minus the first's
            floor = {
                "seeds": [first, second],
                **paired(*paired_values(baselines[second], baselines[first], test.value, keep=test.keep)),
            }
        verdict, why = verdict_of_test(
            diff, (lo, hi), test.side, test.threshold, None if floor is None else floor["diff"]
        )
        tests.append(
            {
                "row": test.row,
                "treated": test.treated,
                "baseline": test.baseline,
                "side": test.side,
                "threshold": test.threshold,
                "points": test.points,
                "per_seed": per_seed,
                "pooled": {"seeds": len(run.seeds), "diff": diff, "ci": [lo, hi]},
                "floor": floor,
                "verdict": verdict,
                "why": why,
            }
        )
    verdict = claim_verdict([t["verdict"] for t in tests])
    premise_met = run.results.get(PREMISE, {"met": True})["met"]
    if not premise_met:  # the arms could not test the claim: what they measured is reported, not judged
        verdict = NOT_SHOWN
    return {
        "seeds": list(run.seeds),
        "tests": tests,
        "verdict": verdict,
        "holds": verdict == HOLDS,
        "fails": verdict == DOES_NOT_HOLD,
        "premise_met": premise_met,
    }
