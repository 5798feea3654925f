"""`sleuth.llm.hf.cpu_dtype`: models loaded with dtype "auto" on a CPU inside the block take its dtype (what
`sleuth reproduce --from-committed` uses to check a GPU run in its bf16), outside it float32; an explicit dtype
wins; the previous setting comes back on leaving, also after an error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sleuth.errors import ConfigError
from sleuth.llm.hf import HFGenerator, auto_cpu_dtype, cpu_cache, cpu_dtype, native_cpu_bf16
from sleuth.llm.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def _dtype(gen: HFGenerator) -> torch.dtype:
    return next(gen.model.parameters()).dtype


def test_auto_dtype_on_a_cpu_follows_the_block(tiny: Path) -> None:
    assert _dtype(HFGenerator(str(tiny), device="cpu")) == torch.float32
    with cpu_dtype("bfloat16"):
        assert auto_cpu_dtype() == torch.bfloat16
        assert _dtype(HFGenerator(str(tiny), device="cpu")) == torch.bfloat16
        assert _dtype(HFGenerator(str(tiny), device="cpu", dtype="float32")) == torch.float32  # explicit wins
        with cpu_dtype(None):
            assert _dtype(HFGenerator(str(tiny), device="cpu")) == torch.float32
        assert auto_cpu_dtype() == torch.bfloat16
    assert auto_cpu_dtype() is None
    with pytest.raises(RuntimeError), cpu_dtype(torch.bfloat16):
        raise RuntimeError("inside")
    assert auto_cpu_dtype() is None
    with pytest.raises(ConfigError, match="unknown dtype"), cpu_dtype("float8"):
        pass
    assert isinstance(native_cpu_bf16(), bool)


def test_bf16_generation_on_a_cpu_runs_and_stays_close(tiny: Path) -> None:
    """The same greedy prompt in float32 and in bf16: both generate, and agree on the first token."""
    from sleuth.llm.base import SamplingParams

    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    full = HFGenerator(str(tiny), device="cpu").generate(["hello there"], params=params)[0]
    with cpu_dtype("bfloat16"):
        half = HFGenerator(str(tiny), device="cpu").generate(["hello there"], params=params)[0]
    assert len(full.token_ids) == len(half.token_ids) == 4
    assert full.token_ids[0] == half.token_ids[0]


def test_auto_cache_on_a_cpu_follows_the_cpu_cache_block(tiny: Path) -> None:
    """`sleuth reproduce --from-committed` decodes with the engine on a CPU (each turn prefills only its new tokens):
    inside `cpu_cache("engine")` cache="auto" picks it where the engine supports the model, an explicit cache wins,
    and the dynamic cache comes back on leaving, also after an error."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from sleuth.llm.hf import auto_cache

    cpu = torch.device("cpu")
    other = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    assert HFGenerator(str(tiny), device="cpu").cache_kind == "dynamic"
    with cpu_cache("engine"):
        assert HFGenerator(str(tiny), device="cpu").cache_kind == "engine"
        assert HFGenerator(str(tiny), device="cpu", cache="dynamic").cache_kind == "dynamic"
        assert auto_cache(cpu, other) == "dynamic"  # a model the engine cannot decode
        with cpu_cache(None):
            assert HFGenerator(str(tiny), device="cpu").cache_kind == "dynamic"
        assert HFGenerator(str(tiny), device="cpu").cache_kind == "engine"
    with pytest.raises(RuntimeError), cpu_cache("engine"):
        raise RuntimeError("inside")
    assert HFGenerator(str(tiny), device="cpu").cache_kind == "dynamic"
    with pytest.raises(ConfigError, match="cpu_cache"), cpu_cache("static"):
        pass


def test_the_engine_decodes_bf16_on_a_cpu_and_its_first_token_is_the_dynamic_caches(tiny: Path) -> None:
    """In bf16 the engine's copy keeps the model's dtype; an unpadded prompt's prefill computes what transformers'
    does (the same products, bit for bit), so the first token and its log-prob are the dynamic cache's. Later tokens
    may differ in a rare near-tie: the engine's decode attention is fp32 (bench/results/from_committed_cpu_engine.json
    counts the responses that differ on SmolLM2)."""
    from sleuth.llm.base import SamplingParams

    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    with cpu_dtype("bfloat16"):
        dynamic = HFGenerator(str(tiny), device="cpu", cache="dynamic")
        with cpu_cache("engine"):
            engine = HFGenerator(str(tiny), device="cpu")
        assert engine.cache_kind == "engine" and engine.engine.dtype == torch.bfloat16
        for prompt in ("hello there", "the capital of the river"):
            want = dynamic.generate([prompt], params=params)[0]
            got = engine.generate([prompt], params=params)[0]
            assert len(got.token_ids) == 6
            assert got.token_ids[0] == want.token_ids[0] and got.logprobs[0] == want.logprobs[0]
