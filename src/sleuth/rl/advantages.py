"""Advantage estimators: rewards (+ values or groups) -> per-token advantages and returns.

Every estimator returns `(advantages, returns)`, both (B, T) and zero at masked positions, and
runs without gradient. Shapes and masks follow `sleuth.rl.losses` (1 in `response_mask` = a
policy token that counts; 0 = padding or a token inserted by the environment).

Estimators are registered by name in `ADVANTAGE_ESTIMATORS`:
  - "gae": PPO with a critic (token rewards + values).
  - "grpo": group-normalised outcome reward (r - mean) / (std + eps).
  - "drgrpo": Dr.GRPO, group mean subtracted, no std division.
  - "rloo": leave-one-out group baseline.
  - "reinforce_plus_plus": discounted return whitened over the batch (no critic, no groups).
  - "turn_grpo": IGPO's turn-level estimator: every turn reward of a group normalised together,
    then the discounted sum over the turns that follow (one advantage per turn).
  - "turn_reinforce": discounted turn-level return-to-go with a group-mean baseline per turn index.

Turn-level rewards come from `turn_token_rewards` (a reward's `RewardResult.turn_rewards`, each put
on the last policy token of its turn). In the token view a turn is a run of policy tokens: the
environment's inserted tokens separate turns (`policy_turn_ids`).

A trainer can call any of them through one entry point:

    adv, ret = compute_advantages(
        "grpo", token_rewards=rewards, response_mask=mask, group_ids=uids, epsilon=1e-6
    )

which passes each estimator only what it declares (outcome estimators get
`scores = token_rewards.sum(-1)`) and rejects unknown hyper-parameters by name. An estimator that
declares `trajectories` is given the batch's `Trajectory` objects by the trainer, one per row (a plugin's
estimator that reads the rollouts' structure: Tree-GRPO's trees in plugins/sleuth_tree_grpo.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from sleuth.rl.losses import check_same_shape, masked_whiten

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}

GroupIds = torch.Tensor | Sequence[Any]


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering an advantage estimator under `name` (a name can be taken once)."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        existing = ADVANTAGE_ESTIMATORS.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered ({existing.__qualname__})")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return decorator


def get_advantage_fn(name: str) -> AdvantageFn:
    """The estimator registered under `name`; ValueError listing the known names otherwise."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        known = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(f"unknown advantage estimator {name!r}; known: {known}") from None


# --------------------------------------------------------------------------- helpers


def estimator_inputs(name: str) -> set[str]:
    """The parameters the estimator `name` declares (inputs and hyper-parameters)."""
    return set(inspect.signature(get_advantage_fn(name)).parameters)


def needs_critic(name: str) -> bool:
    """An estimator that takes `values` needs a critic (the trainer then loads and trains one)."""
    return "values" in estimator_inputs(name)


def needs_groups(name: str) -> bool:
    """An estimator that takes `group_ids` compares the samples of one prompt (algorithm.n >= 2)."""
    return "group_ids" in estimator_inputs(name)


def _check_mask(response_mask: torch.Tensor) -> torch.Tensor:
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be (batch, tokens), got shape {tuple(response_mask.shape)}")
    return response_mask != 0


def _check_scores_and_mask(scores: torch.Tensor, response_mask: torch.Tensor) -> None:
    """One outcome score per response row."""
    if response_mask.shape[0] != scores.shape[0]:
        raise ValueError(
            f"scores has {scores.shape[0]} samples but response_mask has {response_mask.shape[0]} rows"
        )
    _check_mask(response_mask)


def _check_no_masked_rewards(token_rewards: torch.Tensor, selected: torch.Tensor) -> None:
    stray = (token_rewards != 0) & ~selected
    if stray.any():
        rows = sorted({int(r) for r in stray.nonzero()[:, 0]})
        raise ValueError(
            f"token_rewards is non-zero at masked positions in rows {rows[:10]}; a reward there would be "
            "ignored. Put rewards on policy tokens (outcome_to_token_rewards does)."
        )


def group_index(group_ids: GroupIds, batch_size: int) -> tuple[torch.Tensor, int]:
    """Map per-sample group ids (any hashables, or a 1-D tensor) to dense indices 0..G-1.

    Returns (index (B,) long tensor, G). Groups are numbered in order of first appearance.
    """
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1:
            raise ValueError(f"group_ids must be 1-D (one id per sample), got shape {tuple(group_ids.shape)}")
        ids = group_ids.tolist()
    else:
        ids = list(group_ids)
    if len(ids) != batch_size:
        raise ValueError(f"group_ids has {len(ids)} entries but the batch has {batch_size} samples")
    dense: dict[Any, int] = {}
    index = [dense.setdefault(g, len(dense)) for g in ids]
    return torch.tensor(index, dtype=torch.long), len(dense)


def _group_stats(
    scores: torch.Tensor, group_ids: GroupIds
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group size, score - group mean, unbiased group std) gathered back to (B,), in float64.

    The statistics are taken in float64 and a group whose scores are all equal gets a centred score
    of exactly 0 (and std 0): the rounding error of a float mean is not a difference between samples,
    and dividing it by std + epsilon would turn it into an advantage of order 0.1.
    """
    if scores.dim() != 1:
        raise ValueError(
            f"scores must be (batch,), one outcome reward per sample; got shape {tuple(scores.shape)}"
        )
    values = scores.to(torch.float64)
    index, num_groups = group_index(group_ids, values.shape[0])
    index = index.to(values.device)
    counts = torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(
        0, index, torch.ones_like(values)
    )
    means = torch.zeros_like(counts).index_add_(0, index, values) / counts
    group_max = torch.full_like(counts, -torch.inf).scatter_reduce(0, index, values, reduce="amax")
    group_min = torch.full_like(counts, torch.inf).scatter_reduce(0, index, values, reduce="amin")
    uniform = (group_max == group_min)[index]
    centred = torch.where(uniform, torch.zeros_like(values), values - means[index])
    sq_dev = torch.zeros_like(counts).index_add_(0, index, centred**2)
    stds = torch.sqrt(sq_dev / (counts - 1).clamp_min(1))
    return counts[index], centred, stds[index]


def _broadcast(per_sample: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    weight = (response_mask != 0).to(per_sample.dtype)
    return per_sample.unsqueeze(-1) * weight


def outcome_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar reward (B,) on its last policy token -> (B, T).

    The last policy token is the last position with mask != 0 (an observation inserted after the
    final answer never receives the reward). A row without any policy token cannot carry a
    reward and raises ValueError.
    """
    selected = _check_mask(response_mask)
    if scores.shape != (response_mask.shape[0],):
        raise ValueError(
            f"scores must be (batch,) = ({response_mask.shape[0]},), got shape {tuple(scores.shape)}"
        )
    has_token = selected.any(dim=-1)
    if not has_token.all():
        rows = (~has_token).nonzero()[:, 0].tolist()
        raise ValueError(
            f"rows {rows[:10]} have no policy token in response_mask; their reward would be lost"
        )
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    last = torch.where(selected, positions, torch.full_like(positions, -1)).max(dim=-1).values
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    out[torch.arange(out.shape[0], device=out.device), last] = scores.float().to(out.device)
    return out


def turn_token_rewards(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    turn_ends: Sequence[Sequence[int]],
    turn_rewards: Sequence[Sequence[float]],
) -> torch.Tensor:
    """Outcome scores (B,) on each row's last policy token, plus per-turn rewards on the last
    policy token of their turn -> (B, T).

    `turn_ends[i]` are the response positions (exclusive ends) of row i's policy turns and
    `turn_rewards[i]` one reward per such turn (empty: outcome only). A turn reward on the last turn
    adds to the outcome score there. A row whose mask is all zero (DAPO's overlong filter) or a turn
    whose last token is masked raises ValueError, as a reward there would be lost.
    """
    out = outcome_to_token_rewards(scores, response_mask)
    if len(turn_ends) != out.shape[0] or len(turn_rewards) != out.shape[0]:
        raise ValueError(
            f"turn_ends and turn_rewards need one entry per row ({out.shape[0]}), "
            f"got {len(turn_ends)} and {len(turn_rewards)}"
        )
    selected = response_mask != 0
    for row, (ends, rewards) in enumerate(zip(turn_ends, turn_rewards, strict=True)):
        if not rewards:
            continue
        if len(rewards) != len(ends):
            raise ValueError(
                f"row {row}: {len(rewards)} turn rewards for {len(ends)} policy turns; a reward "
                "returns one value per policy turn (Trajectory.turns with role 'policy')"
            )
        for end, value in zip(ends, rewards, strict=True):
            if not 0 < end <= out.shape[1] or not selected[row, end - 1]:
                raise ValueError(
                    f"row {row}: the turn ending at response position {end} has no policy token "
                    "there; its reward would be lost"
                )
            out[row, end - 1] += float(value)
    return out


def policy_turn_ids(response_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) long: the index (0, 1, ...) of the policy turn each token belongs to, -1 on masked tokens.
    A turn is a maximal run of policy tokens: tokens the environment inserted end it."""
    selected = _check_mask(response_mask)
    starts = selected.clone()
    starts[:, 1:] &= ~selected[:, :-1]  # a policy token right after a masked one (or at 0) opens a turn
    ids = starts.long().cumsum(dim=-1) - 1
    return torch.where(selected, ids, torch.full_like(ids, -1))


def _turn_rewards_matrix(
    token_rewards: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, K) sum of each turn's token rewards and (B, K) bool of the turns that exist; K = most turns in a row."""
    check_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    selected = _check_mask(response_mask)
    _check_no_masked_rewards(token_rewards, selected)
    ids = policy_turn_ids(response_mask)
    num_turns = int(ids.max()) + 1 if ids.numel() else 0
    k = max(num_turns, 1)
    per_turn = torch.zeros((ids.shape[0], k), dtype=torch.float64, device=ids.device)
    per_turn.scatter_add_(1, ids.clamp_min(0), torch.where(selected, token_rewards.double(), 0.0))
    # counted, not scattered as booleans: a masked token (clamped to turn 0) must not erase turn 0
    tokens = torch.zeros_like(per_turn).scatter_add_(1, ids.clamp_min(0), selected.double())
    return per_turn, tokens > 0


def _discounted_turn_sums(values: torch.Tensor, exists: torch.Tensor, gamma: float) -> torch.Tensor:
    """(B, K) sum over turns k' >= k of gamma^(k'-k) values[k'] (missing turns add nothing)."""
    out = torch.zeros_like(values)
    running = torch.zeros(values.shape[0], dtype=values.dtype, device=values.device)
    for k in reversed(range(values.shape[1])):
        running = torch.where(exists[:, k], values[:, k] + gamma * running, running)
        out[:, k] = running
    return out


def _spread_over_turns(per_turn: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    ids = policy_turn_ids(response_mask)
    spread = per_turn.gather(1, ids.clamp_min(0)).float()
    return torch.where(ids >= 0, spread, torch.zeros_like(spread))


# --------------------------------------------------------------------------- estimators


@register_advantage("gae")
@torch.no_grad()
def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation over the policy tokens of multi-turn responses.

    A multi-turn response interleaves policy tokens with tokens the environment inserted
    (retrieved documents). Only policy tokens are actions of the MDP, so the recursion runs over
    them alone, as if the masked tokens were deleted:

        for policy tokens t in reverse order, with t' the next *policy* token after t:
            delta_t = r_t + gamma * V(t') - V(t)
            A_t     = delta_t + gamma * lam * A_t'
        (V(t') = 0 and A_t' = 0 after the last policy token)

    The value predicted at an observation token is not used anywhere: the state after a policy
    token that triggered a search is the next policy token, whose value already conditions on
    the inserted documents. Discounting is applied once per policy token, not per inserted token.
    Rewards must sit on policy tokens (non-zero rewards at masked positions raise ValueError).

    Returns (advantages, returns) with returns = A + V (before whitening; the critic's target).
    With `whiten=True` the advantages are whitened over all policy tokens of the batch
    (masked_whiten, unbiased variance). Both outputs are 0 at masked positions.
    """
    check_same_shape(token_rewards=token_rewards, values=values, response_mask=response_mask)
    selected = _check_mask(response_mask)
    _check_no_masked_rewards(token_rewards, selected)
    rewards = token_rewards.float()
    vals = values.float()
    batch, length = rewards.shape
    next_value = torch.zeros(batch, dtype=rewards.dtype, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(length)):
        is_policy = selected[:, t]
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        adv_t = delta + gamma * lam * next_adv
        # Observation tokens leave the carried (value, advantage) untouched: they are skipped.
        next_value = torch.where(is_policy, vals[:, t], next_value)
        next_adv = torch.where(is_policy, adv_t, next_adv)
        advantages[:, t] = torch.where(is_policy, adv_t, torch.zeros_like(adv_t))
    returns = torch.where(selected, advantages + vals, torch.zeros_like(advantages))
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


@register_advantage("grpo")
@torch.no_grad()
def grpo_advantages(
    scores: torch.Tensor,
    group_ids: GroupIds,
    response_mask: torch.Tensor,
    *,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: A_i = (r_i - mean_g) / (std_g + epsilon), broadcast over the
    policy tokens of sample i. `group_ids` (B,) says which samples answer the same prompt.

    - std is the unbiased (n-1) standard deviation of the group's rewards, as torch.std and verl.
    - `norm_by_std=False` gives Dr.GRPO (A_i = r_i - mean_g), which avoids up-weighting groups
      whose rewards barely differ.
    - A group whose rewards are all equal gets advantage exactly 0 either way (statistics in float64
      plus an explicit equal-rewards check; verl's float32 mean/std leaves rounding noise there).
    - A group of one sample gets advantage 0: with no other sample there is no relative signal.
      (verl instead uses mean 0 and std 1 there, i.e. the raw reward as advantage, which turns
      GRPO into plain REINFORCE for that sample; we do not follow it.)

    Returns (advantages, returns); both are the same tensor, as in verl (no critic).
    """
    counts, centred, stds = _group_stats(scores, group_ids)
    _check_scores_and_mask(scores, response_mask)
    per_sample = centred / (stds + epsilon) if norm_by_std else centred
    per_sample = torch.where(counts > 1, per_sample, torch.zeros_like(per_sample)).float()
    adv = _broadcast(per_sample, response_mask)
    return adv, adv


@register_advantage("drgrpo")
@torch.no_grad()
def drgrpo_advantages(
    scores: torch.Tensor, group_ids: GroupIds, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO (Liu et al. 2025): `grpo_advantages(..., norm_by_std=False)`. Pair it with the
    "seq-mean-token-sum-norm" loss aggregation to also remove the length normalisation."""
    return grpo_advantages(scores, group_ids, response_mask, norm_by_std=False)


@register_advantage("rloo")
@torch.no_grad()
def rloo_advantages(
    scores: torch.Tensor, group_ids: GroupIds, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j over the
    other samples of i's group, which equals n/(n-1) * (r_i - mean_g); a group of equal rewards
    gets exactly 0. Returns (advantages, advantages).

    A group of one sample has no leave-one-out baseline and gets advantage 0, the same convention
    as `grpo_advantages`. verl's `rloo` differs here: it leaves such a sample's raw reward as its
    advantage (plain REINFORCE without baseline); see docs/compatibility.md.
    """
    counts, centred, _ = _group_stats(scores, group_ids)
    _check_scores_and_mask(scores, response_mask)
    per_sample = centred * counts / (counts - 1).clamp_min(1)
    per_sample = torch.where(counts > 1, per_sample, torch.zeros_like(per_sample)).float()
    adv = _broadcast(per_sample, response_mask)
    return adv, adv


@register_advantage("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, *, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted reward-to-go per policy token, whitened over the batch.

    G_t = r_t + gamma * G_t' with t' the next policy token (masked tokens are skipped as in
    `gae_advantages`, so discounting counts policy tokens only). Returns (whitened G, G), both 0
    at masked positions. Rewards at masked positions raise ValueError.
    """
    check_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    selected = _check_mask(response_mask)
    _check_no_masked_rewards(token_rewards, selected)
    rewards = token_rewards.float()
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        is_policy = selected[:, t]
        running = torch.where(is_policy, rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(is_policy, running, torch.zeros_like(running))
    return masked_whiten(returns, response_mask), returns


@register_advantage("turn_grpo")
@torch.no_grad()
def turn_grpo_advantages(
    token_rewards: torch.Tensor,
    group_ids: GroupIds,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """IGPO (2510.14967)'s turn-level advantage. Each turn's reward r_{i,t} is the sum of its token
    rewards (the outcome sits on the last turn). All turn rewards of a group are normalised together,
    r^_{i,t} = (r_{i,t} - mean_G) / (std_G + epsilon) over every turn of every sample of the group
    (unbiased std; a group whose turn rewards are all equal gets 0), then A_{i,t} = sum_{t'>=t}
    gamma^(t'-t) r^_{i,t'}, given to every token of turn t. Returns (advantages, advantages)."""
    per_turn, exists = _turn_rewards_matrix(token_rewards, response_mask)
    index, num_groups = group_index(group_ids, per_turn.shape[0])
    normed = torch.zeros_like(per_turn)
    for g in range(num_groups):
        rows = (index == g).nonzero()[:, 0].to(per_turn.device)
        values = per_turn[rows][exists[rows]]
        if values.numel() < 2 or bool((values == values[0]).all()):
            continue  # no spread: no relative signal inside the group
        centred = (per_turn[rows] - values.mean()) / (values.std() + epsilon)
        normed[rows] = torch.where(exists[rows], centred, torch.zeros_like(centred))
    adv = _spread_over_turns(_discounted_turn_sums(normed, exists, gamma), response_mask)
    return adv, adv


@register_advantage("turn_reinforce")
@torch.no_grad()
def turn_reinforce_advantages(
    token_rewards: torch.Tensor, group_ids: GroupIds, response_mask: torch.Tensor, *, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn-level REINFORCE with a group baseline: G_{i,t} = sum_{t'>=t} gamma^(t'-t) r_{i,t'} (turn rewards
    as in `turn_grpo_advantages`), A_{i,t} = G_{i,t} - mean of G_{j,t} over the samples j of i's group that
    have a turn t (a turn index only one sample reached gets 0). Returns (advantages, returns G)."""
    per_turn, exists = _turn_rewards_matrix(token_rewards, response_mask)
    returns = _discounted_turn_sums(per_turn, exists, gamma)
    index, num_groups = group_index(group_ids, per_turn.shape[0])
    adv = torch.zeros_like(returns)
    for g in range(num_groups):
        rows = (index == g).nonzero()[:, 0].to(returns.device)
        present = exists[rows].double()
        count = present.sum(0)
        mean = (returns[rows] * present).sum(0) / count.clamp_min(1)
        centred = torch.where(
            (count > 1) & exists[rows], returns[rows] - mean, torch.zeros_like(returns[rows])
        )
        adv[rows] = centred
    return _spread_over_turns(adv, response_mask), _spread_over_turns(returns, response_mask)


# --------------------------------------------------------------------------- dispatch


def compute_advantages(
    name: str,
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    group_ids: GroupIds | None = None,
    **hparams: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator registered as `name` with what it needs.

    Estimators taking `scores` (outcome rewards) receive `token_rewards.sum(-1)`, so a KL
    penalty applied per token is included in the outcome. `values` (critic) and `group_ids`
    are required only by the estimators that declare them. `hparams` (gamma, lam, whiten,
    norm_by_std, epsilon ...) must be parameters of the estimator; others raise ValueError.
    """
    fn = get_advantage_fn(name)
    params = inspect.signature(fn).parameters
    unknown = sorted(set(hparams) - set(params))
    if unknown:
        allowed = sorted(set(params) - {"scores", "token_rewards", "values", "group_ids", "response_mask"})
        raise ValueError(f"advantage estimator {name!r} does not take {unknown}; its options are {allowed}")
    kwargs: dict[str, Any] = {"response_mask": response_mask, **hparams}
    if "scores" in params:
        kwargs["scores"] = token_rewards.sum(dim=-1)
    if "token_rewards" in params:
        kwargs["token_rewards"] = token_rewards
    for needed_name, given in (("values", values), ("group_ids", group_ids)):
        if needed_name in params:
            if given is None:
                raise ValueError(f"advantage estimator {name!r} needs {needed_name}")
            kwargs[needed_name] = given
    return fn(**kwargs)


__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "compute_advantages",
    "drgrpo_advantages",
    "gae_advantages",
    "get_advantage_fn",
    "estimator_inputs",
    "group_index",
    "needs_critic",
    "needs_groups",
    "grpo_advantages",
    "outcome_to_token_rewards",
    "policy_turn_ids",
    "turn_grpo_advantages",
    "turn_reinforce_advantages",
    "turn_token_rewards",
    "register_advantage",
    "reinforce_plus_plus_advantages",
    "rloo_advantages",
]
