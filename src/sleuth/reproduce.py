"""`sleuth reproduce <method>`: each paper's own claim, end to end, with paired 95% intervals.

A claim is described by its world, its cold start, the arms it compares, the evaluation and the
test that decides it (`CLAIMS`). `staged` runs end to end; the other three are registered with their
plan and stop with "not implemented yet: needs ...".

staged ("learning when to search"): on a knowledge-boundary world (`synth --known-fraction`) the base
model is taught the known facts (`sleuth.knowledge.inject_knowledge`); each arm gets an oracle-trajectory
SFT cold start from the injected model, then the same number of GRPO steps with the same seed, one with
the staged reward and one with search_r1's EM reward; both are evaluated on the same held-out questions.
The claim holds when staged retrieves less on all-known questions (paired difference, 95% interval
entirely below 0) at an accuracy not lower (the paired EM difference's interval lies above -margin).

Every stage writes a marker under OUT/stages/ when it finishes; a rerun skips finished stages.
The pipeline pieces are sleuth's own, chained as `sleuth demo` chains them.
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import typer

from sleuth.appendlog import read_appended
from sleuth.data.synth import KNOWLEDGE_TYPES
from sleuth.demo import DemoSize, demo_recipe, write_oracle_trajectories
from sleuth.errors import ConfigError
from sleuth.utils import atomic_write_json, atomic_write_text

STAGES_DIR = "stages"


@dataclass(frozen=True)
class Claim:
    method: str
    claim: str
    world: str
    cold_start: str
    arms: str
    evaluation: str
    test: str
    needs: str | None = None  # what is missing before it runs (None: implemented)


CLAIMS: dict[str, Claim] = {c.method: c for c in (
    Claim("staged", "a retrieval-count-aware staged reward cuts over-retrieval while keeping accuracy",
          "synth --known-fraction: a share of facts known, questions all-known / mixed / all-unknown",
          "knowledge injection (closed-book SFT of the known facts), then oracle-trajectory SFT per arm",
          "staged reward vs search_r1 EM reward, same RL steps and seed",
          "the same held-out questions: retrievals per question (known / unknown) and EM, paired",
          "staged minus search_r1 retrievals on all-known questions: 95% interval below 0; EM difference: "
          "interval above -margin"),
    Claim("r_search", "the evidence reward improves over an answer-only reward (the paper's ablation)",
          "the synthetic world", "oracle-trajectory SFT (r_search loop)",
          "r_search reward with vs without the evidence term, same steps and seeds",
          "held-out questions: F1 and EM, paired", "with-evidence minus without: F1 interval above 0",
          needs="an r_search reward option that drops the evidence term, wired as a second arm"),
    Claim("qagent", "stage 2 (rewarding a frozen generator's answer) transfers to other generators",
          "the synthetic world", "oracle-trajectory SFT (qagent loop)",
          "qagent stage 2 vs stage 1 (end to end)",
          "each arm read by the generator it trained with and by a second reader, paired",
          "stage 2 minus stage 1 with the other reader: interval above 0",
          needs="a second, stronger frozen reader (issue 25 item 2: SFT of the base on question + gold passages)"),
    Claim("s3", "a searcher trained against a frozen generator needs far less data than end-to-end training",
          "the synthetic world", "oracle-trajectory SFT (s3 and search_r1 loops)",
          "s3 vs search_r1 trained on 100 / 400 / 1,600 / 6,000 questions",
          "held-out accuracy against training questions, same reader for s3",
          "s3 at the smallest size reaches search_r1's accuracy at a larger one (intervals)",
          needs="a stronger frozen reader (issue 25 item 2) and a data-size sweep runner"),
)}


@dataclass(frozen=True)
class StagedProfile:
    pipeline: DemoSize  # model, world size, SFT and RL sizes (the demo's sizing record)
    known_fraction: float
    splits: tuple[float, float, float]
    inject_epochs: int
    inject_lr: float
    inject_batch: int
    lora: bool
    test_questions: int
    accuracy_margin: float  # the EM loss (fraction) still called "not lower"


STAGED_PROFILES = {
    # the tiny random model on a 40-passage world: every stage runs on 2 CPU cores in a few minutes
    "cpu": StagedProfile(
        pipeline=DemoSize(model="tiny", passages=40, questions=100, hops=(1, 2), committed_questions=0,
                          sft_questions=12, sft_epochs=2, train_steps=2, prompts_per_step=2, n=4,
                          max_new_tokens=16, lr=1e-3, eval_questions=30),
        known_fraction=0.5, splits=(0.6, 0.1, 0.3), inject_epochs=40, inject_lr=3e-3, inject_batch=8, lora=False,
        test_questions=30, accuracy_margin=0.02),
    # sized like bench/learning.py's GPU runs (not run in this repository's tests)
    "gpu": StagedProfile(
        pipeline=DemoSize(model="smollm2-135m-instruct", passages=5000, questions=6000, hops=(1, 3),
                          committed_questions=0, sft_questions=1200, sft_epochs=2, train_steps=30,
                          prompts_per_step=16, n=5, max_new_tokens=64, lr=5e-5, eval_questions=500, max_turns=4,
                          compile_generation=True),
        known_fraction=0.5, splits=(0.8, 0.1, 0.1), inject_epochs=3, inject_lr=3e-4, inject_batch=16, lora=True,
        test_questions=500, accuracy_margin=0.02),
}
STAGED_ARMS = ("staged", "search_r1")  # the claim's method first, then the baseline it is compared with


def stage(out: Path, name: str, run: Callable[[], dict[str, Any]], console: Any = None) -> dict[str, Any]:
    """Run a stage once: its result is kept in OUT/stages/<name>.json, and a rerun returns it unrun."""
    marker = out / STAGES_DIR / f"{name}.json"
    if marker.exists():
        if console is not None:
            console.print(f"[dim]stage {name}: done earlier, skipped[/]")
        return json.loads(marker.read_text())["result"]
    if console is not None:
        console.print(f"[bold cyan]stage {name}[/]")
    start = time.perf_counter()
    result = run()
    marker.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(marker, {"result": result, "seconds": time.perf_counter() - start})
    return result


def _build_world(world: Path, profile: StagedProfile) -> dict[str, Any]:
    from sleuth.data.synth import generate_world, write_world
    from sleuth.retrieval import build_index

    size = profile.pipeline
    summary = write_world(generate_world(size.passages, size.questions, hops=size.hops, seed=0,
                                         known_fraction=profile.known_fraction), world, splits=profile.splits)
    build_index(world / "corpus.jsonl", "bm25", world / "bm25")
    return {"world": str(world), "knowledge_distribution": summary["knowledge_distribution"],
            "known_statements": summary["known_statements"]}


def arm_recipe(out: Path, world: Path, profile: StagedProfile, method: str, init_from: str) -> dict[str, Any]:
    """The demo's recipe for `method`, on the knowledge-boundary world, starting from the injected model."""
    arm = out / method
    recipe = demo_recipe(arm, profile.pipeline, method)
    recipe["name"] = f"reproduce-staged-{method}"
    recipe["data"]["train"] = str(world / "train.jsonl")
    recipe["retriever"]["index"] = str(world / "bm25")
    recipe["model"]["lora"]["enabled"] = profile.lora
    recipe["model"]["init_from"] = init_from
    return recipe


def _train_arm(out: Path, world: Path, profile: StagedProfile, method: str, injected: str, console: Any) -> dict:
    """Oracle trajectories -> SFT from the injected model -> GRPO; returns the RL checkpoint."""
    import yaml

    from sleuth.rl.config import recipe_from_dict
    from sleuth.rl.sft import run_sft
    from sleuth.rl.trainer import train
    from sleuth.run_layout import latest_checkpoint

    recipe_dict = arm_recipe(out, world, profile, method, injected)
    path = out / method / "recipe.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe_dict, sort_keys=False))
    recipe = recipe_from_dict(recipe_dict, source=str(path))
    kept = write_oracle_trajectories(out / method, recipe, profile.pipeline)
    sft = run_sft(recipe, resume=True, console=console)
    rl_model = recipe.model.model_copy(update={"init_from": sft["checkpoint"]})
    rl_recipe = recipe.model_copy(update={"sft": None, "model": rl_model})
    resumable = latest_checkpoint(Path(recipe.trainer.out_dir)) is not None
    result = train(rl_recipe, resume=resumable, overwrite=not resumable, console=console)
    return {"sft_checkpoint": sft["checkpoint"], "checkpoint": str(result["checkpoint"]),
            "trajectories": kept.get("kept", 0)}


def _evaluate_arm(out: Path, world: Path, profile: StagedProfile, method: str, checkpoint: str) -> dict:
    from sleuth.agent.registry import get_method
    from sleuth.agent.searcher import load_searcher
    from sleuth.eval.harness import EvalConfig, EvalOutput, evaluate
    from sleuth.knowledge import boundary_questions

    size, spec = profile.pipeline, get_method(method)
    cfg = EvalConfig(batch_size=16, max_new_tokens=size.max_new_tokens * spec.new_tokens_factor,
                     answer_max_new_tokens=24, top_k=3, max_turns=size.max_turns, max_response_tokens=2048,
                     max_obs_tokens=384)
    summary = evaluate([spec.display_name], boundary_questions(world, "test", profile.test_questions),
                       world / "bm25", load_searcher(checkpoint).generator, config=cfg,
                       out_dir=EvalOutput(out / "eval" / method))
    return {"predictions": str(out / "eval" / method / spec.display_name / "predictions.jsonl"),
            "retrieval_boundary": summary.get("retrieval_boundary", {}).get(spec.display_name)}


def _read_predictions(path: str) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in read_appended(path).records}


def _paired(a: list[float], b: list[float], seed: int = 0) -> dict[str, Any]:
    from sleuth.eval.stats import paired_bootstrap

    if not a:
        return {"n": 0, "a": None, "b": None, "diff": None, "ci": None}
    diff, lo, hi = paired_bootstrap(a, b, seed=seed)
    return {"n": len(a), "a": sum(a) / len(a), "b": sum(b) / len(b), "diff": diff, "ci": [lo, hi]}


def claim_table(first: dict[str, dict[str, Any]], second: dict[str, dict[str, Any]],
                margin: float) -> dict[str, Any]:  # fmt: skip
    """The staged claim from two arms' predictions by question id: paired retrievals on all-known and on
    other questions, paired EM on all; holds when the all-known retrieval difference's interval is below 0
    and the EM difference's lower end is at least -margin."""
    ids = sorted(set(first) & set(second))
    if not ids:
        raise ConfigError("the two arms answered no common question; evaluate both on the same test split")

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
    return {"rows": rows, "holds": holds, "accuracy_margin": margin, "questions": len(ids)}


def _fmt(value: float | None, pct: bool) -> str:
    if value is None:
        return "-"
    return f"{100 * value:+.1f}" if pct else f"{value:+.2f}"


def write_report(out: Path, claim: Claim, table: dict[str, Any], arms: tuple[str, str], details: dict) -> Path:
    """OUT/report.json and OUT/report.html; the page opens with the claim table."""
    atomic_write_json(out / "report.json", {"claim": asdict(claim), "arms": list(arms), "table": table, **details})
    cells = []
    for name, row in table["rows"].items():
        pct = name.startswith("EM")
        ci = row["ci"]
        interval = f"[{_fmt(ci[0], pct)}, {_fmt(ci[1], pct)}]" if ci else "-"
        a, b = (("-" if v is None else (f"{100 * v:.1f}" if pct else f"{v:.2f}")) for v in (row["a"], row["b"]))
        cells.append(f"<tr><td>{html.escape(name)}</td><td>{row['n']}</td><td>{a}</td><td>{b}</td>"
                     f"<td>{_fmt(row['diff'], pct)}</td><td>{interval}</td></tr>")
    verdict = "holds" if table["holds"] else "does not hold"
    page = (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>sleuth reproduce {html.escape(claim.method)}</title></head><body>\n"
        f"<table id='claim'><caption>Claim: {html.escape(claim.claim)} &mdash; {verdict}</caption>\n"
        f"<tr><th>measure</th><th>n</th><th>{html.escape(arms[0])}</th><th>{html.escape(arms[1])}</th>"
        "<th>difference</th><th>95% interval (paired bootstrap)</th></tr>\n" + "\n".join(cells) + "\n</table>\n"
        f"<p>The claim holds when the all-known retrieval difference's interval lies below 0 and the EM difference's "
        f"lower end is at least -{100 * table['accuracy_margin']:.1f} points. EM in points; retrievals per question.</p>\n"
        f"<h2>Plan</h2><ul>" + "".join(f"<li><b>{k}</b>: {html.escape(str(v))}</li>" for k, v in asdict(claim).items()
                                        if k != "needs") + "</ul>\n"
        f"<h2>Stages</h2><pre>{html.escape(json.dumps(details, indent=2))}</pre>\n</body></html>\n"
    )
    atomic_write_text(out / "report.html", page)
    return out / "report.html"


def reproduce_staged(out: Path, profile_name: str, console: Any = None) -> Path:
    """The staged claim end to end (module docstring); returns OUT/report.html."""
    from sleuth.knowledge import InjectionSettings, boundary_check, inject_knowledge

    profile = STAGED_PROFILES[profile_name]
    out.mkdir(parents=True, exist_ok=True)
    world = out / "world"
    details: dict[str, Any] = {"profile": profile_name, "world": stage(out, "world", lambda: _build_world(world, profile), console)}
    settings = InjectionSettings(model=profile.pipeline.model, epochs=profile.inject_epochs, lr=profile.inject_lr,
                                 batch_size=profile.inject_batch, lora=profile.lora)

    def inject() -> dict[str, Any]:
        ckpt = inject_knowledge(world, out / "inject", settings, console)
        return {"checkpoint": str(ckpt), "boundary": boundary_check(world, str(ckpt), out / "inject", "test",
                                                                    profile.test_questions)}

    details["inject"] = stage(out, "inject", inject, console)
    for method in STAGED_ARMS:
        details[f"train_{method}"] = stage(out, f"train_{method}", lambda m=method: _train_arm(
            out, world, profile, m, details["inject"]["checkpoint"], console), console)
        details[f"eval_{method}"] = stage(out, f"eval_{method}", lambda m=method: _evaluate_arm(
            out, world, profile, m, details[f"train_{m}"]["checkpoint"]), console)
    first, second = (_read_predictions(details[f"eval_{m}"]["predictions"]) for m in STAGED_ARMS)
    table = claim_table(first, second, profile.accuracy_margin)
    return write_report(out, CLAIMS["staged"], table, STAGED_ARMS, details)


RUNNERS: dict[str, Callable[[Path, str, Any], Path]] = {"staged": reproduce_staged}


def reproduce(method: str, out: Path, profile: str, console: Any = None) -> Path:
    claim = CLAIMS.get(method)
    if claim is None:
        raise ConfigError(f"no claim registered for {method!r}; choose one of {', '.join(CLAIMS)}")
    if profile not in ("cpu", "gpu"):
        raise ConfigError(f"--profile must be cpu or gpu, got {profile!r}")
    if method not in RUNNERS:
        raise ConfigError(f"sleuth reproduce {method}: not implemented yet: needs {claim.needs}")
    return RUNNERS[method](out, profile, console)


def register(app: typer.Typer) -> None:
    repro = typer.Typer(help="Reproduce each paper's own claim end to end, with paired 95% intervals.",
                        no_args_is_help=True)
    app.add_typer(repro, name="reproduce")
    for claim in CLAIMS.values():
        _register_claim(repro, claim)


def _register_claim(repro: typer.Typer, claim: Claim) -> None:
    status = "" if claim.needs is None else f" NOT IMPLEMENTED YET (needs {claim.needs})."
    text = (f"{claim.claim}.{status}\n\nWorld: {claim.world}. Cold start: {claim.cold_start}. Arms: {claim.arms}. "
            f"Evaluation: {claim.evaluation}. Claim test: {claim.test}.")

    def command(
        profile: str = typer.Option("cpu", help="cpu (tiny model, minutes on 2 cores) or gpu (the measured sizes)"),
        out: Path = typer.Option(None, "--out", help="Run directory (default runs/reproduce/<method>); reruns resume"),
    ) -> None:
        from rich.console import Console
        from rich.markup import escape

        from sleuth.errors import SleuthError

        console = Console(soft_wrap=True)  # never break a path or the error across lines
        try:
            report = reproduce(claim.method, out or Path("runs/reproduce") / claim.method, profile, console)
        except SleuthError as err:
            console.print(f"[red]error:[/] {escape(str(err))}", highlight=False)
            raise typer.Exit(2) from None
        console.print(f"[green]report:[/] {escape(str(report))}", highlight=False)

    repro.command(claim.method, help=text, short_help=claim.claim + ("" if claim.needs is None else " (not implemented yet)"))(command)

