"""Tree-GRPO's claim (2509.21240) as a measure: tree rollouts give more trajectories, with fewer tool calls each,
for the same generated tokens as plain GRPO rollouts.

    # CPU check (tiny model, a minute):
    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/tree_grpo_budget.py --model tiny --questions 4
    # GPU, a real model on the decode engine (branches continue from their parent's keys/values):
    PYTHONPATH=src python bench/tree_grpo_budget.py --model DIR --loop search_r1 --questions 64 --cache engine \
        --max-turns 4 --new-tokens 256

The same questions are rolled out twice with the same sampling: plain GRPO (`--n` chains per question,
`sleuth.agent.engine.rollout`) and Tree-GRPO (`--trees` chains, then `--expansions` rounds forking `--branches`
turn boundaries per tree, `rollout_tree`). Each is counted by `plugins/sleuth_tree_grpo.budget_counts`: the policy
tokens actually decoded (a branch's tokens before its fork are its parent's), the policy's searches actually run,
the trajectories; the rates per 1,000 generated tokens put the two at an equal token budget, and "at GRPO's
budget" is how many trajectories and tool calls the tree would give for the tokens GRPO spent. The paper's
numbers: about 1.5x the trajectories and half the tool calls per trajectory at the same budget.

`--loop rehearsal` (default; bench/sleuth_rehearsal.py: a turn without an action searches with the question, and a
trajectory ends after 1-4 turns drawn from its question and sample) gives an untrained or random-weight model
searches to count; a trained model uses `--loop search_r1`. Prints a table and writes JSON (`--out`, else
$OUT/tree_grpo_budget_<device>.json, else bench/results/).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))
import _common  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny, random:<arch>, a hub alias or a model directory")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument(
        "--cache",
        default=None,
        choices=["dynamic", "static", "engine"],
        help="HFGenerator cache (default: engine on CUDA, dynamic on CPU)",
    )
    p.add_argument("--loop", default="rehearsal", choices=["rehearsal", "search_r1"])
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--n", type=int, default=4, help="GRPO: chains per question")
    p.add_argument("--trees", type=int, default=2, help="Tree-GRPO: M chains per question")
    p.add_argument("--expansions", type=int, default=1, help="Tree-GRPO: L expansion rounds")
    p.add_argument("--branches", type=int, default=2, help="Tree-GRPO: N nodes forked per tree and round")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32, help="max new tokens per turn")
    p.add_argument("--max-obs-tokens", type=int, default=128)
    p.add_argument("--max-response-tokens", type=int, default=2048)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--passages", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    _common.require_positive(
        args,
        "questions",
        "n",
        "trees",
        "branches",
        "max_turns",
        "new_tokens",
        "max_obs_tokens",
        "max_response_tokens",
        "passages",
    )
    if args.expansions < 0:
        raise SystemExit("--expansions must be >= 0")
    return args


def measure(label: str, roll: Any, budget_counts: Any, device: str) -> dict[str, Any]:
    t0 = _common.timer(device)
    trajs = roll()
    wall = _common.timer(device) - t0
    counts = budget_counts(trajs)
    print(
        f"  {label}: {int(counts['trajectories'])} trajectories, {int(counts['generated_tokens'])} tokens, "
        f"{int(counts['tool_calls'])} tool calls ({wall:.1f} s)",
        flush=True,
    )
    return {"rollout": label, **counts, "wall_s": wall}


def compare(grpo: dict[str, Any], tree: dict[str, Any]) -> None:
    """The tree's counts at GRPO's generated-token budget, and its rates over GRPO's."""
    scale = grpo["generated_tokens"] / tree["generated_tokens"] if tree["generated_tokens"] else float("nan")
    tree["trajectories_at_grpo_budget"] = tree["trajectories"] * scale
    tree["tool_calls_at_grpo_budget"] = tree["tool_calls"] * scale
    grpo["trajectories_at_grpo_budget"], grpo["tool_calls_at_grpo_budget"] = (
        grpo["trajectories"],
        grpo["tool_calls"],
    )
    for key in ("trajectories_per_1k_tokens", "tool_calls_per_1k_tokens", "tool_calls_per_trajectory"):
        tree[f"{key}_vs_grpo"] = tree[key] / grpo[key] if grpo[key] else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch
    from sleuth_tree_grpo import budget_counts

    import sleuth_rehearsal
    from sleuth.agent import get_loop
    from sleuth.agent.engine import RolloutBudget, TreeSpec, rollout, rollout_tree
    from sleuth.llm.base import SamplingParams
    from sleuth.llm.hf import HFGenerator
    from sleuth.retrieval.index import load_retriever

    device = _common.pick_device(args.device)
    dtype = _common.pick_dtype(args.dtype, device)
    cache = args.cache or ("engine" if device.startswith("cuda") else "dynamic")
    env = _common.environment(device)
    model, tokenizer, model_info = _common.build_model(args.model, args.tokenizer, device, dtype)
    generator = HFGenerator(model, tokenizer=tokenizer, device=device, cache=cache)
    if args.loop == "rehearsal":
        loop = sleuth_rehearsal.RehearsalLoop(
            max_turns=args.max_turns,
            forced_final_answer=False,
            turns_drawn=tuple(range(1, args.max_turns + 1)),
        )
    else:
        loop = get_loop("search_r1", max_turns=args.max_turns)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature)
    budget = RolloutBudget(max_obs_tokens=args.max_obs_tokens, max_response_tokens=args.max_response_tokens)
    spec = TreeSpec(trees=args.trees, expansions=args.expansions, branches=args.branches, seed=args.seed)
    print(
        f"device: {env['card']} ({device}), model {model_info['source']}, cache {cache}, loop {loop.name}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="sleuth-bench-tree-") as tmp:
        world = _common.build_world(Path(tmp) / "world", args.passages, args.questions)
        retriever = load_retriever(world["index"])
        examples = [world["examples"][i % len(world["examples"])] for i in range(args.questions)]
        torch.manual_seed(args.seed)
        grpo = measure(
            f"grpo (n={args.n})",
            lambda: rollout(loop, generator, retriever, examples, params, n=args.n, budget=budget),
            budget_counts,
            device,
        )
        torch.manual_seed(args.seed)
        engine = generator.engine if cache == "engine" else None
        reused = engine.reused_tokens if engine is not None else 0
        tree = measure(
            f"tree (M={args.trees}, L={args.expansions}, N={args.branches})",
            lambda: rollout_tree(loop, generator, retriever, examples, params, spec, budget=budget),
            budget_counts,
            device,
        )
        if engine is not None:
            tree["prefix_tokens_reused"] = engine.reused_tokens - reused
    compare(grpo, tree)
    rows = [grpo, tree]
    result = {
        "bench": "tree_grpo_budget",
        "environment": env,
        "model": model_info,
        "settings": dict(vars(args))
        | {"device": device, "dtype": dtype, "cache": cache, "loop_name": loop.name},
        "rows": rows,
        "modules_loaded": _common.watched_modules_loaded(),
    }
    columns = [
        ("rollout", "rollout"),
        ("trajectories", "traj"),
        ("generated_tokens", "gen tokens"),
        ("tool_calls", "tool calls"),
        ("trajectories_per_1k_tokens", "traj / 1k tok"),
        ("tool_calls_per_1k_tokens", "calls / 1k tok"),
        ("tool_calls_per_trajectory", "calls / traj"),
        ("trajectories_at_grpo_budget", "traj at GRPO budget"),
        ("tool_calls_at_grpo_budget", "calls at GRPO budget"),
        ("trajectories_per_1k_tokens_vs_grpo", "traj/tok vs GRPO"),
        ("tool_calls_per_trajectory_vs_grpo", "calls/traj vs GRPO"),
        ("wall_s", "wall s"),
    ]
    notes = [
        f"{args.model} ({dtype}, {cache}) | {args.questions} questions, loop {loop.name}, <= {args.max_turns} "
        f"turns x {args.new_tokens} new tokens, temperature {args.temperature}",
        "generated tokens: decoded by the policy (a branch's shared prefix counted once, in its parent); "
        "tool calls: the policy's searches run",
        "paper (2509.21240): ~1.5x trajectories per token, ~0.5x tool calls per trajectory",
    ]
    _common.print_table("Tree-GRPO vs GRPO rollouts at an equal generated-token budget", columns, rows, notes)
    out = _common.out_path(args.out, f"tree_grpo_budget_{device.split(':')[0]}.json")
    _common.write_json(out, result)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
