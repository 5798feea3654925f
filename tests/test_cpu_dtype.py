"""`sleuth.llm.hf.cpu_dtype`: models loaded with dtype "auto" on a CPU inside the block take its dtype (what
`sleuth reproduce --from-committed` uses to check a GPU run in its bf16), outside it float32; an explicit dtype
wins; the previous setting comes back on leaving, also after an error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sleuth.errors import ConfigError
from sleuth.llm.hf import HFGenerator, auto_cpu_dtype, cpu_dtype, native_cpu_bf16
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
