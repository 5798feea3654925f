"""Peak host memory of one policy update on the CPU, before and after issue 43's forward (log-probs and entropy at
policy tokens only, a chunked float32 output layer, token-budget micro-batches).

    PYTHONPATH=src python bench/update_memory.py --micro 8 1

The case of issue 43: an s3 update of SmolLM2-135M with the committed Search-R1 searcher's LoRA adapters
(checkpoints/search_r1), one minibatch of 8 trajectories whose prompts hold 750-970 tokens. Each (path, micro)
runs in a fresh process, so its peak RSS (ru_maxrss) is its own; a child is capped at --cap-gib of address
space, so a path that would need more fails with MemoryError instead of taking the box (reported as such).
`legacy` is the forward before issue 43 (kept here, verbatim in effect: the output layer over every position
from the earliest response start, float32 log-softmax and entropy over all of them).

`--recipe` measures real training instead: each `--case NAME key=value...` runs `sleuth train RECIPE` with the
`--set` overrides, then the case's, in a fresh process whose tree's RSS is sampled every `--interval` s (killed
above `--cap-gib`, so a case that would take the box is reported instead); rows go under "train" in the JSON,
beside the synthetic rows. E.g. one GRPO step of s3 from the Search-R1 checkpoint at micro-batch 8:

    PYTHONPATH=src python bench/update_memory.py --recipe recipes/cpu/s3.yaml \
        --set model.init_from=checkpoints/search_r1 algorithm.name=grpo trainer.total_steps=1 \
        --case micro8 algorithm.micro_batch_size=8 --case micro8_tokens4096 algorithm.micro_batch_tokens=4096
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import _common  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="smollm2-135m-instruct")
    p.add_argument("--adapter", default=str(_common.REPO / "checkpoints" / "search_r1" / "policy"))
    p.add_argument("--micro", type=int, nargs="+", default=[8, 1])
    p.add_argument(
        "--paths", nargs="+", default=["legacy", "policy-tokens"], choices=("legacy", "policy-tokens")
    )
    p.add_argument("--trajectories", type=int, default=8)
    p.add_argument("--prompt-min", type=int, default=750)
    p.add_argument("--prompt-max", type=int, default=970)
    p.add_argument(
        "--response", type=int, default=300, help="response tokens per trajectory (policy + inserted)"
    )
    p.add_argument(
        "--policy-share", type=float, default=0.4, help="share of response tokens the policy wrote"
    )
    p.add_argument(
        "--token-budget", type=int, default=None, help="micro_batch_tokens for the policy-tokens path"
    )
    p.add_argument(
        "--checkpointing",
        default="off",
        choices=("off", "auto", "selective", "full"),
        help="activation checkpointing of the policy-tokens path (auto: sleuth.rl.memory_plan)",
    )
    p.add_argument("--cap-gib", type=float, default=12.0, help="address-space cap of each child (GiB)")
    p.add_argument("--out", default=None)
    p.add_argument("--recipe", default=None, help="measure `sleuth train RECIPE` runs (the --case's) instead")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of every --case")
    p.add_argument(
        "--case",
        nargs="+",
        action="append",
        default=[],
        metavar="NAME [KEY=VALUE ...]",
        help="one training run: a name and its own overrides (after --set)",
    )
    p.add_argument("--interval", type=float, default=0.5, help="seconds between RSS samples (--recipe)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def legacy_forward(model: Any, batch: Any, temperature: float) -> tuple[Any, Any]:
    """The trainer's forward before issue 43: logits at every position from the earliest response start."""
    from sleuth.rl import losses as loss_fns
    from sleuth.rl.batch import response_columns

    first = int(batch.response_start.min()) - 1
    L = batch.input_ids.shape[1]
    out = model(input_ids=batch.input_ids, logits_to_keep=L - first, use_cache=False)
    logits = loss_fns.at_least_fp32(out.logits[:, :-1]) / temperature
    cols = response_columns(batch, first)
    logprobs = loss_fns.logprobs_from_logits(logits, batch.input_ids[:, first + 1 :]).gather(1, cols)
    return logprobs, loss_fns.entropy_from_logits(logits).gather(1, cols)


def trajectories(args: argparse.Namespace, vocab: int) -> list[Any]:
    import torch

    from sleuth.agent.trajectory import Trajectory

    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(args.trajectories):
        prompt = int(torch.randint(args.prompt_min, args.prompt_max + 1, (1,), generator=gen))
        ids = torch.randint(0, vocab, (prompt + args.response,), generator=gen).tolist()
        policy = int(args.response * args.policy_share)
        # policy turns around an inserted block of documents, as in a searcher's response
        mask = [1] * (policy // 2) + [0] * (args.response - policy) + [1] * (policy - policy // 2)
        out.append(
            Trajectory(
                question_id=str(i),
                question="q",
                golden_answers=["a"],
                method="s3",
                prompt_ids=ids[:prompt],
                response_ids=ids[prompt:],
                loss_mask=mask,
                logprobs=[0.0] * args.response,
            )
        )
    return out


def child(args: argparse.Namespace, path: str, micro: int) -> dict[str, Any]:
    cap = int(args.cap_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from sleuth.llm.registry import resolve_model_path
    from sleuth.rl import losses as loss_fns
    from sleuth.rl.batch import ForwardPlan, collate, forward_logprobs
    from sleuth.rl.config import recipe_from_dict
    from sleuth.rl.memory_plan import apply_checkpointing

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.policy), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, args.adapter, is_trainable=True).train()
    batch = collate(trajectories(args, base.config.vocab_size), pad_id=0)
    checkpoint = None
    if path == "policy-tokens" and args.checkpointing != "off":
        recipe = recipe_from_dict(
            {
                "name": "m",
                "model": {"policy": args.policy, "gradient_checkpointing": args.checkpointing},
                "data": {"train": "x.jsonl"},
                "retriever": {"index": "i"},
                "agent": {"loop": "s3"},
                "reward": {"name": "s3_gbr"},
                "algorithm": {
                    "micro_batch_size": micro,
                    "minibatch_size": micro,
                    "micro_batch_tokens": args.token_budget,
                },
            }
        )
        checkpoint = apply_checkpointing(recipe, base, torch.device("cpu")).mode
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    mask = batch.action_mask
    agg = loss_fns.LossAgg("token-mean", num_tokens=float(mask.sum()))
    clip = loss_fns.PolicyClip(0.2, 0.2)
    plan = ForwardPlan(micro, args.token_budget if path == "policy-tokens" else None, packed=False)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    for idx in (
        plan.split(batch)
        if path == "policy-tokens"
        else [torch.arange(i, min(i + micro, len(mask))) for i in range(0, len(mask), micro)]
    ):
        mb = batch.index(idx)
        if path == "legacy":
            logprobs, entropy = legacy_forward(model, mb, 1.0)
        else:
            logprobs, entropy = forward_logprobs(model, mb, 1.0, with_entropy=True)
        loss, _ = loss_fns.policy_loss(
            logprobs.detach(), logprobs, adv[idx], mb.action_mask, clip=clip, agg=agg
        )
        (loss - 0.001 * agg(entropy, mb.action_mask)).backward()
    return {
        "path": path,
        "micro": micro,
        "token_budget": args.token_budget if path != "legacy" else None,
        "checkpointing": checkpoint or "off",
        "micro_batches": len(plan.split(batch)) if path != "legacy" else -(-len(mask) // micro),
        "status": "ok",
        "update_s": round(time.perf_counter() - t0, 1),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "rss_after_load_gib": round(loaded, 2),
        "tokens": int(batch.row_lengths().sum()),
        "policy_tokens": int(mask.sum()),
    }


def tree_rss(proc: Any) -> int:
    """Resident bytes of a process and its descendants (0 once it is gone)."""
    import psutil

    total = 0
    try:
        for p in [proc, *proc.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += p.memory_info().rss
    except psutil.NoSuchProcess:
        pass
    return total


def train_case(args: argparse.Namespace, name: str, overrides: list[str]) -> dict[str, Any]:
    """One `sleuth train` run with its tree's RSS sampled: peak, when it was reached, and the step's metrics."""
    import psutil

    with tempfile.TemporaryDirectory(prefix="update_memory_") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "sleuth.cli",
            "train",
            args.recipe,
            *args.set,
            *overrides,
            f"trainer.out_dir={tmp}/run",
        ]
        t0, peak, peak_at, timeline, killed = time.perf_counter(), 0, 0.0, [], False
        with open(Path(tmp) / "log.txt", "w") as log:
            child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            proc = psutil.Process(child.pid)
            while child.poll() is None:
                rss, now = tree_rss(proc), time.perf_counter() - t0
                if rss > peak:
                    peak, peak_at = rss, now
                if not timeline or now - timeline[-1][0] >= 20 * args.interval:
                    timeline.append((round(now, 1), round(rss / 2**30, 2)))
                if rss > args.cap_gib * 2**30:  # would take the shared box: stop it (its own session only)
                    os.killpg(child.pid, signal.SIGKILL)
                    killed = True
                time.sleep(args.interval)
        wall = time.perf_counter() - t0
        log_tail = (Path(tmp) / "log.txt").read_text(errors="replace").splitlines()[-5:]
        metrics_path = Path(tmp) / "run" / "metrics.jsonl"
        first = json.loads(metrics_path.read_text().splitlines()[0]) if metrics_path.exists() else {}
    kept = {
        k: v
        for k, v in first.items()
        if k.split("/")[0] in ("time", "update", "memory")
        or k in ("actor/kl", "actor/pg_loss", "actor/grad_norm", "rollout/logprob_diff_mean", "reward/mean")
    }
    status = (
        f"killed over the {args.cap_gib:g} GiB cap"
        if killed
        else "ok"
        if child.returncode == 0 and first
        else f"failed (exit {child.returncode})"
    )
    return {
        "case": name,
        "overrides": overrides,
        "status": status,
        "peak_rss_gib": round(peak / 2**30, 2),
        "peak_at_s": round(peak_at, 1),
        "wall_s": round(wall, 1),
        "metrics": kept,
        "rss_timeline_gib": timeline,
        **({"log_tail": log_tail} if status != "ok" else {}),
    }


def train_main(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    rows = []
    print(
        f"{'case':<22} {'status':<28} {'peak RSS GiB':>12} {'at s':>7} {'wall s':>7} {'update s':>9} {'micro':>6}"
    )
    for name, *overrides in args.case:
        row = train_case(args, name, overrides)
        rows.append(row)
        m = row["metrics"]
        print(
            f"{name:<22} {row['status']:<28} {row['peak_rss_gib']:>12.2f} {row['peak_at_s']:>7.1f} "
            f"{row['wall_s']:>7.1f} {m.get('time/update', float('nan')):>9.1f} "
            f"{m.get('update/micro_batches', float('nan')):>6.0f}",
            flush=True,
        )
    path = _common.out_path(args.out, "update_memory_cpu.json")
    result = json.loads(path.read_text()) if path.exists() else {"bench": "update_memory"}
    result["train"] = {
        "environment": _common.environment("cpu"),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["bench/update_memory.py", *argv]),
        "recipe": args.recipe,
        "overrides": args.set,
        "cap_gib": args.cap_gib,
        "rows": rows,
        # glibc's allocator settings change a CPU run's RSS (see docs/scaling.md): recorded when set
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
    }
    _common.write_json(path, result)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.recipe:
        if not args.case:
            raise SystemExit("--recipe needs at least one --case NAME [KEY=VALUE ...]")
        return train_main(args, argv if argv is not None else sys.argv[1:])
    if args.child:
        path, micro = args.child.split(":")
        print(json.dumps(child(args, path, int(micro))))
        return {}
    rows = []
    for micro in args.micro:
        for path in args.paths:
            cmd = [
                sys.executable,
                __file__,
                *(argv if argv is not None else sys.argv[1:]),
                "--child",
                f"{path}:{micro}",
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            last = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
            if proc.returncode == 0 and last:
                rows.append(json.loads(last[0]))
            else:
                over = "MemoryError" in proc.stderr or "alloc" in proc.stderr.lower()
                rows.append(
                    {
                        "path": path,
                        "micro": micro,
                        "status": f"over the {args.cap_gib:g} GiB cap"
                        if over
                        else f"failed (exit {proc.returncode})",
                        "stderr_tail": proc.stderr.splitlines()[-3:],
                    }
                )
            print(json.dumps(rows[-1]), flush=True)
    result = {
        "bench": "update_memory",
        "environment": _common.environment("cpu"),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["bench/update_memory.py", *(argv if argv is not None else sys.argv[1:])]),
        "settings": vars(args),
        "rows": rows,
    }
    _common.write_json(_common.out_path(args.out, "update_memory_cpu.json"), result)
    return result


if __name__ == "__main__":
    main()
