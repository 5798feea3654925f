"""What a training step logs: reward, behaviour, loss statistics, timing and memory."""

from __future__ import annotations

import math
import resource
import sys

import numpy as np
import torch

from sleuth.agent.trajectory import Trajectory
from sleuth.progress import clock
from sleuth.rewards.metrics import exact_match
from sleuth.rl.dist import DistContext
from sleuth.run_layout import REWARD_KEPT, groups_filtered, policy_reward


def mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if xs else 0.0


def mean_over_ranks(metrics: dict[str, float], ctx: DistContext) -> dict[str, float]:
    if not ctx.enabled:
        return metrics
    keys = sorted(metrics)
    summed = ctx.all_reduce_sum(torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64))
    return {k: v / ctx.world_size for k, v in zip(keys, summed.tolist(), strict=True)}


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Memory of this rank: the process's peak resident host memory, and on a GPU PyTorch's peak since
    the start and what the whole card has in use (other allocators in the process, e.g. a library's JAX
    preallocating 75% of the GPU, or CUDA-graph pools, show up only in the last)."""
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    metrics = {"memory/host_peak_rss_gib": peak_rss / (2**30 if sys.platform == "darwin" else 2**20)}
    if device.type != "cuda":
        return metrics
    free, total = torch.cuda.mem_get_info(device)
    return {
        **metrics,
        "memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "memory/device_in_use_gib": (total - free) / 2**30,
    }


def dense_group_ids(trajs: list[Trajectory]) -> list[int]:
    """Map each trajectory's group key to a dense integer id (samples of one prompt share it)."""
    ids: dict[str, int] = {}
    return [ids.setdefault((t.sampling_round, t.group), len(ids)) for t in trajs]


def add_stat(stats: dict[str, list[float]], key: str, value: float) -> None:
    stats.setdefault(key, []).append(value)


def acc_stat(sums: dict[str, float], key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + value


def step_metrics(
    trajs: list[Trajectory],
    scores: list[float],
    all_rewards: list[float],
    mask: torch.Tensor,
    kl: torch.Tensor | None,
    stats: dict[str, list[float]],
    answers: bool = True,
) -> dict[str, float]:
    """`answers=False` for searcher-only loops (s3), whose accuracy is a reward component instead;
    it depends on the recipe only, so every rank logs the same keys."""
    metrics: dict[str, float] = {
        "reward/mean": mean(scores),
        "reward/std": float(np.std(scores)) if scores else 0.0,
        "reward/mean_before_filter": mean(all_rewards),
        "retrieval_count": mean([t.retrieval_count for t in trajs]),
        "turns": mean([t.num_turns for t in trajs]),
        "response_length/policy_tokens": mean([t.num_policy_tokens for t in trajs]),
        "response_length/total_tokens": mean([len(t.response_ids) for t in trajs]),
        "answered": mean([float(t.answer is not None) for t in trajs]),
    }
    components = sorted({k for t in trajs for k in t.rewards if k != "total"})
    for k in components:
        metrics[f"reward/{k}"] = mean([t.rewards.get(k, 0.0) for t in trajs])

    if answers:
        metrics["accuracy/em"] = mean([exact_match(t.answer or "", t.golden_answers) for t in trajs])
    if kl is not None:
        metrics["actor/kl"] = float((kl * mask).sum() / mask.sum().clamp(min=1))
    elif (
        "actor/kl_loss" in stats
    ):  # on-policy steps skip the old-log-prob pass; the KL loss term is the estimate
        metrics["actor/kl"] = mean(stats["actor/kl_loss"])
    for k, v in stats.items():
        metrics[k] = mean(v)
    return {k: (0.0 if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}


def format_line(step: int, total: int, m: dict[str, float]) -> str:
    # the share done and an ETA from this step's time: a log under nohup / SLURM says when the run ends
    eta = f", ETA ~{clock((total - step) * m['time/step'])}" if m.get("time/step") and step < total else ""
    parts = [
        f"[bold]step {step}/{total}[/] ({100 * step / total:.0f}%{eta})",
        f"reward {policy_reward(m):+.3f}",
        # with dynamic sampling the update trains on the kept groups only; their mean is shown beside
        *([f"(kept groups {m[REWARD_KEPT]:+.3f})"] if groups_filtered(m) else []),
        *([f"em {m['accuracy/em']:.3f}"] if "accuracy/em" in m else []),
        f"rc {m['retrieval_count']:.2f}",
        f"len {m['response_length/policy_tokens']:.0f}",
    ]
    if "actor/kl" in m:
        parts.append(f"kl {m['actor/kl']:.4f}")
    if "actor/entropy" in m:
        parts.append(f"ent {m['actor/entropy']:.3f}")
    if m.get("actor/skipped_nonfinite_grad"):
        parts.append(
            f"[yellow]skipped {m['actor/skipped_nonfinite_grad']:.0%} of updates (non-finite grad)[/]"
        )
    parts.append(
        f"t {m['time/rollout']:.1f}/{m['time/reward']:.1f}/{m['time/update']:.1f}s (rollout/reward/update)"
    )
    if m.get("time/decode_compile", 0.0) >= 0.05:
        parts.append(
            f"[dim](of which {m['time/decode_compile']:.1f}s one-time compile of new decode shapes)[/]"
        )
    return "  ".join(parts)
