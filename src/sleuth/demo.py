"""`sleuth demo`: the embedded default, end to end on a laptop CPU with no network.

1. generate the synthetic world the committed searchers were trained on, and its BM25 index;
2. evaluate the committed GPU-trained searcher (`checkpoints/<method>`, docs/results.md) beside naive
   RAG with the frozen base model as reader, on held-out questions, with bootstrap intervals and the
   paired difference: this is the effect of training;
3. run the whole training pipeline at CPU size: oracle trajectories, a short SFT, then RL with groups
   of at least 4 samples started from the SFT checkpoint (LoRA), and save the checkpoint;
4. write `runs/demo/report.html` (tables, intervals, SFT and RL curves, trajectories).

The default method is search_r1, whose committed searcher shows the largest measured effect. The CPU
steps show that every stage works, not that they improve the agent: a 135M model on 2 cores manages a
few SFT examples and one or two RL steps. `--fast` swaps in a tiny random model and a small world (about a
minute; CI runs it). `--method` runs another method's loop, oracle and reward (s3, r_search, staged,
qagent); `--profile gpu` sizes the pipeline like the measured GPU runs of bench/learning.py.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from sleuth.agent.registry import Method, get_method
from sleuth.data.formats import read_qa_jsonl
from sleuth.data.synth import generate_world, write_world
from sleuth.errors import ConfigError, SleuthError
from sleuth.eval.compare import headline
from sleuth.retrieval import build_index, load_retriever
from sleuth.rl.trajectory_commands import TrajectorySource, recipe_trajectories
from sleuth.run_layout import SEARCHER_FILE, SearcherInfo, latest_checkpoint
from sleuth.utils import atomic_write_json

# The world of bench/learning.py, where the committed searchers were trained and evaluated.
LEARNING_WORLD = {"passages": 5000, "questions": 6000, "hops": (1, 3), "seed": 0}
REPO_CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"


@dataclass(frozen=True)
class DemoSize:
    model: str
    passages: int
    questions: int
    hops: tuple[int, int]
    committed_questions: int  # held-out questions for the committed searcher vs naive RAG (0: skip)
    sft_questions: int  # oracle trajectories for the short SFT
    sft_epochs: int
    train_steps: int
    prompts_per_step: int
    n: int  # samples per prompt: >= 4, so a group's rewards differ and updates carry signal
    max_new_tokens: int
    lr: float
    eval_questions: int = 0  # held-out questions for the agent trained here (0: skip)
    max_turns: int = 2
    # Rollout decoding: False = HF's dynamic cache (CPU profiles); None = the recipe's "auto" (sleuth's decode
    # engine on CUDA: no per-shape compile, which took 288 s of a 48-step H100 run's 850 s on the compiled
    # static cache); True = the compiled static cache (`--compile`)
    compile_generation: bool | None = False
    eval_batch_size: int = 16  # questions per evaluation batch (the GPU profile's 500 in batches of 128)
    # Trajectories per forward/backward, SFT and GRPO update (0: one group of n). The sum over micro-batches is
    # normalised by the whole batch, so they change memory and speed, not the update. A 135M LoRA policy's
    # forward/backward is ~40,000 aten ops whatever its length (CPU profile: SmolLM2-135M, LoRA on 7 projections),
    # so on a GPU each pass costs its dispatch (~0.25-0.35 s a pass in the 2026-11-28 H100 claim runs):
    # the GPU profiles take large batches (4 SFT trajectories; 2 groups of an 80-trajectory GRPO minibatch: 4 groups,
    # ~40k tokens a pass, peaked at 64-68 GiB allocated on the 2026-11-28 H200 claim runs, too near an H100's 80 GB
    # for qagent's longer rollouts; activations scale with the pass's tokens, so 10 trajectories need about half).
    sft_micro: int = 2
    rl_micro: int = 0


def rl_micro_batch(size: DemoSize) -> int:
    """Trajectories a GRPO pass takes: `rl_micro` (0: one group of n) cut down to a divisor of the minibatch, which
    the recipe requires (a profile of 8 prompts x 16 samples with passes of 10 would be refused at its first step)."""
    minibatch = size.n * size.prompts_per_step
    wanted = min(size.rl_micro or size.n, minibatch)
    return max(k for k in range(1, wanted + 1) if minibatch % k == 0)


# Sized for 2 CPU cores in under 10 minutes: the committed searcher's evaluation is most of it.
FULL = DemoSize(
    model="smollm2-135m-instruct",
    passages=5000,
    questions=6000,
    hops=(1, 3),
    committed_questions=24,
    sft_questions=8,
    sft_epochs=1,
    train_steps=1,
    prompts_per_step=2,
    n=4,
    max_new_tokens=48,
    lr=1e-4,
)
# A GPU run sized like bench/learning.py's (docs/results.md).
GPU = DemoSize(
    model="smollm2-135m-instruct",
    passages=5000,
    questions=6000,
    hops=(1, 3),
    committed_questions=500,
    sft_questions=1200,
    sft_epochs=2,
    train_steps=15,
    prompts_per_step=16,
    n=5,
    max_new_tokens=64,
    lr=5e-5,
    eval_questions=500,
    max_turns=4,
    compile_generation=None,
    eval_batch_size=128,
    sft_micro=4,
    rl_micro=10,
)
FAST = DemoSize(
    model="tiny",
    passages=400,
    questions=80,
    hops=(1, 2),
    committed_questions=0,
    sft_questions=8,
    sft_epochs=2,
    train_steps=2,
    prompts_per_step=2,
    n=4,
    max_new_tokens=16,
    lr=1e-3,
    eval_questions=8,
)


# The demo trains the built-in methods (their loop, default reward and title come from the registry).
DEMO_METHODS = ("s3", "r_search", "search_r1", "qagent", "staged")


NOTES = (
    "What this demo shows. The first table compares the committed searcher (checkpoints/{method}, trained "
    "on a GPU by bench/learning.py: oracle-trajectory SFT then GRPO, see docs/results.md) with naive RAG "
    "on {n_committed} held-out questions, with 95% bootstrap intervals and the paired difference: that "
    "is the effect of training. The rest is the pipeline at CPU size: {traj} oracle trajectories, a short "
    "SFT of the base model on them, then {steps} GRPO step(s) of {prompts} questions x {n} samples starting "
    "from {rl_start}. These CPU steps show that every stage runs; they are far too small to change the agent.",
)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def demo_recipe(out: Path, size: DemoSize, method: str = "search_r1") -> dict[str, Any]:
    """The recipe the demo trains (also written next to the run for re-use with `sleuth train`)."""
    spec = get_method(method)
    # a deep copy: a caller that edits the recipe (overrides, `sleuth reproduce`'s arms) must never edit the method
    # registry's default reward through shared nested dicts
    reward = copy.deepcopy(spec.default_reward)
    if spec.demo_reward is not None:  # the method's own changes for a demo-sized run
        reward = spec.demo_reward(reward, out, size.train_steps)
    return {
        "name": f"{method}-demo",
        "description": f"{method} on the synthetic world with the embedded model (demo-sized)",
        "seed": 0,
        "model": {
            "policy": size.model,
            "lora": {"enabled": True, "r": 16, "alpha": 32},
            # GPU decoding (engine or static cache) wants bf16 rollout weights: a bf16 frozen base (adapters fp32)
            "dtype": "bfloat16" if size.compile_generation is not False and _cuda() else "auto",
            "generation_cache": {True: "static", None: "auto", False: "dynamic"}[size.compile_generation],
            "compile_generation": size.compile_generation,
        },
        "data": {"train": str(out / "world" / "train.jsonl")},
        "retriever": {"index": str(out / "world" / "bm25")},
        "agent": {
            "loop": spec.name,
            "max_turns": size.max_turns,
            "top_k": 3,
            "max_new_tokens_per_turn": size.max_new_tokens * spec.new_tokens_factor,
            "max_obs_tokens": 384,
            "max_response_tokens": 2048,
        },
        "reward": reward,
        "algorithm": {
            "name": "grpo",
            "n": size.n,
            "prompts_per_step": size.prompts_per_step,
            "minibatch_size": size.n * size.prompts_per_step,
            "micro_batch_size": rl_micro_batch(size),
            "kl": {"coef": 0.0},  # RL starts from the SFT adapters; a KL to the base model would undo them
        },
        "optim": {"lr": size.lr},
        "sampling": {"temperature": 1.0},
        "trainer": {
            "total_steps": size.train_steps,
            "save_every": max(1, min(size.train_steps, 5)),  # keep progress when a run is cut short
            "out_dir": str(out / "train"),
        },
        "sft": {
            "data": str(out / "trajectories.jsonl"),
            "epochs": size.sft_epochs,
            "lr": 3e-4 if size.model != "tiny" else 3e-3,
            "batch_size": 4,
            "micro_batch_size": size.sft_micro,
            "held_out": 0.0,
            "save_every": 100,  # a cold start cut short (a lease ended) resumes from its last hundred steps
        },
    }


PROFILES = {"cpu": FULL, "fast": FAST, "gpu": GPU}


class _Timer:
    """Wall time per stage, summed over invocations (a killed run resumes; its finished stages count)."""

    def __init__(self, path: Path, method: str, size: DemoSize, console: Any):
        self.path, self.method, self.size, self.console = path, method, size, console
        self.earlier = json.loads(path.read_text()).get("timings", {}) if path.exists() else {}
        self.timings: dict[str, float] = {}

    def stage(self, title: str) -> float:
        from rich.panel import Panel

        self.console.print(Panel.fit(title, style="bold cyan"))
        return time.perf_counter()

    def record(self, key: str, start: float) -> None:
        self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - start
        keys = [k for k in (*self.earlier, *self.timings) if k != "total_s"]  # stage order, first seen first
        total = {k: self.earlier.get(k, 0.0) + self.timings.get(k, 0.0) for k in dict.fromkeys(keys)}
        total["total_s"] = sum(total.values())
        atomic_write_json(self.path, {"method": self.method, "size": self.size.__dict__, "timings": total})

    def totals(self) -> dict[str, float]:
        return json.loads(self.path.read_text())["timings"]


def committed_checkpoint(method: str, size: DemoSize, option: str | None) -> Path | None:
    """The GPU-trained searcher to show: --checkpoint, else checkpoints/<method> when its base is the
    profile's model and the world is the one it was trained on."""
    if option == "none":
        return None
    if option:
        return Path(option)
    path = REPO_CHECKPOINTS / method
    world = (size.passages, size.questions, size.hops) == (
        LEARNING_WORLD["passages"],
        LEARNING_WORLD["questions"],
        LEARNING_WORLD["hops"],
    )
    if not (path / SEARCHER_FILE).exists() or not world:
        return None
    return path if SearcherInfo.read(path).base_model == size.model else None


def _build_world(out: Path, size: DemoSize) -> None:
    world = out / "world"
    if not (world / "corpus.jsonl").exists():
        write_world(
            generate_world(size.passages, size.questions, hops=size.hops, seed=LEARNING_WORLD["seed"]), world
        )
    if not (world / "bm25" / "manifest.json").exists():
        build_index(world / "corpus.jsonl", "bm25", world / "bm25")


def held_out_questions(world: Path, count: int) -> list:
    """The first `count` test questions of a synthetic world, each reported under its hop count."""
    test = read_qa_jsonl(world / "test.jsonl")[:count]
    for ex in test:
        ex.metadata["dataset"] = f"synth-{ex.metadata.get('hops', '?')}hop"
    return test


def _evaluate_committed(
    out: Path, size: DemoSize, spec: Method, ckpt: Path, retriever: Any
) -> dict[str, Any]:
    # deferred: the harness loads model and hub code; `sleuth --help` imports this module
    from sleuth.agent.searcher import load_searcher
    from sleuth.eval.harness import EvalConfig, EvalOutput, checkpoint_budgets, evaluate
    from sleuth.llm.registry import load_generator

    searcher = load_searcher(ckpt)
    cfg = EvalConfig(
        batch_size=size.committed_questions, answer_max_new_tokens=24, **checkpoint_budgets(ckpt)
    )
    return evaluate(
        [spec.display_name, "naive-rag"],
        held_out_questions(out / "world", size.committed_questions),
        retriever,
        searcher.generator,
        generator=load_generator(size.model),
        config=cfg,
        out_dir=EvalOutput(out / "eval_committed", run_info={"checkpoint": str(ckpt)}, progress=True),
    )


def write_oracle_trajectories(out: Path, recipe: Any, size: DemoSize) -> dict[str, int]:
    """The recipe's oracle cold-start trajectories under `out` (the demo's and `sleuth reproduce`'s SFT data)."""
    path = out / "trajectories.jsonl"
    if path.exists():
        return {"kept": sum(1 for _ in path.open())}
    return recipe_trajectories(recipe, path, TrajectorySource(limit=size.sft_questions))


def run_demo(
    out: Path,
    profile: str,
    console: Any,
    model: str | None = None,
    method: str = "search_r1",
    steps: int | None = None,
    compile_generation: bool | None = None,
    checkpoint: str | None = None,
) -> Path:
    import torch

    # deferred: the harness, the report and training load torch; `sleuth --help` imports this module
    from sleuth.agent.searcher import load_searcher
    from sleuth.eval.harness import EvalConfig, EvalOutput, evaluate
    from sleuth.eval.report import build_report
    from sleuth.llm.registry import load_generator
    from sleuth.rl.config import write_recipe
    from sleuth.rl.sft import run_sft
    from sleuth.rl.trainer import train

    if method not in DEMO_METHODS:
        raise ConfigError(
            f"--method {method!r} is not a demo method; choose one of {', '.join(DEMO_METHODS)}"
        )
    spec = get_method(method)
    size = PROFILES[profile]
    if model:
        size = replace(size, model=model)
    if steps is not None:
        if steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {steps}")
        size = replace(size, train_steps=steps)
    if compile_generation is not None:
        size = replace(size, compile_generation=compile_generation)
    committed = committed_checkpoint(method, size, checkpoint)
    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    timer = _Timer(out / "demo.json", method, size, console)

    t0 = timer.stage(
        f"1/4  synthetic world ({size.passages} passages, {size.questions} questions) and BM25 index"
    )
    _build_world(out, size)
    timer.record("world_and_index_s", t0)
    retriever = load_retriever(out / "world" / "bm25", corpus=out / "world" / "corpus.jsonl")

    committed_line = None
    if committed is not None:
        t0 = timer.stage(
            f"2/4  the GPU-trained searcher {committed} vs naive RAG ({size.committed_questions} "
            "held-out questions)"
        )
        committed_line = headline(
            _evaluate_committed(out, size, spec, committed, retriever), spec.display_name
        )
        timer.record("eval_committed_s", t0)
        if committed_line:
            console.print(
                f"[bold green]the GPU-trained searcher vs naive RAG[/] ({escape(committed.name)}): "
                f"{escape(committed_line)}",
                highlight=False,
                soft_wrap=True,
            )
    else:
        console.print(
            "[yellow]2/4  no committed GPU-trained searcher for this method/model/world: skipped[/]"
        )

    recipe_dict = demo_recipe(out, size, method)
    recipe = write_recipe(recipe_dict, out / f"{method}_recipe.yaml")
    t0 = timer.stage(
        f"3/4  pipeline: oracle trajectories ({size.sft_questions} questions), SFT, then "
        f"{size.train_steps} GRPO step(s) x {size.prompts_per_step} questions x {size.n} samples"
    )
    traj = write_oracle_trajectories(out, recipe, size)
    sft = run_sft(recipe, resume=True, console=console)
    # RL continues the committed searcher when there is one: a few CPU SFT steps leave a 135M model
    # answering nothing right, so every group would have equal rewards and the update no signal.
    start = committed if committed is not None and size.model != "tiny" else Path(sft["checkpoint"])
    rl_recipe = recipe.model_copy(
        update={"sft": None, "model": recipe.model.model_copy(update={"init_from": str(start)})}
    )
    resumable = latest_checkpoint(out / "train") is not None  # else a killed attempt's steps are moved aside
    result = train(rl_recipe, resume=resumable, overwrite=not resumable, console=console)
    timer.record("pipeline_s", t0)

    t0 = timer.stage("4/4  evaluate the agent trained here, write the report")
    after_line = None
    if size.eval_questions:
        searcher = load_searcher(result["checkpoint"])
        cfg = EvalConfig(
            batch_size=size.eval_batch_size,
            max_new_tokens=size.max_new_tokens * spec.new_tokens_factor,
            answer_max_new_tokens=24,
            top_k=3,
            max_turns=size.max_turns,
            max_response_tokens=2048,
            max_obs_tokens=384,
        )
        after = evaluate(
            [spec.display_name, "naive-rag"],
            held_out_questions(out / "world", size.eval_questions),
            retriever,
            searcher.generator,
            generator=load_generator(size.model),
            config=cfg,
            out_dir=EvalOutput(out / "eval_after", progress=True),
        )
        after_line = headline(after, spec.display_name)
    notes = [
        n.format(
            method=method,
            n_committed=size.committed_questions if committed else 0,
            traj=traj.get("kept", 0),
            steps=size.train_steps,
            prompts=size.prompts_per_step,
            n=size.n,
            rl_start="the committed searcher (so that a group's rewards differ and the update carries signal)"
            if start == committed
            else "the SFT checkpoint",
        )
        for n in NOTES
    ]
    if committed is None:
        notes.append("No committed GPU-trained searcher was evaluated in this run (see docs/results.md).")
    # the page and the console end open with the comparison the demo exists to show
    top = (
        f"GPU-trained searcher vs naive RAG: {committed_line}"
        if committed_line
        else f"searcher trained here vs naive RAG: {after_line}"
        if after_line
        else None
    )
    report = build_report(out, title=f"sleuth demo: {method} on a synthetic world", notes=notes, headline=top)
    timer.record("eval_and_report_s", t0)
    notes_time = ", ".join(f"{k} {v:.0f}s" for k, v in timer.totals().items())
    console.print(
        f"[green]report:[/] {report}   checkpoint: {result['checkpoint']}   wall time: {notes_time}"
    )
    if top:
        console.print(f"[bold green]{escape(top)}[/]", highlight=False, soft_wrap=True)
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
        method: str = typer.Option("search_r1", help=f"Method to train: {', '.join(DEMO_METHODS)}"),
        steps: int = typer.Option(None, help="Override the number of RL steps of the profile"),
        checkpoint: str = typer.Option(
            None,
            help="GPU-trained searcher to evaluate beside naive RAG (default: checkpoints/<method> of the "
            "repository, when it exists); 'none' skips it",
        ),
        compile_generation: bool = typer.Option(
            None,
            "--compile/--no-compile",
            help="Compiled static-cache decoding in rollouts (default: the gpu profile "
            "decodes with sleuth's engine, the cpu profiles with HF's dynamic cache)",
        ),
    ) -> None:
        """Run the embedded default end to end: world, indexes, baselines, training, report."""
        from rich.console import Console

        console = Console()
        try:
            if profile not in PROFILES:
                raise typer.BadParameter(f"--profile must be one of {', '.join(PROFILES)}")
            run_demo(
                Path(out),
                "fast" if fast else profile,
                console,
                model=model,
                method=method,
                steps=steps,
                compile_generation=compile_generation,
                checkpoint=checkpoint,
            )
        except SleuthError as err:
            console.print(f"[red]error:[/] {err}")
            raise typer.Exit(2) from None
