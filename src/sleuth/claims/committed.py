"""Check a committed claim run's verdict without a GPU (issue 42 item 5): `sleuth reproduce <claim> --from-committed`.

A committed claim run (bench/results/claims/<run>/, written by bench/claims_pack.py) holds the per-question rows of
every evaluation. Packed with `--adapters SEED`, it also holds, under ADAPTERS_DIR, what evaluating the claim's
decisive arms of that seed needs, and nothing else:
- each model a decisive evaluation loads (`Stage.loads`: the arms' final checkpoints, the trained reader, qagent's
  other reader): a LoRA adapter in bfloat16 (adapter_model.safetensors, adapter_config.json) with its searcher.json
  (method, loop options, budgets, the recipe's name); a fully fine-tuned model only when it is small (the cpu
  profile's tiny reader). Never the base model, and the tokenizer files only where they differ from the base's;
- the relabelled test split of a claim whose stage QUESTIONS relabels questions (staged);
- COMMITTED_FILE: the claim, profile and seed, the world's sha256 (it is rebuilt from its seed, and checked), the
  decisive evaluations with their committed rows, and the models by the stage result each stands for.

The check rebuilds the world, puts each model back together on the base model (the adapter cast to float32, the
tokenizer files rebuilt from the base where the pack left them out), runs each decisive evaluation stage's own code
on the first `questions` held-out questions, and computes each decisive test with the claim's stats code beside the
committed GPU numbers on the same questions (recomputed from the committed rows) and on all of them (the committed
report). The verdict on N questions is judged against the committed noise floor (one seed has none of its own).
"""

from __future__ import annotations

import hashlib
import html
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from sleuth.appendlog import read_appended
from sleuth.claims.base import QUESTIONS, ClaimRun, ClaimSpec, predictions, seeded_name
from sleuth.claims.registry import get_claim
from sleuth.claims.report import STYLE, paired_row
from sleuth.claims.reuse import world_fingerprint
from sleuth.claims.stages import read_claim_file, read_stage, run_seeds, stage
from sleuth.claims.stats import paired, paired_values, verdict_of_test
from sleuth.claims.steps import build_world
from sleuth.errors import ConfigError
from sleuth.run_layout import SEARCHER_FILE, SearcherInfo
from sleuth.utils import atomic_write_json, atomic_write_text, sha256_file

ADAPTERS_DIR = "adapters"  # DEST/adapters: the packed models of one seed and COMMITTED_FILE
COMMITTED_FILE = "committed.json"
COMMITTED_ROOT = Path("bench/results/claims")
CHECK_FILE = "check.json"  # OUT/check.json: what --from-committed measured (OUT/check.html shows it)
PACKED_DTYPE = "bfloat16"
# a fully fine-tuned model is packed only this small (the cpu profile's tiny reader); a 135M model is 270 MB
MAX_FULL_BYTES = 16 * 2**20
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
FULL_FILES = ("config.json", "generation_config.json", "model.safetensors")


def response_digest(prediction: dict[str, Any]) -> str | None:
    """sha256 of a prediction's whole decoded response (the policy's turns and what the environment inserted): two
    evaluations that decoded alike hash alike, where the answers alone (often none, from an untrained model) would not
    tell. None for a record without a trajectory."""
    text = (prediction.get("trajectory") or {}).get("response_text")
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


# -- packing (bench/claims_pack.py pack --adapters SEED) ---------------------------------------------------------


def decisive_evaluations(spec: ClaimSpec, profile: str) -> list[str]:
    """The evaluation stages the claim's decisive tests compare, in order, each once."""
    names: list[str] = []
    for test in spec.tests(profile):
        names += [n for n in (test.treated, test.baseline) if n not in names]
    return names


def decisive_loads(spec: ClaimSpec, profile: str) -> list[str]:
    """What the decisive evaluation stages load from earlier stages ("stage.key"), each once."""
    stages = {s.name: s for s in spec.stages(profile)}
    loads: list[str] = []
    for name in decisive_evaluations(spec, profile):
        for load in stages[name].loads:
            head, _, key = load.partition(".")
            if (
                not key or "/" in key
            ):  # an evaluation loads a model a stage result names, never a path under it
                raise ConfigError(
                    f"{spec.method}: stage {name} loads {load!r}, which is not a stage result's model"
                )
            if load not in loads:
                loads.append(load)
    return loads


def _recorded(run: Path, name: str) -> tuple[dict[str, Any], str | None]:
    """A stage's result (paths re-rooted under RUN) and the root it was written under."""
    result = read_stage(run, name)
    if result is None:
        raise ConfigError(
            f"{run}: stage {name} is not recorded (stages/{name}.json); pack a finished claim run"
        )
    raw = json.loads((run / "stages" / f"{name}.json").read_text())
    return result, raw.get("root")


def _source_checkpoint(model: Path, run: Path, root: str | None) -> Path:
    """A LoRA checkpoint to pack for `model`: itself, or for an exported reader (LoRA merged: the full model) the SFT
    checkpoint its reader.json names (re-rooted under RUN), when that one holds LoRA adapters."""
    info = SearcherInfo.read(model)
    record = model.parent / "reader.json"
    if info.lora or info.policy_dir != "." or not record.is_file():
        return model
    source = json.loads(record.read_text()).get("checkpoint")
    if not source:
        return model
    if root and source.startswith(root + "/"):
        source = str(run.resolve()) + source[len(root) :]
    if not (Path(source) / SEARCHER_FILE).is_file():
        raise ConfigError(
            f"{model} is an export (the full model); its checkpoint {source}, whose LoRA adapters are "
            f"what is committed, is not in {run}: unpack the run's reader checkpoints there"
        )
    return Path(source) if SearcherInfo.read(source).lora else model


def _base_tokenizer(base_model: str | None, scratch: Path) -> dict[str, Path]:
    """Where the base model's tokenizer files are: "base", its own directory, and "saved", the tokenizer as loading and
    saving it writes (a checkpoint's copy: transformers writes it back in its own form). {} for an unknown base."""
    # deferred: transformers and the model registry (its GGUF conversion) are not needed to read a committed folder
    from transformers import AutoTokenizer

    from sleuth.llm.registry import resolve_model_path

    if not base_model:
        return {}
    path = Path(resolve_model_path(base_model))
    AutoTokenizer.from_pretrained(path).save_pretrained(scratch)
    return {"base": path, "saved": scratch}


def _cast(src: Path, dest: Path, dtype: str) -> int:
    """`src`'s floating tensors as `dtype` into `dest` (safetensors); the bytes written."""
    import torch  # deferred, with safetensors' torch loader: `sleuth --help` loads neither
    from safetensors.torch import load_file, save_file

    target = getattr(torch, dtype)
    tensors = {
        k: (v.to(target) if v.is_floating_point() else v).contiguous() for k, v in load_file(src).items()
    }
    save_file(tensors, dest, metadata={"format": "pt"})
    return dest.stat().st_size


def pack_model(model: Path, dest: Path, run: Path, root: str | None) -> dict[str, Any]:
    """The checkpoint or export `model` as DEST: LoRA adapters in bfloat16 (or a small full model), searcher.json,
    and the tokenizer files that differ from the base model's. Written under a temporary name, renamed into place."""
    source = _source_checkpoint(model, run, root)
    info = SearcherInfo.read(source)
    policy = source / info.policy_dir
    if not info.lora:
        size = _parameter_bytes(policy / "model.safetensors")
        if size > MAX_FULL_BYTES:
            raise ConfigError(
                f"{source}: a fully fine-tuned model of {size / 2**20:.0f} MB in {PACKED_DTYPE} (the "
                f"limit is {MAX_FULL_BYTES / 2**20:.0f} MB); only LoRA adapters are committed: train "
                f"it with LoRA (the gpu profiles do)"
            )
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "policy").mkdir(parents=True)
    for name in ADAPTER_FILES if info.lora else FULL_FILES:
        if not (policy / name).is_file():
            if name == "generation_config.json":
                continue
            raise ConfigError(f"{policy}: {name} missing; the checkpoint is incomplete")
        if name.endswith(".safetensors"):
            _cast(policy / name, tmp / "policy" / name, PACKED_DTYPE)
        else:
            shutil.copy2(policy / name, tmp / "policy" / name)
    rebuilt = {}  # the tokenizer files left out, each rebuilt from the base model at the check
    with tempfile.TemporaryDirectory() as scratch:
        base = _base_tokenizer(info.base_model, Path(scratch))
        for name in TOKENIZER_FILES:
            here = policy / name
            if not here.is_file():
                continue
            same = next(
                (
                    kind
                    for kind, folder in base.items()
                    if (folder / name).is_file() and sha256_file(folder / name) == sha256_file(here)
                ),
                None,
            )
            if same is None:
                shutil.copy2(here, tmp / "policy" / name)
            else:
                rebuilt[name] = same
    replace(
        info,
        policy_dir="policy",
        extra={
            **info.extra,
            "packed_from": str(source.relative_to(run.resolve()))
            if source.is_relative_to(run.resolve())
            else str(source),
            "packed_dtype": PACKED_DTYPE,
            "tokenizer_from_base": rebuilt,
        },
    ).write(tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return {
        "lora": info.lora,
        "base_model": info.base_model,
        "tokenizer_from_base": rebuilt,
        "bytes": sum(p.stat().st_size for p in dest.rglob("*") if p.is_file()),
    }


def _parameter_bytes(weights: Path) -> int:
    """The bytes of a safetensors file's tensors in PACKED_DTYPE (2 a number)."""
    from safetensors import safe_open  # deferred with torch: `sleuth --help` loads neither

    with safe_open(str(weights), "pt") as f:
        names = f.keys()
        return sum(2 * math.prod(f.get_slice(k).get_shape()) for k in names)


def pack_committed(run: Path, dest: Path, seed: int, world: Path) -> dict[str, Any]:
    """DEST/ADAPTERS_DIR for `seed` of the claim run RUN (already packed into DEST by bench/claims_pack.py): the
    models the decisive evaluations load, the relabelled test split where the claim relabels, COMMITTED_FILE.
    `world`: the run's world, rebuilt and checked by the caller; its sha256 is recorded for the check to compare."""
    run = run.resolve()
    claim = read_claim_file(run)
    if claim is None:
        raise ConfigError(f"{run}: no claim.json; pass a `sleuth reproduce` run directory")
    method, profile = claim["method"], claim["profile"]
    seeds, base = run_seeds(run), int(claim.get("seed", 0))
    if seed not in seeds:
        raise ConfigError(
            f"--adapters {seed}: {run} trained seeds {', '.join(map(str, seeds))}; pick one of them"
        )
    spec = get_claim(method)
    per_seed = {s.name for s in spec.stages(profile) if s.per_seed}

    def named(stage_name: str) -> str:
        return seeded_name(stage_name, seed, base) if stage_name in per_seed else stage_name

    out = dest / ADAPTERS_DIR
    tmp = dest / (ADAPTERS_DIR + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    models: dict[str, str] = {}
    packed: dict[str, Any] = {}
    for load in decisive_loads(spec, profile):
        head, _, key = load.partition(".")
        result, root = _recorded(run, named(head))
        folder = head if key == "checkpoint" else f"{head}.{key}"
        packed[folder] = pack_model(Path(result[key]), tmp / folder, run, root)
        models[load] = folder
    evaluations = {}
    for name in decisive_evaluations(spec, profile):
        result, _ = _recorded(run, named(name))
        folder = Path(
            result["predictions"]
        ).parent.parent  # <seed root>/eval/<name>: packed as <seed root>/<name>
        rows = folder.parent.parent.relative_to(run) / folder.name / "per_question.jsonl"
        if not (dest / rows).is_file():
            raise ConfigError(
                f"{dest / rows} missing: pack the run's evaluations first (claims_pack.py pack)"
            )
        evaluations[name] = str(rows)
    questions = None
    if any(s.name == QUESTIONS for s in spec.stages(profile)):
        result, _ = _recorded(run, QUESTIONS)
        (tmp / QUESTIONS).mkdir()
        shutil.copy2(Path(result["questions"]) / "test.jsonl", tmp / QUESTIONS / "test.jsonl")
        questions = QUESTIONS
    committed = {
        "claim": method,
        "profile": profile,
        "seed": seed,
        "dtype": PACKED_DTYPE,
        "packed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "world": {"seed": 0, "files": world_fingerprint(world)},
        "evaluations": evaluations,
        "models": models,
        "packed": packed,
        "questions": questions,
    }
    atomic_write_json(tmp / COMMITTED_FILE, committed)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return committed


# -- the check (sleuth reproduce <claim> --from-committed) ------------------------------------------------------


def _read_committed(folder: Path) -> dict[str, Any] | None:
    path = folder / ADAPTERS_DIR / COMMITTED_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def newest_committed(method: str, root: Path = COMMITTED_ROOT) -> Path:
    """The newest committed gpu run of `method` under ROOT packed with adapters; a ConfigError listing what exists."""
    runs, packed = [], []
    for claim_file in sorted(root.glob("*/claim.json")):
        if json.loads(claim_file.read_text()).get("method") != method:
            continue
        runs.append(claim_file.parent.name)
        committed = _read_committed(claim_file.parent)
        if committed is not None and committed["profile"] == "gpu":
            packed.append((committed["packed_at"], claim_file.parent))
    if not packed:
        held = ", ".join(runs) if runs else "none"
        raise ConfigError(
            f"{root}: no committed gpu run of {method} holds adapters ({ADAPTERS_DIR}/"
            f"{COMMITTED_FILE}); committed runs of {method}: {held}. Pack one with `python "
            f"bench/claims_pack.py pack RUN DEST --world W --adapters SEED`, or pass a packed folder: "
            f"--from-committed DIR"
        )
    return max(packed)[1]


def materialize(packed: Path, dest: Path) -> Path:
    """A packed model as a checkpoint `load_searcher` loads: its tensors in float32 (the evaluation's precision on a
    CPU), the base model's tokenizer files where the pack left them out. Redone only when missing."""
    if (dest / SEARCHER_FILE).is_file():
        return dest
    info = SearcherInfo.read(packed)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(packed, tmp)
    for weights in (tmp / info.policy_dir).glob("*.safetensors"):
        _cast(packed / info.policy_dir / weights.name, weights, "float32")
    with tempfile.TemporaryDirectory() as scratch:
        base = _base_tokenizer(info.base_model, Path(scratch))
        for name, kind in info.extra.get("tokenizer_from_base", {}).items():
            shutil.copy2(base[kind] / name, tmp / info.policy_dir / name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(dest)
    return dest


def committed_records(path: Path) -> dict[str, dict[str, Any]]:
    """A committed evaluation's per-question rows as the prediction records the claim's tests read, by id: the
    metrics (rows written before they were carried: from the row's em, cover_em and f1) and the agent's own answer
    where a reader answered for it (extra.agent_answer)."""
    records = {}
    for row in read_appended(path).records:
        metrics = row.get("metrics") or {k: row[k] for k in ("em", "cover_em", "f1")}
        extra = {"agent_answer": row["agent_answer"]} if "agent_answer" in row else {}
        records[row["id"]] = {**row, "metrics": metrics, "extra": extra}
    return records


def committed_table(folder: Path) -> dict[str, Any]:
    """The claim table of a committed run's first seed recomputed from its committed rows alone (every evaluation
    stage's rows: <eval name>/per_question.jsonl), by the claim's own `table`: what the rows must carry for the
    committed report to be checked from them."""
    claim = json.loads((folder / "claim.json").read_text())
    spec, profile = get_claim(claim["method"]), claim["profile"]
    run = ClaimRun(out=folder, spec=spec, profile_name=profile, profile=spec.profile(profile))
    for st in spec.stages(profile):
        rows = folder / st.name.removeprefix("eval_") / "per_question.jsonl"
        if st.name.startswith("eval_") and rows.is_file():
            run.results[st.name] = {"predictions": str(rows)}
            run.read_predictions[str(rows)] = committed_records(rows)  # `predictions` reads them from here
    return spec.table(run)


def _check_out(out: Path, folder: Path, questions: int) -> None:
    """OUT holds one check (a committed folder at a number of questions): another one is refused, a rerun resumes."""
    wanted = {"committed": str(folder.resolve()), "questions": questions}
    marker = out / "check_of.json"
    if marker.is_file():
        held = json.loads(marker.read_text())
        if held != wanted:
            raise ConfigError(
                f"{out} holds the check of {held['committed']} on {held['questions']} questions; give "
                f"another --out, or the same folder and --questions to resume it"
            )
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(marker, wanted)


def passive_openmp_waits() -> bool:
    """Let OpenMP's idle threads sleep instead of spinning (OMP_WAIT_POLICY=PASSIVE, unless the caller set a policy),
    where torch is not loaded yet (OpenMP reads it when torch loads); True where it took effect. The CPU decode engine
    hands each layer's attention rows to a worker thread while torch runs on one thread, and the spinning OpenMP
    thread took the worker's core: both r_search arms on 100 questions, 2 threads, took 594-611 s spinning and 469 s
    passive (bench/results/from_committed_cpu_engine.json), with the same responses."""
    if "torch" in sys.modules:
        return False
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return True


def check_committed(
    method: str, folder: Path | None, out: Path, questions: int = 100, console: Any = None
) -> Path:
    """Evaluate the committed adapters of `method`'s decisive arms on the first `questions` held-out questions on
    this machine; returns OUT/check.html (OUT/check.json beside it)."""
    passive_openmp_waits()  # first: nothing may load torch before it
    spec = get_claim(method)
    folder = newest_committed(method) if folder is None else folder
    committed = _read_committed(folder)
    if committed is None:
        raise ConfigError(
            f"--from-committed {folder}: no {ADAPTERS_DIR}/{COMMITTED_FILE} there; pack the run with "
            f"`python bench/claims_pack.py pack RUN {folder} --world W --adapters SEED`"
        )
    if committed["claim"] != method:
        raise ConfigError(f"--from-committed {folder}: a run of the {committed['claim']} claim, not {method}")
    if questions < 1:
        raise ConfigError(f"--questions {questions}: give at least 1 held-out question")
    out = out.resolve()
    _check_out(out, folder, questions)
    seed, profile_name = int(committed["seed"]), committed["profile"]
    stages = {s.name: s for s in spec.stages(profile_name)}
    run = ClaimRun(
        out=out,
        spec=spec,
        profile_name=profile_name,
        profile=replace(spec.profile(profile_name), test_questions=questions),
        console=console,
        base_seed=seed,
        seed=seed,
        seeds=(seed,),
        per_seed=frozenset(n for n, s in stages.items() if s.per_seed),
    )
    run.results["world"] = stage(out, "world", lambda: build_world(run.world, run.profile), console)
    differ = [
        n for n, sha in world_fingerprint(run.world).items() if committed["world"]["files"].get(n) != sha
    ]
    if differ:
        raise ConfigError(
            f"{run.world}: the rebuilt world's {', '.join(differ)} differ from the committed run's "
            f"({folder / ADAPTERS_DIR / COMMITTED_FILE}): this sleuth builds another world from the "
            f"{profile_name} profile; check out the commit the run was made with"
        )
    packed = folder / ADAPTERS_DIR
    for load, name in committed["models"].items():
        head, _, key = load.partition(".")
        run.results.setdefault(head, {})[key] = str(materialize(packed / name, out / "models" / name))
    if committed.get("questions"):
        labels = out / QUESTIONS
        labels.mkdir(exist_ok=True)
        shutil.copy2(packed / committed["questions"] / "test.jsonl", labels / "test.jsonl")
        run.results[QUESTIONS] = {"questions": str(labels)}
    # deferred: the model code loads torch; `sleuth --help` imports this module
    from sleuth.llm.hf import cpu_cache, cpu_dtype, native_cpu_bf16

    # a GPU run decoded in bf16 (the decode engine's copy): on a CPU that computes bf16 natively, so does the
    # check (closer to the run, and ~2.6x faster than float32); a CPU run, or a CPU without it, in float32. The
    # engine decodes here too: it prefills only each turn's new tokens, where the dynamic cache encoded every turn's
    # whole context again (bench/from_committed_timing.py)
    dtype = "bfloat16" if profile_name == "gpu" and native_cpu_bf16() else None
    start = time.perf_counter()
    with cpu_dtype(dtype), cpu_cache("engine"):
        for name in committed["evaluations"]:
            run.results[name] = stage(out, name, lambda name=name: stages[name].run(run), console)
    seconds = time.perf_counter() - start
    check = compare(run, folder, committed)
    check["evaluation_seconds"] = seconds  # 0-ish on a resumed check: its evaluations were recorded
    check["cpu_dtype"] = dtype or "float32"
    atomic_write_json(out / CHECK_FILE, check)
    page = out / "check.html"
    atomic_write_text(page, check_html(check))
    return page


def compare(run: ClaimRun, folder: Path, committed: dict[str, Any]) -> dict[str, Any]:
    """Each decisive test on this machine's evaluations, and on the committed rows of the same questions; beside them
    the committed report's numbers for the seed on every question and pooled over seeds; how often this machine's
    answers are the committed ones."""
    report = json.loads((folder / "report.json").read_text()) if (folder / "report.json").is_file() else {}
    reported = {t["row"]: t for t in report.get("table", {}).get("seeds", {}).get("tests", [])}
    here = {name: predictions(run, name) for name in committed["evaluations"]}
    there = {name: committed_records(folder / rows) for name, rows in committed["evaluations"].items()}
    same = {name: {i: there[name][i] for i in here[name] if i in there[name]} for name in here}
    missing = {
        name: sorted(set(here[name]) - set(same[name]))[:3]
        for name in here
        if len(same[name]) < len(here[name])
    }
    if missing:
        raise ConfigError(
            f"{folder}: the committed rows lack questions this check answered ({missing}); the "
            f"committed evaluation ran on fewer questions than --questions"
        )
    tests = []
    for test in run.spec.tests(run.profile_name):
        full = reported.get(test.row)
        seed_row = next((r for r in (full or {}).get("per_seed", []) if r["seed"] == committed["seed"]), None)
        floor = (full or {}).get("floor")
        cpu = paired(*paired_values(here[test.treated], here[test.baseline], test.value, keep=test.keep))
        gpu = paired(*paired_values(same[test.treated], same[test.baseline], test.value, keep=test.keep))
        verdicts = {}
        for side, row in (("here", cpu), ("committed_same_questions", gpu)):
            verdicts[side] = (
                verdict_of_test(
                    row["diff"],
                    row["ci"],
                    test.side,
                    test.threshold,
                    None if floor is None else floor["diff"],
                )
                if row["n"]
                else ("not shown", "no question to compare")
            )
        tests.append(
            {
                "row": test.row,
                "treated": test.treated,
                "baseline": test.baseline,
                "side": test.side,
                "threshold": test.threshold,
                "points": test.points,
                "here": cpu,
                "committed_same_questions": gpu,
                "committed_seed": seed_row,
                "committed_pooled": None if full is None else {**full["pooled"], "verdict": full["verdict"]},
                "noise_floor": floor,
                "verdict_here": verdicts["here"][0],
                "why_here": verdicts["here"][1],
                "verdict_committed_same_questions": verdicts["committed_same_questions"][0],
            }
        )
    agreement = {
        name: {
            "n": len(here[name]),
            "same_prediction": sum(
                here[name][i]["prediction"] == same[name][i]["prediction"] for i in here[name]
            ),
            "same_em": sum(
                here[name][i]["metrics"]["em"] == same[name][i]["metrics"]["em"] for i in here[name]
            ),
            # rows packed before the digest was carried have none: not compared (None)
            "same_response": sum(
                response_digest(here[name][i]) == same[name][i]["response_sha256"] for i in here[name]
            )
            if all("response_sha256" in same[name][i] for i in here[name])
            else None,
        }
        for name in here
    }
    try:
        rows = committed_table(folder)["rows"]
        reproduced = rows == report.get("table", {}).get("rows")
    except (KeyError, ConfigError):  # a committed folder without every evaluation's rows (an older run's)
        reproduced = None
    return {
        "claim": run.spec.method,
        "committed": str(folder),
        "profile": run.profile_name,
        "committed_rows_reproduce_report": reproduced,
        "seed": committed["seed"],
        "questions": run.profile.test_questions,
        "tests": tests,
        "agreement": agreement,
        "committed_verdict": report.get("verdict"),
    }


def _line(label: str, row: dict[str, Any] | None, points: bool, verdict: str = "") -> str:
    """One console row: a paired row (`sleuth.claims.stats.paired`) or a pooled one (no means: seeds instead of n)."""
    if not row or row.get("diff") is None:
        return f"  {label:<46} -"
    scale = 100 if points else 1
    means = (
        f"{scale * row['a']:8.2f} {scale * row['b']:8.2f}" if row.get("a") is not None else f"{'':>8} {'':>8}"
    )
    lo, hi = row["ci"]
    count = row["n"] if "n" in row else f"{row['seeds']} seed{'s' if row['seeds'] > 1 else ''}"
    return (
        f"  {label:<46} {count!s:>5} {means} {scale * row['diff']:+8.2f} [{scale * lo:+.2f}, {scale * hi:+.2f}]"
        f"  {verdict}"
    ).rstrip()


def check_text(check: dict[str, Any]) -> str:
    """The console's table: each decisive test here, committed on the same questions, committed on all of them."""
    lines = [
        f"{check['claim']} claim, committed run {check['committed']} (seed {check['seed']}), "
        f"first {check['questions']} held-out questions"
    ]
    for t in check["tests"]:
        unit = "points" if t["points"] else "per question"
        lines.append(
            f"{t['row']}: {t['treated']} minus {t['baseline']}, claimed {t['side']} "
            f"{t['threshold']:+g} ({unit})"
        )
        lines.append(f"  {'':<46} {'n':>5} {'treated':>8} {'baseline':>8} {'diff':>8} 95% interval  verdict")
        lines.append(_line("this machine, committed adapters", t["here"], t["points"], t["verdict_here"]))
        lines.append(
            _line(
                "committed run, the same questions",
                t["committed_same_questions"],
                t["points"],
                t["verdict_committed_same_questions"],
            )
        )
        lines.append(
            _line(f"committed run, seed {check['seed']}, every question", t["committed_seed"], t["points"])
        )
        pooled = t["committed_pooled"]
        if pooled is not None:
            lines.append(_line("committed run, pooled over seeds", pooled, t["points"], pooled["verdict"]))
    same = ", ".join(f"{name} {a['same_prediction']}/{a['n']}" for name, a in check["agreement"].items())
    lines.append(f"answers identical to the committed run's: {same}")
    if all(a["same_response"] is not None for a in check["agreement"].values()):
        decoded = ", ".join(f"{name} {a['same_response']}/{a['n']}" for name, a in check["agreement"].items())
        lines.append(f"whole responses decoded identically: {decoded}")
    reproduced = {True: "yes", False: "NO", None: "not checked (rows missing)"}[
        check["committed_rows_reproduce_report"]
    ]
    lines.append(f"the committed rows give the committed report's claim table: {reproduced}")
    lines.append(
        "verdicts here and on the same questions use the committed noise floor; the committed claim "
        f"verdict (every question, pooled over seeds): {check['committed_verdict']}"
    )
    return "\n".join(lines)


def check_html(check: dict[str, Any]) -> str:
    parts = []
    for t in check["tests"]:
        pct = t["points"]
        rows = [
            paired_row("this machine, committed adapters", t["here"], pct),
            paired_row("committed run, the same questions", t["committed_same_questions"], pct),
        ]
        if t["committed_seed"] is not None:
            rows.append(
                paired_row(f"committed run, seed {check['seed']}, every question", t["committed_seed"], pct)
            )
        pooled = t["committed_pooled"]
        if pooled is not None:
            rows.append(
                paired_row(
                    f"committed run, pooled over {pooled['seeds']} seed(s): {html.escape(pooled['verdict'])}",
                    {"n": "", "a": None, "b": None, "diff": pooled["diff"], "ci": pooled["ci"]},
                    pct,
                )
            )
        parts.append(
            f"<table><caption>{html.escape(t['row'])}: {html.escape(t['treated'])} minus "
            f"{html.escape(t['baseline'])} (claimed {t['side']} {t['threshold']:+g}); here: "
            f"{html.escape(t['verdict_here'])}</caption><tr><th>evaluation</th><th>n</th><th>treated</th>"
            "<th>baseline</th><th>difference</th><th>95% interval</th></tr>" + "".join(rows) + "</table>"
        )
    agreement = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{a['n']}</td><td>{a['same_prediction']}</td>"
        f"<td>{a['same_em']}</td><td>{'-' if a['same_response'] is None else a['same_response']}</td>"
        "</tr>"
        for name, a in check["agreement"].items()
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(check['claim'])}: committed "
        f"adapters checked</title><style>{STYLE}</style></head><body><header><h1>{html.escape(check['claim'])}: "
        f"the committed arms evaluated again</h1><div class='sub'>{html.escape(check['committed'])}, seed "
        f"{check['seed']}, first {check['questions']} held-out questions</div></header><main><section>"
        + "".join(parts)
        + "<table><caption>answers identical to the committed run's</caption><tr><th>evaluation"
        "</th><th>n</th><th>same answer</th><th>same EM</th><th>same whole response</th></tr>"
        + agreement
        + "</table><p class='note'>"
        f"The committed claim verdict (every question, pooled over seeds): "
        f"{html.escape(str(check['committed_verdict']))}.</p></section></main></body></html>\n"
    )
