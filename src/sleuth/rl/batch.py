"""Tensors from trajectories and the no-grad forward passes over them.

Token layout. A trajectory is `prompt_ids + response_ids`; the response mixes policy tokens
(loss_mask 1) and tokens the environment inserted (documents, feedback; loss_mask 0). All per-token
tensors here are (B, R) over response positions only: entry j scores response token j given
everything before it. `action_mask` is 1 exactly on policy tokens, so inserted tokens never
contribute to the policy, value or KL terms.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from sleuth.agent.trajectory import Trajectory
from sleuth.rl import advantages as adv_fns
from sleuth.rl import losses as loss_fns
from sleuth.rl.config import Recipe
from sleuth.rl.dist import unwrap
from sleuth.rl.models import ValueModel, autocast
from sleuth.rl.sampling import overlong_mask


@dataclass
class TokenBatch:
    """Each row is prompt + response packed to the left and right-padded, so the training forward
    needs no attention mask at all: causal attention alone keeps real tokens from seeing the padding
    after them. (Left padding needs a mask whose pad rows attend to nothing; CUDA's
    memory-efficient attention backward has produced NaN gradients for such masks while the forward
    stayed finite.) Without a mask SDPA can pick its flash kernel. Per-token tensors cover only
    response positions: column j of `action_mask` is response token j of that row. `lengths` holds each
    row's real token count (prompt + response), which the padding-free forward packs by."""

    input_ids: torch.Tensor  # (B, L), L = longest prompt + R
    response_start: torch.Tensor  # (B,) long: the column where each row's response begins
    action_mask: torch.Tensor  # (B, R) float: 1 where response token j is a policy token
    lengths: torch.Tensor | None = None  # (B,) long; None: every row runs to its last policy token

    @property
    def response_width(self) -> int:
        return self.action_mask.shape[1]

    def row_lengths(self) -> torch.Tensor:
        if self.lengths is not None:
            return self.lengths
        # no recorded lengths: up to the last policy token (what the log-probs need), at least the prompt
        cols = torch.arange(1, self.response_width + 1, device=self.action_mask.device)
        last = ((self.action_mask != 0) * cols).amax(dim=1) if self.response_width else 0
        return self.response_start + last

    def index(self, idx: torch.Tensor, width_multiple: int = 1) -> TokenBatch:
        """The rows `idx`, cut to the columns they use: their longest row (the token budget's count), not their
        longest prompt + the whole batch's longest response, which on ragged rows made a budgeted micro-batch
        of short rows as wide as the batch's longest and ran out of memory (the late-training rehearsal on an
        H200), rounded up to `width_multiple` columns (`padded_width`). Per-token tensors keep the batch's
        response width R."""
        starts = self.response_start[idx]
        lengths = None if self.lengths is None else self.lengths[idx]
        sub = TokenBatch(self.input_ids[idx], starts, self.action_mask[idx], lengths)
        width = padded_width(int(sub.row_lengths().max()), width_multiple) if len(starts) else 1
        sub.input_ids = sub.input_ids[:, : max(width, 1)]
        return sub


# On a GPU, padded micro-batches are cut to a multiple of this many columns: each new (rows, width) shape costs
# the attention a plan of its own (cuDNN SDPA on an H200: ~0.15 s on top of a 0.7 s micro-batch of 5 x 3,141
# tokens; bench/results/update43_h200_20261129/s16_call6_width_probe.json), and exact widths are almost all new,
# while a few dozen rounded widths come back step after step, for ~1% more columns.
GPU_WIDTH_MULTIPLE = 64


def padded_width(longest: int, multiple: int) -> int:
    """The columns a padded micro-batch whose longest row has `longest` tokens runs on."""
    return -(-longest // multiple) * multiple


def collate(trajs: list[Trajectory], pad_id: int, drop_truncated: bool = False) -> TokenBatch:
    S = max(len(t.prompt_ids) for t in trajs)
    R = max(1, max(len(t.response_ids) for t in trajs))
    B = len(trajs)
    input_ids = torch.full((B, S + R), pad_id, dtype=torch.long)
    starts = torch.zeros(B, dtype=torch.long)
    lengths = torch.tensor([len(t.prompt_ids) + len(t.response_ids) for t in trajs], dtype=torch.long)
    action = torch.zeros((B, R), dtype=torch.float32)
    keep = (
        overlong_mask([t.finish_reason for t in trajs]) if drop_truncated else torch.ones(B, dtype=torch.bool)
    )
    for i, t in enumerate(trajs):
        P, n = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, : P + n] = torch.tensor(t.prompt_ids + t.response_ids, dtype=torch.long)
        starts[i] = P
        if not keep[i]:
            continue  # DAPO overlong filtering: a truncated response teaches nothing reliable
        if n:
            action[i, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
    return TokenBatch(input_ids, starts, action, lengths)


def token_rewards(trajs: list[Trajectory], scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, R) rewards: each score on its row's last policy token and each trajectory's `turn_rewards` on the
    last token of its policy turns (outcome-only rewards give exactly `outcome_to_token_rewards`).

    A truncated response that DAPO's overlong filter dropped (`collate(drop_truncated=True)`: no policy token left
    in its mask) gets no reward tokens: nothing of it is trained, as the filter means. Any other row without a
    policy token is still an error (its reward would be lost silently)."""
    dropped = ~(mask > 0).any(dim=-1) & ~overlong_mask([t.finish_reason for t in trajs])
    if dropped.any():
        kept = (~dropped).nonzero()[:, 0].tolist()
        out = torch.zeros(mask.shape, dtype=scores.dtype, device=mask.device)
        if kept:
            out[kept] = token_rewards([trajs[i] for i in kept], scores[kept], mask[kept])
        return out
    if not any(t.turn_rewards for t in trajs):
        return adv_fns.outcome_to_token_rewards(scores, mask)
    return adv_fns.turn_token_rewards(
        scores, mask, [t.policy_turn_ends() for t in trajs], [t.turn_rewards for t in trajs]
    )


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


# rows of the output layer's logits turned into float32 at a time (forward and backward): 1,024 x a 151,936-word
# vocabulary is 0.6 GB of float32 working memory, whatever the micro-batch
LOGIT_CHUNK_ROWS = 1024


def forward_logprobs(
    model: nn.Module, batch: TokenBatch, temperature: float, with_entropy: bool = False, packed: bool = False,
    chunk_rows: int = LOGIT_CHUNK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Log-prob (B, R) of each policy token (action_mask != 0) under `model`, logits scaled by the sampling
    temperature; 0 at every other response position, which every loss masks out. Only the positions that
    predict a policy token go through the output layer (`logits_to_keep` with their indices), so neither the
    prompt nor inserted documents ever produce a vocabulary-wide row, and the float32 log-softmax and entropy
    run `chunk_rows` rows at a time (`losses.token_logprobs_and_entropy`).

    `packed`: the rows run as one padding-free sequence with per-row position ids (transformers then builds a
    block-diagonal causal mask, or passes cu_seqlens to flash attention), so no compute goes to padding;
    otherwise right-padded rows under causal attention alone (no mask)."""
    rows, cols = torch.nonzero(batch.action_mask, as_tuple=True)
    keep_rows = rows
    target = batch.response_start[rows] + cols  # column of each scored token in its row
    if len(rows) == 0:  # no policy token: one dummy position keeps the graph (and DDP's hooks) intact
        rows = torch.zeros(1, dtype=torch.long, device=batch.input_ids.device)
        target = batch.row_lengths()[:1].clamp(max=batch.input_ids.shape[1]) - 1
    with adapter_inputs_uncast(model, batch.input_ids.device.type):
        if packed:
            logits, labels = _packed_logits(model, batch, rows, target)
        else:
            logits, labels = _padded_logits(model, batch, rows, target)
    logp, ent = loss_fns.token_logprobs_and_entropy(logits, labels, temperature, chunk_rows)
    logprobs = _scatter(logp, batch, keep_rows, cols)
    return logprobs, (_scatter(ent, batch, keep_rows, cols) if with_entropy else None)


@contextmanager
def adapter_inputs_uncast(model: nn.Module, device_type: str) -> Iterator[None]:
    """Under autocast, peft's adapter layers keep the layer's input as it comes (bf16) instead of casting it to
    their float32 weights' dtype: autocast runs the adapter's products in bf16 either way (the float32 copy is cast
    back), so the values are the same, but each cast copy was kept for the backward - about 0.75x more activation
    memory on a 3B LoRA update and ~14% of its time (bench/update_profile.py, `no_input_cast`). Outside autocast
    nothing changes (a bf16 input would then meet float32 weights)."""
    layers = (
        [m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled")]
        if torch.is_autocast_enabled(device_type)
        else []
    )
    before = [m.cast_input_dtype_enabled for m in layers]
    for m in layers:
        m.cast_input_dtype_enabled = False
    try:
        yield
    finally:
        for m, value in zip(layers, before, strict=True):
            m.cast_input_dtype_enabled = value


def _padded_logits(model: nn.Module, batch: TokenBatch, rows: torch.Tensor,
                   target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(K, V) logits at the positions predicting `target` columns, from right-padded rows: the output layer
    runs on the union of those positions over the rows."""
    keep, where = torch.unique(target - 1, sorted=True, return_inverse=True)
    out = model(input_ids=batch.input_ids, logits_to_keep=keep, use_cache=False)
    return out.logits[rows, where], batch.input_ids[rows, target]


def _packed_logits(model: nn.Module, batch: TokenBatch, rows: torch.Tensor,
                   target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    lengths = batch.row_lengths()
    device = batch.input_ids.device
    width = torch.arange(batch.input_ids.shape[1], device=device)
    real = width[None, :] < lengths[:, None]
    ids = batch.input_ids[real][None, :]  # (1, T): the rows' real tokens, one after the other
    positions = width.expand_as(real)[real][None, :]  # each row's positions start at 0 again
    offsets = torch.cumsum(lengths, 0) - lengths
    flat = offsets[rows] + target
    out = model(input_ids=ids, position_ids=positions, logits_to_keep=flat - 1, use_cache=False)
    return out.logits[0], ids[0, flat]


def _scatter(values: torch.Tensor, batch: TokenBatch, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """(K,) per-token values -> (B, R), zero off the policy positions (differentiable)."""
    out = values.new_zeros(batch.action_mask.shape)
    if len(rows) == 0:
        return out + 0 * values.sum()  # still connected to the graph
    return out.index_put((rows, cols), values)


def micro_batches(
    lengths: torch.Tensor, max_rows: int, max_tokens: int | None, packed: bool, width_multiple: int = 1
) -> list[torch.Tensor]:
    """Split rows 0..B-1 (in order) into micro-batches of at most `max_rows` rows and, with a token budget, at
    most `max_tokens` tokens: the sum of lengths when packed, rows x the longest row's `padded_width` when
    padded (what the forward computes on). A row longer than the budget goes alone. The loss is normalised by
    the minibatch's totals, so any split gives the same gradient."""
    out: list[torch.Tensor] = []
    current: list[int] = []
    longest = total = 0
    for i, n in enumerate(lengths.tolist()):
        cost = total + n if packed else (len(current) + 1) * padded_width(max(longest, n), width_multiple)
        if current and (len(current) >= max_rows or (max_tokens is not None and cost > max_tokens)):
            out.append(torch.tensor(current, dtype=torch.long))
            current, longest, total = [], 0, 0
        current.append(i)
        longest, total = max(longest, n), total + n
    if current:
        out.append(torch.tensor(current, dtype=torch.long))
    return out


def critic_values(critic: nn.Module, batch: TokenBatch) -> torch.Tensor:
    """Values (B, R): entry j is the value of the state just before response token j."""
    values = critic(batch.input_ids)
    # response positions past a row's end (rows are cut to their longest) read the last column: masked anyway
    return values.gather(1, response_columns(batch, 0).clamp(max=values.shape[1] - 1))


def chunks(n: int, size: int) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


@dataclass(frozen=True)
class ForwardPlan:
    """How a batch goes through the model: at most `max_rows` rows and `max_tokens` tokens (None: no token
    budget) per micro-batch, packed without padding or right-padded (to a multiple of `width_multiple`
    columns)."""

    max_rows: int
    max_tokens: int | None = None
    packed: bool = False
    width_multiple: int = 1

    def split(self, batch: TokenBatch) -> list[torch.Tensor]:
        """Row indices of each micro-batch. Padded rows go longest first, so rows of similar length share a
        micro-batch and little goes to padding (any split gives the same gradient: the loss is normalised by
        the minibatch's totals)."""
        lengths = batch.row_lengths().cpu()
        order = (
            torch.arange(len(lengths))
            if self.packed
            else torch.argsort(lengths, descending=True, stable=True)
        )
        return [
            order[idx]
            for idx in micro_batches(
                lengths[order], self.max_rows, self.max_tokens, self.packed, self.width_multiple
            )
        ]


def forward_plan(recipe: Recipe, model: nn.Module) -> ForwardPlan:
    """The update's micro-batches: `algorithm.micro_batch_size` rows and, when set, `micro_batch_tokens`
    tokens; packed (`model.packing`) where the attention runs packed rows without a dense mask, else padded."""
    algo, packing = recipe.algorithm, recipe.model.packing
    packed = packing == "packed" or (packing == "auto" and supports_packing(unwrap(model)))
    on_gpu = next(model.parameters()).device.type == "cuda"
    multiple = GPU_WIDTH_MULTIPLE if on_gpu and not packed else 1
    return ForwardPlan(algo.micro_batch_size, algo.micro_batch_tokens, packed, multiple)


def supports_packing(model: nn.Module) -> bool:
    """A transformers model whose attention runs packed rows without a dense mask: flash attention (cu_seqlens
    from the position ids) or flex attention (a block mask that skips cross-row blocks). SDPA and eager would get
    a dense (T, T) block-diagonal mask over the whole micro-batch: correct, but attention then computes (and on
    the CPU's math kernel stores, per layer) every cross-row pair, more than the padded rows cost."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    return impl in ("flash_attention_2", "flash_attention_3", "flex_attention")


@torch.no_grad()
def batched_logprobs(
    model: nn.Module, batch: TokenBatch, temperature: float, plan: ForwardPlan | int, device: torch.device
) -> torch.Tensor:
    """Policy-token log-probs (B, R) without gradients, in micro-batches, returned on the CPU."""
    plan = ForwardPlan(plan) if isinstance(plan, int) else plan
    out = torch.zeros(batch.action_mask.shape, dtype=torch.float32)
    for idx in plan.split(batch):
        mb = to_device(batch.index(idx, plan.width_multiple), device)
        with autocast(device):
            logprobs = forward_logprobs(model, mb, temperature, packed=plan.packed)[0].cpu()
        out = out.to(torch.promote_types(out.dtype, logprobs.dtype))
        out[idx] = logprobs
    return out


@torch.no_grad()
def adapter_free_logprobs(
    model: nn.Module, batch: TokenBatch, temperature: float, packed: bool
) -> torch.Tensor:
    """Policy-token log-probs (B, R) of a LoRA (peft) model's base weights, adapters disabled, without gradients:
    the reference of a LoRA policy on one update micro-batch (`forward_logprobs`: policy positions only, the
    output layer chunked). In eval mode, so dropout cannot touch the reference; the model's mode is restored."""
    peft_model = unwrap(model)
    training = peft_model.training
    peft_model.eval()
    try:
        with peft_model.disable_adapter():
            return forward_logprobs(model, batch, temperature, packed=packed)[0]
    finally:
        peft_model.train(training)


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
    lengths = None if batch.lengths is None else batch.lengths.to(device)
    return TokenBatch(
        *(t.to(device) for t in (batch.input_ids, batch.response_start, batch.action_mask)), lengths
    )


@torch.no_grad()
def reference_logprobs(
    ref_model: nn.Module, batch: TokenBatch, temperature: float, plan: ForwardPlan | int, device: torch.device
) -> torch.Tensor:
    """Reference log-probs; an offloaded reference visits the GPU only for this pass."""
    home = next(ref_model.parameters()).device
    ref_model.to(device)
    try:
        return batched_logprobs(ref_model, batch, temperature, plan, device)
    finally:
        ref_model.to(home)
