"""`sleuth reproduce <method>`: each paper's own claim, end to end, with paired 95% intervals.

A claim is described by its world, its cold start, the arms it compares, the evaluation and the
test that decides it (`CLAIMS`). All four run end to end; each reuses the same pieces: the world
(`build_world`), the demo's recipe for an arm (`arm_recipe`), the oracle-trajectory SFT cold start per
method (`_cold_start`), GRPO for an arm (`_train_rl`), the evaluation of an arm on the same held-out
questions (`_evaluate`), paired bootstrap rows (`_paired_on`) and the report (`write_report`).

staged ("learning when to search"): on a knowledge-boundary world (`synth --known-fraction`) the base
model is taught the known facts (`sleuth.knowledge.inject_knowledge`); each arm gets an oracle-trajectory
SFT cold start from the injected model, then the same number of GRPO steps with the same seed, one with
the staged reward and one with search_r1's EM reward; both are evaluated on the same held-out questions.
The claim holds when staged retrieves less on all-known questions (paired difference, 95% interval
entirely below 0) at an accuracy not lower (the paired EM difference's interval lies above -margin).

r_search: a trained reader is the frozen evidence model (the paper's is a strong model; the base model scored exact
evidence at F1 0.07-0.29 on a GPU run); one oracle-trajectory SFT, then GRPO arms with the same steps and seed, the
reward with and without its evidence term (`use_evidence_reward`); holds when with-evidence F1 is higher (paired).

qagent: a reader is trained (`sleuth.reader.train_reader`). Stage 1 is end to end (qagent_stage1 reward)
for 2N steps; stage 2 continues stage 1's checkpoint at step N for N steps with the frozen-reader reward
(qagent_stage2, the trained reader), so both arms have 2N RL steps. Each arm's documents are read by the
trained reader and by the base model (the other reader); stage 1 is also scored on its own answers. Holds
when stage 2 beats stage 1 with the reader it did not train with (paired interval above 0, in QAgent's non-strict EM).

s3: the same trained reader is s3's reward generator and evaluation reader at every size; s3 and search_r1
each get one SFT, then one GRPO run per number of RL training questions (`data.max_train_examples`, one
pass: ceil(size / prompts_per_step) steps). Holds when s3 at the smallest size is not below search_r1 at
the largest (paired EM interval above -margin).

Every stage writes a marker under OUT/stages/ when it finishes; a rerun skips finished stages, and runs given
disjoint `--arms` share one OUT (`sleuth.claim_stages`). `stage_plan` lists each claim's stages and what they
load, so `sleuth.claim_bundle` can carry a part-done run to another machine. `--seed N` sets the arms' training
seed (cold-start SFT, RL); OUT/claim.json records it and refuses another. The world, reader and injected model
stay seed 0's, so every seed's arms start from the same ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sleuth.appendlog import read_appended
from sleuth.claim_report import curve_figure, knowledge_table, write_report
from sleuth.claim_reuse import inject_stage, reader_stage
from sleuth.claim_stages import STAGES_DIR as STAGES_DIR  # importable from here, where it lived
from sleuth.claim_stages import ArmSelection, require_arm_stages, run_seed, stage, write_claim_file
from sleuth.data.synth import KNOWLEDGE_TYPES
from sleuth.demo import GPU, DemoSize, demo_recipe, held_out_questions, write_oracle_trajectories
from sleuth.errors import ConfigError
from sleuth.reader import ReaderSettings
from sleuth.rewards.metrics import cover_exact_match


@dataclass(frozen=True)
class Claim:
    method: str
    claim: str
    world: str
    cold_start: str
    arms: str
    evaluation: str
    test: str


CLAIMS: dict[str, Claim] = {c.method: c for c in (
    Claim("staged", "a retrieval-count-aware staged reward cuts over-retrieval while keeping accuracy",
          "synth --known-fraction: a share of facts known, questions all-known / mixed / all-unknown",
          "knowledge injection (closed-book SFT of the known facts), then oracle-trajectory SFT per arm",
          "staged reward vs search_r1 EM reward, same RL steps and seed",
          "the same held-out questions: retrievals per question (known / unknown) and EM, paired",
          "staged minus search_r1 retrievals on all-known questions: 95% interval below 0; EM difference: "
          "interval above -margin"),
    Claim("r_search", "the evidence reward improves over an answer-only reward (the paper's ablation)",
          "the synthetic world", "a trained reader (sleuth train-reader) as the frozen evidence model; "
          "oracle-trajectory SFT (r_search loop), shared by both arms",
          "r_search reward with vs without the evidence term, same steps and seeds",
          "held-out questions: F1 and EM of the agent's answer, paired", "with-evidence minus without: F1 interval above 0"),
    Claim("qagent", "stage 2 (rewarding a frozen generator's answer) transfers to other generators",
          "the synthetic world", "a trained reader (sleuth train-reader); oracle-trajectory SFT (qagent loop)",
          "qagent stage 2 (frozen trained reader's EM + hit, continuing stage 1 at half its steps) vs stage 1 "
          "(end to end), the same total RL steps",
          "each arm's documents read by the trained reader (stage 2's) and by the base model (the other reader); "
          "stage 1 also on its own answers; paired",
          "stage 2 minus stage 1, read by the other reader: non-strict EM (QAgent's) interval above 0"),
    Claim("s3", "a searcher trained against a frozen generator needs far less data than end-to-end training",
          "the synthetic world", "a trained reader (sleuth train-reader); oracle-trajectory SFT (s3 and search_r1 loops)",
          "s3 vs search_r1, one GRPO run per number of RL training questions (cpu: 2 / 4; gpu: 25 / 100 / 400 / "
          "1,600, a 64-fold range like the paper's 2.4k vs 170k)",
          "held-out EM against training questions; the same trained reader reads s3's documents at every size",
          "s3 at the smallest size minus search_r1 at the largest: EM interval above -margin"),
)}


@dataclass(frozen=True)
class ClaimProfile:
    pipeline: DemoSize  # model, world size, SFT and RL sizes (the demo's sizing record)
    splits: tuple[float, float, float]
    lora: bool
    test_questions: int
    accuracy_margin: float  # the EM loss (fraction) still called "not lower"
    known_fraction: float | None = None  # a knowledge-boundary world (staged) or a plain one (None)
    reader: ReaderSettings | None = None  # the trained reader of qagent and s3
    sizes: tuple[int, ...] = ()  # s3: numbers of RL training questions


@dataclass(frozen=True)
class StagedProfile(ClaimProfile):
    inject_epochs: int = 3
    inject_lr: float = 3e-4
    inject_batch: int = 16


STAGED_PROFILES = {
    # the tiny random model on a 40-passage world: every stage runs on 2 CPU cores in a few minutes
    "cpu": StagedProfile(
        pipeline=DemoSize(model="tiny", passages=40, questions=100, hops=(1, 2), committed_questions=0,
                          sft_questions=12, sft_epochs=2, train_steps=2, prompts_per_step=2, n=4,
                          max_new_tokens=16, lr=1e-3, eval_questions=30),
        known_fraction=0.5, splits=(0.6, 0.1, 0.3), inject_epochs=40, inject_lr=3e-3, inject_batch=8, lora=False,
        test_questions=30, accuracy_margin=0.02),
    # sized like bench/learning.py's GPU runs. Injection calibrated on SmolLM2-135M (knowledge_injection_calibration_cpu.json
    # in bench/results): direct EM known vs unknown 0.97 vs 0.05 at 12 epochs x 3e-3 x 128 (LoRA r16); 0.10 vs 0.03 at 3 x 3e-4 x 16
    # (the demo's GPU pipeline, whole-batch passes included, with 30 RL steps and no committed-searcher check)
    "gpu": StagedProfile(
        pipeline=replace(GPU, committed_questions=0, train_steps=30),
        known_fraction=0.5, splits=(0.8, 0.1, 0.1), inject_epochs=12, inject_lr=3e-3, inject_batch=128, lora=True,
        test_questions=500, accuracy_margin=0.02),
}
STAGED_ARMS = ("staged", "search_r1")  # the claim's method first, then the baseline it is compared with

# r_search, qagent and s3: the staged profiles' sizes on a plain world, with LoRA (r_search's evidence model
# and s3's naive-RAG baseline default to the policy's base, which needs adapters) and a trained reader.
CLAIM_PROFILES = {
    "cpu": ClaimProfile(
        pipeline=STAGED_PROFILES["cpu"].pipeline, splits=(0.6, 0.1, 0.3), lora=True, test_questions=30,
        accuracy_margin=0.02, sizes=(2, 4),
        reader=ReaderSettings(model="tiny", distractors=1, epochs=2, lr=3e-3, batch_size=8, lora=False)),
    "gpu": ClaimProfile(
        pipeline=replace(STAGED_PROFILES["gpu"].pipeline, questions=8000), splits=(0.8, 0.1, 0.1), lora=True,
        test_questions=500, accuracy_margin=0.02, sizes=(25, 100, 400, 1600),
        reader=ReaderSettings(model="smollm2-135m-instruct", distractors=2, epochs=2, lr=3e-4, batch_size=16)),
}


def build_world(world: Path, profile: ClaimProfile) -> dict[str, Any]:
    """The claim's world from its seed (questions, corpus, BM25 index) under `world`: the same bytes every time
    but for the index manifest's build time and corpus path (a claim bundle rebuilds it rather than carrying it)."""
    from sleuth.data.synth import generate_world, write_world
    from sleuth.retrieval import build_index

    size = profile.pipeline
    summary = write_world(generate_world(size.passages, size.questions, hops=size.hops, seed=0,
                                         known_fraction=profile.known_fraction), world, splits=profile.splits)
    build_index(world / "corpus.jsonl", "bm25", world / "bm25")
    return {"world": str(world), "splits": summary["splits"],
            **{k: summary[k] for k in ("knowledge_distribution", "known_statements") if k in summary}}


@dataclass(frozen=True)
class Arm:
    """One compared arm: GRPO of `method` with the demo's recipe, changed by the fields set here."""

    name: str  # its run directory OUT/<name> and its label
    method: str
    reward: dict[str, Any] | None = None  # merged into the method's default reward (options merged too)
    steps: int | None = None  # RL steps (default: the profile's)
    train_questions: int | None = None  # data.max_train_examples (default: the whole train split)
    save_every: int | None = None


# r_search's ablation: the same GRPO run with and without the evidence term of its reward
R_SEARCH_ARMS = (Arm("with_evidence", "r_search"),
                 Arm("without_evidence", "r_search", reward={"options": {"use_evidence_reward": False}}))


def arm_recipe(out: Path, world: Path, profile: ClaimProfile, method: str, init_from: str | None,
               name: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The demo's recipe for `method` under OUT/<name or method>, on the claim's world, starting from the
    checkpoint `init_from` (None: the profile's base model)."""
    arm = out / (name or method)
    recipe = demo_recipe(arm, profile.pipeline, method)
    recipe["name"] = f"reproduce-{name or method}"
    recipe["seed"] = run_seed(out)  # the arms' training seed (--seed); the world, reader and injection keep theirs
    recipe["data"]["train"] = str(world / "train.jsonl")
    recipe["retriever"]["index"] = str(world / "bm25")
    recipe["model"]["lora"]["enabled"] = profile.lora
    if init_from is not None:
        recipe["model"]["init_from"] = init_from
    return recipe


def _cold_start(out: Path, world: Path, profile: ClaimProfile, method: str, init_from: str | None,
                console: Any) -> dict:  # fmt: skip
    """Oracle trajectories of `method` -> SFT from `init_from` (None: the base model) under OUT/<method>;
    returns the SFT checkpoint."""
    from sleuth.rl.config import write_recipe
    from sleuth.rl.sft import run_sft

    recipe = write_recipe(arm_recipe(out, world, profile, method, init_from), out / method / "recipe.yaml")
    kept = write_oracle_trajectories(out / method, recipe, profile.pipeline)
    sft = run_sft(recipe, resume=True, console=console)
    return {"sft_checkpoint": sft["checkpoint"], "trajectories": kept.get("kept", 0)}


def arm_rl_recipe(out: Path, world: Path, profile: ClaimProfile, arm: Arm, init_from: str) -> dict[str, Any]:
    """The GRPO recipe of one arm: the demo's recipe for its method with the arm's reward, steps and data."""
    recipe_dict = arm_recipe(out, world, profile, arm.method, init_from, arm.name)
    recipe_dict.pop("sft")
    if arm.reward is not None:
        reward = recipe_dict["reward"]
        options = {**reward.get("options", {}), **arm.reward.get("options", {})}
        recipe_dict["reward"] = {**reward, **arm.reward, **({"options": options} if options else {})}
    trainer = recipe_dict["trainer"]
    trainer["total_steps"] = arm.steps or trainer["total_steps"]
    trainer["save_every"] = arm.save_every or max(1, min(trainer["total_steps"], 5))
    if arm.train_questions is not None:
        recipe_dict["data"]["max_train_examples"] = arm.train_questions
    return recipe_dict


def _train_rl(out: Path, world: Path, profile: ClaimProfile, arm: Arm, init_from: str, console: Any) -> dict:
    """GRPO of one arm from `init_from` (an SFT or RL checkpoint), resumable; returns its last checkpoint."""
    from sleuth.rl.config import write_recipe
    from sleuth.rl.trainer import train
    from sleuth.run_layout import latest_checkpoint

    recipe = write_recipe(arm_rl_recipe(out, world, profile, arm, init_from), out / arm.name / "rl_recipe.yaml")
    resumable = latest_checkpoint(Path(recipe.trainer.out_dir)) is not None
    result = train(recipe, resume=resumable, overwrite=not resumable, console=console)
    return {"checkpoint": str(result["checkpoint"]), "run": recipe.trainer.out_dir,
            "steps": recipe.trainer.total_steps}


def _train_arm(out: Path, world: Path, profile: ClaimProfile, method: str, injected: str, console: Any) -> dict:
    """Oracle trajectories -> SFT from the injected model -> GRPO (the staged claim's arm, one stage)."""
    sft = _cold_start(out, world, profile, method, injected, console)
    rl = _train_rl(out, world, profile, Arm(method, method), sft["sft_checkpoint"], console)
    return {**sft, "checkpoint": rl["checkpoint"]}


def _evaluate(out: Path, world: Path, profile: ClaimProfile, method: str, checkpoint: str, name: str,
              reader: str | None = None) -> dict:  # fmt: skip
    """`method`'s checkpoint on the claim's held-out questions (greedy), under OUT/eval/<name>; a searcher's
    documents go to `reader` (default: the checkpoint itself)."""
    from sleuth.agent.registry import get_method
    from sleuth.agent.searcher import load_searcher
    from sleuth.eval.harness import EvalConfig, EvalOutput, evaluate
    from sleuth.knowledge import boundary_questions

    size, spec = profile.pipeline, get_method(method)
    cfg = EvalConfig(batch_size=size.eval_batch_size, max_new_tokens=size.max_new_tokens * spec.new_tokens_factor,
                     answer_max_new_tokens=24, top_k=3, max_turns=size.max_turns, max_response_tokens=2048,
                     max_obs_tokens=384)
    questions = (boundary_questions(world, "test", profile.test_questions) if profile.known_fraction is not None
                 else held_out_questions(world, profile.test_questions))
    summary = evaluate([spec.display_name], questions, world / "bm25", load_searcher(checkpoint).generator,
                       generator=reader, config=cfg, out_dir=EvalOutput(out / "eval" / name))
    return {"predictions": str(out / "eval" / name / spec.display_name / "predictions.jsonl"), "reader": reader,
            "retrieval_boundary": summary.get("retrieval_boundary", {}).get(spec.display_name)}


def _evaluate_arm(out: Path, world: Path, profile: ClaimProfile, method: str, checkpoint: str) -> dict:
    return _evaluate(out, world, profile, method, checkpoint, method)


def _read_predictions(path: str) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in read_appended(path).records}


def _paired(a: list[float], b: list[float], seed: int = 0) -> dict[str, Any]:
    from sleuth.eval.stats import paired_bootstrap

    if not a:
        return {"n": 0, "a": None, "b": None, "diff": None, "ci": None}
    diff, lo, hi = paired_bootstrap(a, b, seed=seed)
    return {"n": len(a), "a": sum(a) / len(a), "b": sum(b) / len(b), "diff": diff, "ci": [lo, hi]}


def common_ids(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    """The question ids both arms' predictions hold (sorted): what a paired comparison runs over."""
    ids = sorted(set(first) & set(second))
    if not ids:
        raise ConfigError("the two arms answered no common question; evaluate both on the same test split")
    return ids


def claim_table(first: dict[str, dict[str, Any]], second: dict[str, dict[str, Any]],
                margin: float) -> dict[str, Any]:  # fmt: skip
    """The staged claim from two arms' predictions by question id: paired retrievals on all-known and on
    other questions, paired EM on all; holds when the all-known retrieval difference's interval is below 0
    and the EM difference's lower end is at least -margin."""
    ids = common_ids(first, second)

    def column(arm: dict, ids_: list[str], key: str) -> list[float]:
        return [float(arm[i]["retrieval_count"] if key == "rc" else arm[i]["metrics"]["em"]) for i in ids_]

    known = [i for i in ids if first[i].get("knowledge") == "all-known"]
    unknown = [i for i in ids if first[i].get("knowledge") in KNOWLEDGE_TYPES and i not in set(known)]
    rows = {
        "retrievals per question, all-known": _paired(column(first, known, "rc"), column(second, known, "rc")),
        "retrievals per question, mixed / all-unknown": _paired(column(first, unknown, "rc"),
                                                                column(second, unknown, "rc")),
        "EM, all questions": _paired(column(first, ids, "em"), column(second, ids, "em")),
    }
    fewer = rows["retrievals per question, all-known"]["ci"]
    accuracy = rows["EM, all questions"]["ci"]
    holds = fewer is not None and fewer[1] < 0 and accuracy[0] >= -margin
    rule = ("The claim holds when the all-known retrieval difference's interval lies below 0 and the EM "
            f"difference's lower end is at least -{100 * margin:.1f} points. EM in points; retrievals per question.")
    return {"rows": rows, "holds": holds, "accuracy_margin": margin, "questions": len(ids), "rule": rule}


def reproduce_staged(out: Path, profile_name: str, console: Any, arms: ArmSelection, reuse: Path | None) -> Path:
    """The staged claim end to end (module docstring); returns OUT/report.html."""
    profile = STAGED_PROFILES[profile_name]
    out.mkdir(parents=True, exist_ok=True)
    world = out / "world"
    details: dict[str, Any] = {"profile": profile_name, "world": stage(out, "world", lambda: build_world(world, profile), console)}
    details["inject"] = stage(out, "inject", lambda: inject_stage(world, out / "inject", profile, reuse, console), console)
    for method in STAGED_ARMS:
        if not arms.runs(method):
            continue
        details[f"train_{method}"] = stage(out, f"train_{method}", lambda m=method: _train_arm(
            out, world, profile, m, details["inject"]["checkpoint"], console), console)
        details[f"eval_{method}"] = stage(out, f"eval_{method}", lambda m=method: _evaluate_arm(
            out, world, profile, m, details[f"train_{m}"]["checkpoint"]), console)
    details |= require_arm_stages(out, STAGED_ARMS)
    first, second = (_read_predictions(details[f"eval_{m}"]["predictions"]) for m in STAGED_ARMS)
    table = claim_table(first, second, profile.accuracy_margin)
    by_type = knowledge_table(details["inject"]["boundary"], {m: details[f"eval_{m}"].get("retrieval_boundary")
                                                              for m in STAGED_ARMS})
    return write_report(out, CLAIMS["staged"], table, STAGED_ARMS, details, figure=by_type)


def _paired_on(first: dict[str, dict], second: dict[str, dict], value_a: Callable[[dict], float],
               value_b: Callable[[dict], float] | None = None) -> dict[str, Any]:  # fmt: skip
    """A paired row over the questions both prediction sets answered: value_a of the first, value_b of the second."""
    ids = common_ids(first, second)
    value_b = value_b or value_a
    return _paired([value_a(first[i]) for i in ids], [value_b(second[i]) for i in ids])


def metric(key: str) -> Callable[[dict], float]:
    """A prediction record's answer metric (as the evaluator scored the answer it reports)."""
    return lambda record: float(record["metrics"][key])


def own_answer_cover_em(record: dict) -> float:
    """Non-strict EM (a gold answer inside the answer) of the agent's own answer, where the evaluator handed its
    documents to a reader (extra.agent_answer)."""
    return cover_exact_match(record.get("extra", {}).get("agent_answer"), record["golden_answers"])


def _start(out: Path, profile_name: str, console: Any, reuse: Path | None) -> tuple[ClaimProfile, Path, dict[str, Any]]:
    """The shared first stages: the profile, the plain world and the trained reader."""
    profile = CLAIM_PROFILES[profile_name]
    out.mkdir(parents=True, exist_ok=True)
    world = out / "world"
    details: dict[str, Any] = {"profile": profile_name,
                               "world": stage(out, "world", lambda: build_world(world, profile), console)}
    details["reader"] = stage(out, "reader", lambda: reader_stage(world, out / "reader", profile, reuse, console),
                              console)
    return profile, world, details


def reproduce_r_search(out: Path, profile_name: str, console: Any, arms: ArmSelection, reuse: Path | None) -> Path:
    """r_search with vs without the evidence reward (module docstring); returns OUT/report.html."""
    profile, world, details = _start(out, profile_name, console, reuse)
    details["sft_r_search"] = stage(out, "sft_r_search", lambda: _cold_start(
        out, world, profile, "r_search", None, console), console)
    for arm in R_SEARCH_ARMS:
        if not arms.runs(arm.name):
            continue
        arm = replace(arm, reward={**(arm.reward or {}), "generator": details["reader"]["reader"]})
        details[f"train_{arm.name}"] = stage(out, f"train_{arm.name}", lambda a=arm: _train_rl(
            out, world, profile, a, details["sft_r_search"]["sft_checkpoint"], console), console)
        details[f"eval_{arm.name}"] = stage(out, f"eval_{arm.name}", lambda a=arm: _evaluate(
            out, world, profile, a.method, details[f"train_{a.name}"]["checkpoint"], a.name), console)
    details |= require_arm_stages(out, (arm.name for arm in R_SEARCH_ARMS))
    preds = [_read_predictions(details[f"eval_{arm.name}"]["predictions"]) for arm in R_SEARCH_ARMS]
    rows = {"F1, all questions": _paired_on(preds[0], preds[1], metric("f1")),
            "EM, all questions": _paired_on(preds[0], preds[1], metric("em"))}
    f1 = rows["F1, all questions"]["ci"]
    table = {"rows": rows, "holds": f1[0] > 0, "questions": rows["F1, all questions"]["n"],
             "rule": "The claim holds when the with-evidence arm's F1 minus the without-evidence arm's has a 95% "
                     "interval above 0. F1 and EM in points."}
    return write_report(out, CLAIMS["r_search"], table, tuple(a.name for a in R_SEARCH_ARMS), details)


def reproduce_qagent(out: Path, profile_name: str, console: Any, arms: ArmSelection, reuse: Path | None) -> Path:
    """qagent stage 2 vs stage 1, each read by both readers (module docstring); returns OUT/report.html."""
    profile, world, details = _start(out, profile_name, console, reuse)
    trained, base = details["reader"]["reader"], profile.pipeline.model
    half = max(1, profile.pipeline.train_steps // 2)
    details["sft_qagent"] = stage(out, "sft_qagent", lambda: _cold_start(
        out, world, profile, "qagent", None, console), console)
    stage1 = Arm("stage1", "qagent", steps=2 * half, save_every=half)
    stage2 = Arm("stage2", "qagent", reward={"name": "qagent_stage2", "options": {"hit_weight": 0.5},
                                             "generator": trained}, steps=half)
    details["train_stage1"] = stage(out, "train_stage1", lambda: _train_rl(
        out, world, profile, stage1, details["sft_qagent"]["sft_checkpoint"], console), console)
    midway = str(Path(details["train_stage1"]["run"]) / "checkpoints" / f"step_{half:06d}")
    details["train_stage2"] = stage(out, "train_stage2", lambda: _train_rl(
        out, world, profile, stage2, midway, console), console)
    preds: dict[tuple[str, str], dict] = {}
    for arm in (stage2, stage1):
        for reader_name, reader in (("trained_reader", trained), ("base_reader", base)):
            name = f"{arm.name}_{reader_name}"
            details[f"eval_{name}"] = stage(out, f"eval_{name}", lambda a=arm, r=reader, n=name: _evaluate(
                out, world, profile, a.method, details[f"train_{a.name}"]["checkpoint"], n, r), console)
            preds[arm.name, reader_name] = _read_predictions(details[f"eval_{name}"]["predictions"])
    # QAgent's EM is non-strict (Sec. 4.1: the answer contains a gold answer; its stage-2 reward too): the base model
    # answers in sentences, strict EM ~1% whatever the searcher. Strict EM and F1 stay as rows beside it
    other = f"non-strict EM read by the other reader ({base}, the base model)"
    s2_base, s1_base = preds["stage2", "base_reader"], preds["stage1", "base_reader"]
    s2_trained, s1_trained = preds["stage2", "trained_reader"], preds["stage1", "trained_reader"]
    rows = {
        other: _paired_on(s2_base, s1_base, metric("cover_em")),
        "F1 read by the other reader": _paired_on(s2_base, s1_base, metric("f1")),
        "strict EM read by the other reader": _paired_on(s2_base, s1_base, metric("em")),
        "EM (non-strict) read by stage 2's training reader (trained reader)": _paired_on(
            s2_trained, s1_trained, metric("cover_em")),
        "EM (non-strict) with the answerer each trained with (stage 2: trained reader; stage 1: its own answer)":
            _paired_on(s2_trained, s1_trained, metric("cover_em"), own_answer_cover_em),
    }
    table = {"rows": rows, "holds": rows[other]["ci"][0] > 0, "questions": rows[other]["n"],
             "rule": "The claim holds when stage 2 minus stage 1, both read by the reader stage 2 did not train "
                     "with, has a 95% interval above 0 in non-strict EM (QAgent's EM: the answer contains a gold "
                     "answer). EM and F1 in points."}
    return write_report(out, CLAIMS["qagent"], table, ("stage 2", "stage 1"), details)


def reproduce_s3(out: Path, profile_name: str, console: Any, arms: ArmSelection, reuse: Path | None) -> Path:
    """s3 vs search_r1 against the number of RL training questions (module docstring); returns OUT/report.html."""
    import math

    from sleuth.agent.registry import get_method
    from sleuth.eval.stats import bootstrap_ci

    profile, world, details = _start(out, profile_name, console, reuse)
    reader, per_step = details["reader"]["reader"], profile.pipeline.prompts_per_step
    methods = ("s3", "search_r1")
    for method in methods:  # only the cold starts this run's arms train from: the two run side by side
        if any(arms.runs(f"{method}_{size}") for size in profile.sizes):
            details[f"sft_{method}"] = stage(out, f"sft_{method}", lambda m=method: _cold_start(
                out, world, profile, m, None, console), console)
    for size in profile.sizes:
        for method in methods:
            if not arms.runs(f"{method}_{size}"):
                continue
            # a searcher that hands its documents to a reader trains and is evaluated with the trained reader
            read_by = reader if get_method(method).evaluated_by_reader else None
            arm = Arm(f"{method}_{size}", method, reward={"generator": read_by} if read_by else None,
                      steps=math.ceil(size / per_step), train_questions=size)
            details[f"train_{arm.name}"] = stage(out, f"train_{arm.name}", lambda a=arm: _train_rl(
                out, world, profile, a, details[f"sft_{a.method}"]["sft_checkpoint"], console), console)
            details[f"eval_{arm.name}"] = stage(out, f"eval_{arm.name}", lambda a=arm, r=read_by: _evaluate(
                out, world, profile, a.method, details[f"train_{a.name}"]["checkpoint"], a.name, r), console)
    details |= require_arm_stages(out, claim_arms("s3", profile_name))
    preds: dict[tuple[str, int], dict] = {}
    curve: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for size in profile.sizes:
        for method in methods:
            preds[method, size] = _read_predictions(details[f"eval_{method}_{size}"]["predictions"])
            em = [metric("em")(r) for r in preds[method, size].values()]
            curve[method].append({"questions": size, "em": sum(em) / len(em), "em_ci": list(bootstrap_ci(em))})
    rows = {f"EM after RL on {size} training questions": _paired_on(preds["s3", size], preds["search_r1", size],
                                                                    metric("em")) for size in profile.sizes}
    smallest, largest = min(profile.sizes), max(profile.sizes)
    claim_row = f"EM: s3 on {smallest} questions vs search_r1 on {largest}"
    rows = {claim_row: _paired_on(preds["s3", smallest], preds["search_r1", largest], metric("em")), **rows}
    margin = profile.accuracy_margin
    table = {"rows": rows, "holds": rows[claim_row]["ci"][0] >= -margin, "questions": rows[claim_row]["n"],
             "accuracy_margin": margin, "curve": curve,
             "rule": f"The claim holds when s3 trained on {smallest} questions minus search_r1 trained on {largest} "
                     f"has a 95% EM interval whose lower end is at least -{100 * margin:.1f} points. EM in points; "
                     f"s3's documents are read by the trained reader at every size."}
    return write_report(out, CLAIMS["s3"], table, methods, details, figure=curve_figure(curve))


RUNNERS: dict[str, Callable[[Path, str, Any, ArmSelection, Path | None], Path]] = {
    "staged": reproduce_staged, "r_search": reproduce_r_search, "qagent": reproduce_qagent, "s3": reproduce_s3}


def reproduce(method: str, out: Path, profile: str, console: Any = None, arms: Sequence[str] | None = None,
              reuse: Path | None = None, seed: int = 0) -> Path:  # fmt: skip
    """Run `method`'s claim in OUT, resuming; `arms`: only these arms (`claim_arms`), for runs sharing OUT;
    `reuse`: a folder whose reader/ or injected/ (trained on this world) replaces training one (`sleuth.claim_reuse`)."""
    claim = CLAIMS.get(method)
    if claim is None:
        raise ConfigError(f"no claim registered for {method!r}; choose one of {', '.join(CLAIMS)}")
    if profile not in ("cpu", "gpu"):
        raise ConfigError(f"--profile must be cpu or gpu, got {profile!r}")
    independent = claim_arms(method, profile)
    if arms is not None and not independent:
        raise ConfigError(f"--arms: the {method} claim's arms run one after another (stage 2 continues stage 1), "
                          "so they cannot be split over runs; leave --arms out")
    selection = ArmSelection(arms, independent, method)
    out = out.resolve()  # one spelling of OUT in every stage's paths, whatever the working directory
    write_claim_file(out, method, profile, seed)
    return RUNNERS[method](out, profile, console, selection, reuse)


def claim_arms(method: str, profile_name: str) -> tuple[str, ...]:
    """The names `--arms` takes: arms that train and evaluate independently; () if each needs the last (qagent)."""
    if method == "staged":
        return STAGED_ARMS
    if method == "r_search":
        return tuple(arm.name for arm in R_SEARCH_ARMS)
    if method == "s3":
        return tuple(f"{m}_{size}" for size in claim_profile(method, profile_name).sizes for m in ("s3", "search_r1"))
    return ()


def claim_profile(method: str, profile_name: str) -> ClaimProfile:
    """The sizes `method`'s claim runs at under `profile_name` (cpu or gpu)."""
    return (STAGED_PROFILES if method == "staged" else CLAIM_PROFILES)[profile_name]


def stage_plan(method: str, profile_name: str) -> dict[str, tuple[str, ...]]:
    """A claim's stages in the order its runner above runs them, each with what it loads from earlier stages'
    results: "stage.key" (a checkpoint path in that result) or "stage.key/sub/path" (a path under it). What a
    claim bundle must carry for the stages still to run (`sleuth.claim_bundle`); a test holds it to the runners."""
    profile = claim_profile(method, profile_name)
    plan: dict[str, tuple[str, ...]] = {"world": ()}
    if method == "staged":
        plan["inject"] = ()
        for m in STAGED_ARMS:
            plan |= {f"train_{m}": ("inject.checkpoint",), f"eval_{m}": (f"train_{m}.checkpoint",)}
    elif method == "r_search":
        plan |= {"reader": (), "sft_r_search": ()}
        for arm in claim_arms(method, profile_name):
            plan |= {f"train_{arm}": ("sft_r_search.sft_checkpoint", "reader.reader"),
                     f"eval_{arm}": (f"train_{arm}.checkpoint",)}
    elif method == "qagent":
        half = max(1, profile.pipeline.train_steps // 2)  # stage 2 continues stage 1's checkpoint at this step
        plan |= {"reader": (), "sft_qagent": (), "train_stage1": ("sft_qagent.sft_checkpoint",),
                 "train_stage2": (f"train_stage1.run/checkpoints/step_{half:06d}", "reader.reader")}
        for arm in ("stage2", "stage1"):
            plan |= {f"eval_{arm}_trained_reader": (f"train_{arm}.checkpoint", "reader.reader"),
                     f"eval_{arm}_base_reader": (f"train_{arm}.checkpoint",)}
    else:
        from sleuth.agent.registry import get_method

        plan |= {"reader": (), "sft_s3": (), "sft_search_r1": ()}
        for size in profile.sizes:
            for m in ("s3", "search_r1"):
                reader = ("reader.reader",) if get_method(m).evaluated_by_reader else ()
                plan |= {f"train_{m}_{size}": (f"sft_{m}.sft_checkpoint", *reader),
                         f"eval_{m}_{size}": (f"train_{m}_{size}.checkpoint", *reader)}
    return plan
