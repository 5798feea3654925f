"""Do the rollouts and the trainer see the same policy? Per step, |log p_rollout - log p_trainer| over the sampled
policy tokens, the trainer's log-probs taken under the weights that rolled out (the old log-probs, or the on-policy
update's own forward before its optimizer step).

Numerical noise (bf16 decoding against the trainer's forward) keeps the mean around 1e-2 on a GPU and ~1e-6 in
float32 on a CPU; a rollout engine that never received the trained weights (LoRA adapters not merged into the
decode copy, a stale sync) drifts away from the trainer step after step. `default_guards` warns when the mean
stays above a threshold."""

from __future__ import annotations

import torch

from sleuth.agent.trajectory import Trajectory


def rollout_agreement(trajs: list[Trajectory], action_mask: torch.Tensor,
                      trainer_logprobs: torch.Tensor | None) -> dict[str, float]:  # fmt: skip
    """{"rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout/logprob_diff_tokens"} over the policy
    tokens of the trajectories whose backend reported per-token log-probs (0 tokens, and 0 differences, when none
    did: every rank logs the same keys, which the metrics' all-reduce needs)."""
    none = {
        "rollout/logprob_diff_mean": 0.0,
        "rollout/logprob_diff_max": 0.0,
        "rollout/logprob_diff_tokens": 0.0,
    }
    if trainer_logprobs is None:
        return none
    diffs = []
    for i, t in enumerate(trajs):
        if t.logprobs_missing or len(t.logprobs) != len(t.response_ids):
            continue
        n = len(t.response_ids)
        policy = action_mask[i, :n] != 0
        rollout = torch.tensor(t.logprobs, dtype=torch.float64)[policy]
        diffs.append((rollout - trainer_logprobs[i, :n].to(torch.float64)[policy]).abs())
    every = torch.cat(diffs) if diffs else torch.zeros(0)
    if every.numel() == 0:
        return none
    return {
        "rollout/logprob_diff_mean": float(every.mean()),
        "rollout/logprob_diff_max": float(every.max()),
        "rollout/logprob_diff_tokens": float(every.numel()),
    }
