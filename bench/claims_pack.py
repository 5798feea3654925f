"""Issue 25: a claim run (runs/claims/<claim>, as `sleuth reproduce` or bench/gpu_claims.sh wrote it) -> the
folder committed under bench/results/claims/<name>/, and the per-question analysis of why an arm wins or loses.

`pack RUN DEST --world W [--logs L]`: report.json/html, claim.json, stages/, the logs, and for each evaluation
stage DEST/<eval name>/per_question.jsonl (id, type, hops, prediction, gold, retrievals, EM, non-strict EM, F1,
the share of the question's supporting passages retrieved by any search (on a knowledge-boundary world also the
share of the unknown hops' passages), and what the answerer was handed:
documents, the share of supporting passages among them, whether a gold answer occurs in them), summary.json; for each RL run DEST/<arm>/metrics.jsonl and rl_recipe.yaml.
W is the run's world (`supporting_ids` per test question): a world rebuilt from the seed is checked against the
run's world record (sha256 of corpus, train, test).
`--adapters SEED`: also DEST/adapters/, what `sleuth reproduce <claim> --from-committed DEST` needs to evaluate the
claim's decisive arms of that training seed again on a CPU: each model they load as a bfloat16 LoRA adapter, the
world's sha256, committed.json (sleuth.claims.committed).
`why DEST`: per evaluation, EM and the retrieval quantities above, by question type and overall, with 95%
intervals, and EM split by whether every supporting passage reached the answerer; writes DEST/why.json, prints
a Markdown table.

    PYTHONPATH=src python bench/claims_pack.py pack runs/claims/s3 bench/results/claims/s3_gpu_h200_20261128 \
        --world /tmp/world_gpu --world-record checkpoints/claims/reader/claim_world.json --logs LOGS
    PYTHONPATH=src python bench/claims_pack.py why bench/results/claims/s3_gpu_h200_20261128
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from sleuth.appendlog import read_appended
from sleuth.claims.committed import pack_committed, response_digest
from sleuth.claims.reuse import world_differences
from sleuth.errors import ConfigError
from sleuth.eval.stats import bootstrap_ci
from sleuth.rewards.metrics import cover_exact_match
from sleuth.utils import atomic_write_text


def check_world(run: Path, world: Path, record: Path | None) -> None:
    """The rebuilt world must be the run's: its files' sha256 against the run's world record (claim_world.json)."""
    records = (
        [record]
        if record
        else [*run.glob("reader/**/claim_world.json"), *run.glob("inject/**/claim_world.json")]
    )
    if not records:
        raise SystemExit(
            f"{run}: no claim_world.json under reader/ or inject/ to check the world {world} against; "
            f"give --world-record (a reused model's, e.g. checkpoints/claims/reader/claim_world.json)"
        )
    try:
        differ = world_differences(records[0], world)
    except ConfigError as err:  # a world file missing
        raise SystemExit(str(err)) from err
    if differ:
        raise SystemExit(
            f"{world}: {', '.join(differ)} differ from the run's world ({records[0]}): rebuild it "
            f"from the run's profile (sleuth.claims.steps.build_world)"
        )


def per_question(pred: dict[str, Any], support: dict[str, list[str]],
                 known_hops: dict[str, list[bool]] | None = None) -> dict[str, Any]:  # fmt: skip
    """One prediction record -> its committed row (module docstring). `known_hops` (a knowledge-boundary world: per
    question, per supporting passage, whether the model knows that hop's fact) adds the share of the passages of
    the hops it does not know that some search retrieved: all a searcher that answers the known hops from memory
    needs."""
    traj = pred.get("trajectory") or {}
    served = traj.get("served_context") or []
    served_ids = {doc.get("doc_id") for doc in served}
    retrieved_ids = {doc.get("doc_id") for window in traj.get("retrieved") or [] for doc in window}
    supporting = support.get(pred["id"], [])
    text = " ".join(f"{doc.get('title', '')} {doc.get('text', '')}" for doc in served)
    row = {
        "id": pred["id"],
        "dataset": pred["dataset"],
        "prediction": pred["prediction"],
        "golden_answers": pred["golden_answers"],
        "retrieval_count": pred["retrieval_count"],
        "em": pred["metrics"]["em"],
        "cover_em": pred["metrics"]["cover_em"],
        "f1": pred["metrics"]["f1"],
        "served_docs": len(served),
        "support_served": sum(s in served_ids for s in supporting) / len(supporting) if supporting else None,
        # retrieved in some search but not served: the searcher's selection (s3) left it out
        "support_retrieved": sum(s in retrieved_ids for s in supporting) / len(supporting)
        if supporting
        else None,
        "answer_in_served": cover_exact_match(text, pred["golden_answers"]),
    }
    known = (known_hops or {}).get(pred["id"])
    if known is not None:
        unknown = [s for s, is_known in zip(supporting, known, strict=True) if not is_known]
        row["unknown_support_retrieved"] = (
            sum(s in retrieved_ids for s in unknown) / len(unknown) if unknown else None
        )
    if "knowledge" in pred:
        row["knowledge"] = pred["knowledge"]
    # every field a report row is computed from: the agent's own answer where a reader answered for it (qagent's
    # own-answerer row), and the metrics it was scored by
    extra = pred.get("extra") or {}
    if "agent_answer" in extra:
        row["agent_answer"] = extra["agent_answer"]
    row["metrics"] = pred["metrics"]
    # the whole decoded response, hashed: `sleuth reproduce --from-committed` tells a re-evaluation that decoded
    # alike from one that merely answered alike
    digest = response_digest(pred)
    if digest is not None:
        row["response_sha256"] = digest
    return row


def pack(run: Path, dest: Path, world: Path, logs: Path | None, record: Path | None = None) -> list[str]:
    check_world(run, world, record)
    metadata = {q["id"]: q["metadata"] for q in read_appended(world / "test.jsonl").records}
    support = {qid: meta["supporting_ids"] for qid, meta in metadata.items()}
    known = {qid: meta["known_hops"] for qid, meta in metadata.items() if "known_hops" in meta}
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("report.json", "report.html", "claim.json"):
        if (run / name).exists():
            shutil.copy2(run / name, dest / name)
    shutil.copytree(run / "stages", dest / "stages", dirs_exist_ok=True)
    if logs:
        for log in logs.glob(f"{run.name}*.log"):
            shutil.copy2(log, dest / log.name)
    evals = []
    # the run's first seed lies in RUN, each later one in RUN/seed<s> (`sleuth reproduce --seeds`): packed alike
    for root in [run, *sorted(p for p in run.glob("seed*") if p.is_dir())]:
        target = dest / root.relative_to(run)
        target.mkdir(parents=True, exist_ok=True)
        evals += [
            f"{root.relative_to(run) / name}".removeprefix("./")
            for name in _pack_root(root, target, support, known)
        ]
    return evals


def _pack_root(run: Path, dest: Path, support: dict, known: dict) -> list[str]:
    """One seed's evaluations (per-question rows, summaries) and RL arms (recipe, training metrics) into DEST."""
    evals = []
    for summary in sorted((run / "eval").glob("*/summary.json")):
        name = summary.parent.name
        (dest / name).mkdir(exist_ok=True)
        predictions = next(summary.parent.glob("*/predictions.jsonl"), None)
        if (
            predictions is None
        ):  # bench/gpu_claims.sh's claims.tgz leaves them out: its results_<claim>.tgz has them
            raise SystemExit(
                f"{summary.parent}: no */predictions.jsonl beside summary.json; unpack the claim's "
                f"results_<claim>.tgz (bench/gpu_claims.sh pack), which keeps them"
            )
        rows = [per_question(p, support, known) for p in read_appended(predictions).records]
        atomic_write_text(dest / name / "per_question.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        shutil.copy2(summary, dest / name / "summary.json")
        evals.append(name)
    for recipe in sorted(run.glob("*/rl_recipe.yaml")):
        arm = recipe.parent.name
        (dest / arm).mkdir(exist_ok=True)
        shutil.copy2(recipe, dest / arm / "rl_recipe.yaml")
        shutil.copy2(recipe.parent / "train" / "metrics.jsonl", dest / arm / "metrics.jsonl")
    return evals


def _mean_ci(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "mean": None, "ci": None}
    low, high = bootstrap_ci(values)
    return {"n": len(values), "mean": sum(values) / len(values), "ci": [low, high]}


def why(dest: Path) -> dict[str, Any]:
    """Per evaluation and question type: EM, retrievals, documents, supporting passages served, EM given them."""
    out: dict[str, Any] = {}
    for path in sorted(dest.glob("*/per_question.jsonl")):
        rows = read_appended(path).records
        groups: dict[str, list[dict]] = {"all": rows}
        for row in rows:
            groups.setdefault(row["dataset"], []).append(row)
        out[path.parent.name] = {
            name: {
                "em": _mean_ci([r["em"] for r in group]),
                "cover_em": _mean_ci([r["cover_em"] for r in group]),
                "retrievals": _mean_ci([float(r["retrieval_count"]) for r in group]),
                "searched": _mean_ci([float(r["retrieval_count"] > 0) for r in group]),
                "all_unknown_support_retrieved": _mean_ci(
                    [
                        float(r["unknown_support_retrieved"] == 1.0)
                        for r in group
                        if r.get("unknown_support_retrieved") is not None
                    ]
                ),
                "served_docs": _mean_ci([float(r["served_docs"]) for r in group]),
                "all_support_served": _mean_ci([float(r["support_served"] == 1.0) for r in group]),
                "all_support_retrieved": _mean_ci([float(r["support_retrieved"] == 1.0) for r in group]),
                "answer_in_served": _mean_ci([r["answer_in_served"] for r in group]),
                "em_when_all_support_served": _mean_ci(
                    [r["em"] for r in group if r["support_served"] == 1.0]
                ),
                "em_otherwise": _mean_ci([r["em"] for r in group if r["support_served"] != 1.0]),
            }
            for name, group in sorted(groups.items())
        }
    atomic_write_text(dest / "why.json", json.dumps(out, indent=1) + "\n")
    return out


def markdown(analysis: dict[str, Any]) -> str:
    def cell(stat: dict[str, Any], scale: float = 100, digits: int = 1) -> str:
        if not stat["n"]:
            return "–"
        low, high = stat["ci"]
        return f"{scale * stat['mean']:.{digits}f} [{scale * low:.{digits}f}, {scale * high:.{digits}f}] (n={stat['n']})"

    lines = [
        "| evaluation | type | EM % | non-strict EM % | retrievals | searched % | docs served | all support retrieved % "
        "| unknown hops' support retrieved % | all support served % | EM % when all served | EM % otherwise |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, groups in analysis.items():
        for kind, s in groups.items():
            lines.append(
                f"| {name} | {kind} | {cell(s['em'])} | {cell(s['cover_em'])} | {cell(s['retrievals'], 1, 2)} | "
                f"{cell(s['searched'])} | {cell(s['served_docs'], 1, 1)} | {cell(s['all_support_retrieved'])} | "
                f"{cell(s['all_unknown_support_retrieved'])} | "
                f"{cell(s['all_support_served'])} | "
                f"{cell(s['em_when_all_support_served'])} | {cell(s['em_otherwise'])} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    packing = sub.add_parser("pack", help="a claim run -> its committed result folder")
    packing.add_argument("run", type=Path, help="runs/claims/<claim>")
    packing.add_argument("dest", type=Path, help="bench/results/claims/<name>")
    packing.add_argument(
        "--world", type=Path, required=True, help="the run's world (rebuilt: checked by sha256)"
    )
    packing.add_argument(
        "--world-record",
        type=Path,
        help="claim_world.json to check --world against (default: "
        "the run's reader's or injected model's; a reused one's where the run copied none)",
    )
    packing.add_argument("--logs", type=Path, help="gpu_claims.sh's logs folder (<claim>*.log are copied)")
    packing.add_argument(
        "--adapters",
        type=int,
        metavar="SEED",
        help="also pack the decisive arms' models of this "
        "training seed (bfloat16 LoRA adapters) for `sleuth reproduce <claim> --from-committed`",
    )
    analysing = sub.add_parser("why", help="the per-question analysis of a committed result folder")
    analysing.add_argument("dest", type=Path)
    args = parser.parse_args()
    if args.command == "pack":
        print(
            f"packed {', '.join(pack(args.run, args.dest, args.world, args.logs, args.world_record))} into {args.dest}"
        )
        if args.adapters is not None:
            try:
                committed = pack_committed(args.run, args.dest, args.adapters, args.world)
            except ConfigError as err:
                raise SystemExit(f"--adapters {args.adapters}: {err}") from None
            sizes = ", ".join(
                f"{name} {m['bytes'] / 2**20:.1f} MB" for name, m in committed["packed"].items()
            )
            print(
                f"packed seed {args.adapters}'s models for --from-committed into {args.dest}/adapters: {sizes}"
            )
    else:
        print(markdown(why(args.dest)))


if __name__ == "__main__":
    main()
