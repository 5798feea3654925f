"""The trajectory viewer: each prediction's turns, documents (gold ones marked) and answer."""

from __future__ import annotations

import json
from collections.abc import Sequence

from sleuth.eval.report.format import AGENT_TAGS, contains_answer, format_value, highlight_text, is_number
from sleuth.eval.report.run_data import RunData, read_jsonl
from sleuth.rewards.metrics import exact_match

MAX_TRAJECTORIES = 200


def _correct_from_metrics(metrics: dict | None) -> bool | None:
    if not isinstance(metrics, dict):
        return None
    for key in ("em", "genacc", "cover_em"):
        if is_number(metrics.get(key)):
            return metrics[key] >= 1.0
    return None


def _doc_view(hit: dict, golds: Sequence[str], selected_ids: set[str]) -> dict:
    text = str(hit.get("text", "") or hit.get("contents", ""))
    title = str(hit.get("title", ""))
    doc_id = str(hit.get("doc_id", hit.get("id", "")))
    return {
        "doc_id": doc_id,
        "title": title,
        "score": format_value(hit.get("score")) if hit.get("score") is not None else "",
        "text": highlight_text(text, golds, tags=()),
        "selected": doc_id in selected_ids,
        "has_gold": contains_answer(f"{title} {text}", golds),
    }


def trajectory_view(source: str, record: dict, traj: dict | None) -> dict:
    """Everything the viewer shows for one question, from a prediction record and/or a trajectory."""
    traj = traj or {}
    golds = [str(g) for g in (record.get("golden_answers") or traj.get("golden_answers") or [])]
    prediction = record.get("prediction", traj.get("answer"))
    metrics = record.get("metrics") if isinstance(record.get("metrics"), dict) else {}
    correct = _correct_from_metrics(metrics)
    if correct is None and "golden_answers" in traj:
        correct = bool(exact_match(traj.get("answer") or "", golds))
    selected_ids = {str(h.get("doc_id", h.get("id", ""))) for h in traj.get("selected") or []}
    rewards = traj.get("rewards") or record.get("rewards") or {}
    return {
        "source": source,
        "id": str(record.get("id", traj.get("question_id", ""))),
        "question": str(record.get("question", traj.get("question", ""))),
        "dataset": record.get("dataset") or "",
        "method": record.get("method") or traj.get("method") or "",
        "golds": golds,
        "prediction": "" if prediction is None else str(prediction),
        "no_answer": prediction is None,
        "correct": correct,
        "metrics": [(k, format_value(v)) for k, v in metrics.items()],
        "rewards": [
            (k, format_value(v)) for k, v in sorted(rewards.items(), key=lambda kv: kv[0] != "total")
        ],
        "retrieval_count": record.get("retrieval_count", traj.get("retrieval_count")),
        "finish_reason": traj.get("finish_reason", ""),
        "has_trajectory": bool(traj),
        "prompt": highlight_text(traj.get("prompt_text"), (), tags=AGENT_TAGS),
        # Baselines without an agent loop record no turns, only the response.
        "turns": [
            {"role": t.get("role", "policy"), "text": highlight_text(t.get("text", ""), golds)}
            for t in traj.get("turns") or []
        ]
        or (
            [{"role": "policy", "text": highlight_text(traj["response_text"], golds)}]
            if traj.get("response_text")
            else []
        ),
        "record_extra": [
            (str(k), highlight_text(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False), golds))
            for k, v in (
                [("answer_source", record.get("answer_source"))]
                + list((record.get("extra") if isinstance(record.get("extra"), dict) else {}).items())
            )
            if v is not None
        ],
        "queries": [str(q) for q in traj.get("queries") or []],
        "retrieved": [
            [_doc_view(h, golds, selected_ids) for h in call if isinstance(h, dict)]
            for call in traj.get("retrieved") or []
        ],
        "selected": [_doc_view(h, golds, set()) for h in traj.get("selected") or [] if isinstance(h, dict)],
        "evidence": highlight_text(traj.get("evidence"), golds) if traj.get("evidence") else None,
        "served_context": [
            _doc_view(h, golds, selected_ids) for h in traj.get("served_context") or [] if isinstance(h, dict)
        ],
    }


def _interleave(sources: list[tuple[str, list[dict]]], cap: int) -> list[tuple[str, dict]]:
    """Round-robin over sources so every source is represented when the cap bites."""
    picked: list[tuple[str, dict]] = []
    i = 0
    while len(picked) < cap and any(i < len(recs) for _, recs in sources):
        for label, recs in sources:
            if i < len(recs) and len(picked) < cap:
                picked.append((label, recs[i]))
        i += 1
    return picked


def collect_trajectories(data: RunData, cap: int) -> tuple[list[dict], int, list[str]]:
    """(views, total available, source labels). Sources: each eval dir x method, then the first
    and last training rollout files of each training run (to see what training changed)."""
    sources: list[tuple[str, list[dict]]] = []
    for e in data.evals:
        for method, records in e.predictions.items():
            sources.append((f"{e.label} · {method}", records))
    for run in data.training:
        files = run.rollout_files
        for path in dict.fromkeys([files[0], files[-1]] if files else []):
            records, warn = read_jsonl(path)
            data.warnings.extend(warn)
            step = path.stem.removeprefix("step_").lstrip("0") or "0"
            # Rollout lines are bare trajectories: the record *is* the trajectory.
            sources.append((f"{run.label} · train step {step}", [{"__traj__": r} for r in records]))
    total = sum(len(recs) for _, recs in sources)
    views = []
    for label, rec in _interleave(sources, cap):
        if "__traj__" in rec:
            views.append(trajectory_view(label, {}, rec["__traj__"]))
        else:
            traj = rec.get("trajectory") if isinstance(rec.get("trajectory"), dict) else None
            views.append(trajectory_view(label, rec, traj))
    return views, total, [label for label, recs in sources if recs]
