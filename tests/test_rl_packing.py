"""Issue 43: padding-free token-budget micro-batches, log-probs only at policy positions through a chunked
output layer, and the on-policy ratio from the update's own forward. Every check is in float64 against an
independent reference (each trajectory alone through the model's full logits and torch's log_softmax)."""

from __future__ import annotations

import pytest
import torch

from sleuth.agent.trajectory import Trajectory
from sleuth.rl import losses as loss_fns
from sleuth.rl.batch import (
    ForwardPlan,
    TokenBatch,
    batched_logprobs,
    collate,
    forward_logprobs,
    micro_batches,
    padded_width,
)


def _traj(prompt: list[int], response: list[int], mask: list[int]) -> Trajectory:
    return Trajectory(
        question_id="q",
        question="q",
        golden_answers=["a"],
        method="t",
        prompt_ids=prompt,
        response_ids=response,
        loss_mask=mask,
        logprobs=[0.0] * len(response),
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    from sleuth.llm.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa").eval()


def _trajs() -> list[Trajectory]:
    # ragged prompts and responses; inserted (mask 0) spans inside responses; a row with no policy token
    return [
        _traj([11, 12, 13, 14], [20, 21, 30, 31, 22], [1, 1, 0, 0, 1]),
        _traj([11], [22, 23, 24, 25], [1, 0, 0, 1]),
        _traj([15, 16, 17], [26, 27], [0, 0]),
        _traj([18, 19], [28, 29, 40, 41, 42, 43, 44], [1, 1, 1, 0, 0, 1, 1]),
    ]


def _reference(model, trajs: list[Trajectory], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row alone, full logits, torch's log_softmax and entropy: (B, R) at policy positions, 0 elsewhere."""
    R = max(len(t.response_ids) for t in trajs)
    lp, ent = torch.zeros(len(trajs), R, dtype=torch.float64), torch.zeros(len(trajs), R, dtype=torch.float64)
    for i, t in enumerate(trajs):
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        logits = model(input_ids=ids).logits[0, :-1] / temperature
        P = len(t.prompt_ids)
        logp_all = torch.log_softmax(logits[P - 1 :], -1)
        mask = torch.tensor(t.loss_mask, dtype=torch.float64)
        lp[i, : len(t.response_ids)] = logp_all.gather(-1, ids[0, P:, None]).squeeze(-1) * mask
        ent[i, : len(t.response_ids)] = -(logp_all.exp() * logp_all).sum(-1) * mask
    return lp, ent


def _loss(model, trajs, packed: bool | None, temperature: float = 0.7):
    batch = collate(trajs, pad_id=0)
    model.zero_grad(set_to_none=True)
    if packed is None:
        lp, ent = _reference(model, trajs, temperature)
    else:
        lp, ent = forward_logprobs(model, batch, temperature, with_entropy=True, packed=packed, chunk_rows=3)
    adv = torch.linspace(-1.0, 1.0, lp.numel(), dtype=torch.float64).reshape(lp.shape)
    # a policy-gradient surrogate plus an entropy term: gradients reach every scored logit
    loss = loss_fns.agg_loss(-adv * lp - 0.1 * ent, batch.action_mask.double())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), lp.detach(), ent.detach(), grads


def test_packed_and_padded_give_the_reference_loss_and_gradients(model) -> None:
    trajs = _trajs()
    ref_loss, ref_lp, ref_ent, ref_grads = _loss(model, trajs, packed=None)
    for packed in (True, False):
        loss, lp, ent, grads = _loss(model, trajs, packed=packed)
        torch.testing.assert_close(lp, ref_lp, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(ent, ref_ent, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-8, atol=1e-11, msg=name)


def test_packing_without_position_ids_would_differ(model) -> None:
    """The packed forward depends on per-row positions: the same packed tokens with one running position
    (rows attending to earlier rows) give other log-probs, so the equality above is not vacuous."""
    trajs = _trajs()
    ids = torch.tensor([sum((t.prompt_ids + t.response_ids for t in trajs), [])])
    wrong = model(input_ids=ids).logits[0]
    right = model(
        input_ids=ids,
        position_ids=torch.cat([torch.arange(len(t.prompt_ids) + len(t.response_ids)) for t in trajs])[None],
    ).logits[0]
    first = len(trajs[0].prompt_ids) + len(trajs[0].response_ids)
    torch.testing.assert_close(wrong[:first], right[:first])
    assert (wrong[first:] - right[first:]).abs().max() > 1e-3


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_logprobs_and_entropy_equal_the_full_softmax(chunk: int) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 11, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.randint(0, 11, (7,), generator=gen)
    w1, w2 = (
        torch.randn(7, dtype=torch.float64, generator=gen),
        torch.randn(7, dtype=torch.float64, generator=gen),
    )
    lp, ent = loss_fns.token_logprobs_and_entropy(logits, labels, temperature=0.6, chunk_rows=chunk)
    (g_chunked,) = torch.autograd.grad((w1 * lp + w2 * ent).sum(), logits)
    full = torch.log_softmax(logits / 0.6, -1)
    ref_lp, ref_ent = full.gather(-1, labels[:, None]).squeeze(-1), -(full.exp() * full).sum(-1)
    (g_ref,) = torch.autograd.grad((w1 * ref_lp + w2 * ref_ent).sum(), logits)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_chunked, g_ref, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda x: loss_fns.token_logprobs_and_entropy(x, labels, 0.6, chunk),
        (logits.detach().requires_grad_(),),
    )


def test_chunked_logprobs_keep_half_precision_gradients_and_reject_bad_labels() -> None:
    logits = torch.randn(5, 9).to(torch.bfloat16).requires_grad_()
    lp, _ = loss_fns.token_logprobs_and_entropy(logits, torch.tensor([0, 1, 2, 3, 8]), chunk_rows=2)
    assert lp.dtype == torch.float32
    lp.sum().backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="token ids"):
        loss_fns.token_logprobs_and_entropy(logits.detach(), torch.tensor([0, 1, 2, 3, 9]))


def test_micro_batches_respect_the_token_budget() -> None:
    lengths = torch.tensor([5, 3, 9, 2, 2, 20, 1])
    packed = micro_batches(lengths, max_rows=4, max_tokens=12, packed=True)
    assert [p.tolist() for p in packed] == [[0, 1], [2, 3], [4], [5], [6]]  # sums <= 12
    padded = micro_batches(lengths, max_rows=4, max_tokens=12, packed=False)
    assert [p.tolist() for p in padded] == [[0, 1], [2], [3, 4], [5], [6]]  # rows x longest <= 12: 3 x 9 > 12
    assert [p.tolist() for p in micro_batches(lengths, 3, None, packed=True)] == [[0, 1, 2], [3, 4, 5], [6]]


def test_padded_widths_round_up_and_count_in_the_budget() -> None:
    """GPU micro-batches run on widths rounded up to a multiple (so attention plans are met again): by hand."""
    assert [padded_width(n, 64) for n in (1, 64, 65, 3141)] == [64, 64, 128, 3200]
    assert padded_width(37, 1) == 37
    lengths = torch.tensor([70, 60, 50, 10])
    # exact widths: 70 + 70 = 140 <= 200, then 3 x 70 = 210 > 200 -> [0, 1], [2, 3]
    assert [p.tolist() for p in micro_batches(lengths, 8, 200, False)] == [[0, 1], [2, 3]]
    # rounded to 64: row 0 is 128 wide, 2 x 128 = 256 > 200 -> alone; then 60, 50, 10 are 64 wide: 3 x 64 <= 200
    assert [p.tolist() for p in micro_batches(lengths, 8, 200, False, 64)] == [[0], [1, 2, 3]]
    ids = torch.arange(2 * 150).reshape(2, 150)
    batch = TokenBatch(ids, torch.tensor([10, 10]), torch.ones(2, 140), torch.tensor([70, 130]))
    assert batch.index(torch.tensor([0])).input_ids.shape == (1, 70)
    assert batch.index(torch.tensor([0]), 64).input_ids.shape == (1, 128)
    assert batch.index(torch.tensor([1]), 64).input_ids.shape == (1, 150)  # never past the batch's own width
    assert torch.equal(batch.index(torch.tensor([0]), 64).input_ids, ids[:1, :128])


def test_rounded_widths_give_the_same_log_probs(model) -> None:
    """The columns a rounded width adds are padding past every row's length: the log-probs do not change."""
    batch = collate(_trajs(), pad_id=0)
    exact = batched_logprobs(model, batch, 1.0, ForwardPlan(2), torch.device("cpu"))
    rounded = batched_logprobs(model, batch, 1.0, ForwardPlan(2, width_multiple=7), torch.device("cpu"))
    assert torch.allclose(exact, rounded, atol=1e-10)


def test_token_budget_micro_batches_give_the_same_log_probs(model) -> None:
    trajs = _trajs()
    batch = collate(trajs, pad_id=0)
    whole = batched_logprobs(model, batch, 0.7, ForwardPlan(8), torch.device("cpu"))
    for plan in (ForwardPlan(8, max_tokens=12, packed=True), ForwardPlan(2, max_tokens=30, packed=False)):
        assert len(plan.split(batch)) > 1
        torch.testing.assert_close(batched_logprobs(model, batch, 0.7, plan, torch.device("cpu")), whole)


def test_a_micro_batch_is_as_wide_as_its_longest_row() -> None:
    """The token budget counts rows x longest row: the micro-batch's tensor must be that wide, not its longest
    prompt + the whole batch's longest response (ragged late-training rows ran out of memory on an H200)."""
    trajs = _trajs()
    batch = collate(trajs, pad_id=0)  # lengths 9, 5, 5, 9; response width 7
    short = batch.index(torch.tensor([1, 2]))
    assert short.input_ids.shape == (2, 5) and short.action_mask.shape == (2, 7)
    assert torch.equal(short.input_ids, batch.input_ids[[1, 2], :5])
    assert batch.index(torch.tensor([3, 1])).input_ids.shape == (2, 9)
    plan = ForwardPlan(4, max_tokens=10, packed=False)
    assert all(
        len(idx) * batch.index(idx).input_ids.shape[1] <= 10 or len(idx) == 1 for idx in plan.split(batch)
    )


def test_fused_ratio_equals_the_separate_old_logprob_pass(model) -> None:
    """One on-policy epoch: the old log-probs taken as the update's own forward, detached, give the loss and
    gradients of a separate no-grad pass over the same weights (what the trainer skips)."""
    trajs = _trajs()
    batch = collate(trajs, pad_id=0)
    mask = batch.action_mask.double()
    adv = torch.linspace(-1.0, 1.0, mask.numel(), dtype=torch.float64).reshape(mask.shape)
    clip, agg = (
        loss_fns.PolicyClip(0.2, 0.28, 3.0),
        loss_fns.LossAgg("token-mean", num_tokens=float(mask.sum())),
    )
    separate = batched_logprobs(model, batch, 0.7, ForwardPlan(2), torch.device("cpu"))
    results = []
    for old in ("fused", "separate"):
        model.zero_grad(set_to_none=True)
        lp, _ = forward_logprobs(model, batch, 0.7, packed=True)
        loss, stats = loss_fns.get_policy_loss("ppo_clip")(
            lp.detach() if old == "fused" else separate, lp, adv, mask, clip=clip, agg=agg
        )
        loss.backward()
        results.append((loss.detach(), stats, [p.grad.clone() for p in model.parameters()]))
    (l1, s1, g1), (l2, s2, g2) = results
    torch.testing.assert_close(l1, l2, rtol=1e-12, atol=1e-14)
    assert s1["clipfrac"] == s2["clipfrac"] == 0.0 and abs(s2["ratio_mean"] - 1.0) < 1e-12
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)


def test_padded_split_groups_rows_of_similar_length() -> None:
    trajs = [_traj([1] * p, [2] * 3, [1, 1, 1]) for p in (2, 30, 3, 28)]
    batch = collate(trajs, pad_id=0)
    padded = ForwardPlan(2, packed=False).split(batch)
    assert sorted(sorted(p.tolist()) for p in padded) == [[0, 2], [1, 3]]  # long with long, short with short
    assert [p.tolist() for p in ForwardPlan(2, packed=True).split(batch)] == [
        [0, 1],
        [2, 3],
    ]  # no padding: in order


def test_adapter_inputs_stay_bf16_under_autocast_with_the_same_values_and_gradients(tmp_path) -> None:
    """peft casts an adapter layer's input to its float32 weights' dtype and keeps that copy for the backward;
    under autocast the products run in bf16 either way, so skipping the cast changes no value or gradient."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from sleuth.llm.tiny import build_tiny_model
    from sleuth.rl.batch import adapter_inputs_uncast

    base = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "tiny"), dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = get_peft_model(
        base,
        LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
        ),
    )
    adapters = [m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert adapters and all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    ids = torch.tensor([[11, 12, 13, 14, 20, 21, 22]])

    def run(uncast: bool) -> tuple[torch.Tensor, list[torch.Tensor], list[bool]]:
        model.zero_grad(set_to_none=True)
        seen: list[bool] = []
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if uncast:
                with adapter_inputs_uncast(model, "cpu"):
                    seen = [m.cast_input_dtype_enabled for m in adapters]
                    logits = model(input_ids=ids).logits
            else:
                logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad], seen

    cast_logits, cast_grads, _ = run(False)
    logits, grads, seen = run(True)
    assert seen and not any(seen)  # the casts were off inside
    assert all(m.cast_input_dtype_enabled for m in adapters)  # and restored after
    assert torch.equal(logits, cast_logits)
    assert all(torch.equal(a, b) for a, b in zip(grads, cast_grads, strict=True))
    with adapter_inputs_uncast(model, "cpu"):  # outside autocast nothing changes
        assert all(m.cast_input_dtype_enabled for m in adapters)
