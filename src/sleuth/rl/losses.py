"""Loss functions and masked reductions for PPO-family training of LLM policies.

Conventions shared by every function here (the same as verl's `core_algos`):

- Token tensors have shape (B, T): B sequences, T response positions. Position t holds the
  quantity for the token at t (its log-prob, value, advantage ...).
- `response_mask` is (B, T), bool or float, 1 where the token is a policy token that counts
  and 0 for padding and for tokens the environment inserted (retrieved documents, tool
  feedback). Every loss ignores masked positions exactly: they contribute nothing to the
  value and their gradient is exactly zero, even when the inputs there are garbage
  (inf/NaN log-probs from padding).
- Losses are to be minimised and return `(loss, stats)` where `stats` maps a metric name to a
  plain Python float, ready for logging.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")

# exp() of a log-ratio beyond this is meaningless for PPO and overflows in half precision.
_LOG_RATIO_LIMIT = 20.0


# --------------------------------------------------------------------------- checks


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError naming the inputs when the given tensors do not all share one shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        described = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"shape mismatch: {described}; these must all have the same (batch, tokens) shape")


def _as_weight(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.to(dtype=like.dtype if like.is_floating_point() else torch.float32)


def _zero_outside(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values * mask, except that masked positions are exactly 0 and pass no gradient even if
    `values` holds inf/NaN there (plain multiplication would give 0 * inf = NaN)."""
    weight = _as_weight(mask, values)
    return torch.where(mask != 0, values * weight, torch.zeros_like(values))


# --------------------------------------------------------------------------- masked reductions


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values * mask` over `dim` (all elements when None). Masked positions count as 0."""
    check_same_shape(values=values, mask=mask)
    masked = _zero_outside(values, mask)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over positions where mask != 0 (weighted by a float mask).

    An empty selection gives 0 rather than NaN, so a batch with no policy tokens yields a
    zero loss instead of poisoning the optimizer state.
    """
    total = masked_sum(values, mask, dim)
    weight = _as_weight(mask, values)
    count = weight.sum() if dim is None else weight.sum(dim=dim)
    return total / count.clamp_min(1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the selected positions of the whole tensor. `unbiased` applies Bessel's
    correction n/(n-1) with n the number of selected positions (the mask's sum)."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = _as_weight(mask, values).sum()
        if count <= 1:
            raise ValueError(
                f"masked_var(unbiased=True) needs at least 2 selected positions, got {float(count)}; "
                "pass more tokens or unbiased=False"
            )
        var = var * count / (count - 1)
    return var


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) with mean and unbiased variance taken over the selected
    positions of the whole batch. With `shift_mean=False` the mean is added back (only the scale
    changes). Masked positions are set to 0 in the output."""
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _zero_outside(whitened, mask)


# --------------------------------------------------------------------------- aggregation


def agg_loss(
    loss_mat: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    norm_length: float | None = None,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss matrix (B, T) to a scalar.

    Modes:
      - "token-mean" (DAPO): sum over all selected tokens / number of selected tokens. Every token
        weighs the same, so long responses weigh more than short ones.
      - "seq-mean-token-mean" (original GRPO): mean over tokens within each sequence, then mean
        over sequences. Every sequence weighs the same.
      - "seq-mean-token-sum": sum over tokens within each sequence, then mean over sequences.
      - "seq-mean-token-sum-norm" (Dr.GRPO): sum over tokens within each sequence divided by the
        constant `norm_length` (default T, the padded length; pass the configured maximum
        response length so the scale does not change with the batch), then mean over sequences.
        Note: verl sums over sequences here instead of averaging; we average so that the scale
        does not depend on the batch size, which only rescales the learning rate.

    The "seq-mean-*" modes average over sequences that have at least one selected token.

    Gradient accumulation: a loss computed per micro-batch and summed over micro-batches equals
    the loss of the whole mini-batch only if every micro-batch divides by the mini-batch's
    counts. Pass `num_tokens` (token-mean) or `num_seqs` (seq-mean-*) with the mini-batch totals
    to do that; by default the micro-batch's own counts are used.
    """
    check_same_shape(loss_mat=loss_mat, response_mask=response_mask)
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be (batch, tokens), got shape {tuple(loss_mat.shape)}")
    if mode == "token-mean":
        total = masked_sum(loss_mat, response_mask)
        denom = _as_weight(response_mask, loss_mat).sum() if num_tokens is None else num_tokens
        return total / torch.as_tensor(denom, dtype=total.dtype, device=total.device).clamp_min(1e-8)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")

    token_sums = masked_sum(loss_mat, response_mask, dim=-1)
    token_counts = _as_weight(response_mask, loss_mat).sum(dim=-1)
    if mode == "seq-mean-token-sum":
        seq_losses = token_sums
    elif mode == "seq-mean-token-mean":
        seq_losses = token_sums / token_counts.clamp_min(1e-8)
    else:  # seq-mean-token-sum-norm
        length = loss_mat.shape[-1] if norm_length is None else norm_length
        if length <= 0:
            raise ValueError(f"norm_length must be positive, got {length}")
        seq_losses = token_sums / length
    has_tokens = token_counts > 0
    denom = has_tokens.sum() if num_seqs is None else num_seqs
    denom_t = torch.as_tensor(denom, dtype=seq_losses.dtype, device=seq_losses.device).clamp_min(1e-8)
    return torch.where(has_tokens, seq_losses, torch.zeros_like(seq_losses)).sum() / denom_t


@dataclass(frozen=True)
class LossAgg:
    """How a loss matrix becomes a scalar: the `agg_loss` mode and, under gradient accumulation,
    the mini-batch totals every micro-batch divides by (see `agg_loss`)."""

    mode: str = "token-mean"
    norm_length: float | None = None
    num_tokens: float | torch.Tensor | None = None
    num_seqs: float | torch.Tensor | None = None

    def __call__(self, loss_mat: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        return agg_loss(
            loss_mat,
            response_mask,
            self.mode,
            norm_length=self.norm_length,
            num_tokens=self.num_tokens,
            num_seqs=self.num_seqs,
        )


# --------------------------------------------------------------------------- policy / value losses


@dataclass(frozen=True)
class PolicyClip:
    """PPO ratio clipping: [1 - clip_low, 1 + clip_high] (DAPO clip-higher when clip_high > clip_low),
    and the dual-clip constant c > 1 bounding negative-advantage tokens (None: off)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: float | None = None


PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
# name -> policy loss; each takes (old_logprob, logprob, advantages, response_mask, *, clip, agg) and
# returns (loss, stats), like verl's core_algos. A recipe names one in algorithm.policy_loss.
POLICY_LOSSES: dict[str, PolicyLossFn] = {}
# name -> the stats its loss returns (logged as `actor/<stat>`), when declared: a guard on `actor/x` is checked
# against them when the recipe loads (sleuth.rl.guard_metrics); an undeclared loss lets any `actor/...` pass
POLICY_LOSS_STATS: dict[str, tuple[str, ...]] = {}


def register_policy_loss(
    name: str, stats: Sequence[str] | None = None
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under `name` (a name can be taken once), with the names of the
    stats it returns if known."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        existing = POLICY_LOSSES.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"policy loss {name!r} is already registered ({existing.__qualname__})")
        POLICY_LOSSES[name] = fn
        if stats is not None:
            POLICY_LOSS_STATS[name] = tuple(stats)
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLossFn:
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; known: {', '.join(sorted(POLICY_LOSSES))}") from None


@register_policy_loss(
    "ppo_clip",
    stats=("clipfrac", "clipfrac_lower", "approx_kl", "approx_kl_k3", "ratio_mean", "ratio_min", "ratio_max"),
)
def policy_loss(
    old_logprob: torch.Tensor,
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip: PolicyClip = PolicyClip(),
    agg: LossAgg = LossAgg(),
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate loss with asymmetric clipping (DAPO clip-higher) and optional dual clip.

    Per token, with r = exp(logprob - old_logprob) and advantage A:
        loss_t = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))
    With `clip.dual_clip_c` = c > 1 (Ye et al. 2020), tokens with A < 0 are further bounded:
        loss_t = min(loss_t, -A * c)
    so a huge ratio on a negative-advantage token cannot blow up the loss.
    DAPO's clip-higher is `clip_high` > `clip_low` (e.g. 0.2 / 0.28).

    Only `logprob` should carry gradient; `old_logprob` and `advantages` are treated as constants.
    The log-ratio is clamped to +-20 before exp for numerical safety.

    Returns (loss, stats) with stats:
      - clipfrac: fraction of selected tokens where the clipped branch is active (it is strictly
        larger than the unclipped one, i.e. the gradient is cut off);
      - clipfrac_lower: fraction where the dual clip bound is active (0 without dual clip);
      - approx_kl: mean of (old_logprob - logprob), a k1 estimate of KL(old || new);
      - approx_kl_k3: mean of the low-variance k3 estimate of KL(old || new) (always >= 0);
      - ratio_mean / ratio_min / ratio_max over selected tokens.
    """
    check_same_shape(
        old_logprob=old_logprob, logprob=logprob, advantages=advantages, response_mask=response_mask
    )
    clip_low, clip_high, dual_clip_c = clip.clip_low, clip.clip_high, clip.dual_clip_c
    if clip_low <= 0 or clip_low >= 1 or clip_high <= 0:
        raise ValueError(
            f"need 0 < clip_low < 1 and clip_high > 0, got clip_low={clip_low}, clip_high={clip_high}"
        )
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (it bounds the ratio from above), got {dual_clip_c}")

    selected = response_mask != 0
    old_logprob = old_logprob.detach()
    advantages = advantages.detach()
    # torch.where (not multiplication) so that garbage at masked positions cannot reach exp/grad.
    log_ratio = torch.where(selected, logprob - old_logprob, torch.zeros_like(logprob))
    log_ratio = log_ratio.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    safe_adv = torch.where(selected, advantages, torch.zeros_like(advantages))

    unclipped = -safe_adv * ratio
    clipped = -safe_adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped

    lower_active = torch.zeros_like(clip_active)
    if dual_clip_c is not None:
        bound = -safe_adv * dual_clip_c
        negative = safe_adv < 0
        lower_active = negative & (loss_mat > bound)
        loss_mat = torch.where(negative, torch.minimum(loss_mat, bound), loss_mat)

    loss = agg(loss_mat, response_mask)

    with torch.no_grad():
        neg_log_ratio = -log_ratio
        k3 = torch.exp(log_ratio) - 1.0 - log_ratio  # KL(old||new) k3 form with r = new/old
        if selected.any():
            sel_ratio = ratio[selected]
            ratio_min, ratio_max = float(sel_ratio.min()), float(sel_ratio.max())
        else:
            ratio_min = ratio_max = 1.0
        stats = {
            "clipfrac": float(masked_mean(clip_active.float(), response_mask)),
            "clipfrac_lower": float(masked_mean(lower_active.float(), response_mask)),
            "approx_kl": float(masked_mean(neg_log_ratio, response_mask)),
            "approx_kl_k3": float(masked_mean(k3, response_mask)),
            "ratio_mean": float(masked_mean(ratio, response_mask)),
            "ratio_min": ratio_min,
            "ratio_max": ratio_max,
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip: float | None = 0.2,
    agg: LossAgg = LossAgg(),
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped value loss.

    Per token, with v the new value prediction, v_old the prediction at rollout time and R the
    GAE return:
        v_clip = clamp(v, v_old - clip, v_old + clip)
        loss_t = 0.5 * max((v - R)^2, (v_clip - R)^2)
    The 0.5 factor follows the common PPO/verl convention (the gradient of 0.5 * e^2 is e);
    `clip=None` disables clipping (loss_t = 0.5 * (v - R)^2).

    Returns (loss, stats) with stats "vf_clipfrac" (fraction of selected tokens where the
    clipped error is the larger one) and "vf_error" (mean squared error of v, unclipped).
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, response_mask=response_mask)
    if clip is not None and clip <= 0:
        raise ValueError(f"value clip must be positive or None, got {clip}")
    old_values = old_values.detach()
    returns = returns.detach()
    err_unclipped = (values - returns) ** 2
    if clip is None:
        loss_mat = err_unclipped
        clip_active = torch.zeros_like(err_unclipped, dtype=torch.bool)
    else:
        v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        err_clipped = (v_clipped - returns) ** 2
        loss_mat = torch.maximum(err_unclipped, err_clipped)
        clip_active = err_clipped > err_unclipped
    loss = 0.5 * agg(loss_mat, response_mask)
    with torch.no_grad():
        stats = {
            "vf_clipfrac": float(masked_mean(clip_active.float(), response_mask)),
            "vf_error": float(masked_mean(err_unclipped, response_mask)),
        }
    return loss, stats


# --------------------------------------------------------------------------- KL


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs (B, T).

    With d = logprob - ref_logprob (tokens were sampled from the policy; see
    http://joschu.net/blog/kl-approx.html):
      - "k1" / "kl":          d                       (unbiased, can be negative)
      - "abs":                |d|
      - "k2" / "mse":         0.5 * d^2               (biased, non-negative)
      - "k3" / "low_var_kl":  exp(-d) + d - 1          (unbiased, non-negative, low variance);
        like verl, -d is clamped to [-20, 20] before exp and the result to [-10, 10].
    A trailing "+" (e.g. "k3+") keeps the value of the named estimator but takes the gradient of
    k2, whose gradient is the unbiased gradient of the KL (straight-through trick).

    The result is not masked; mask it (apply_kl_penalty, kl_loss do).
    """
    check_same_shape(logprob=logprob, ref_logprob=ref_logprob)
    base = kind[:-1] if kind.endswith("+") else kind
    if base not in KL_ESTIMATORS:
        raise ValueError(
            f"unknown KL estimator {kind!r}; choose one of {', '.join(KL_ESTIMATORS)} (optionally with '+')"
        )
    diff = logprob - ref_logprob
    if base in ("k1", "kl"):
        value = diff
    elif base == "abs":
        value = diff.abs()
    elif base in ("k2", "mse"):
        value = 0.5 * diff.square()
    else:
        neg = torch.clamp(-diff, -20.0, 20.0)
        value = torch.clamp(torch.exp(neg) - neg - 1.0, -10.0, 10.0)
    if kind.endswith("+") and base not in ("k2", "mse"):
        surrogate = 0.5 * diff.square()
        value = surrogate - surrogate.detach() + value.detach()
    return value


def adaptive_kl_coef(coef: float, current_kl: float, target_kl: float, horizon: int, n_steps: int) -> float:
    """verl's `AdaptiveKLController.update` (Ziegler et al. 2019): the next KL penalty coefficient.

    coef * (1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon), where
    `current_kl` is the batch mean of each sequence's mean per-token KL (`sequence_mean_kl`) and
    `n_steps` the number of sequences in the batch."""
    proportional_error = min(max(current_kl / target_kl - 1.0, -0.2), 0.2)
    return coef * (1.0 + proportional_error * n_steps / horizon)


def sequence_mean_kl(kl: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per sequence, the mean KL over its policy tokens (verl's `masked_mean(kld, mask, axis=-1)`);
    a sequence without policy tokens counts 0."""
    check_same_shape(kl=kl, response_mask=response_mask)
    mask = response_mask.to(kl.dtype)
    return (kl * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def apply_kl_penalty(
    token_rewards: torch.Tensor, kl: torch.Tensor, beta: float, response_mask: torch.Tensor
) -> torch.Tensor:
    """KL as a reward penalty (PPO-RLHF style): rewards - beta * kl on policy tokens.

    `kl` is a per-token estimate from `kl_penalty(old_logprob, ref_logprob, kind)`. Masked
    positions get no penalty (environment tokens are not the policy's actions). The result is
    detached: rewards are data, not part of the graph.
    """
    check_same_shape(token_rewards=token_rewards, kl=kl, response_mask=response_mask)
    return (token_rewards - beta * _zero_outside(kl, response_mask)).detach()


def kl_loss(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kind: str = "low_var_kl",
    agg: LossAgg = LossAgg(),
) -> torch.Tensor:
    """KL as a loss term (GRPO style): agg_loss(kl_penalty(logprob, ref_logprob, kind)).

    Multiply by the KL coefficient and add to the policy loss. `ref_logprob` is treated as a
    constant. Garbage at masked positions cannot reach the value or the gradient.
    """
    check_same_shape(logprob=logprob, ref_logprob=ref_logprob, response_mask=response_mask)
    selected = response_mask != 0
    ref = ref_logprob.detach()
    # Replace masked inputs by equal values (kl 0) through torch.where so they pass no gradient.
    safe_logprob = torch.where(selected, logprob, torch.zeros_like(logprob))
    safe_ref = torch.where(selected, ref, torch.zeros_like(ref))
    kl = kl_penalty(safe_logprob, safe_ref, kind)
    return agg(kl, response_mask)


# --------------------------------------------------------------------------- logits helpers


def _rows_in_chunks(logits: torch.Tensor, chunk_rows: int | None):
    flat = logits.reshape(-1, logits.shape[-1])
    step = chunk_rows if chunk_rows else flat.shape[0]
    for start in range(0, flat.shape[0], max(step, 1)):
        yield start, flat[start : start + step]


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int | None = None
) -> torch.Tensor:
    """log softmax(logits)[..., label] without materialising the full log-softmax.

    logits (..., V), labels (...) of integer ids -> (...) float32 log-probs, computed as
    logits[label] - logsumexp(logits) in float32. `chunk_rows` processes that many positions
    at a time so a bf16 (B*T, V) tensor is never copied to float32 in one piece. Gradients
    flow to `logits`. Labels are the *next* tokens: shift before calling (logits[:, :-1],
    ids[:, 1:]).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} plus a vocabulary dimension"
        )
    flat_labels = labels.reshape(-1).long()
    vocab = logits.shape[-1]
    if flat_labels.numel() and (int(flat_labels.min()) < 0 or int(flat_labels.max()) >= vocab):
        raise ValueError(
            f"labels must be token ids in [0, {vocab}); replace padding ids (e.g. -100) before calling"
        )
    pieces = []
    for start, rows in _rows_in_chunks(logits, chunk_rows):
        rows32 = at_least_fp32(rows)
        lab = flat_labels[start : start + rows.shape[0]]
        picked = rows32.gather(-1, lab.unsqueeze(-1)).squeeze(-1)
        pieces.append(picked - torch.logsumexp(rows32, dim=-1))
    out = torch.cat(pieces) if pieces else logits.new_zeros(0, dtype=torch.float32)
    return out.reshape(labels.shape)


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Upcast half precision to float32; float64 stays float64 (numerical checks run in it)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def entropy_from_logits(logits: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension, (..., V) -> (...), float32.

    Uses H = logsumexp(z) - sum(softmax(z) * z), which needs one softmax and no log-softmax
    tensor. `chunk_rows` bounds the float32 working memory as in `logprobs_from_logits`.
    """
    pieces = []
    for _, rows in _rows_in_chunks(logits, chunk_rows):
        rows32 = at_least_fp32(rows)
        probs = torch.softmax(rows32, dim=-1)
        pieces.append(torch.logsumexp(rows32, dim=-1) - (probs * rows32).sum(dim=-1))
    out = torch.cat(pieces) if pieces else logits.new_zeros(0, dtype=torch.float32)
    return out.reshape(logits.shape[:-1])


class _ChunkedTokenStats(torch.autograd.Function):
    """Log-prob of the label and entropy of softmax(logits / T) for each row of (K, V) logits, computed
    `chunk` rows at a time in at least float32, forward and backward: the largest float32 temporary is
    (chunk, V), and the gradient is written into one (K, V) tensor of the logits' dtype. (Autograd through
    per-chunk slices and upcasts would keep a float32 copy of every chunk and add a (K, V) zero tensor per
    chunk in the backward.)"""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, temperature: float, chunk: int):  # type: ignore[override]
        logp = torch.empty(
            logits.shape[0], dtype=torch.promote_types(logits.dtype, torch.float32), device=logits.device
        )
        ent = torch.empty_like(logp)
        for start in range(0, logits.shape[0], chunk):
            z = at_least_fp32(logits[start : start + chunk]) / temperature
            lse = torch.logsumexp(z, dim=-1)
            logp[start : start + chunk] = z.gather(-1, labels[start : start + chunk, None]).squeeze(-1) - lse
            ent[start : start + chunk] = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(logits, labels, ent)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_ent: torch.Tensor):  # type: ignore[override]
        logits, labels, ent = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], chunk):
            sl = slice(start, start + chunk)
            z = at_least_fp32(logits[sl]) / temperature
            log_p = torch.log_softmax(z, dim=-1)
            p = log_p.exp()
            # d logp[label] / dz = onehot - p;  d H / dz = -p * (log p + H)
            g = -grad_ent[sl, None] * p * (log_p + ent[sl, None]) - grad_logp[sl, None] * p
            g.scatter_add_(-1, labels[sl, None], grad_logp[sl, None].to(g.dtype))
            grad[sl] = (g / temperature).to(grad.dtype)
        return grad, None, None, None


def token_logprobs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, chunk_rows: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(label), entropy) of softmax(logits / temperature) per row of (K, V) logits, both (K,) in at
    least float32, differentiable, with float32 working memory bounded by (chunk_rows, V) in the forward and
    the backward. Temperature 0 (greedy sampling) means 1: the sampler's log-probs are then untempered."""
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be (K, V) and labels (K,), got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    labels = labels.long()
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= logits.shape[1]):
        raise ValueError(f"labels must be token ids in [0, {logits.shape[1]})")
    scale = temperature if temperature > 0 else 1.0
    return _ChunkedTokenStats.apply(logits, labels, scale, chunk_rows)


__all__ = [
    "POLICY_LOSSES",
    "POLICY_LOSS_STATS",
    "LossAgg",
    "PolicyClip",
    "get_policy_loss",
    "register_policy_loss",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "agg_loss",
    "apply_kl_penalty",
    "check_same_shape",
    "entropy_from_logits",
    "kl_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "token_logprobs_and_entropy",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "value_loss",
]
