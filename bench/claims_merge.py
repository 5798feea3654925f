"""Issue 42: one claim's training seeds run in two leases -> one run directory, whose report pools them all.

A claim at three seeds can outlast a lease (s3: ~150 lane-minutes on two GPUs), so its seeds run in separate leases
(`bench/gpu_claims.sh` with `CLAIMS="s3@0,1" NO_REPORT=s3`, then `CLAIMS="s3@2"`), each coming back as a run directory
(results_<claim>.tgz). `merge SRC DEST --seeds 2` copies seed 2's stage records (`<stage>.seed2.json`) and its folder
(SRC/seed2) into DEST and widens DEST/claim.json to cover it; then `sleuth reproduce <claim> --profile P --out DEST`
finds every stage done and writes the report over all seeds.

Both runs must be the same claim, profile and first seed, and their shared stages (world, reader, baselines, premise:
every stage not run per seed but the premise check, which feeds no arm) must have recorded the same results, times
aside: otherwise the seeds' arms trained on
different worlds or baselines and pooling them would mix two experiments. Both must also have been written under the
same directory (the records name absolute paths), as gpu_claims.sh does (runs/claims/<claim>).

    PYTHONPATH=src python bench/claims_merge.py merge runs/lease2/s3 runs/claims/s3 --seeds 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from sleuth.claims.base import PREMISE, seeded_name
from sleuth.claims.registry import get_claim
from sleuth.claims.stages import STAGES_DIR, read_claim_file, run_seeds
from sleuth.utils import atomic_write_json

UNCOMPARED = ("seconds",)  # how long a shared stage took differs between leases; what it produced must not


def _claim(run: Path) -> dict[str, Any]:
    held = read_claim_file(run)
    if held is None:
        raise SystemExit(f"{run}: no claim.json; pass a `sleuth reproduce` run directory")
    return {"seed": 0, **held}


def _record(run: Path, name: str) -> dict[str, Any] | None:
    path = run / STAGES_DIR / f"{name}.json"
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    return {k: v for k, v in record.items() if k not in UNCOMPARED}


def merge(src: Path, dest: Path, seeds: list[int]) -> dict[str, Any]:
    """Seeds `seeds` of the claim run SRC into the claim run DEST (see the module docstring); returns what was copied."""
    held, into = _claim(src), _claim(dest)
    for key in ("method", "profile", "seed"):
        if held[key] != into[key]:
            raise SystemExit(f"{src} and {dest} differ in {key}: {held[key]!r} vs {into[key]!r}")
    method, profile, base = held["method"], held["profile"], int(held["seed"])
    if base in seeds:
        raise SystemExit(
            f"--seeds {base}: the first seed's stages are the run's own (no .seed suffix); merge later ones"
        )
    missing = [s for s in seeds if s not in run_seeds(src)]
    if missing:
        raise SystemExit(f"{src} holds seeds {list(run_seeds(src))}, not {missing}")
    stages = get_claim(method).stages(profile)
    per_seed = [st.name for st in stages if st.per_seed]
    shared = {st.name: (_record(src, st.name), _record(dest, st.name)) for st in stages if not st.per_seed}
    differ = [name for name, (a, b) in shared.items() if None not in (a, b) and a != b]
    # the premise checks what the arms will meet and feeds none of them; measured again in another lease it may
    # sample other closed-book answers: DEST's record stands and the difference is reported, not refused
    premise_differs = PREMISE in differ
    differ = [name for name in differ if name != PREMISE]
    if differ:
        raise SystemExit(
            f"the shared stages {', '.join(differ)} recorded other results in {src} than in {dest}: the seeds "
            "trained on different worlds or baselines, so they cannot be pooled"
        )
    copied: dict[str, Any] = {"stages": [], "folders": [], "premise_differs": premise_differs}
    for seed in seeds:
        names = [seeded_name(name, seed, base) for name in per_seed]
        absent = [n for n in names if _record(src, n) is None]
        if absent:
            raise SystemExit(f"{src}: seed {seed} has not finished {', '.join(absent)}")
        clash = [n for n in names if _record(dest, n) not in (None, _record(src, n))]
        if clash:
            raise SystemExit(f"{dest} already holds other results for {', '.join(clash)}")
        for name in names:
            shutil.copy2(src / STAGES_DIR / f"{name}.json", dest / STAGES_DIR / f"{name}.json")
            copied["stages"].append(name)
        folder = f"seed{seed}"
        if (src / folder).is_dir():
            shutil.copytree(src / folder, dest / folder, dirs_exist_ok=True)
            copied["folders"].append(folder)
    count = max(max(run_seeds(dest)), *seeds) - base + 1
    atomic_write_json(dest / "claim.json", {**into, "seeds": count})
    copied["seeds"] = count
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    merging = sub.add_parser("merge", help="copy seeds of SRC into DEST")
    merging.add_argument("src", type=Path)
    merging.add_argument("dest", type=Path)
    merging.add_argument("--seeds", type=int, nargs="+", required=True, help="the training seeds to copy")
    args = parser.parse_args(argv)
    copied = merge(args.src, args.dest, args.seeds)
    if copied["premise_differs"]:
        print(
            f"note: {args.src}'s premise check measured other values than {args.dest}'s; {args.dest}'s is kept"
        )
    print(
        f"merged seeds {args.seeds} ({len(copied['stages'])} stage records, folders {copied['folders']}) into "
        f"{args.dest}; it now holds {copied['seeds']} seeds: run `sleuth reproduce` on it to write the report"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
