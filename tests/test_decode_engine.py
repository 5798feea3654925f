"""sleuth's decode engine (sleuth.llm.decode_engine, sleuth.llm.kernels) against transformers and the
arithmetic it claims: greedy tokens equal transformers' decoding, sampled tokens follow the softmax, the
Triton kernels (under Triton's CPU interpreter) equal the torch references, and the inference copy of an
FSDP2-sharded or LoRA policy equals its weights after an update."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from sleuth.llm import kernels
from sleuth.llm.decode_engine import DecodeEngine, supports

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _model(kind: str, seed: int = 0):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    kw = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        rope_theta=10000.0,
    )
    model = {
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**kw, tie_word_embeddings=True)),
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**kw)),
        "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**kw, head_dim=16)),
    }[kind]()
    for p in model.parameters():  # larger than the default init: logits far from uniform, no near-ties
        p.data.normal_(0, 0.3)
    return model.eval()


def _hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    ids = out.sequences[0, len(prompt) :].tolist()
    return ids, [s[0].float().log_softmax(-1)[t].item() for s, t in zip(out.scores, ids, strict=True)]


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3"])
def test_greedy_decoding_equals_transformers(kind: str) -> None:
    """Rows of different lengths, several chunks, and rows leaving the batch midway (a smaller graph takes over)."""
    model = _model(kind)
    engine = DecodeEngine(model, max_batch_size=8, min_bucket=1)
    prompts = [[1, 2, 3, 4, 5], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [20, 21]]
    state, first, first_lp = engine.start(prompts, 12, temperature=0.0)
    got = [[t] for t in first.tolist()]
    lps = [[lp] for lp in first_lp.tolist()]
    tokens, logprobs = engine.steps(state, 5)
    for r in range(4):
        got[r] += tokens[r].tolist()
        lps[r] += logprobs[r].tolist()
    engine.keep(state, [0, 2])  # rows 1 and 3 finish
    assert state.rows == [0, 2] and state.bucket.size == 2
    tokens, logprobs = engine.steps(state, 6)
    for j, r in enumerate(state.rows):
        got[r] += tokens[j].tolist()
        lps[r] += logprobs[j].tolist()
    for r, prompt in enumerate(prompts):
        want, want_lp = _hf_greedy(model, prompt, len(got[r]))
        assert got[r] == want, (kind, r)
        assert max(abs(a - b) for a, b in zip(lps[r], want_lp, strict=True)) < 1e-4


def test_the_generator_decodes_the_same_tokens_with_the_engine_and_stops_alike(tmp_path: Path) -> None:
    """HFGenerator(cache="engine") against its dynamic-cache path: same tokens, log-probs, stops and finish reasons."""
    from sleuth.llm.base import SamplingParams
    from sleuth.llm.hf import HFGenerator
    from sleuth.llm.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "tiny")
    prompts = ["the capital of", "a search for the", "x", "answer: the river"]
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    stops = ["</search>", " the"]
    dynamic = HFGenerator(path, device="cpu", cache="dynamic").generate(prompts, stops, params)
    gen = HFGenerator(path, device="cpu", cache="engine", sync_every=3)
    engine = gen.generate(prompts, stops, params)
    for a, b in zip(dynamic, engine, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and a.stop == b.stop
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)), default=0) < 1e-4
    assert any(g.finish_reason == "stop" for g in engine)  # the stop path ran


def test_nucleus_sampling_runs_outside_the_captured_step_and_matches_the_dynamic_path(tmp_path: Path) -> None:
    """top_p < 1 stops the step at the logits and samples with `select_next_tokens`: with a nucleus of one token
    both paths are deterministic, so tokens and (untruncated) log-probs must equal the dynamic path's."""
    from sleuth.llm.base import SamplingParams
    from sleuth.llm.hf import HFGenerator
    from sleuth.llm.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "tiny")
    prompts = ["the capital of", "x", "answer: the river"]
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=1e-6, seed=3)
    dynamic = HFGenerator(path, device="cpu", cache="dynamic").generate(prompts, None, params)
    engine = HFGenerator(path, device="cpu", cache="engine", sync_every=5).generate(prompts, None, params)
    for a, b in zip(dynamic, engine, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


def test_unsupported_models_are_named() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    why = supports(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)))
    assert why is not None and "gpt2" in why


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy.stats import chisquare

    expected = probs * counts.sum()
    return float(chisquare(counts.numpy(), expected.numpy()).pvalue)


def test_gumbel_sampling_follows_the_softmax_and_returns_its_logprob() -> None:
    """8 000 draws (fixed seeds) of a 6-token distribution at temperature 0.7: counts pass a chi-square test
    against softmax(logits / 0.7), and each draw's log-prob is log_softmax(logits / 0.7) at the token."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(200, 1)
    probs = (logits[0] / 0.7).softmax(-1)
    counts = torch.zeros(6)
    for seed in range(40):
        tokens, logprobs = kernels.sample_reference(logits, 0.7, torch.tensor([seed]))
        counts += torch.bincount(tokens, minlength=6).float()
        assert torch.allclose(
            logprobs, (logits / 0.7).log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
        )
    assert _chi_square_p(counts, probs) > 1e-3
    # the check can fail: the same counts against the untempered softmax are rejected
    assert _chi_square_p(counts, logits[0].softmax(-1)) < 1e-6


KERNEL_CHECK = textwrap.dedent("""
    import torch
    from sleuth.llm import kernels as K
    assert K.triton_enabled(torch.zeros(1)), "the interpreter is not on"
    torch.manual_seed(0)
    worst = {}
    x, d, w = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)
    rx, ry = K.add_rmsnorm_reference(x.clone(), d, w, 1e-6)
    x2 = x.clone(); _, y2 = K.add_rmsnorm(x2, d, w, 1e-6)
    worst["rmsnorm"] = max((x2 - rx).abs().max().item(), (y2 - ry).abs().max().item())
    b, h, kv, dim = 3, 8, 2, 64
    qkv = torch.randn(b, (h + 2 * kv) * dim)
    pos, slots = torch.tensor([5, 0, 17], dtype=torch.int32), torch.tensor([10, 3, 40], dtype=torch.int32)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    for norm in (None, (torch.randn(dim), torch.randn(dim))):
        kc, vc = torch.zeros(64, kv, dim), torch.zeros(64, kv, dim)
        kc2, vc2 = kc.clone(), vc.clone()
        layout = K.HeadLayout(h, kv, inv)
        q1 = K.rope_store_reference(qkv, pos.long(), slots.long(), layout, kc, vc, norm)
        q2 = K.rope_store(qkv, pos, slots, layout, kc2, vc2, norm)
        worst[f"rope norm={norm is not None}"] = max((q1 - q2).abs().max().item(), (kc - kc2).abs().max().item(),
                                                    (vc - vc2).abs().max().item())
    b, h, kv, dim = 4, 14, 2, 64
    kc, vc, q = torch.randn(600, kv, dim), torch.randn(600, kv, dim), torch.randn(b, h, dim)
    starts = torch.tensor([0, 100, 300, 590], dtype=torch.int32)
    lens = torch.tensor([1, 150, 257, 10], dtype=torch.int32)
    ref = K.decode_attention_reference(q, kc, vc, starts, lens, 0.125)
    for splits in (1, 4, 16):  # 16 splits leave some empty for short rows
        worst[f"attention splits={splits}"] = (K.decode_attention(q, kc, vc, starts, lens, 0.125, splits) - ref).abs().max().item()
    gu = torch.randn(3, 200)
    worst["silu"] = (K.silu_mul(gu) - K.silu_mul_reference(gu)).abs().max().item()
    # fused_kernels: rotary + KV store + attention in one kernel (the new key from registers, one split writing
    # the output itself, several merged by the combine kernel): the same output and the same pool as the
    # reference's rope_store then attention, with and without q/k norms, for a row at position 0 (only the new
    # key), rows whose new key opens or ends a 64-key block, and splits that leave some programs empty
    from sleuth.llm import fused_kernels as F
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    layout = K.HeadLayout(h, kv, inv, rope_scale=0.9)
    pos = torch.tensor([0, 149, 256, 9], dtype=torch.int32)
    qkv = torch.randn(b, (h + 2 * kv) * dim)
    for norm in (None, (torch.randn(dim), torch.randn(dim))):
        kc1, vc1 = kc.clone(), vc.clone()
        ref = F.rope_attention_reference(qkv, pos, starts, layout, (kc1, vc1), norm)
        for splits in (1, 2, 4, 16):
            kc2, vc2 = kc.clone(), vc.clone()
            got = F.rope_attention(qkv, pos, starts, layout, (kc2, vc2), norm, splits)
            worst[f"rope_attention norm={norm is not None} splits={splits}"] = max(
                (got - ref).abs().max().item(), (kc2 - kc1).abs().max().item(), (vc2 - vc1).abs().max().item())
    # the gate/up product with SiLU(gate) * up in its epilogue, for one partial row block and two
    for m in (3, 64, 100):
        hm, w = torch.randn(m, 96), torch.randn(2 * 200, 96) * 0.2
        want = F.gate_up_silu_reference(hm, w)
        worst[f"gate_up_silu m={m} (relative)"] = ((F.gate_up_silu(hm, w) - want).abs().max() / want.abs().max()).item()
    assert not F._FAILED, F._FAILED  # the fused kernels ran, not the unfused fallback
    lg = torch.randn(6, 5000)
    tok, lp = K.sample(lg, 0.0, torch.tensor([3]))
    assert torch.equal(tok, lg.argmax(-1))
    worst["greedy logprob"] = (lp - lg.log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1)).abs().max().item()
    # sampling: a 6-token distribution, 50 rows x 60 seeds
    small = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(50, 1)
    counts = torch.zeros(6)
    for seed in range(60):
        tok, lp = K.sample(small, 0.7, torch.tensor([seed]))
        counts += torch.bincount(tok, minlength=6).float()
        worst["sample logprob"] = max(worst.get("sample logprob", 0.0), (lp - (small / 0.7).log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1)).abs().max().item())
    # a vocabulary split over several programs per row (5 chunks of 1,024 and a partial one) draws the same
    # noise, so it samples the same tokens as one program per row, with the same log-probs
    wide = torch.randn(5, 5500) * 3
    for temperature in (0.0, 0.7):
        for seed in range(4):
            t1, l1 = K.sample(wide, temperature, torch.tensor([seed]), chunk=10**9)
            t2, l2 = K.sample(wide, temperature, torch.tensor([seed]), chunk=1024)
            assert torch.equal(t1, t2), (temperature, seed, t1, t2)
            worst["split sampler logprob"] = max(worst.get("split sampler logprob", 0.0), (l1 - l2).abs().max().item())
    class RejectedByTheCompiler:
        def __getitem__(self, grid):
            raise RuntimeError("rejected by the compiler")
    K._sample_split_kernel = RejectedByTheCompiler()  # falls back to one program per row, same tokens
    t3, _ = K.sample(wide, 0.7, torch.tensor([1]), chunk=1024)
    assert torch.equal(t3, K.sample(wide, 0.7, torch.tensor([1]), chunk=10**9)[0]) and K._SPLIT_SAMPLER_FAILED
    from scipy.stats import chisquare
    p = chisquare(counts.numpy(), ((small[0] / 0.7).softmax(-1) * counts.sum()).numpy()).pvalue
    worst["sampling chi-square p (want > 1e-3)"] = -p
    print(worst)
    bad = {k: v for k, v in worst.items() if (v > 2e-6 if v >= 0 else -v < 1e-3)}
    assert not bad, bad
""")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (it is in the dev extra)")
def test_triton_kernels_equal_the_references_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


LORA_CHECK = textwrap.dedent("""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from sleuth.llm.decode_engine import DecodeEngine
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=100))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.5)  # peft starts B at zero: make the adapters matter
    engine = DecodeEngine(model)
    with model.disable_adapter():
        plain = DecodeEngine(model)
    merged = model.merge_and_unload()
    layer = merged.model.layers[1]
    want_qkv = torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight])
    assert torch.allclose(engine.layers[1].w_qkv, want_qkv, atol=1e-6)
    assert torch.allclose(engine.layers[1].w_down, layer.mlp.down_proj.weight, atol=1e-6)
    assert not torch.allclose(plain.layers[1].w_qkv, want_qkv, atol=1e-3)  # the adapters changed the weights
""")


def test_lora_adapters_are_merged_into_the_copy_and_left_out_for_the_frozen_base() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", LORA_CHECK],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


FSDP_CHECK = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from sleuth.llm.decode_engine import DecodeEngine
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    engine = DecodeEngine(model, device="cpu", dtype=torch.float32)
    before = engine.layers[0].w_qkv.clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.manual_seed(1 + rank)  # ranks see different data, as in training
    ids = torch.randint(0, 100, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    engine.refresh(model)  # every rank gathers the shards
    attn = model.model.layers[0].self_attn
    full = torch.cat([attn.q_proj.weight.full_tensor(), attn.k_proj.weight.full_tensor(), attn.v_proj.weight.full_tensor()])
    assert torch.equal(engine.layers[0].w_qkv, full), "the copy differs from the sharded weights"
    assert not torch.allclose(before, full), "the update changed nothing: the check could not fail"
    down = model.model.layers[1].mlp.down_proj.weight.full_tensor()
    assert torch.equal(engine.layers[1].w_down, down)
    copies = [torch.zeros_like(full) for _ in range(2)]
    dist.all_gather(copies, engine.layers[0].w_qkv)
    assert torch.equal(copies[0], copies[1]), "ranks hold different copies"
    # The sharded model's DTensors hold the process group: freed here, not by interpreter exit, where gloo's
    # threads can abort the process after every check passed
    del model, opt, engine, attn
    import gc, sys
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # every check above passed; skip the C++ teardown at exit
""")


def test_the_fsdp_inference_copy_equals_the_sharded_weights_after_an_update(tmp_path: Path) -> None:
    script = tmp_path / "fsdp_check.py"
    script.write_text(FSDP_CHECK)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    proc = subprocess.run(
        cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


ENGINE_UNDER_TRITON = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from sleuth.llm import fused_kernels, kernels
    assert kernels.triton_enabled(__import__("torch").zeros(1))
    calls = {{"rope_attention": 0, "gate_up_silu": 0}}
    for name in calls:  # count the fused kernels' calls: the step must run the ones its switches ask for
        def counted(*args, _name=name, _fn=getattr(fused_kernels, name), **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        setattr(fused_kernels, name, counted)
    import test_decode_engine as t
    t.test_greedy_decoding_equals_transformers("qwen3")  # q/k norms, GQA, rows leaving: every kernel runs
    t.test_a_next_turn_reuses_the_stored_prefix_and_still_decodes_like_transformers("qwen3")  # packed prefill
    assert not fused_kernels._FAILED, fused_kernels._FAILED
    assert (calls["rope_attention"] > 0) == fused_kernels.FUSED_DECODE, calls
    assert (calls["gate_up_silu"] > 0) == fused_kernels.FUSED_MLP, calls
""")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (it is in the dev extra)")
@pytest.mark.parametrize(
    "switches",
    [{}, {"SLEUTH_FUSED_DECODE": "0"}, {"SLEUTH_FUSED_MLP": "1", "SLEUTH_ATTENTION_SPLITS": "4"}],
    ids=["fused-attention", "unfused", "fused-mlp-4-splits"],
)
def test_the_engine_decodes_like_transformers_through_the_triton_kernels(switches: dict[str, str]) -> None:
    """The whole decode step with the Triton kernels (CPU interpreter) instead of the torch references: the
    fused attention (default), the one-operation kernels (SLEUTH_FUSED_DECODE=0), and the fused MLP with the
    attention split four ways (the combine path)."""
    script = ENGINE_UNDER_TRITON.format(tests=str(Path(__file__).parent))
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "OMP_NUM_THREADS": "1",
        "SLEUTH_FUSED_DECODE": "1",
        "SLEUTH_FUSED_MLP": "0",
        "SLEUTH_ATTENTION_SPLITS": "0",
        **switches,
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_release_drops_the_copy_and_the_next_refresh_or_use_rebuilds_it(tmp_path: Path) -> None:
    """The trainer releases the engine after the rollouts (KV pool, graphs and the policy's bf16 copy, which the
    update needs) and refreshes it after the update; a use without a refresh rebuilds the copy too. Decoding
    after either equals decoding before."""
    from sleuth.llm.base import SamplingParams
    from sleuth.llm.hf import HFGenerator
    from sleuth.llm.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "tiny")
    prompts = ["the capital of", "a search for the", "x"]
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    gen = HFGenerator(path, device="cpu", cache="engine", sync_every=4)
    first = [g.token_ids for g in gen.generate(prompts, None, params)]
    engine = gen.engine
    slots = engine.pool_k.shape[1]
    gen.release()
    assert not engine.has_weights and engine.pool_k is None
    with pytest.raises(RuntimeError, match="released"):
        engine.start([[1, 2]], 3)
    gen.refresh_weights()
    assert engine.has_weights
    assert [g.token_ids for g in gen.generate(["x"], None, params)] == [first[2]]
    assert engine.pool_k.shape[1] == slots  # the pool comes back at the size the last rollout reached
    gen.release()
    assert [g.token_ids for g in gen.generate(prompts, None, params)] == first  # rebuilt on use


def test_growing_the_pool_drops_the_graphs_memory_pool_handle() -> None:
    """A grown KV pool drops the captured graphs, and with them their private memory pool: capturing the next
    graph into the freed pool's handle fails inside the caching allocator (seen on H200: every later batch then
    decoded eagerly), so the handle must go with the graphs."""
    engine = DecodeEngine(_model("qwen2"), max_batch_size=4)
    engine._ensure_pool(16)
    engine._graph_pool = ("a pool handle of graphs captured on the old pool",)
    engine._buckets[4] = "a graph captured on the old pool"
    engine._ensure_pool(64)
    assert engine.pool_k.shape[1] >= 64 and engine._graph_pool is None and not engine._buckets


def _greedy_rows(
    engine: DecodeEngine, prompts: list[list[int]], n: int
) -> tuple[list[list[int]], list[list[float]]]:
    state, first, first_lp = engine.start(prompts, n, temperature=0.0)
    tokens, logprobs = engine.steps(state, n - 1)
    got = [[f] + t for f, t in zip(first.tolist(), tokens.tolist(), strict=True)]
    lps = [[f] + t for f, t in zip(first_lp.tolist(), logprobs.tolist(), strict=True)]
    return got, lps


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3"])
def test_a_next_turn_reuses_the_stored_prefix_and_still_decodes_like_transformers(kind: str) -> None:
    """Turn 2's prompts continue turn 1's rows (prompt + generated + an observation): the matched rows prefill only
    their new tokens over the moved keys/values, and every row decodes what transformers decodes from the whole
    prompt. Row 2's history was edited (no match: full prefill); row 3 continues without an observation."""
    model = _model(kind)
    engine = DecodeEngine(model, max_batch_size=8, min_bucket=1)
    turn1 = [[1, 2, 3, 4, 5], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [20, 21]]
    got, _ = _greedy_rows(engine, turn1, 6)
    engine.remember([p + g for p, g in zip(turn1, got, strict=True)])
    turn2 = [
        turn1[0] + got[0] + [40, 41, 42],
        turn1[1] + got[1] + [50] * 9,
        [99] + turn1[2][1:] + got[2] + [60, 61],
        turn1[3] + got[3],
    ]
    before = engine.reused_tokens
    got2, lps2 = _greedy_rows(engine, turn2, 7)
    assert engine.reused_tokens - before == sum(len(turn1[r]) + 6 - 1 for r in (0, 1, 3))
    for r, prompt in enumerate(turn2):
        want, want_lp = _hf_greedy(model, prompt, 7)
        assert got2[r] == want, (kind, r)
        assert max(abs(a - b) for a, b in zip(lps2[r], want_lp, strict=True)) < 1e-4


def test_stored_prefixes_are_forgotten_when_the_weights_change_and_kept_when_the_pool_grows(
    monkeypatch,
) -> None:
    """A policy update makes the stored keys/values stale; a grown pool copies them over, unless the old and the
    new pool do not fit together (then the new one is allocated alone and nothing is reused)."""
    model = _model("qwen2")
    engine = DecodeEngine(model, max_batch_size=4, min_bucket=1)
    prompts = [[1, 2, 3], [4, 5]]
    got, _ = _greedy_rows(engine, prompts, 4)
    rows = [p + g for p, g in zip(prompts, got, strict=True)]
    engine.remember(rows)
    engine.refresh(model)
    assert not engine.prefixes
    engine.remember(rows)
    slots = engine.pool_k.shape[1]
    long = [rows[0] + [7] * 200]
    got_long, _ = _greedy_rows(engine, long, 3)  # grows the pool: the stored row moves with it
    assert engine.pool_k.shape[1] > slots and engine.reused_tokens == len(rows[0]) - 1
    assert got_long[0] == _hf_greedy(model, long[0], 3)[0]
    engine.remember([long[0] + got_long[0]])
    real_zeros, calls = torch.zeros, []

    def zeros_without_room_for_two_pools(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("no room for the old and the new pool at once")
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", zeros_without_room_for_two_pools)
    longer = [long[0] + got_long[0] + [8] * 400]
    got_longer, _ = _greedy_rows(engine, longer, 3)
    monkeypatch.setattr(torch, "zeros", real_zeros)
    assert engine.reused_tokens == len(rows[0]) - 1  # nothing reused this time, and still the right tokens
    assert got_longer[0] == _hf_greedy(model, longer[0], 3)[0]


def test_the_prefix_store_finds_the_longest_exact_prefix() -> None:
    from sleuth.llm.prefix_cache import Prefix, PrefixStore

    store = PrefixStore()
    store.remember([[1, 2, 3], [1, 2, 3, 4, 5], [9, 9]], [0, 10, 30])
    assert store.match([1, 2, 3, 4, 5, 6]) == Prefix(
        start=10, tokens=4
    )  # the last token's KV was never written
    assert store.match([1, 2, 3, 4, 7]) == Prefix(start=0, tokens=2)
    assert store.match([1, 2, 3]) == Prefix(start=0, tokens=2)  # an identical prompt prefills its last token
    assert store.match([1, 2, 4]) is None and store.match([9]) is None
    with pytest.raises(ValueError, match="2 sequences for 1 rows"):
        store.remember([[1, 2], [3, 4]], [0])


def test_moving_prefixes_reads_every_source_before_writing() -> None:
    from sleuth.llm.prefix_cache import move_prefixes

    pool_k = torch.arange(2 * 12 * 2, dtype=torch.float32).view(2, 12, 2)
    pool_v = -pool_k.clone()
    want_k, want_v = pool_k.clone(), pool_v.clone()
    moves = [(0, 4, 5), (4, 0, 3), (9, 9, 3)]  # overlapping: 4..8 <- 0..4 while 0..2 <- 4..6 (old values)
    for s, d, n in moves:
        want_k[:, d : d + n], want_v[:, d : d + n] = pool_k[:, s : s + n], pool_v[:, s : s + n]
    move_prefixes(pool_k, pool_v, moves)
    assert torch.equal(pool_k, want_k) and torch.equal(pool_v, want_v)


def test_the_generator_reuses_each_rows_keys_across_turns_and_decodes_like_the_dynamic_cache(
    tmp_path: Path,
) -> None:
    """Token-in, token-out turns as the agent engine sends them: turn 2 = turn 1's prompt + its generation + an
    observation, through HFGenerator(cache="engine") against the dynamic-cache path."""
    from sleuth.llm.base import SamplingParams
    from sleuth.llm.hf import HFGenerator
    from sleuth.llm.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "tiny")
    params = SamplingParams(max_new_tokens=9, temperature=0.0)
    dynamic = HFGenerator(path, device="cpu", cache="dynamic")
    gen = HFGenerator(path, device="cpu", cache="engine", sync_every=4)
    turn1 = [dynamic.encode(t) for t in ("the capital of", "a search for the", "x")]
    first = gen.generate(turn1, ["</search>"], params)
    assert [g.token_ids for g in first] == [
        g.token_ids for g in dynamic.generate(turn1, ["</search>"], params)
    ]
    obs = dynamic.encode(" <information> the river </information>")
    turn2 = [p + g.token_ids + obs for p, g in zip(turn1, first, strict=True)]
    before = gen.engine.reused_tokens
    second = gen.generate(turn2, ["</search>"], params)
    assert gen.engine.reused_tokens - before == sum(
        len(p) + len(g.token_ids) - 1 for p, g in zip(turn1, first, strict=True)
    )
    for a, b in zip(dynamic.generate(turn2, ["</search>"], params), second, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)), default=0) < 1e-4


def test_auto_cache_picks_the_engine_on_cuda_for_the_models_it_supports() -> None:
    """HFGenerator(cache="auto") (evaluation, serving) decodes like the trainer's rollouts: the engine on CUDA
    where it supports the model, a static cache for other models or to compile, HF's dynamic cache on a CPU.
    Only the choice is checked here (no GPU): the engine's decoding has its own tests above."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from sleuth.llm.hf import auto_cache

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    supported = _model("llama")
    other = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    assert supports(supported) is None and supports(other) is not None
    assert auto_cache(cuda, supported) == "engine"
    assert auto_cache(cuda, supported, compile=True) == "static"
    assert auto_cache(cuda, other) == "static"
    assert auto_cache(cpu, supported) == "dynamic"


def test_without_prefix_reuse_every_prompt_is_prefilled_whole_and_nothing_is_stored() -> None:
    """bench/rollout.py --no-prefix-reuse: the comparison row; same tokens as with reuse."""
    model = _model("qwen2")
    prompts = [[1, 2, 3], [4, 5]]
    outputs = []
    for reuse in (True, False):
        engine = DecodeEngine(model, max_batch_size=4, min_bucket=1)
        engine.reuse_prefixes = reuse
        got, _ = _greedy_rows(engine, prompts, 4)
        engine.remember([p + g for p, g in zip(prompts, got, strict=True)])
        assert bool(engine.prefixes) == reuse
        turn2 = [p + g + [9, 9] for p, g in zip(prompts, got, strict=True)]
        outputs.append(_greedy_rows(engine, turn2, 4)[0])
        assert engine.reused_tokens == (sum(len(p) + 4 - 1 for p in prompts) if reuse else 0)
    assert outputs[0] == outputs[1]


def _decode_engine_before_overlap(self, rows, params, seed) -> None:
    """HFGenerator._decode_engine as it was before the first chunk overlapped the first tokens' readback: the
    reference for the schedule of chunks and batch changes (the seeded noise of a row follows its batch slot)."""
    engine, max_new = self.engine, params.max_new_tokens
    state, tokens, logprobs = engine.start(
        [r.prompt_ids for r in rows], max_new, temperature=params.temperature, top_p=params.top_p, seed=seed
    )
    self._accept_tokens(rows, [[t] for t in tokens.tolist()], [[lp] for lp in logprobs.tolist()], max_new)
    pending, remaining = None, max_new - 1
    while remaining > 0 and any(r.finish_reason is None for r in rows):
        k = min(self.sync_every, remaining)
        chunk = (list(state.rows), self._to_host(*engine.steps(state, k)))
        remaining -= k
        if pending is not None:
            self._accept_chunk([rows[i] for i in pending[0]], pending[1], max_new)
            live = [j for j, i in enumerate(state.rows) if rows[i].finish_reason is None]
            if not live:
                return
            if len(live) <= state.bucket.size // 2:
                engine.keep(state, live)
        pending = chunk
    if pending is not None:
        self._accept_chunk([rows[i] for i in pending[0]], pending[1], max_new)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_launching_the_first_chunk_before_reading_the_first_tokens_changes_no_token(
    tmp_path: Path, monkeypatch, temperature: float
) -> None:
    """The engine loop queues the first decode chunk before it reads the first tokens back: greedy and seeded
    sampling return the same tokens, log-probs, stops and finish reasons as the loop before it, with rows
    stopping at different chunks and the batch shrinking (a smaller bucket: other noise slots) on the way."""
    from sleuth.llm.base import SamplingParams
    from sleuth.llm.decode_engine import DecodeEngine as Engine
    from sleuth.llm.hf import HFGenerator
    from sleuth.llm.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "tiny")
    prompts = ["the capital of", "a search for the", "x", "answer: the river", "where", "one two", "a", "b c"]
    params = SamplingParams(max_new_tokens=24, temperature=temperature, seed=11)
    # greedy repeats one token per row: five rows stop at their first token, the others after 7, 11 and 18
    stops = [" of", "a", "e", " c c c c c c c", "xxxxxxxxxxx", "oooooooooooooooooo"]
    keeps: list[list[tuple[int, int]]] = []
    real_keep = Engine.keep

    def keep(self, state, live):  # when (in steps: the seed advances once a step) and to how many rows
        keeps[-1].append((len(live), int(self._seed.item())))
        return real_keep(self, state, live)

    monkeypatch.setattr(Engine, "keep", keep)
    runs = []
    for loop in (None, _decode_engine_before_overlap):
        keeps.append([])
        gen = HFGenerator(path, device="cpu", cache="engine", sync_every=2, max_batch_size=8)
        gen.engine.step_by_step = False  # the chunks of a CUDA decode (a CPU steps one token at a time)
        if loop is not None:
            monkeypatch.setattr(gen, "_decode_engine", loop.__get__(gen))
        runs.append(gen.generate(prompts, stops, params))
    new, old = runs
    assert keeps[0] == keeps[1] and keeps[0], keeps  # the batch shrank, at the same steps
    assert len({len(g.token_ids) for g in old}) > 2  # rows left at different chunks
    for a, b in zip(old, new, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and a.stop == b.stop
        assert a.logprobs == b.logprobs


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_held_rows_survive_later_starts_and_a_fork_of_one_decodes_like_transformers(kind: str) -> None:
    """`holding` (forked trajectories): row B of turn 1 is not in turn 2's batch, yet stays in the pool (behind turn
    2's rows); turn 3 forks B at an earlier point (a prompt sharing only B's head, then new tokens) and A's turn 2 row
    at its end: each prefills only what it does not share, and every row decodes what transformers decodes."""
    model = _model(kind)
    engine = DecodeEngine(model, max_batch_size=8, min_bucket=1)
    with engine.holding():
        a, b = [1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]
        got, _ = _greedy_rows(engine, [a, b], 6)
        engine.remember([a + got[0], b + got[1]])
        a2 = a + got[0] + [40, 41, 42]
        got2, _ = _greedy_rows(engine, [a2], 5)  # B is not decoded this turn
        engine.remember([a2 + got2[0]])
        assert sorted(len(seq) for seq, _ in engine.prefixes.rows()) == [
            len(b) + 6,
            len(a2) + 5,
        ]  # A's turn 1 row went
        fork_b = b[:7] + [50, 51]  # shares B's first 7 tokens
        fork_a = a2 + got2[0][:2] + [60]  # shares A's turn 2 row up to its second generated token
        other = list(range(70, 110))  # a long new row last: held rows placed over it would be overwritten
        before = engine.reused_tokens
        got3, lps3 = _greedy_rows(engine, [fork_b, fork_a, other], 6)
        assert engine.reused_tokens - before == 7 + len(a2) + 2
        for r, prompt in enumerate([fork_b, fork_a, other]):
            want, want_lp = _hf_greedy(model, prompt, 6)
            assert got3[r] == want, (kind, r)
            assert max(abs(x - y) for x, y in zip(lps3[r], want_lp, strict=True)) < 1e-4
        engine.remember([fork_b + got3[0], fork_a + got3[1], other + got3[2]])
        # B's row was held through turn 3 (behind its rows, none of which wrote over it): fork it once more
        fork_b2 = b[:9] + [80]
        before = engine.reused_tokens
        got4, lps4 = _greedy_rows(engine, [fork_b2], 6)
        assert engine.reused_tokens - before == 9
        want, want_lp = _hf_greedy(model, fork_b2, 6)
        assert got4[0] == want and max(abs(x - y) for x, y in zip(lps4[0], want_lp, strict=True)) < 1e-4
    assert not engine.prefixes.hold and not engine.prefixes


def test_the_cpu_decode_attention_reads_each_row_in_place_and_equals_the_reference() -> None:
    """`kernels.decode_attention` on a CPU (`decode_attention_rows`, one SDPA call per row over its own slots) against
    the gathering reference: rows of different lengths at different starts, 4 query heads over 2 key/value heads."""
    torch.manual_seed(0)
    heads, kv_heads, d = 4, 2, 16
    k_cache, v_cache = torch.randn(40, kv_heads, d), torch.randn(40, kv_heads, d)
    q = torch.randn(3, heads, d)
    starts = torch.tensor([0, 12, 25], dtype=torch.int32)
    lengths = torch.tensor([7, 1, 15], dtype=torch.int32)
    want = kernels.decode_attention_reference(q, k_cache, v_cache, starts, lengths, 0.25)
    got = kernels.decode_attention(q, k_cache, v_cache, starts, lengths, 0.25)
    assert torch.allclose(got, want, atol=1e-6)
    # by hand: a row of one key returns that key's value in every query head of its group (heads 0-1: kv head 0)
    assert torch.equal(got[1, :2], v_cache[12, 0].expand(2, d)) and torch.equal(
        got[1, 2:], v_cache[12, 1].expand(2, d)
    )
    half = kernels.decode_attention(
        q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), starts, lengths, 0.25
    )
    ref = kernels.decode_attention_reference(
        q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), starts, lengths, 0.25
    )
    assert half.dtype == torch.bfloat16 and (half.float() - ref.float()).abs().max() <= 1e-2


def test_on_a_cpu_the_engine_decodes_in_the_models_dtype_without_padding_rows() -> None:
    """No graphs on a CPU: a batch is exactly its live rows (a padding row would cost a live one's step), and the copy
    keeps the model's dtype (bf16 where `cpu_dtype` loaded the model so)."""
    model = _model("llama")
    engine = DecodeEngine(model, max_batch_size=8)  # min_bucket 8 pads on CUDA only
    assert engine.dtype == torch.float32 and not engine.use_graphs
    state, _, _ = engine.start([[1, 2, 3], [4, 5], [6]], 6, temperature=0.0)
    assert state.bucket.size == 3
    engine.keep(state, [0, 2])
    assert state.bucket.size == 2 and state.bucket.tokens.shape == (2,)
    assert DecodeEngine(model.to(torch.bfloat16)).dtype == torch.bfloat16


def test_on_a_cpu_the_generator_drops_each_finished_row_at_once_and_decodes_like_the_dynamic_cache(
    tmp_path: Path,
) -> None:
    """HFGenerator(cache="engine") on a CPU steps one token at a time and a row leaves the batch at the step after
    its last token was read (on CUDA only once half the batch has finished): rows stopping at different lengths
    cost no step past that, and the tokens are the dynamic cache's."""
    from sleuth.llm.base import SamplingParams
    from sleuth.llm.hf import HFGenerator
    from sleuth.llm.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "tiny")
    prompts = ["the capital of", "a search for the", "x", "answer: the river", "y z"]
    stops = [[" of of of"], [], ["xxxxxxx"], ["verververver"], []]  # the tiny model repeats itself
    dynamic = HFGenerator(path, device="cpu", cache="dynamic")
    gen = HFGenerator(path, device="cpu", cache="engine", sync_every=8)
    rows_per_step: list[int] = []
    steps = gen.engine.steps

    def counted(state, k):
        rows_per_step.extend([len(state.rows)] * k)
        return steps(state, k)

    gen.engine.steps = counted  # type: ignore[method-assign]
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    want = dynamic.generate(prompts, stops, params)
    got = gen.generate(prompts, stops, params)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    assert [g.finish_reason for g in got] == [g.finish_reason for g in want]
    generated = sorted(len(g.token_ids) for g in got)
    assert generated[0] < generated[-1]  # rows did finish apart
    # the first token comes from the prefill; a row is in every step until the one after its last token
    assert sum(rows_per_step) <= sum(generated)
    assert rows_per_step == sorted(rows_per_step, reverse=True) and rows_per_step[-1] < len(prompts)


def test_on_a_cpu_the_engine_takes_a_whole_evaluation_batch_so_every_row_reuses_its_keys(
    tmp_path: Path,
) -> None:
    """HFGenerator(cache="engine") on a CPU decodes a generate call of more than 64 rows as one batch (unless
    max_batch_size says otherwise): the next turn of every row reuses all its stored keys. Batches of 64 (the default
    elsewhere) lose them: the second batch's start reassigns the slots of the first batch's rows and vice versa."""
    from sleuth.llm.base import SamplingParams
    from sleuth.llm.hf import HFGenerator
    from sleuth.llm.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "tiny")
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    words = ["the", "capital", "of", "a", "search", "for", "river", "x"]
    reused = {}
    for batch in (None, 64):
        gen = HFGenerator(path, device="cpu", cache="engine", max_batch_size=batch)
        assert gen.max_batch_size == (256 if batch is None else 64)
        # 70 rows of different lengths: sorted by length, the 64 shortest form the first batch of 64
        turn1 = [gen.encode(" ".join(words[: 1 + i % 8]) + f" {i}") for i in range(70)]
        first = gen.generate(turn1, None, params)
        turn2 = [p + g.token_ids + gen.encode(" ok") for p, g in zip(turn1, first, strict=True)]
        before = gen.engine.reused_tokens
        gen.generate(turn2, None, params)
        reused[batch] = gen.engine.reused_tokens - before
        stored = sum(len(p) + len(g.token_ids) - 1 for p, g in zip(turn1, first, strict=True))
    assert reused[None] == stored  # every row: all but its last token's keys
    assert reused[64] < stored / 2
    assert HFGenerator(path, device="cpu", cache="dynamic").max_batch_size == 64


def test_rotary_tables_passed_in_equal_those_the_reference_computes() -> None:
    """The engine computes a step's rotary tables once for all layers (`DecodeEngine._rotary`) and hands them to
    `kernels.rope_store_reference`: the stored keys/values and the returned queries are those it computes itself."""
    torch.manual_seed(0)
    layout = kernels.HeadLayout(4, 2, 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)))
    qkv = torch.randn(5, (4 + 2 * 2) * 16).bfloat16()
    positions = torch.tensor([0, 3, 7, 100, 2047], dtype=torch.int32)
    slots = torch.tensor([1, 4, 9, 12, 20], dtype=torch.int32)
    pools = [torch.zeros(24, 2, 16, dtype=torch.bfloat16) for _ in range(4)]
    q1 = kernels.rope_store(qkv, positions, slots, layout, pools[0], pools[1])
    tables = kernels.rotary_tables(positions, layout, torch.bfloat16)
    q2 = kernels.rope_store_reference(qkv, positions, slots, layout, pools[2], pools[3], rotary=tables)
    assert torch.equal(q1, q2) and torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])


def test_the_cpu_decode_attention_splits_rows_between_threads_and_computes_what_one_thread_does() -> None:
    """With torch on several threads, `decode_attention_rows` hands consecutive rows (about equal numbers of keys)
    to worker threads: every row equals the one-thread result bit for bit, and the torch thread count comes back."""
    torch.manual_seed(0)
    heads, kv_heads, d = 4, 2, 16
    lengths = torch.tensor([7, 1, 15, 30, 2, 9, 40], dtype=torch.int32)
    starts = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int32), lengths[:-1] + 3]), 0).to(torch.int32)
    k_cache, v_cache = torch.randn(130, kv_heads, d).bfloat16(), torch.randn(130, kv_heads, d).bfloat16()
    q = torch.randn(7, heads, d).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernels.decode_attention_rows(q, k_cache, v_cache, starts, lengths, 0.25)
        for threads in (2, 3):
            torch.set_num_threads(threads)
            split = kernels.decode_attention_rows(q, k_cache, v_cache, starts, lengths, 0.25)
            assert torch.equal(split, alone) and torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    want = kernels.decode_attention_reference(
        q.float(), k_cache.float(), v_cache.float(), starts, lengths, 0.25
    )
    assert (alone.float() - want).abs().max() <= 1e-2  # bf16 rounding of the output
    assert kernels._balanced_parts([10, 10, 10, 10], 2) == [range(0, 2), range(2, 4)]
    assert kernels._balanced_parts([100, 1, 1, 1], 2) == [range(0, 1), range(1, 4)]
    assert kernels._balanced_parts([5], 3) == [range(0, 1)]
