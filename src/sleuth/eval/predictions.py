"""One method's predictions file: run or resume a method over the questions, score each batch, append
its records (OUT/<method>/predictions.jsonl), and refuse to resume under another configuration
(OUT/<method>/config.json) or other questions."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sleuth.agent.trajectory import Trajectory
from sleuth.errors import ConfigError, DataFormatError
from sleuth.eval.methods import EvalContext, method_traits, run_method_batch
from sleuth.eval.questions import EvalItem
from sleuth.eval.records import append_records, load_predictions
from sleuth.llm.base import Generator
from sleuth.rewards.answerer import (
    gen_acc,
    judge_contains,
)
from sleuth.rewards.metrics import cover_exact_match, exact_match, f1_score, span_check
from sleuth.utils import atomic_write_json, seed_everything


def score_predictions(
    questions: Sequence[str],
    golden_answers: Sequence[Sequence[str]],
    predictions: Sequence[str | None],
    judge: Generator | None = None,
    judge_rule: str = "strict",
) -> list[dict[str, float | None]]:
    """EM, cover-EM, F1, span_check, judge (None without a judge; 0 for a missing prediction) and
    GenAcc = span_check OR judge (s3). The judge is asked about every prediction in one call; its
    replies are read with `judge_rule` (`sleuth.rewards.answerer.JUDGE_RULES`)."""
    verdicts: list[float | None] = [None] * len(predictions)
    if judge is not None:
        ask = [i for i, p in enumerate(predictions) if p is not None and p.strip()]
        for i in range(len(predictions)):
            verdicts[i] = 0.0
        if ask:
            said = judge_contains(
                judge,
                [questions[i] for i in ask],
                [golden_answers[i] for i in ask],
                [predictions[i] or "" for i in ask],
                rule=judge_rule,
            )
            for i, ok in zip(ask, said, strict=True):
                verdicts[i] = float(ok)
    out = []
    for pred, golds, verdict in zip(predictions, golden_answers, verdicts, strict=True):
        out.append(
            {
                "em": exact_match(pred, golds),
                "cover_em": cover_exact_match(pred, golds),
                "f1": f1_score(pred, golds),
                "span_check": span_check(pred, golds),
                "genacc": gen_acc(pred, golds, None if verdict is None else bool(verdict)),
                "judge": verdict,
            }
        )
    return out


def _stored_trajectory(traj: Trajectory | None, keep_token_ids: bool) -> dict | None:
    if traj is None:
        return None
    d = traj.to_dict()
    if not keep_token_ids:
        for name in ("prompt_ids", "response_ids", "loss_mask", "logprobs"):
            d[name] = []
    return d


def method_config(
    method: str,
    ctx: EvalContext,
    retriever_desc: str | None,
    model_desc: str | None,
    generator_desc: str | None,
    judge_desc: str | None,
) -> dict[str, Any]:
    """Everything a method's stored predictions depend on (compared when resuming)."""
    cfg = ctx.cfg
    traits = method_traits(method, cfg)
    return {
        "method": method,
        "model": None if traits.model_free else model_desc,
        "generator": generator_desc if traits.uses_generator else None,
        "judge": judge_desc,
        "retriever": retriever_desc if traits.needs_retriever else None,
        "top_k": cfg.top_k,
        "max_turns": cfg.max_turns,
        "seed": cfg.seed,
        "max_new_tokens": cfg.max_new_tokens,
        "answer_max_new_tokens": cfg.answer_max_new_tokens,
        "max_obs_tokens": cfg.max_obs_tokens,
        "max_response_tokens": cfg.max_response_tokens,
        "answer_template": traits.template,
        "r_search_evidence": cfg.r_search_evidence if traits.evidence else None,
    }


def _check_resume(path: Path, current: dict[str, Any]) -> None:
    if not path.exists():
        atomic_write_json(path, current)
        return
    try:
        previous = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise DataFormatError(str(path), None, f"unreadable run config ({err}); rerun with --fresh") from err
    changed = [f"{k}: {previous.get(k)!r} -> {v!r}" for k, v in current.items() if previous.get(k) != v]
    if changed:
        raise ConfigError(
            f"{path.parent} holds predictions made with a different configuration ({'; '.join(changed)}); "
            "use another --out directory, or --fresh to discard them"
        )


def _check_stored_questions(path: Path, done: Mapping[Any, dict], items: Sequence[EvalItem]) -> None:
    """A stored prediction is reused only for the very question it answered: data regenerated or edited
    under the same ids (another synthetic world, a fixed answer key) must not inherit old predictions."""
    for it in items:
        rec = done.get(it.key)
        if rec is None:
            continue
        same = rec.get("question") == it.example.question and list(rec.get("golden_answers") or []) == list(
            it.example.golden_answers
        )
        if not same:
            raise ConfigError(
                f"{path} holds a prediction for question id {it.example.id!r} of dataset {it.dataset!r} whose "
                f"question or gold answers differ from the data given now (stored: {rec.get('question')!r}); "
                "use another --out directory, or --fresh to discard the stored predictions"
            )


def _chunks(seq: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for start in range(0, len(seq), size):
        yield seq[start : start + size]


def run_method(
    method: str,
    items: Sequence[EvalItem],
    ctx: EvalContext,
    judge: Generator | None,
    out_dir: Path,
    method_cfg: dict[str, Any],
    on_progress: Callable[[int], None] | None = None,
) -> list[dict]:
    """Run (or resume) one method over `items`; returns their records in `items` order."""
    cfg = ctx.cfg
    mdir = out_dir / method
    mdir.mkdir(parents=True, exist_ok=True)
    pred_path = mdir / "predictions.jsonl"
    if cfg.fresh:
        for stale in (pred_path, mdir / "config.json"):
            if stale.exists():
                stale.unlink()
    _check_resume(mdir / "config.json", method_cfg)
    done = load_predictions(pred_path)
    _check_stored_questions(pred_path, done, items)
    todo = [it for it in items if it.key not in done]
    if on_progress:
        on_progress(len(items) - len(todo))
    seed_everything(cfg.seed)
    for batch in _chunks(todo, cfg.batch_size):
        examples = [it.example for it in batch]
        start = time.perf_counter()
        outputs = run_method_batch(method, examples, ctx)
        latency = (time.perf_counter() - start) / len(batch)
        if len(outputs) != len(batch):
            raise RuntimeError(f"method {method} returned {len(outputs)} outputs for {len(batch)} questions")
        metrics = score_predictions(
            [ex.question for ex in examples],
            [ex.golden_answers for ex in examples],
            [o.prediction for o in outputs],
            judge,
            cfg.judge_rule,
        )
        records = []
        for it, out, m in zip(batch, outputs, metrics, strict=True):
            rec = {
                "id": str(it.example.id),
                "question": it.example.question,
                "golden_answers": list(it.example.golden_answers),
                "dataset": it.dataset,
                "method": method,
                "prediction": out.prediction,
                "metrics": m,
                "retrieval_count": out.retrieval_count,
                "input_tokens": out.input_tokens,
                "output_tokens": out.output_tokens,
                "latency_s": latency,
                "answer_source": out.answer_source,
                "trajectory": _stored_trajectory(out.trajectory, cfg.keep_token_ids),
            }
            if out.extra:
                rec["extra"] = out.extra
            if (
                "knowledge" in it.example.metadata
            ):  # a knowledge-boundary world: over/under-retrieval is scored
                rec["knowledge"] = it.example.metadata["knowledge"]
            records.append(rec)
            done[it.key] = rec
        append_records(pred_path, records)
        if on_progress:
            on_progress(len(batch))
    return [done[it.key] for it in items]
