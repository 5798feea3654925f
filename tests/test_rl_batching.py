"""Trainer batching: left-padded prompts + right-padded responses give the same per-token log-probs
and values as running each trajectory alone, and the mask covers exactly the policy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sleuth.agent.trajectory import Trajectory
from sleuth.errors import ConfigError
from sleuth.rl.batch import collate, critic_values, forward_logprobs, token_rewards
from sleuth.rl.models import ValueModel


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
def tiny(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModel, AutoModelForCausalLM

    from sleuth.llm.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    critic = ValueModel(
        AutoModel.from_pretrained(path, dtype=torch.float64), model.config.hidden_size
    ).double()
    torch.nn.init.normal_(critic.value_head.weight)  # a non-trivial head so values differ per position
    return Path(path), model, critic


def test_collate_layout_by_hand() -> None:
    batch = collate([_traj([5, 6, 7], [8, 9], [1, 0]), _traj([5], [8, 9, 10], [1, 1, 0])], pad_id=0)
    # rows packed to the left, width = longest prompt (3) + R (3); no attention mask needed
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [5, 8, 9, 10, 0, 0]]
    assert batch.response_start.tolist() == [3, 1]
    assert batch.action_mask.tolist() == [[1, 0, 0], [1, 1, 0]]
    # a sub-batch keeps only the columns its rows use
    assert batch.index(torch.tensor([1])).input_ids.tolist() == [[5, 8, 9, 10]]
    truncated = _traj([5], [8], [1])
    truncated.finish_reason = "length"
    assert collate([truncated], pad_id=0, drop_truncated=True).action_mask.tolist() == [[0.0]]


def test_a_response_the_overlong_filter_dropped_gets_no_reward_tokens() -> None:
    """DAPO's overlong filter (recipes/staged.yaml) drops a truncated response's tokens: its reward goes nowhere,
    the other rows get theirs on their last policy token; a row empty for any other reason is still refused."""
    kept, truncated = _traj([5], [8, 9], [1, 1]), _traj([5], [8, 9, 10], [1, 1, 1])
    truncated.finish_reason = "length"
    batch = collate([kept, truncated], pad_id=0, drop_truncated=True)
    rewards = token_rewards([kept, truncated], torch.tensor([0.5, -1.0]), batch.action_mask)
    assert rewards.tolist() == [[0.0, 0.5, 0.0], [0.0, 0.0, 0.0]]
    empty = _traj([5], [8], [0])  # ended normally, yet no policy token
    with pytest.raises(ValueError, match="have no policy token"):
        token_rewards([kept, empty], torch.tensor([0.5, 1.0]), collate([kept, empty], pad_id=0).action_mask)


def test_batched_logprobs_and_values_equal_single_sequences(tiny) -> None:
    _, model, critic = tiny
    trajs = [_traj([11, 12, 13, 14], [20, 21], [1, 1]), _traj([11], [22, 23, 24, 25], [1, 0, 0, 1])]
    batch = collate(trajs, pad_id=0)
    with torch.no_grad():
        logprobs, entropy = forward_logprobs(model, batch, temperature=0.7, with_entropy=True)
        values = critic_values(critic, batch)
    for i, t in enumerate(trajs):
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1] / 0.7
            hidden = critic.backbone(input_ids=ids).last_hidden_state
        P, R = len(t.prompt_ids), len(t.response_ids)
        # log-probs and entropy at policy tokens only (issue 43); 0 at inserted tokens, which every loss masks
        policy = torch.tensor(t.loss_mask, dtype=torch.float64)
        expected = torch.log_softmax(logits, -1)[P - 1 :].gather(-1, ids[0, P:, None]).squeeze(-1)
        torch.testing.assert_close(logprobs[i, :R], expected * policy, rtol=1e-9, atol=1e-9)
        probs = torch.softmax(logits[P - 1 :], -1)
        torch.testing.assert_close(
            entropy[i, :R], -(probs * probs.log()).sum(-1) * policy, rtol=1e-9, atol=1e-9
        )
        expected_v = critic.value_head(hidden[0, P - 1 : P + R - 1]).squeeze(-1)
        torch.testing.assert_close(values[i, :R], expected_v, rtol=1e-9, atol=1e-9)


def _recipe(**model):
    from sleuth.rl.config import recipe_from_dict

    return recipe_from_dict(
        {
            "name": "t",
            "model": {"policy": "tiny", **model},
            "data": {"train": "x.jsonl"},
            "retriever": {"index": "idx"},
            "agent": {"loop": "search_r1"},
            "reward": {"name": "search_r1_em"},
        }
    )


def test_rollout_copy_is_bf16_and_follows_the_policy(tiny) -> None:
    from transformers import AutoModelForCausalLM

    from sleuth.rl.models import rollout_copy, sync_rollout_copy

    policy = AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32)  # this test changes it
    cuda = torch.device("cuda")  # eligibility depends on the device type only; nothing moves
    copy = rollout_copy(_recipe(), policy, cuda)
    assert copy is not None and copy is not policy
    assert {p.dtype for p in copy.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in copy.buffers() if b.is_floating_point()} <= {torch.float32}  # RoPE stays fp32
    if policy.config.tie_word_embeddings:  # a tie stays a tie (one tensor to sync, not two)
        assert copy.get_input_embeddings().weight is copy.get_output_embeddings().weight
    assert all(p.device == q.device for p, q in zip(copy.parameters(), policy.parameters(), strict=True))
    with torch.no_grad():  # an optimizer step on the policy
        for p in policy.parameters():
            p.add_(0.5)
    first = next(copy.parameters()).clone()
    sync_rollout_copy(copy, policy)
    for dst, src in zip(copy.parameters(), policy.parameters(), strict=True):
        assert torch.equal(dst, src.detach().to(torch.bfloat16))
    assert not torch.equal(first, next(copy.parameters()))
    assert not any(p.requires_grad for p in copy.parameters())


def test_rollout_copy_only_where_it_applies(tiny) -> None:
    from transformers import AutoModelForCausalLM

    from sleuth.errors import ConfigError
    from sleuth.rl.models import rollout_copy

    model = AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32)
    assert rollout_copy(_recipe(), tiny[1], torch.device("cuda")) is None  # float64 weights: numerical checks
    assert rollout_copy(_recipe(), model, torch.device("cpu")) is None  # CPU rollouts use the fp32 policy
    assert rollout_copy(_recipe(generation_weights="policy"), model, torch.device("cuda")) is None
    assert rollout_copy(_recipe(parallel="fsdp"), model, torch.device("cuda")) is None
    lora = {"lora": {"enabled": True}}
    assert rollout_copy(_recipe(**lora), model, torch.device("cuda")) is None
    with pytest.raises(ConfigError, match="generation_weights=bf16-copy"):
        rollout_copy(_recipe(generation_weights="bf16-copy", **lora), model, torch.device("cuda"))


def test_static_cache_with_fp32_rollout_weights_fails_at_start(tiny) -> None:
    from transformers import AutoModelForCausalLM

    from sleuth.errors import ConfigError
    from sleuth.rl.models import rollout_copy, rollout_decoding

    model = AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32)
    cuda = torch.device("cuda")
    lora_static = _recipe(lora={"enabled": True}, generation_cache="static")
    with pytest.raises(ConfigError, match="model.dtype=bfloat16"):
        rollout_decoding(lora_static, model, cuda)
    assert rollout_decoding(lora_static, model.to(torch.bfloat16), cuda)[:2] == (
        "static",
        True,
    )  # a bf16 base is fine
    assert rollout_decoding(lora_static, model.float(), torch.device("cpu"))[:2] == (
        "static",
        False,
    )  # no autocast on CPU
    full = _recipe(generation_cache="static")
    assert rollout_decoding(full, rollout_copy(full, model, cuda), cuda)[:2] == (
        "static",
        True,
    )  # decodes the bf16 copy


def test_rollout_decoding_defaults_to_the_decode_engine_on_cuda_only(tiny) -> None:
    """auto: the decode engine on CUDA for a model it supports (full, LoRA, FSDP, fp32 or bf16 weights: it keeps
    its own bf16 copy); the compiled static cache or HF's dynamic cache for other models and explicit choices."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from sleuth.rl.models import master_dtype, rollout_copy, rollout_decoding

    model = AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    full, lora = _recipe(), _recipe(lora={"enabled": True})
    assert rollout_decoding(full, model, cuda)[:2] == ("engine", False)
    assert master_dtype(lora, cuda) == torch.bfloat16 and master_dtype(lora, cpu) == torch.float32
    assert master_dtype(full, cuda) == torch.float32  # full fine-tuning keeps fp32 masters
    bf16 = AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.bfloat16)
    assert rollout_decoding(lora, bf16, cuda)[:2] == ("engine", False)
    assert rollout_decoding(lora, model, cuda)[:2] == ("engine", False)
    assert rollout_decoding(lora, bf16, cpu)[:2] == ("dynamic", False)
    assert rollout_decoding(_recipe(parallel="fsdp"), bf16, cuda)[:2] == ("engine", False)
    assert rollout_decoding(_recipe(compile_generation=False), bf16, cuda)[:2] == ("dynamic", False)
    assert rollout_decoding(_recipe(generation_cache="dynamic"), bf16, cuda)[:2] == ("dynamic", False)
    assert rollout_decoding(_recipe(generation_cache="static", compile_generation=False), bf16, cuda)[:2] == (
        "static",
        False,
    )
    # a model the engine does not decode keeps the earlier rules
    other = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert rollout_decoding(full, rollout_copy(full, other, cuda), cuda)[:2] == ("static", True)
    assert rollout_decoding(_recipe(parallel="fsdp"), other.to(torch.bfloat16), cuda)[:2] == (
        "dynamic",
        False,
    )
    cache, compiled, why = rollout_decoding(lora, other.float(), cuda)
    assert (cache, compiled) == ("dynamic", False) and "model.dtype=bfloat16" in why
    with pytest.raises(ConfigError, match="generation_cache=engine"):
        rollout_decoding(_recipe(generation_cache="engine"), other, cuda)
