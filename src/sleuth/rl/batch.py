"""Tensors from trajectories and the no-grad forward passes over them.

Token layout. A trajectory is `prompt_ids + response_ids`; the response mixes policy tokens
(loss_mask 1) and tokens the environment inserted (documents, feedback; loss_mask 0). All per-token
tensors here are (B, R) over response positions only: entry j scores response token j given
everything before it. `action_mask` is 1 exactly on policy tokens, so inserted tokens never
contribute to the policy, value or KL terms.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from sleuth.agent.trajectory import Trajectory
from sleuth.rl import advantages as adv_fns
from sleuth.rl import losses as loss_fns
from sleuth.rl.models import ValueModel, autocast
from sleuth.rl.sampling import overlong_mask


@dataclass
class TokenBatch:
    """Each row is prompt + response packed to the left and right-padded, so the training forward
    needs no attention mask at all: causal attention alone keeps real tokens from seeing the padding
    after them. (Left padding needs a mask whose pad rows attend to nothing; CUDA's
    memory-efficient attention backward has produced NaN gradients for such masks while the forward
    stayed finite.) Without a mask SDPA can pick its flash kernel. Per-token tensors cover only
    response positions: column j of `action_mask` is response token j of that row."""

    input_ids: torch.Tensor  # (B, L), L = longest prompt + R
    response_start: torch.Tensor  # (B,) long: the column where each row's response begins
    action_mask: torch.Tensor  # (B, R) float: 1 where response token j is a policy token

    @property
    def response_width(self) -> int:
        return self.action_mask.shape[1]

    def index(self, idx: torch.Tensor) -> TokenBatch:
        """The rows `idx`, cut to the columns they use (their longest prompt + R)."""
        starts = self.response_start[idx]
        width = int(starts.max()) + self.response_width if len(starts) else 0
        return TokenBatch(self.input_ids[idx, :width], starts, self.action_mask[idx])


def collate(trajs: list[Trajectory], pad_id: int, drop_truncated: bool = False) -> TokenBatch:
    S = max(len(t.prompt_ids) for t in trajs)
    R = max(1, max(len(t.response_ids) for t in trajs))
    B = len(trajs)
    input_ids = torch.full((B, S + R), pad_id, dtype=torch.long)
    starts = torch.zeros(B, dtype=torch.long)
    action = torch.zeros((B, R), dtype=torch.float32)
    keep = overlong_mask([t.finish_reason for t in trajs]) if drop_truncated else torch.ones(B, dtype=torch.bool)
    for i, t in enumerate(trajs):
        P, n = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, : P + n] = torch.tensor(t.prompt_ids + t.response_ids, dtype=torch.long)
        starts[i] = P
        if not keep[i]:
            continue  # DAPO overlong filtering: a truncated response teaches nothing reliable
        if n:
            action[i, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
    return TokenBatch(input_ids, starts, action)


def token_rewards(trajs: list[Trajectory], scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, R) rewards: each score on its row's last policy token and each trajectory's `turn_rewards` on the
    last token of its policy turns (outcome-only rewards give exactly `outcome_to_token_rewards`)."""
    if not any(t.turn_rewards for t in trajs):
        return adv_fns.outcome_to_token_rewards(scores, mask)
    return adv_fns.turn_token_rewards(scores, mask, [t.policy_turn_ends() for t in trajs],
                                      [t.turn_rewards for t in trajs])


class PolicyScorer:
    """`sleuth.rewards.base.PolicyScorer` over the policy in training: prefix + continuation rows packed as the
    update packs them (`TokenBatch`: the continuation is the "response"), scored by `batched_logprobs`.

    Multi-rank note: each rank scores its own trajectories; a sharded (FSDP) policy needs every rank to run
    the same number of forwards, which a reward's call count does not guarantee, so it is refused there."""

    def __init__(self, model: nn.Module, tokenizer, micro_batch_size: int = 8, sharded: bool = False):
        self.model, self.tokenizer, self.micro, self.sharded = model, tokenizer, micro_batch_size, sharded

    def logprobs(self, prefixes, continuations) -> list[list[float]]:
        if self.sharded:
            raise RuntimeError("scoring with the policy is not supported on a sharded (FSDP) policy yet")
        if len(prefixes) != len(continuations):
            raise ValueError(f"{len(prefixes)} prefixes for {len(continuations)} continuations")
        if not prefixes:
            return []
        conts = [list(self.tokenizer.encode(c, add_special_tokens=False)) for c in continuations]
        if any(not c for c in conts) or any(not p for p in prefixes):
            raise ValueError("each prefix and each continuation needs at least one token")
        width = max(len(c) for c in conts)
        longest = max(len(p) for p in prefixes)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(conts), longest + width), pad, dtype=torch.long)
        mask = torch.zeros((len(conts), width), dtype=torch.float32)
        for i, (p, c) in enumerate(zip(prefixes, conts, strict=True)):
            ids[i, : len(p) + len(c)] = torch.tensor(list(p) + c, dtype=torch.long)
            mask[i, : len(c)] = 1.0
        batch = TokenBatch(ids, torch.tensor([len(p) for p in prefixes], dtype=torch.long), mask)
        device = next(self.model.parameters()).device
        out = batched_logprobs(self.model, batch, 1.0, self.micro, device)
        return [out[i, : len(c)].tolist() for i, c in enumerate(conts)]


def response_columns(batch: TokenBatch, first: int) -> torch.Tensor:
    """(B, R) index of the position predicting response token j of each row, counted from `first`."""
    R = batch.response_width
    offsets = torch.arange(R, device=batch.input_ids.device)
    return (batch.response_start.to(batch.input_ids.device) - 1 - first)[:, None] + offsets[None, :]


def forward_logprobs(
    model: nn.Module, batch: TokenBatch, temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob (B, R) of each response token under `model`, logits scaled by the sampling
    temperature. Only positions from the earliest response start on go through the LM head: prompt
    positions never materialise (B, L, V) logits, which dominate memory and time at a 150k vocabulary."""
    first = int(batch.response_start.min()) - 1  # the position predicting the earliest response token
    L = batch.input_ids.shape[1]
    out = model(input_ids=batch.input_ids, logits_to_keep=L - first, use_cache=False)
    logits = loss_fns.at_least_fp32(out.logits[:, :-1])  # positions first .. L-2
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    cols = response_columns(batch, first)
    per_position = loss_fns.logprobs_from_logits(logits, batch.input_ids[:, first + 1 :])
    logprobs = per_position.gather(1, cols)
    entropy = loss_fns.entropy_from_logits(logits).gather(1, cols) if with_entropy else None
    return logprobs, entropy


def critic_values(critic: nn.Module, batch: TokenBatch) -> torch.Tensor:
    """Values (B, R): entry j is the value of the state just before response token j."""
    values = critic(batch.input_ids)
    return values.gather(1, response_columns(batch, 0))


def chunks(n: int, size: int) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


@torch.no_grad()
def batched_logprobs(
    model: nn.Module, batch: TokenBatch, temperature: float, micro: int, device: torch.device
) -> torch.Tensor:
    """Log-probs (B, L-1) without gradients, in micro-batches, returned on the CPU."""
    out = []
    for sl in chunks(batch.input_ids.shape[0], micro):
        mb = to_device(batch.index(torch.arange(sl.start, sl.stop)), device)
        with autocast(device):
            out.append(forward_logprobs(model, mb, temperature)[0].cpu())
    return torch.cat(out)


@torch.no_grad()
def batched_values(critic: ValueModel, batch: TokenBatch, micro: int, device: torch.device) -> torch.Tensor:
    """Critic values (B, R) without gradients, in micro-batches, returned on the CPU."""
    out = []
    for sl in chunks(batch.input_ids.shape[0], micro):
        mb = to_device(batch.index(torch.arange(sl.start, sl.stop)), device)
        with autocast(device):
            out.append(loss_fns.at_least_fp32(critic_values(critic, mb)).cpu())
    return torch.cat(out)


def to_device(batch: TokenBatch, device: torch.device) -> TokenBatch:
    return TokenBatch(*(t.to(device) for t in (batch.input_ids, batch.response_start, batch.action_mask)))


@torch.no_grad()
def reference_logprobs(
    ref_model: nn.Module, batch: TokenBatch, temperature: float, micro: int, device: torch.device
) -> torch.Tensor:
    """Reference log-probs; an offloaded reference visits the GPU only for this pass."""
    home = next(ref_model.parameters()).device
    ref_model.to(device)
    try:
        return batched_logprobs(ref_model, batch, temperature, micro, device)
    finally:
        ref_model.to(home)

