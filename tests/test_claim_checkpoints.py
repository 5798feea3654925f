"""The claim runs' injected model and trained reader (checkpoints/claims: LoRA adapters in bf16 from the 2026-11-28
H100 claim runs, issue 25) load on a CPU onto the real SmolLM2-135M-Instruct and still do what they were trained
for, on the GPU profiles' own worlds rebuilt here from their seeds: the injected model answers known questions
closed-book and not unknown ones; the reader answers from gold passages far better than its base model."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from sleuth.claims.knowledge import boundary_check
from sleuth.claims.profiles import PLAIN_PROFILES
from sleuth.claims.reader import reader_check
from sleuth.claims.staged import PROFILES as STAGED_PROFILES
from sleuth.claims.steps import build_world
from sleuth.llm.hf import cpu_dtype, native_cpu_bf16

CLAIMS = Path(__file__).resolve().parent.parent / "checkpoints" / "claims"
# the adapters were trained and evaluated in bf16 on a GPU: checked in bf16 where this CPU computes it natively
# (as `sleuth reproduce --from-committed` checks a GPU run; ~2.6x faster than float32), else in float32
GPU_DTYPE = "bfloat16" if native_cpu_bf16() else None
# test.jsonl of the worlds the adapters were trained on (the claim bundle's record of the H100 runs' worlds)
STAGED_TEST_SHA = "106a2e65de98c0ff424abc443258dff54fc7baf72e1a6bd62916e9ee302beb88"
PLAIN_TEST_SHA = "febc498aa1857b39461904f722f40166493c2d56b289b0ff4290c6eb756d216e"


def _world(tmp_path: Path, profile, sha: str) -> Path:
    world = tmp_path / "world"
    build_world(world, profile)
    assert hashlib.sha256((world / "test.jsonl").read_bytes()).hexdigest() == sha, (
        "not the world the adapters learned"
    )
    return world


@pytest.mark.parametrize("name", ["injected", "reader"])
def test_committed_claim_adapters_are_small_lora_on_the_embedded_model(name: str) -> None:
    import json

    info = json.loads((CLAIMS / name / "searcher.json").read_text())
    assert info["base_model"] == "smollm2-135m-instruct" and info["lora"] is True
    adapters = CLAIMS / name / "policy" / "adapter_model.safetensors"
    assert adapters.stat().st_size < 12 * 2**20  # bf16 adapters, not a merged model


def test_injected_model_knows_the_known_facts_of_its_world_on_a_cpu(tmp_path: Path) -> None:
    world = _world(tmp_path, STAGED_PROFILES["gpu"], STAGED_TEST_SHA)
    with cpu_dtype(GPU_DTYPE):
        result = boundary_check(world, str(CLAIMS / "injected"), tmp_path / "check", "test", limit=60)
    known, unknown = result["all-known"], result["all-unknown"]
    assert known["n"] >= 10 and unknown["n"] >= 10, result
    # on the H100 (500 questions): all-known 45.8% [38.0, 54.2], all-unknown 0.0
    assert known["em"] >= 0.2 and unknown["em"] <= 0.1, result


def test_trained_reader_reads_gold_passages_far_better_than_its_base_on_a_cpu(tmp_path: Path) -> None:
    world = _world(tmp_path, PLAIN_PROFILES["gpu"], PLAIN_TEST_SHA)
    # 16 questions: the gap measured on the H100 (500 questions: trained 92.4% [90.0, 94.6], the base ~45%,
    # docs/results.md) is ~47 points, several standard errors of a 16-question paired difference
    with cpu_dtype(GPU_DTYPE):
        trained = reader_check(world, str(CLAIMS / "reader"), tmp_path / "trained", "test", 16, ("qagent",))
        base = reader_check(world, "smollm2-135m-instruct", tmp_path / "base", "test", 16, ("qagent",))
    trained, base = trained["qagent"], base["qagent"]
    assert trained["n"] == base["n"] == 16
    assert trained["em"] >= 0.75 and trained["em"] - base["em"] >= 0.2, (trained, base)
