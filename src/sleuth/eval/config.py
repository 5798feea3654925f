"""What an evaluation is configured with (`EvalConfig`) and the metrics it writes."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from sleuth.agent.registry import reader_names
from sleuth.errors import ConfigError
from sleuth.rewards.answerer import (
    DEFAULT_READER,
    JUDGE_RULES,
)

ANSWER_METRICS = ("em", "cover_em", "f1", "span_check", "genacc", "judge")


COST_METRICS = ("retrieval_count", "input_tokens", "output_tokens", "latency_s")


METRIC_KEYS = ANSWER_METRICS + COST_METRICS


DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass
class EvalConfig:
    batch_size: int = 16
    seed: int = 0
    top_k: int | None = None  # None: each method's own default (loops: the papers'; baselines: 3)
    max_turns: int | None = None  # None: each method's default (IRCoT 4 steps, Search-o1 5)
    max_new_tokens: int = 512  # per agent turn, and for CoT
    answer_max_new_tokens: int = 64  # direct answers and frozen-generator readers
    max_obs_tokens: int = 512
    max_response_tokens: int = 4096
    answer_template: str = DEFAULT_READER  # frozen-generator prompt for naive-rag and IRCoT's reader
    r_search_evidence: bool = False  # R-Search answered by the frozen generator from its evidence (RSTool)
    keep_token_ids: bool = False  # store token ids / masks / logprobs in trajectories (large)
    fresh: bool = False  # discard existing predictions instead of resuming
    default_dataset: str = "data"  # dataset name for examples without metadata["dataset"]
    judge_rule: str = "strict"  # how a judge reply is read: "strict" or s3's "upstream" ("yes" anywhere)
    retriever_cache: str | None = (
        None  # record every search here, replay it next time (sleuth.retrieval.cache)
    )
    # a trained checkpoint's loop switches (searcher.json `loop_options`: s3 without selection, r_search without its
    # evidence block, ...), applied when its own method (`loop_method`) is evaluated
    loop_method: str | None = None
    loop_options: dict[str, Any] = field(default_factory=dict)
    # a reader prompt: every searcher's documents (its hand-over) are answered by the frozen reader with it, also for
    # methods that answer themselves (search_r1's documents read as s3's are: the searchers compared, not the readers)
    hand_over_template: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "batch_size",
            "max_new_tokens",
            "answer_max_new_tokens",
            "max_obs_tokens",
            "max_response_tokens",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("top_k", "max_turns"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.hand_over_template is not None and self.hand_over_template not in reader_names():
            choices = " or ".join(repr(x) for x in reader_names())
            raise ConfigError(f"hand_over_template must be {choices}, got {self.hand_over_template!r}")
        if self.answer_template not in reader_names():
            choices = " or ".join(repr(x) for x in reader_names())
            raise ConfigError(f"answer_template must be {choices}, got {self.answer_template!r}")
        if self.judge_rule not in JUDGE_RULES:
            raise ConfigError(f"judge_rule must be one of {list(JUDGE_RULES)}, got {self.judge_rule!r}")
        if self.default_dataset == "overall":
            raise ConfigError("default_dataset 'overall' collides with the overall summary row")


def eval_config(**options: Any) -> EvalConfig:
    """An EvalConfig from keyword options, naming any unknown one."""
    known = {f.name for f in fields(EvalConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(
            f"unknown evaluate option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return EvalConfig(**options)
