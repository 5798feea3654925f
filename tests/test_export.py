"""`sleuth export`: a LoRA checkpoint folded into a Hugging Face model directory that transformers loads
and that generates exactly what the checkpoint generates; serving and evaluation take the export like
the checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

PLUGINS = Path(__file__).parent / "plugins"
sys.path.insert(0, str(PLUGINS))

PROMPTS = [
    "Where was the director of the film born?",
    "<search> capital of Varonia </search>",
    "The quick brown fox",
]


@pytest.fixture(scope="module")
def lora_run(small_world: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real `sleuth train` run with LoRA adapters, trained two steps so the adapters are non-zero."""
    from sleuth.rl.config import recipe_from_dict
    from sleuth.rl.trainer import train

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("lora-run")
    recipe = {
        "name": "export-test",
        "seed": 0,
        "model": {"policy": "tiny", "lora": {"enabled": True, "r": 4, "alpha": 8}},
        "data": {"train": str(small_world / "train.jsonl")},
        "retriever": {"index": str(small_world / "bm25")},
        "agent": {
            "loop": "search_r1",
            "max_turns": 1,
            "top_k": 2,
            "max_new_tokens_per_turn": 8,
            "max_response_tokens": 64,
            "max_obs_tokens": 16,
        },
        "plugins": ["sleuth_test_rewards"],
        "reward": {"name": "test_token_fraction"},
        "algorithm": {
            "name": "grpo",
            "n": 4,
            "prompts_per_step": 2,
            "minibatch_size": 8,
            "micro_batch_size": 8,
        },
        "optim": {"lr": 5e-2},
        "trainer": {"total_steps": 2, "save_every": 2, "out_dir": str(out)},
    }
    train(recipe_from_dict(recipe))
    return out


@pytest.fixture(scope="module")
def exported(lora_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from typer.testing import CliRunner

    from sleuth.cli import app

    out = tmp_path_factory.mktemp("export") / "searcher-hf"
    res = CliRunner().invoke(app, ["export", str(lora_run), "--out", str(out)])
    assert res.exit_code == 0, res.output
    return out


def _greedy(model, tokenizer, prompt: str, n: int = 12) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    return out[0, ids.shape[1] :].tolist()


def test_export_is_a_plain_hf_model_with_the_checkpoints_greedy_tokens(
    lora_run: Path, exported: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sleuth.agent.searcher import resolve_checkpoint
    from sleuth.llm.registry import tiny_model_dir

    names = {p.name for p in exported.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "searcher.json"} <= names
    assert "adapter_config.json" not in names  # merged, not an adapter

    ckpt = resolve_checkpoint(lora_run)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert (
        tokenizer.chat_template
        and tokenizer.chat_template == AutoTokenizer.from_pretrained(ckpt / "policy").chat_template
    )
    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    # the reference: base + adapter applied unmerged by peft, as the checkpoint stores it
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir())
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir()), ckpt / "policy"
    ).eval()

    ids = tokenizer(PROMPTS[0], return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        export_logits, adapted_logits, base_logits = (m(ids).logits for m in (model, adapted, base.eval()))
    torch.testing.assert_close(export_logits, adapted_logits, rtol=1e-4, atol=1e-5)
    # the adapters moved the model, so a missing merge would be caught
    assert (export_logits - base_logits).abs().max() > 1e-3

    for prompt in PROMPTS:
        assert _greedy(model, tokenizer, prompt) == _greedy(adapted, tokenizer, prompt), prompt


def test_export_carries_the_loop_and_prompts(lora_run: Path, exported: Path) -> None:
    from sleuth.agent.search_r1 import SEARCH_R1_USER_TEMPLATE
    from sleuth.agent.searcher import load_searcher, resolve_checkpoint

    info = json.loads((exported / "searcher.json").read_text())
    original = json.loads((resolve_checkpoint(lora_run) / "searcher.json").read_text())
    assert info["loop"] == "search_r1" and info["loop_options"] == original["loop_options"] == {
        "max_turns": 1,
        "top_k": 2,
    }
    assert info["lora"] is False and info["max_obs_tokens"] == 16
    assert (
        info["loop_config"]["user_template"] == SEARCH_R1_USER_TEMPLATE and info["loop_config"]["top_k"] == 2
    )

    searcher = load_searcher(exported, device="cpu")
    assert searcher.loop.name == "search_r1" and searcher.loop.top_k == 2 and searcher.loop.max_turns == 1


def test_serve_and_eval_take_the_export_like_the_checkpoint(
    lora_run: Path, exported: Path, small_world: Path, tmp_path: Path
) -> None:
    from sleuth.data.formats import read_qa_jsonl
    from sleuth.eval.harness import EvalConfig, evaluate
    from sleuth.serve.loading import ServiceSpec, build_service
    from sleuth.serve.service import SearchQuery

    from_export = build_service(ServiceSpec(checkpoint=exported, index=small_world / "bm25"))
    from_ckpt = build_service(ServiceSpec(checkpoint=lora_run, index=small_world / "bm25"))
    try:
        assert from_export.max_obs_tokens == from_ckpt.max_obs_tokens == 16
        assert from_export.loop.config() == from_ckpt.loop.config()
        query = SearchQuery(question=PROMPTS[0], max_turns=1, top_k=2)
        (a,), (b,) = from_export.run_batch([query]), from_ckpt.run_batch([query])
        assert a.body == b.body and a.body["trajectory"]["num_turns"] >= 1
    finally:
        from_export.close()
        from_ckpt.close()

    examples = read_qa_jsonl(small_world / "dev.jsonl")[:2]
    summaries = [
        evaluate(
            "search-r1",
            examples,
            small_world / "bm25",
            str(spec),
            out_dir=tmp_path / name,
            config=EvalConfig(max_new_tokens=8, max_turns=1),
        )
        for name, spec in (("export", exported), ("ckpt", lora_run))
    ]
    preds = [
        [
            json.loads(line)["prediction"]
            for line in (tmp_path / name / "search-r1" / "predictions.jsonl").read_text().splitlines()
        ]
        for name in ("export", "ckpt")
    ]
    assert preds[0] == preds[1] and len(preds[0]) == 2
    assert (
        summaries[0]["methods"]["search-r1"]["overall"]["em"]
        == summaries[1]["methods"]["search-r1"]["overall"]["em"]
    )


def test_export_refuses_a_non_empty_out_and_a_bad_dtype(
    lora_run: Path, exported: Path, tmp_path: Path
) -> None:
    from sleuth.agent.searcher import export_searcher
    from sleuth.errors import ConfigError

    with pytest.raises(ConfigError, match="not empty; pass --overwrite"):
        export_searcher(lora_run, exported)
    with pytest.raises(ConfigError, match="--dtype 'int4'"):
        export_searcher(lora_run, tmp_path / "x", dtype="int4")
    with pytest.raises(ConfigError, match="not a sleuth checkpoint"):
        export_searcher(tmp_path, tmp_path / "y")
    half = export_searcher(lora_run, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((half / "searcher.json").read_text())["dtype"] == "bfloat16"
    assert (
        json.loads((half / "config.json").read_text()).get(
            "dtype", json.loads((half / "config.json").read_text()).get("torch_dtype")
        )
        == "bfloat16"
    )


def test_export_of_a_checkpoint_with_the_wrong_eos_stops_at_the_turn_end(
    lora_run: Path, tmp_path: Path
) -> None:
    """A checkpoint whose tokenizer says eos = `<|im_start|>` (as the committed ones did) exports
    `<|im_end|>` as eos and pad in the tokenizer, config and generation config; the directory is
    readable by others (0755 / 0644) and names a tokenizer class transformers 4.x knows."""
    import shutil

    from transformers import AutoTokenizer, GenerationConfig

    from sleuth.agent.searcher import export_searcher, resolve_checkpoint
    from test_special_tokens import KNOWN_TO_TRANSFORMERS_4, assert_normal_permissions

    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    tok_file = resolve_checkpoint(run) / "policy" / "tokenizer_config.json"
    saved = json.loads(tok_file.read_text())
    tok_file.write_text(json.dumps({**saved, "eos_token": "<|im_start|>", "pad_token": "<|im_start|>"}))
    assert AutoTokenizer.from_pretrained(tok_file.parent).eos_token == "<|im_start|>"

    out = export_searcher(run, tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(out)
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    # the old eos stays a stop: a model trained with it may end turns with <|im_start|>
    assert GenerationConfig.from_pretrained(out).eos_token_id == [
        end_id,
        tok.convert_tokens_to_ids("<|im_start|>"),
    ]
    config = json.loads((out / "config.json").read_text())
    assert (
        config["eos_token_id"] == end_id and config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    )
    assert (
        json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] in KNOWN_TO_TRANSFORMERS_4
    )
    assert_normal_permissions(out)


CHAT_IDIOM = """
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
inputs = tok.apply_chat_template([{"role": "user", "content": "Where is Varonia?"}], add_generation_prompt=True,
                                 return_tensors="pt", return_dict=True)
assert sorted(inputs) == ["attention_mask", "input_ids"], sorted(inputs)
out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
print("generated", out.shape[1] - inputs["input_ids"].shape[1])
"""


@pytest.fixture(scope="module")
def committed_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The committed Search-R1 searcher (SmolLM2 from its GGUF: a PreTrainedTokenizerFast), exported."""
    from sleuth.agent.searcher import export_searcher
    from sleuth.errors import ConfigError
    from sleuth.llm.registry import embedded_gguf_path

    try:
        embedded_gguf_path()
    except ConfigError as err:
        pytest.skip(str(err))
    return export_searcher(
        Path(__file__).resolve().parents[1] / "checkpoints" / "search_r1",
        tmp_path_factory.mktemp("committed") / "hf",
    )


@pytest.mark.parametrize("which", ["tiny", "committed"])
def test_export_generates_with_the_chat_template_idiom(which: str, request: pytest.FixtureRequest) -> None:
    """`model.generate(**tok.apply_chat_template(..., return_dict=True))` works on the export: the tokenizer
    gives no token_type_ids (transformers 4.56 refused them) and config.json names no GGUF title."""
    import subprocess

    exported = request.getfixturevalue("exported" if which == "tiny" else "committed_export")

    assert json.loads((exported / "tokenizer_config.json").read_text())["model_input_names"] == [
        "input_ids",
        "attention_mask",
    ]
    assert "_model_name_or_path" not in json.loads((exported / "config.json").read_text())
    result = subprocess.run(
        [sys.executable, "-c", CHAT_IDIOM, str(exported)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "generated" in result.stdout, result.stderr[-2000:]


def test_export_generates_with_transformers_4(committed_export: Path) -> None:
    """The same with transformers 4.56, from a directory holding it (and its huggingface_hub / tokenizers):
    `pip install --no-deps --target DIR transformers==4.56.2 'huggingface_hub<1.0' 'tokenizers<0.23'`,
    then SLEUTH_TRANSFORMERS4_DIR=DIR."""
    import os
    import subprocess

    target = os.environ.get("SLEUTH_TRANSFORMERS4_DIR")
    if not target:
        pytest.skip("SLEUTH_TRANSFORMERS4_DIR is not set (see the docstring)")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([target, os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    check = (
        "import transformers; assert transformers.__version__.startswith('4.'), transformers.__version__\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", check + CHAT_IDIOM, str(committed_export)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0 and "generated" in result.stdout, result.stderr[-2000:]
