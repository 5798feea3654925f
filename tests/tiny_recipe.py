"""The tiny GRPO recipe the robustness and reliability tests train (tiny model, small world, 1 turn of 8 tokens)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tiny_grpo_recipe(small_world: Path, out_dir: Path, name: str, steps: int = 2, **overrides: Any) -> dict:
    """`overrides`: "section.field" sets one field of a section, "section" replaces the section."""
    data: dict[str, Any] = {
        "name": name,
        "model": {"policy": "tiny"},
        "data": {"train": str(small_world / "train.jsonl")},
        "retriever": {"index": str(small_world / "bm25")},
        "agent": {
            "loop": "search_r1",
            "max_turns": 1,
            "max_new_tokens_per_turn": 8,
            "max_response_tokens": 64,
            "max_obs_tokens": 16,
        },
        "reward": {"name": "search_r1_em"},
        "algorithm": {
            "name": "grpo",
            "n": 2,
            "prompts_per_step": 2,
            "minibatch_size": 4,
            "micro_batch_size": 4,
        },
        "trainer": {"total_steps": steps, "save_every": 1, "out_dir": str(out_dir)},
    }
    for key, value in overrides.items():
        section, _, field = key.partition(".")
        if field:
            data.setdefault(section, {})[field] = value
        else:
            data[section] = value
    return data
