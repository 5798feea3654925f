"""The chat format's turn end (`<|im_end|>`) is the eos of every tokenizer sleuth writes: the GGUF
conversion, `sleuth export` and the committed checkpoints; the files load with older transformers."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# tokenizer classes transformers 4.56 loads from tokenizer.json (5.x writes "TokenizersBackend", unknown to 4.x)
KNOWN_TO_TRANSFORMERS_4 = {"PreTrainedTokenizerFast", "Qwen2Tokenizer", "Qwen2TokenizerFast"}
CHECKPOINTS = sorted((REPO / "checkpoints").glob("*/policy"))


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def assert_normal_permissions(root: Path) -> None:
    mask = _umask()
    for path in [root, *root.rglob("*")]:
        want = (0o777 if path.is_dir() else 0o666) & ~mask
        assert stat.S_IMODE(path.stat().st_mode) == want, f"{path}: {oct(stat.S_IMODE(path.stat().st_mode))}"


def _tiny_tokenizer_with_wrong_eos():
    from transformers import AutoTokenizer

    from sleuth.llm.registry import tiny_model_dir

    tok = AutoTokenizer.from_pretrained(tiny_model_dir())
    # what some transformers versions read from SmolLM2's GGUF file: the turn *opener* as eos and pad
    tok.eos_token = "<|im_start|>"
    tok.pad_token = "<|im_start|>"
    return tok


def test_align_moves_eos_and_pad_to_the_templates_turn_end() -> None:
    from sleuth.llm.special_tokens import align_chat_special_tokens, chat_turn_end_token

    tok = _tiny_tokenizer_with_wrong_eos()
    assert chat_turn_end_token(tok) == "<|im_end|>"
    changes = align_chat_special_tokens(tok)
    assert changes == {
        "eos_token": ("<|im_start|>", "<|im_end|>"),
        "pad_token": ("<|im_start|>", "<|im_end|>"),
    }
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    assert align_chat_special_tokens(tok) == {}  # already right: nothing changes
    # the rendered assistant turn ends with the eos a serving engine stops at
    text = tok.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], tokenize=False
    )
    assert text.endswith("a" + tok.eos_token + "\n")


def test_align_keeps_a_distinct_pad_and_leaves_plain_lms_alone() -> None:
    from sleuth.llm.special_tokens import align_chat_special_tokens

    tok = _tiny_tokenizer_with_wrong_eos()
    tok.pad_token = "<|endoftext|>"
    assert align_chat_special_tokens(tok) == {"eos_token": ("<|im_start|>", "<|im_end|>")}
    assert tok.pad_token == "<|endoftext|>"
    tok.chat_template = None
    tok.eos_token = "<|endoftext|>"
    assert align_chat_special_tokens(tok) == {} and tok.eos_token == "<|endoftext|>"


def test_gguf_conversion_writes_the_turn_end_as_eos_in_all_three_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The conversion repairs what the GGUF reader returned (stubbed here with the tiny model and a
    tokenizer whose eos is `<|im_start|>`), and writes files older transformers read."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from sleuth.llm import gguf
    from sleuth.llm.registry import tiny_model_dir

    fake = tmp_path / "model.Q4.gguf"
    fake.write_bytes(b"GGUF")
    monkeypatch.setattr(gguf, "_load_tokenizer", lambda path: _tiny_tokenizer_with_wrong_eos())
    monkeypatch.setattr(
        gguf, "_load_dequantized", lambda path, dtype: AutoModelForCausalLM.from_pretrained(tiny_model_dir())
    )
    out = gguf.ensure_converted(fake, cache_dir=tmp_path / "cache")
    assert out.name.endswith(gguf.gguf_cache_key(fake))

    tok = AutoTokenizer.from_pretrained(out)
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    assert GenerationConfig.from_pretrained(out).eos_token_id == [
        end_id,
        tok.convert_tokens_to_ids("<|im_start|>"),
    ]
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == config["pad_token_id"] == end_id
    assert (
        json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] in KNOWN_TO_TRANSFORMERS_4
    )
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    assert_normal_permissions(out)


def test_cache_key_changes_with_the_conversion_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sleuth.llm import gguf

    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF")
    before = gguf.gguf_cache_key(fake)
    monkeypatch.setattr(gguf, "CONVERSION_VERSION", gguf.CONVERSION_VERSION + 1)
    assert gguf.gguf_cache_key(fake) != before  # a conversion made by an older sleuth is redone


def test_write_compatible_files_puts_rope_where_transformers_4_reads_it(tmp_path: Path) -> None:
    from sleuth.llm.special_tokens import write_compatible_files

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0},
                "_model_name_or_path": "Smollm2 135M 8k Lc100K Mix1 Ep2",
            }
        )
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "TokenizersBackend", "local_files_only": True, "is_local": True})
    )
    write_compatible_files(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_theta"] == 1e6 and config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0}
    assert "_model_name_or_path" not in config  # the GGUF file's title, not a model anyone can load
    # 4.x's PreTrainedTokenizerFast returns token_type_ids unless told, and generate(**inputs) refuses them
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_input_names": ["input_ids", "attention_mask"],
    }


@pytest.mark.parametrize("policy", CHECKPOINTS, ids=[p.parent.name for p in CHECKPOINTS])
def test_committed_checkpoints_end_turns_with_im_end(policy: Path) -> None:
    from transformers import AutoTokenizer

    from sleuth.llm.special_tokens import chat_turn_end_token

    saved = json.loads((policy / "tokenizer_config.json").read_text())
    assert saved["eos_token"] == saved["pad_token"] == "<|im_end|>"
    assert saved["tokenizer_class"] == "PreTrainedTokenizerFast"
    tok = AutoTokenizer.from_pretrained(policy)
    assert tok.eos_token == chat_turn_end_token(tok) == "<|im_end|>" and tok.bos_token == "<|im_start|>"


def test_atomic_writes_are_readable_like_plain_writes(tmp_path: Path) -> None:
    from sleuth.utils import atomic_write_text

    atomic_write_text(tmp_path / "report.html", "x")
    assert_normal_permissions(tmp_path / "report.html")


def test_assert_normal_permissions_catches_a_private_file(tmp_path: Path) -> None:
    private = tmp_path / "secret"
    private.write_text("x")
    private.chmod(0o600)
    with pytest.raises(AssertionError):
        assert_normal_permissions(private)
