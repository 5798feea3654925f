"""Measured learning on the synthetic world: oracle trajectories -> SFT -> RL -> evaluation, per method.

    PYTHONPATH=src python bench/learning.py run --out runs/learn --model MODEL --gpus 4
    PYTHONPATH=src python bench/learning.py status --out runs/learn

Per method (by registered name: s3, search_r1, staged, r_search, qagent by default; a plugin's with
`--plugins MODULE,...`, e.g. stepsearch, zerosearch, tree_search) it writes oracle trajectories of the training
questions, fine-tunes the model on them (`full`: every trajectory; `warm`: a small format warm-up of
`--warm` trajectories, s3 and search_r1 only), runs RL from each SFT checkpoint, and evaluates every
checkpoint on the same held-out questions. A method's recipe sections are its own: its `default_reward`, the
budget of BUILTIN (else Search-R1's) and what it adds (`Method.recipe_sections`); its cold start is its oracle
(`Method.oracle_planner`, or the one its `oracle_format` names). Shared rows: naive RAG and the oracle (gold
passages) with the frozen base model as reader, and the base model's direct answer. Every stage writes a marker
when it is complete, so rerunning the same command continues where an interrupted run stopped (RL and SFT
resume from their checkpoints). Work is spread over `--gpus` lanes (one process per GPU; LEARN_LANES may give
more lanes than GPUs, which then share them round-robin).
Results: OUT/<method>/<variant>/{sft,checkpoints,metrics.jsonl}, OUT/<method>/eval_<variant>_{sft,rl}/,
OUT/shared/eval_*, OUT/status.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from sleuth.agent.registry import RunShape, get_method, load_plugins, method_plugins
from sleuth.run_layout import REWARD_EVERY_ROLLOUT, REWARD_KEPT, groups_filtered, policy_reward
from sleuth.utils import atomic_write_json

METHODS = ("s3", "search_r1", "staged", "r_search", "qagent")  # the default --methods
# The built-in methods' budgets on this world and model (tokens per turn: the oracle's turns are far shorter;
# documents per search and their budget), and which also get a small warm-up SFT (`warm`): bench choices, one table.
# Every method's reward is its own `default_reward`; a method not in this table (a plugin's) gets Search-R1's
# budget and the sections it gives itself (`Method.recipe_sections`).
BUILTIN: dict[str, dict[str, Any]] = {
    "s3": {
        "agent": {"max_new_tokens_per_turn": 80, "top_k": 5, "max_obs_tokens": 480},
        "warm": True,
        "cost": 4,
    },
    "search_r1": {
        "agent": {"max_new_tokens_per_turn": 96, "top_k": 3, "max_obs_tokens": 384},
        "warm": True,
        "cost": 3,
    },
    "staged": {"agent": {"max_new_tokens_per_turn": 96, "top_k": 3, "max_obs_tokens": 384}, "cost": 3},
    "r_search": {"agent": {"max_new_tokens_per_turn": 160, "top_k": 3, "max_obs_tokens": 384}, "cost": 4},
    "qagent": {"agent": {"max_new_tokens_per_turn": 128, "top_k": 1, "max_obs_tokens": 384}, "cost": 3},
}
OTHER = {"agent": {"max_new_tokens_per_turn": 96, "top_k": 3, "max_obs_tokens": 384}, "cost": 3}
MAX_RESPONSE_TOKENS = 2048


@dataclass
class Size:
    passages: int = 5000
    questions: int = 6000
    test: int = 500
    sft_questions: int = 1200
    warm: int = 64
    rl_steps: int = 30
    prompts_per_step: int = 16
    n: int = 5
    eval_batch: int = 250
    sft_epochs: int = 2
    warm_epochs: int = 6
    sft_micro: int = 8
    # validation during RL: the same dev questions, greedy, scored by the method's reward (sleuth.rl.validate)
    val_examples: int = 200
    val_every: int = 10


CPU_SIZE = Size(
    passages=400,
    questions=200,
    test=12,
    sft_questions=24,
    warm=6,
    rl_steps=2,
    prompts_per_step=2,
    n=4,
    eval_batch=12,
    sft_epochs=1,
    warm_epochs=1,
    sft_micro=2,
    val_examples=4,
    val_every=2,
)


def run_size(cpu: bool) -> Size:
    """The run's size; LEARN_VAL_EXAMPLES / LEARN_VAL_EVERY change validation (more questions resolve a smaller
    change of the reward, fewer validations leave more of a lease to training)."""
    size = CPU_SIZE if cpu else Size()
    overrides = {
        field: int(os.environ[var])
        for field, var in (("val_examples", "LEARN_VAL_EXAMPLES"), ("val_every", "LEARN_VAL_EVERY"))
        if os.environ.get(var)
    }
    return replace(size, **overrides)


def rl_steps(method: str, size: Size) -> int:
    """LEARN_RL_STEPS="r_search=20,...": fewer RL steps for some methods (a lease's time is short)."""
    pairs = [p.split("=") for p in os.environ.get("LEARN_RL_STEPS", "").split(",") if p]
    return {name: int(steps) for name, steps in pairs}.get(method, size.rl_steps)


def merged(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`extra` over `base`, section by section (a None value keeps its key, as a recipe's unset field)."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = (
            merged(out[key], value)
            if isinstance(value, Mapping) and isinstance(out.get(key), dict)
            else copy.deepcopy(value)
        )
    return out


def method_sections(method: str, model: str, size: Size) -> dict[str, Any]:
    """The method's own recipe sections for this run: its loop and budget (BUILTIN, else Search-R1's), its
    `default_reward`, its plugin module and whatever it adds itself (`Method.recipe_sections`: algorithm
    overrides, loop options, a training retriever)."""
    m = get_method(method)
    settings = BUILTIN.get(m.name, OTHER)
    sections: dict[str, Any] = {
        "plugins": method_plugins(m.name),
        "agent": {"loop": m.name, **settings["agent"], "max_response_tokens": MAX_RESPONSE_TOKENS},
        "reward": copy.deepcopy(dict(m.default_reward)),
    }
    if m.recipe_sections is not None:
        shape = RunShape(
            model=model, total_steps=rl_steps(m.name, size), prompts_per_step=size.prompts_per_step, n=size.n
        )
        sections = merged(sections, m.recipe_sections(shape))
    return sections


def recipe_for(
    out: Path, method: str, variant: str, model: str, size: Size, encoder: str | None, training: bool = False
) -> dict[str, Any]:
    """The run's recipe of `method`; `training`: RL's (a method's own training retriever, e.g. a simulated one,
    replaces the world's index; the cold start and SFT read the index)."""
    own = method_sections(method, model, size)
    reward = own.pop("reward")
    if reward["name"] == "s3_gbr":
        reward["baseline_cache"] = str(out / method / variant / "naive_rag_cache.jsonl")
    if reward["name"] == "staged":
        reward["encoder"] = encoder
        # stage 2 from step 11 (runs under LEARN_RL_MINUTES may stop before rl_steps)
        reward["options"]["switch_step"] = max(1, min(10, rl_steps(method, size) // 2))
    if not training:
        own.pop("retriever", None)
    world = out / "shared" / "world"
    data: dict[str, Any] = {
        "name": f"learn-{method}-{variant}",
        "plugins": own.pop("plugins"),
        "seed": 0,
        "model": {"policy": model, "lora": {"enabled": True, "r": 16, "alpha": 32}},
        "data": {"train": str(world / "train.jsonl"), "dev": str(world / "dev.jsonl")},
        "retriever": {"index": str(world / "bm25")},
        "agent": own.pop("agent"),
        "reward": reward,
        # From the warm-up most groups have equal rewards (measured: 3-5% correct); DAPO's dynamic sampling
        # refills the step with groups that carry signal.
        "algorithm": {
            "name": "grpo",
            "n": size.n,
            "prompts_per_step": size.prompts_per_step,
            "minibatch_size": size.n * size.prompts_per_step,
            "micro_batch_size": 4,
            "kl": {"coef": 0.0},
            "dynamic_sampling": variant == "warm",
        },
        "optim": {"lr": 5e-5, "warmup_steps": 0},
        "sampling": {"temperature": 1.0},
        "trainer": {
            "total_steps": rl_steps(method, size),
            "save_every": 5,
            "out_dir": str(out / method / variant),
            "eval_every": size.val_every,
            "eval_examples": size.val_examples,
            "time_limit_minutes": float(os.environ["LEARN_RL_MINUTES"])
            if os.environ.get("LEARN_RL_MINUTES")
            else None,
        },
        "sft": {
            "data": str(out / method / "trajectories.jsonl"),
            "epochs": size.sft_epochs if variant == "full" else size.warm_epochs,
            "lr": 3e-4,
            "batch_size": 16 if variant == "full" else 8,
            "micro_batch_size": size.sft_micro,
            "held_out": 0.05,
            "limit": None if variant == "full" else size.warm,
        },
    }
    data = merged(data, own)
    if not data["plugins"]:
        del data["plugins"]
    return data


# -- stages ---------------------------------------------------------------------------------------------------


def marker(out: Path, name: str) -> Path:
    return out / "done" / f"{name}.json"


def stage(out: Path, name: str, fn, *args) -> Any:
    """Run `fn` once: a marker records completion and its result (rerun = skip)."""
    path = marker(out, name)
    if path.exists():
        return json.loads(path.read_text())
    t0 = time.time()
    print(f"[{time.strftime('%H:%M:%S')}] start {name}", flush=True)
    result = fn(*args) or {}
    result = {**result, "seconds": time.time() - t0}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, result)
    print(f"[{time.strftime('%H:%M:%S')}] done {name} in {result['seconds']:.0f}s", flush=True)
    return result


def make_world(out: Path, size: Size) -> dict:
    from sleuth.data.synth import generate_world, write_world
    from sleuth.retrieval import build_index

    world = out / "shared" / "world"
    write_world(generate_world(size.passages, size.questions, hops=(1, 3), seed=0), world)
    build_index(world / "corpus.jsonl", "bm25", world / "bm25")
    return {"world": str(world)}


def test_questions(out: Path, size: Size):
    from sleuth.demo import held_out_questions

    return held_out_questions(out / "shared" / "world", size.test)


def make_trajectories(out: Path, method: str, model: str, size: Size) -> dict:
    from sleuth.agent.coldstart import read_records
    from sleuth.rl.config import recipe_from_dict
    from sleuth.rl.trajectory_commands import TrajectorySource, recipe_trajectories

    recipe = recipe_from_dict(recipe_for(out, method, "full", model, size, None))
    path = out / method / "trajectories.jsonl"
    stats = recipe_trajectories(recipe, path, TrajectorySource(limit=size.sft_questions))
    lengths = sorted(len(r.prompt_ids) + len(r.response_ids) for r in read_records(path))
    return {**stats, "median_tokens": lengths[len(lengths) // 2], "max_tokens": lengths[-1]}


def sft(out: Path, method: str, variant: str, model: str, size: Size) -> dict:
    from sleuth.rl.config import recipe_from_dict
    from sleuth.rl.sft import run_sft

    recipe = recipe_from_dict(recipe_for(out, method, variant, model, size, None))
    result = run_sft(recipe, resume=True)
    return {"checkpoint": result["checkpoint"], **result["metrics"]}


def rl(
    out: Path, method: str, variant: str, model: str, size: Size, sft_ckpt: str, encoder: str | None
) -> dict:
    from sleuth.rl.checkpoint import latest_checkpoint
    from sleuth.rl.config import recipe_from_dict
    from sleuth.rl.trainer import train

    data = recipe_for(out, method, variant, model, size, encoder, training=True)
    data["model"]["init_from"] = sft_ckpt
    recipe_path = out / method / variant / "recipe.yaml"
    recipe_path.parent.mkdir(parents=True, exist_ok=True)
    recipe_path.write_text(yaml.safe_dump(data, sort_keys=False))
    run_dir = out / method / variant
    resumable = latest_checkpoint(run_dir) is not None  # else a killed attempt's steps are moved aside
    result = train(recipe_from_dict(data), resume=resumable, overwrite=not resumable)
    return {"checkpoint": result["checkpoint"]}


def eval_config(agent: Mapping[str, Any], size: Size):
    """Evaluation with a recipe's `agent` budget (tokens per turn, documents per search and their budget)."""
    from sleuth.eval.harness import EvalConfig

    return EvalConfig(
        batch_size=size.eval_batch,
        max_new_tokens=agent["max_new_tokens_per_turn"],
        answer_max_new_tokens=24,
        top_k=agent["top_k"],
        max_obs_tokens=agent["max_obs_tokens"],
        max_response_tokens=agent["max_response_tokens"],
    )


def evaluate_checkpoint(out: Path, method: str, ckpt: str, name: str, model: str, size: Size) -> dict:
    from sleuth.agent.searcher import load_searcher
    from sleuth.eval.harness import evaluate
    from sleuth.llm.registry import load_generator
    from sleuth.retrieval import load_retriever

    world = out / "shared" / "world"
    retriever = load_retriever(world / "bm25", corpus=world / "corpus.jsonl")
    searcher = load_searcher(ckpt)
    frozen = load_generator(model)
    agent = method_sections(method, model, size)["agent"]
    summary = evaluate(
        [get_method(method).display_name, "direct"],
        test_questions(out, size),
        retriever,
        searcher.generator,
        generator=frozen,
        out_dir=out / method / f"eval_{name}",
        config=eval_config(agent, size),
    )
    return {"summary": {m: s.get("overall") or next(iter(s.values())) for m, s in summary["methods"].items()}}


def evaluate_shared(out: Path, model: str, size: Size) -> dict:
    """Naive RAG, the oracle (gold passages) and direct answers, all by the frozen base model."""
    from sleuth.eval.harness import evaluate
    from sleuth.llm.registry import load_generator
    from sleuth.retrieval import load_retriever

    world = out / "shared" / "world"
    retriever = load_retriever(world / "bm25", corpus=world / "corpus.jsonl")
    summary = evaluate(
        ["direct", "naive-rag", "oracle"],
        test_questions(out, size),
        retriever,
        load_generator(model),
        out_dir=out / "shared" / "eval_base",
        config=eval_config({**BUILTIN["s3"]["agent"], "max_response_tokens": MAX_RESPONSE_TOKENS}, size),
    )
    overall = {k: v.get("overall") or next(iter(v.values())) for k, v in summary["methods"].items()}
    return {"summary": overall, "oracle_span": overall["oracle"]["span_check"]}


def method_jobs(method: str) -> list[str]:
    variants = ("full", "warm") if BUILTIN.get(method, OTHER).get("warm") else ("full",)
    return [f"{method}:{v}" for v in variants]


def run_job(out: Path, job: str, model: str, size: Size, encoder: str | None) -> None:
    if job == "shared":
        stage(out, "shared_eval", evaluate_shared, out, model, size)
        return
    method, variant = job.split(":")
    # LEARN_EVAL=0: train and validate only (the held-out rows of an earlier run stand; saves ~4 GPU-min a job)
    held_out = os.environ.get("LEARN_EVAL", "1") != "0"
    stage(out, f"{method}_trajectories", make_trajectories, out, method, model, size)
    s = stage(out, f"{method}_{variant}_sft", sft, out, method, variant, model, size)
    if held_out:
        stage(
            out,
            f"{method}_{variant}_eval_sft",
            evaluate_checkpoint,
            out,
            method,
            s["checkpoint"],
            f"{variant}_sft",
            model,
            size,
        )
    if method == "staged" and encoder and not Path(encoder).exists() and encoder != "minilm":
        for _ in range(120):  # the encoder arrives with a later call (carry limit); wait for it
            if Path(encoder).exists():
                break
            time.sleep(10)
    r = stage(out, f"{method}_{variant}_rl", rl, out, method, variant, model, size, s["checkpoint"], encoder)
    if held_out:
        stage(
            out,
            f"{method}_{variant}_eval_rl",
            evaluate_checkpoint,
            out,
            method,
            r["checkpoint"],
            f"{variant}_rl",
            model,
            size,
        )


def lane(args) -> None:
    # LEARN_NO_CUDNN_SDPA=qagent,...: lanes with these methods' jobs turn cuDNN's attention off (it once failed
    # mid-run in qagent's decoding: mha_graph.execute); PyTorch's own flash / memory-efficient kernels serve
    avoid = set(os.environ.get("LEARN_NO_CUDNN_SDPA", "").split(",")) - {""}
    if avoid & {job.split(":")[0] for job in args.jobs.split(",")}:
        import torch

        torch.backends.cuda.enable_cudnn_sdp(False)
        print("cuDNN SDPA off in this lane", flush=True)
    out = Path(args.out)
    size = run_size(args.cpu)
    for job in args.jobs.split(","):
        try:
            run_job(out, job, args.model, size, args.encoder)
        except Exception:  # one failing job must not stop the lane's other jobs
            traceback.print_exc()
            (out / "failed").mkdir(parents=True, exist_ok=True)
            (out / "failed" / f"{job.replace(':', '_')}.txt").write_text(traceback.format_exc())


def plan_lanes(methods: list[str], gpus: int) -> list[list[str]]:
    jobs = ["shared"] + [j for m in methods for j in method_jobs(m)]
    # longest first onto the least-loaded lane; s3 and search_r1 jobs are the ones the bars need
    lanes: list[list[str]] = [[] for _ in range(gpus)]
    load = [0] * gpus
    for job in jobs:
        i = load.index(min(load))
        lanes[i].append(job)
        load[i] += 1 if job == "shared" else BUILTIN.get(job.split(":")[0], OTHER)["cost"]
    return lanes


def run(args) -> None:
    out = Path(args.out)
    size = run_size(args.cpu)
    stage(out, "world", make_world, out, size)
    methods = [get_method(m).name for m in args.methods.split(",") if m]
    atomic_write_json(out / "methods.json", {"methods": methods, "plugins": plugin_list(args)})
    # LEARN_LANES="shared,s3:full;search_r1:warm;..." places jobs by hand (one lane per ';')
    lanes = (
        [lane.split(",") for lane in os.environ["LEARN_LANES"].split(";")]
        if os.environ.get("LEARN_LANES")
        else plan_lanes(methods, args.gpus)
    )
    atomic_write_json(out / "lanes.json", lanes)
    procs = []
    for i, jobs in enumerate(lanes):
        env = dict(os.environ)
        if not args.cpu:  # more lanes than GPUs (LEARN_LANES) share them round-robin
            env["CUDA_VISIBLE_DEVICES"] = str(i % args.gpus)
        cmd = [
            sys.executable,
            __file__,
            "lane",
            "--out",
            str(out),
            "--model",
            args.model,
            "--jobs",
            ",".join(jobs),
        ]
        cmd += ["--encoder", args.encoder] if args.encoder else []
        cmd += ["--cpu"] if args.cpu else []
        cmd += ["--plugins", args.plugins] if args.plugins else []
        with open(out / f"lane{i}.log", "a") as log:  # the child keeps its own copy of the descriptor
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    for p in procs:
        p.wait()
    status(args)


def status(args) -> None:
    out = Path(args.out)
    done = sorted(p.stem for p in (out / "done").glob("*.json")) if (out / "done").exists() else []
    failed = sorted(p.stem for p in (out / "failed").glob("*.txt")) if (out / "failed").exists() else []
    rows = {name: json.loads((out / "done" / f"{name}.json").read_text()) for name in done}
    atomic_write_json(out / "status.json", {"done": rows, "failed": failed})
    for name, r in rows.items():
        brief = {k: v for k, v in r.items() if k not in ("summary",)}
        print(name, json.dumps(brief)[:300])
        for m, s in (r.get("summary") or {}).items():
            print(
                f"    {m}: span {s.get('span_check')} cem {s.get('cover_em')} em {s.get('em')} rc {s.get('retrieval_count')}"
            )
    print("failed:", failed)


def plugin_list(args) -> list[str]:
    return [p for p in args.plugins.split(",") if p]


def run_methods(out: Path) -> list[str]:
    """The methods `run` was given (OUT/methods.json, its plugins imported); before that file: METHODS."""
    path = out / "methods.json"
    if not path.exists():
        return list(METHODS)
    recorded = json.loads(path.read_text())
    load_plugins(recorded["plugins"])
    return list(recorded["methods"])


def checkpoint_priority(methods: list[str]) -> list[str]:
    """Which RL checkpoints `pack` carries first: every method's from full SFT, then the warm-ups'."""
    return [f"{m}:full" for m in methods] + [
        j for m in methods for j in method_jobs(m) if j.endswith(":warm")
    ]


def _bf16_policy(policy: Path, dest: Path) -> None:
    """Copy a LoRA policy directory with its adapter weights cast to bf16 (half the bytes to carry)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    for f in policy.iterdir():
        if f.name == "adapter_model.safetensors":
            save_file(
                {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(f).items()},
                dest / f.name,
                metadata={"format": "pt"},
            )
        elif f.is_file():
            shutil.copy2(f, dest / f.name)


def pack(args) -> None:
    """Results into at most 8 files of <= 15 MiB under --dest (the GPU machine's return folder)."""
    import tarfile
    import tempfile

    out, dest = Path(args.out), Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    status(args)
    skip = ("trajectories.jsonl", "state.pt", ".safetensors", "naive_rag_cache")
    results = dest / "results.tgz"
    # of each run's step rollouts, the first and the last step's (a run may stop early at its time limit)
    last_rollouts = {
        max(d.glob("step_*.jsonl")) for d in out.rglob("rollouts") if any(d.glob("step_*.jsonl"))
    }
    with tarfile.open(results, "w:gz") as tar:
        for f in sorted(out.rglob("*")):
            rel = f.relative_to(out)
            if not f.is_file() or any(s in f.name for s in skip) or "checkpoints" in rel.parts:
                continue
            if "rollouts" in rel.parts and f.name != "step_000001.jsonl" and f not in last_rollouts:
                continue
            tar.add(f, arcname=str(rel))
        for method in run_methods(out):  # a sample of each method's SFT data, for the docs
            traj = out / method / "trajectories.jsonl"
            if traj.exists():
                with (
                    open(traj, encoding="utf-8") as fh,
                    tempfile.NamedTemporaryFile("w", delete=False) as tmp,
                ):
                    for _, line in zip(range(5), fh, strict=False):
                        tmp.write(line)
                tar.add(tmp.name, arcname=f"{method}/trajectories_sample.jsonl")
    budget = 60 * 2**20 - results.stat().st_size
    with tempfile.TemporaryDirectory() as tmpdir:
        staged = Path(tmpdir)
        from sleuth.rl.checkpoint import latest_checkpoint

        for job in checkpoint_priority(run_methods(out)):
            method, variant = job.split(":")
            if not marker(out, f"{method}_{variant}_rl").exists():
                continue
            ckpt = latest_checkpoint(out / method / variant)
            target = staged / method / variant
            _bf16_policy(ckpt / "policy", target / "policy")
            for name in ("searcher.json", "trainer_state.json"):
                (target / name).write_bytes((ckpt / name).read_bytes())
            size = sum(f.stat().st_size for f in staged.rglob("*") if f.is_file())
            if size > budget * 1.5:  # tokenizer files compress; adapters barely do
                import shutil

                shutil.rmtree(target)
                break
        ckpts = dest / "checkpoints.tgz"
        with tarfile.open(ckpts, "w:gz") as tar:
            tar.add(staged, arcname="checkpoints")
    for f in (results, ckpts):
        if f.stat().st_size > 15 * 2**20:
            data = f.read_bytes()
            for i in range(0, len(data), 15 * 2**20):
                (dest / f"{f.name}.part{i // (15 * 2**20):02d}").write_bytes(data[i : i + 15 * 2**20])
            f.unlink()
    for f in sorted(dest.iterdir()):
        print("packed", f.name, f.stat().st_size)


ROWS = (
    ("full", "sft", "SFT only"),
    ("full", "rl", "SFT + RL"),
    ("warm", "sft", "warm-up only"),
    ("warm", "rl", "warm-up + RL"),
)


def _records(path: Path) -> list[dict] | None:
    from sleuth.eval.harness import load_predictions

    return list(load_predictions(path).values()) if path.exists() else None


def _ols(x, y) -> dict[str, Any]:
    import numpy as np
    from scipy import stats as st

    fit = st.linregress(np.asarray(x, dtype=float), np.asarray(y, dtype=float))
    half = st.t.ppf(0.975, len(x) - 2) * fit.stderr
    return {
        "steps": len(x),
        "slope": float(fit.slope),
        "ci": [float(fit.slope - half), float(fit.slope + half)],
    }


def reward_slope(path: Path) -> dict[str, Any] | None:
    """OLS slope of the mean training reward over RL steps, with a 95% t interval (steps as samples).

    The reward is that of every rollout of the step: with DAPO's dynamic sampling the logged `reward/mean`
    is over the kept groups only (those with unequal rewards), which drifts towards the middle of the
    reward range as the policy improves, so it cannot show learning. A reward whose definition changes
    with the training stage (staged: stage 2 from `switch_step`) gets one slope per stage."""
    if not path.exists():
        return None
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    if len(rows) < 3:
        return None
    key = REWARD_EVERY_ROLLOUT if all(REWARD_EVERY_ROLLOUT in r for r in rows) else REWARD_KEPT
    steps = [r["step"] for r in rows]
    rewards = [policy_reward(r) for r in rows]
    result = {
        **_ols(steps, rewards),
        "reward": key,
        "first": sum(rewards[:3]) / 3,
        "last": sum(rewards[-3:]) / 3,
        "rewards": rewards,
    }
    stages = sorted({int(r.get("stage", 1)) for r in rows})
    if len(stages) > 1:
        result["per_stage"] = {}
        for stage_no in stages:
            part = [(r["step"], policy_reward(r)) for r in rows if int(r.get("stage", 1)) == stage_no]
            if len(part) >= 3:
                result["per_stage"][str(stage_no)] = {
                    **_ols(*zip(*part, strict=True)),
                    "first_step": part[0][0],
                }
    # the answers' exact match (a stage-free measure), where no group was filtered out of the logged mean
    if all("accuracy/em" in r and not groups_filtered(r) for r in rows):
        result["em_slope"] = _ols(steps, [r["accuracy/em"] for r in rows])
    return result


def validation_reward(run_dir: Path) -> dict[str, Any] | None:
    """The method's reward on the same dev questions (greedy) at each validation of an RL run, and the last
    minus the first of the same reward stage, paired over questions (sleuth.rl.validate, sleuth report)."""
    from sleuth.eval.report import load_validations, validation_change
    from sleuth.eval.stats import bootstrap_ci

    validations = load_validations(run_dir, [])
    if not validations:
        return None
    return {
        "steps": [v.step for v in validations],
        "means": [v.mean for v in validations],
        "cis": [list(bootstrap_ci(v.rewards)) for v in validations],
        "stages": [v.stage for v in validations],
        "n": len(validations[-1].rewards),
        "change": validation_change(validations),
    }


def _steps_done(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.exists() else 0


def _with_retrievals(recs: list[dict]) -> list[dict]:
    """Records whose retrieval count is one of their metrics (for a paired difference)."""
    return [
        {**r, "metrics": {**r["metrics"], "retrievals": float(r.get("retrieval_count", 0))}} for r in recs
    ]


def report(args) -> None:
    """Tables (accuracy with 95% bootstrap intervals, paired differences), reward slopes and plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sleuth.eval.compare import paired_difference
    from sleuth.eval.stats import bootstrap_ci

    out, dest = Path(args.out), Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    base = out / "shared" / "eval_base"
    naive, oracle = (
        _records(base / "naive-rag" / "predictions.jsonl"),
        _records(base / "oracle" / "predictions.jsonl"),
    )
    metric = "span_check"

    def acc(recs):
        vals = [r["metrics"][metric] for r in recs]
        lo, hi = bootstrap_ci(vals)
        rc = sum(r.get("retrieval_count", 0) for r in recs) / len(recs)
        return {"n": len(vals), "acc": sum(vals) / len(vals), "ci": [lo, hi], "rc": rc}

    def diff(a, b):
        d = paired_difference(a, b, metric)
        return {"diff": d["diff"], "ci": d["ci"], "n": d["n"]}

    result: dict[str, Any] = {
        "metric": metric,
        "card": (out / "card.txt").read_text().splitlines()[0] if (out / "card.txt").exists() else None,
        "shared": {
            "naive-rag": acc(naive),
            "oracle": acc(oracle),
            "direct": acc(_records(base / "direct" / "predictions.jsonl")),
        },
        "methods": {},
    }
    records: dict[str, dict[str, list[dict]]] = {}
    methods = run_methods(out)
    for method in methods:
        rows, rec_of = {}, {}
        for variant, kind, label in ROWS:
            recs = _records(
                out
                / method
                / f"eval_{variant}_{kind}"
                / get_method(method).display_name
                / "predictions.jsonl"
            )
            if recs is None:
                continue
            direct = _records(out / method / f"eval_{variant}_{kind}" / "direct" / "predictions.jsonl")
            rec_of[label] = recs
            rows[label] = {
                **acc(recs),
                "vs_naive_rag": diff(recs, naive),
                "own_direct_answer": acc(direct) if direct else None,
            }
        for a, b in (("SFT + RL", "SFT only"), ("warm-up + RL", "warm-up only")):
            if a in rec_of and b in rec_of:
                rows[a]["vs_" + b.replace(" ", "_")] = diff(rec_of[a], rec_of[b])
        slopes = {v: reward_slope(out / method / v / "metrics.jsonl") for v in ("full", "warm")}
        validations = {v: validation_reward(out / method / v) for v in ("full", "warm")}
        result["methods"][method] = {
            "rows": rows,
            "reward_slope": {k: v for k, v in slopes.items() if v},
            "validation_reward": {k: v for k, v in validations.items() if v},
        }
        records[method] = rec_of
    # Every other method against search_r1 trained on the same SFT data and RL steps, row by row, paired
    for method, rec_of in records.items():
        for label, recs in rec_of.items():
            base = records.get("search_r1", {}).get(label) if method != "search_r1" else None
            if base:
                result["methods"][method]["rows"][label]["vs_search_r1"] = diff(recs, base)
    # Staged's claim: fewer retrievals than search_r1 trained on as many SFT trajectories and RL steps,
    # at an accuracy within the interval. Paired on the same test questions, row by row.
    result["staged_vs_search_r1"] = {}
    for label in ("SFT only", "SFT + RL"):
        a, b = records.get("staged", {}).get(label), records.get("search_r1", {}).get(label)
        if a and b:
            d_rc = paired_difference(_with_retrievals(a), _with_retrievals(b), "retrievals")
            result["staged_vs_search_r1"][label] = {
                "accuracy": diff(a, b),
                "retrievals": {"diff": d_rc["diff"], "ci": d_rc["ci"], "n": d_rc["n"]},
                "rl_steps": {
                    m: _steps_done(out / m / "full" / "metrics.jsonl") for m in ("staged", "search_r1")
                },
            }
    atomic_write_json(dest / "learning.json", result)

    trained = [m for m in methods if result["methods"][m]["reward_slope"]] or methods[:1]
    fig, axes = plt.subplots(1, len(trained), figsize=(4.5 * len(trained), 3.2), squeeze=False)
    for ax, method in zip(axes[0], trained, strict=True):
        for variant, slope in result["methods"][method]["reward_slope"].items():
            ax.plot(
                range(1, slope["steps"] + 1),
                slope["rewards"],
                marker="o",
                ms=3,
                label=f"from {'SFT' if variant == 'full' else 'warm-up'} (slope {slope['slope']:+.3f}/step)",
            )
            for stage_no, part in slope.get("per_stage", {}).items():
                if stage_no != "1":
                    ax.axvline(part["first_step"] - 0.5, color="grey", lw=0.8, ls=":")
        ax.set_title(method)
        ax.set_xlabel("RL step")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("mean reward, all rollouts of the step")
    fig.tight_layout()
    fig.savefig(dest / "reward_curves.png", dpi=110)

    validated = [m for m in methods if result["methods"][m]["validation_reward"]]
    if validated:
        fig, axes = plt.subplots(1, len(validated), figsize=(4.5 * len(validated), 3.2), squeeze=False)
        for ax, method in zip(axes[0], validated, strict=True):
            for variant, val in result["methods"][method]["validation_reward"].items():
                change = val["change"] or {}
                for stage_no in sorted(set(val["stages"])):  # a two-stage reward: one line per stage
                    idx = [i for i, s in enumerate(val["stages"]) if s == stage_no]
                    err = [
                        [val["means"][i] - val["cis"][i][0] for i in idx],
                        [val["cis"][i][1] - val["means"][i] for i in idx],
                    ]
                    label = f"from {'SFT' if variant == 'full' else 'warm-up'}" + (
                        f", stage {stage_no}" if len(set(val["stages"])) > 1 else ""
                    )
                    if stage_no == val["stages"][-1] and change:
                        label += f" (last - first {change['diff']:+.3f} [{change['ci'][0]:+.3f}, {change['ci'][1]:+.3f}])"
                    ax.errorbar(
                        [val["steps"][i] for i in idx],
                        [val["means"][i] for i in idx],
                        yerr=err,
                        marker="o",
                        ms=3,
                        capsize=3,
                        label=label,
                    )
            ax.set_title(f"{method} (n={val['n']} dev questions)")
            ax.set_xlabel("RL updates")
            ax.legend(fontsize=6)
        axes[0][0].set_ylabel("validation reward, greedy (95% CI)")
        fig.tight_layout()
        fig.savefig(dest / "validation_reward.png", dpi=110)

    fig, ax = plt.subplots(figsize=(11, 3.8))
    labels, values, errs = ["naive RAG", "oracle"], [], []
    for key in ("naive-rag", "oracle"):
        r = result["shared"][key]
        values.append(r["acc"])
        errs.append([r["acc"] - r["ci"][0], r["ci"][1] - r["acc"]])
    for method in methods:
        for label, r in result["methods"][method]["rows"].items():
            labels.append(f"{method}\n{label}")
            values.append(r["acc"])
            errs.append([r["acc"] - r["ci"][0], r["ci"][1] - r["acc"]])
    ax.bar(
        range(len(values)),
        [100 * v for v in values],
        yerr=[[100 * e[0] for e in errs], [100 * e[1] for e in errs]],
        color=["grey", "black"] + ["tab:blue"] * (len(values) - 2),
        capsize=3,
    )
    ax.set_xticks(range(len(values)), labels, fontsize=6)
    ax.set_ylabel(f"{metric} % (95% CI)")
    fig.tight_layout()
    fig.savefig(dest / "accuracy.png", dpi=110)
    print(json.dumps(result, indent=1, default=float)[:6000])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("run", "lane", "status", "pack", "report"):
        p = sub.add_parser(name)
        p.add_argument("--out", default="runs/learn")
        p.add_argument("--model", default="smollm2-135m-instruct")
        p.add_argument("--encoder", default="minilm", help="staged reward's query encoder (dir or alias)")
        p.add_argument("--cpu", action="store_true", help="CPU-sized run (tests the pipeline)")
        p.add_argument("--gpus", type=int, default=1)
        p.add_argument("--methods", default=",".join(METHODS))
        p.add_argument("--jobs", default="")
        p.add_argument(
            "--plugins",
            default="",
            help="plugin modules whose methods --methods may name, comma-separated "
            "(imported as a recipe's `plugins:`; their directory on PYTHONPATH)",
        )
        p.add_argument("--dest", default="runs/learn_packed")
    args = parser.parse_args()
    load_plugins(plugin_list(args))
    {"run": run, "lane": lane, "status": status, "pack": pack, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
