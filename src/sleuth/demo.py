"""`sleuth demo`: the embedded default, end to end on a laptop CPU with no network.

1. generate a synthetic world and build its BM25 and dense indexes;
2. evaluate direct answering, naive RAG and the untrained s3 searcher;
3. train the s3 searcher for a few RL steps with LoRA and save the checkpoint;
4. re-evaluate the trained searcher and write `runs/demo/report.html`.

The default uses the embedded SmolLM2-135M-Instruct as both searcher and frozen
generator (the generator is the base model with the LoRA adapters switched off,
so one copy of the weights serves both). `--fast` swaps in a tiny random model
and a smaller world: it checks the whole pipeline in about a minute (CI runs it).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import typer
import yaml


@dataclass(frozen=True)
class DemoSize:
    model: str
    passages: int
    questions: int
    hops: tuple[int, int]
    eval_questions: int
    train_steps: int
    prompts_per_step: int
    n: int
    max_new_tokens: int
    dense: bool
    lr: float
    max_turns: int = 2


# Sized for 2 CPU cores in under 10 minutes: on a CPU the cost is prefill of the long s3 prompt
# plus documents (~1k tokens per trajectory per turn) and the LoRA update over the same tokens.
FULL = DemoSize(
    model="smollm2-135m-instruct",
    passages=2000,
    questions=300,
    hops=(1, 3),
    eval_questions=12,
    train_steps=2,
    prompts_per_step=2,
    n=2,
    max_new_tokens=32,
    dense=True,
    lr=1e-4,
    max_turns=1,
)
# A real RL run for a GPU (docs/results.md): more questions, more steps, the paper's 3 turns.
GPU = DemoSize(
    model="smollm2-135m-instruct",
    passages=5000,
    questions=1000,
    hops=(1, 3),
    eval_questions=200,
    train_steps=6,
    prompts_per_step=16,
    n=5,
    max_new_tokens=64,
    dense=False,
    lr=2e-5,
)
FAST = DemoSize(
    model="tiny",
    passages=400,
    questions=80,
    hops=(1, 2),
    eval_questions=12,
    train_steps=2,
    prompts_per_step=2,
    n=2,
    max_new_tokens=16,
    dense=False,
    lr=1e-3,
)

NOTES = (
    "What this demo shows: every stage of sleuth runs end to end on a CPU with no network — a synthetic "
    "world no pretrained model can know, BM25 and dense indexes, prompted baselines, an s3 searcher trained "
    "with RL against a frozen generator, a saved LoRA checkpoint and this report.",
    "What it cannot show: that training improves the searcher. {steps} RL steps of {batch} trajectories on "
    "{eval_n} held-out questions is far too little signal for a 135M-parameter model; differences between the "
    "untrained and trained rows below are within noise (one question is {pct:.1f} points of accuracy). The "
    "papers train for hundreds of steps on GPUs — see docs/results.md for a measured GPU run.",
)


def s3_recipe(out: Path, size: DemoSize) -> dict[str, Any]:
    """The CPU-sized s3 recipe the demo trains (also written next to the run for re-use)."""
    return {
        "name": "s3-demo",
        "description": "s3 on the synthetic world with the embedded model (CPU-sized)",
        "seed": 0,
        "model": {"policy": size.model, "lora": {"enabled": True, "r": 8, "alpha": 16}},
        "data": {"train": str(out / "world" / "train.jsonl"), "max_train_examples": 200},
        "retriever": {"index": str(out / "world" / "bm25")},
        "agent": {
            "loop": "s3",
            "max_turns": size.max_turns,
            "top_k": 3,
            "max_new_tokens_per_turn": size.max_new_tokens,
            "max_obs_tokens": 256,
            "max_response_tokens": 1024,
        },
        "reward": {
            "name": "s3_gbr",
            "options": {"form": "code", "rag_k": 3, "generator_max_new_tokens": 24, "use_judge": False},
            "generator": "policy-base",
            "baseline_cache": str(out / "train" / "naive_rag_cache.jsonl"),
        },
        "algorithm": {
            "name": "grpo",
            "n": size.n,
            "prompts_per_step": size.prompts_per_step,
            "minibatch_size": size.n * size.prompts_per_step,
            "micro_batch_size": size.n,
            "kl": {"coef": 0.001, "mode": "loss", "estimator": "low_var_kl"},
        },
        "optim": {"lr": size.lr},
        "sampling": {"temperature": 0.6},
        "trainer": {
            "total_steps": size.train_steps,
            "save_every": max(1, min(size.train_steps, 2)),  # keep progress when a run is cut short
            "out_dir": str(out / "train"),
        },
    }


PROFILES = {"cpu": FULL, "fast": FAST, "gpu": GPU}


def run_demo(out: Path, profile: str, console: Any, model: str | None = None) -> Path:
    import torch
    from rich.panel import Panel

    from sleuth.agent.searcher import load_searcher
    from sleuth.data.formats import read_qa_jsonl
    from sleuth.data.synth import generate_world, write_world
    from sleuth.eval.harness import EvalConfig, evaluate
    from sleuth.eval.report import build_report
    from sleuth.llm.registry import load_generator
    from sleuth.retrieval import build_index, load_retriever
    from sleuth.rl.checkpoint import latest_checkpoint
    from sleuth.rl.config import recipe_from_dict
    from sleuth.rl.trainer import train

    size = PROFILES[profile]
    if model:
        size = replace(size, model=model)
    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t_all = time.perf_counter()

    def stage(title: str) -> float:
        console.print(Panel.fit(title, style="bold cyan"))
        return time.perf_counter()

    # 1. world and indexes
    t0 = stage(f"1/4  synthetic world ({size.passages} passages) and indexes")
    world = out / "world"
    if not (world / "corpus.jsonl").exists():
        write_world(generate_world(size.passages, size.questions, hops=size.hops, seed=0), world)
    if not (world / "bm25" / "manifest.json").exists():
        build_index(world / "corpus.jsonl", "bm25", world / "bm25")
    if size.dense and not (world / "dense" / "manifest.json").exists():
        build_index(world / "corpus.jsonl", "dense", world / "dense")
    timings["world_and_indexes_s"] = time.perf_counter() - t0
    retriever = load_retriever(world / "bm25", corpus=world / "corpus.jsonl")
    test = read_qa_jsonl(world / "test.jsonl")[: size.eval_questions]
    for ex in test:  # report accuracy per hop count
        ex.metadata["dataset"] = f"synth-{ex.metadata.get('hops', '?')}hop"

    # 2. baselines and the untrained searcher (one loaded model serves every method)
    t0 = stage(f"2/4  evaluate direct, naive RAG, untrained s3 ({len(test)} held-out questions)")
    base = load_generator(size.model)
    cfg = EvalConfig(
        batch_size=16,
        max_new_tokens=size.max_new_tokens,
        answer_max_new_tokens=24,
        top_k=3,
        max_turns=size.max_turns,
        max_response_tokens=1024,
        max_obs_tokens=256,
    )
    evaluate(
        ["direct", "naive-rag", "s3"],
        test,
        retriever,
        base,
        generator=base,
        out_dir=out / "eval_before",
        progress=True,
        config=cfg,
    )
    timings["eval_before_s"] = time.perf_counter() - t0
    del base

    # 3. train s3 with GRPO + LoRA against the frozen base model
    t0 = stage(
        f"3/4  train s3: {size.train_steps} GRPO steps x {size.prompts_per_step * size.n} trajectories, LoRA"
    )
    recipe_dict = s3_recipe(out, size)
    (out / "s3_recipe.yaml").write_text(yaml.safe_dump(recipe_dict, sort_keys=False))
    # a rerun (or a run killed mid-way) continues from the newest checkpoint
    resume = latest_checkpoint(out / "train") is not None
    result = train(
        recipe_from_dict(recipe_dict, source=str(out / "s3_recipe.yaml")), resume=resume, console=console
    )
    timings["train_s"] = time.perf_counter() - t0

    # 4. re-evaluate the trained searcher; the frozen generator is the untouched base model
    t0 = stage("4/4  evaluate the trained s3 searcher and write the report")
    searcher = load_searcher(result["checkpoint"])
    frozen = load_generator(size.model)
    evaluate(
        ["s3"],
        test,
        retriever,
        searcher.generator,
        generator=frozen,
        out_dir=out / "eval_after",
        config=cfg,
        progress=True,
    )
    timings["eval_after_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - t_all

    batch = size.prompts_per_step * size.n
    notes = [
        n.format(steps=size.train_steps, batch=batch, eval_n=len(test), pct=100 / max(1, len(test)))
        for n in NOTES
    ]
    notes.append("Wall time on this machine: " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()))
    (out / "demo.json").write_text(
        json.dumps({"size": size.__dict__, "timings": timings}, indent=2, default=list)
    )
    report = build_report(out, title="sleuth demo: s3 on a synthetic world", notes=notes)
    console.print(f"[green]report:[/] {report}   checkpoint: {result['checkpoint']}")
    return report


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo_cmd(
        out: str = typer.Option("runs/demo", help="Run directory"),
        fast: bool = typer.Option(
            False, "--fast", help="Tiny local model and a small world (about a minute)"
        ),
        profile: str = typer.Option(
            "cpu", help="cpu (default, ~10 min on 2 cores), fast, or gpu (a real RL run)"
        ),
        model: str = typer.Option(None, help="Override the model (alias, directory or .gguf file)"),
    ) -> None:
        """Run the embedded default end to end: world, indexes, baselines, s3 training, report."""
        from rich.console import Console

        from sleuth.errors import SleuthError

        console = Console()
        try:
            if profile not in PROFILES:
                raise typer.BadParameter(f"--profile must be one of {', '.join(PROFILES)}")
            run_demo(Path(out), "fast" if fast else profile, console, model=model)
        except SleuthError as err:
            console.print(f"[red]error:[/] {err}")
            raise typer.Exit(2) from None
