"""Claim bundles: a `sleuth reproduce` run carried from one lent GPU machine to the next (issue 25).

A lease holds a machine for a limited time and a claim's GPU profile runs longer, so each lease must go on
where the last one stopped. `pack` writes what the stages still to run need as one gzipped tar cut into parts
of at most `--part-mib`, with an index, bundle.json, of every part's size and sha256. `send` copies the index
and the parts not yet sent into $OUT within a call's limits (`CallLimits`: the files and bytes a call hands
back and carries in; the lender's numbers are arguments, given by bench/gpu_claims.sh, and sleuth names none); `take` gathers them on the development machine into the carried folder;
`restore` joins and checks them on the next machine and lays each claim out again under its run directory.

A claim's bundle holds, from its run directory OUT:
  - OUT/claim.json, the stage records (OUT/stages/*.json) and every small output: the evaluations (the
    predictions the report pairs), reports, metrics, recipes;
  - the checkpoints the stages still to run load (`sleuth.claims.runner.stage_plan`) without their optimizer and
    RNG state (state.pt): init_from and evaluation read only policy/ and searcher.json, and a finished run is
    not resumed. With LoRA (every gpu profile) policy/ holds the adapters only;
  - the newest checkpoint of each run a stage was still training, whole (resuming needs state.pt), with the
    run's SFT data, so a run longer than a lease goes on where it stopped.
It leaves out what is rebuilt on restore and checked against the sha256 the index keeps:
  - the world (questions, corpus, BM25 index), regenerated from its seed; a mismatch fails the claim's
    restore (the records would pair answers to other questions) and the claim starts again;
  - an exported reader: a merged model (SmolLM2-135M: 540 MB in float32) that no call could carry, exported
    again from its SFT checkpoint (carried: adapters); a mismatch (a merge rounded differently on another
    CPU) is written to OUT/restored.json and the claim goes on.
Rollouts, finished runs' SFT data and older checkpoints stay behind: no stage still to run reads them.

Paths: stage records keep the directory they were written in (`sleuth.claims.stages`); restore re-roots every
JSON file outside the checkpoints from the packed OUT to the new one (the records, injected.json, reader.json).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import sys
import tarfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from sleuth.claims.reuse import WORLD_RECORD, write_world_record
from sleuth.claims.runner import claim_profile, stage_plan
from sleuth.claims.stages import LOCKS_DIR, STAGES_DIR, finished_stages, read_claim_file, reroot, run_seeds
from sleuth.claims.steps import build_world
from sleuth.errors import SleuthError
from sleuth.run_layout import CHECKPOINTS, LATEST, SEARCHER_FILE, TRAINING_STATE, latest_checkpoint
from sleuth.utils import atomic_write_json, link_or_copy, sha256_file, tree_bytes

FORMAT = "sleuth-claim-bundle/1"
INDEX = "bundle.json"
PART_PREFIX = "bundle."
MIB = 1 << 20
RESTORED = "restored.json"
WORLD_UNCHECKED = ("bm25/manifest.json",)  # the index's build time and corpus path: the rest is bit-identical
EXPORT_UNCHECKED = (SEARCHER_FILE,)  # names the checkpoint it came from: where it now is
SKIPPED_DIRS = ("rollouts",)  # per-step rollout dumps: read by people, never by a later stage


class BundleError(SleuthError):
    """A bundle that cannot be packed or restored: the message names the file and what is wrong."""


@dataclass(frozen=True)
class CallLimits:
    """What one call of a machine lender hands back (`out_files` files, `out_bytes` in all) and carries in
    (`carry_bytes`, the working tree counted); the lender's, given by the caller (bench/gpu_claims.sh)."""

    out_files: int
    out_bytes: int
    carry_bytes: int

    def __post_init__(self) -> None:
        if min(self.out_files, self.out_bytes, self.carry_bytes) < 1:
            raise BundleError(f"call limits must be positive, got {self}")


def _read_json(path: Path) -> Any:
    """A JSON file's content, or None where there is no such file."""
    return json.loads(path.read_text()) if path.is_file() else None


def _digests(folder: Path, unchecked: Iterable[str] = ()) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): sha256_file(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.relative_to(folder).as_posix() not in unchecked
    }


def _is_export(folder: Path) -> bool:
    """A reader or searcher exported as a model directory (searcher.json with policy_dir ".")."""
    info = folder / SEARCHER_FILE
    return info.is_file() and json.loads(info.read_text()).get("policy_dir") == "."


def _under(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


class _Claim:
    """One run directory's bundle: the files to carry (archive name -> file) and what the index says of it."""

    def __init__(self, out: Path) -> None:
        self.out, self.root = out, out.resolve()
        claim = read_claim_file(out)
        if claim is None:
            raise BundleError(f"{out}: no claim.json; not a run directory of `sleuth reproduce`")
        self.method, self.profile = claim["method"], claim["profile"]
        self.plan = stage_plan(self.method, self.profile, run_seeds(out))
        self.done = finished_stages(out)
        self.roots: set[str] = set()
        self.results = {s: self._result(s) for s in self.done}
        self.files: dict[str, Path] = {}
        self.checkpoints: dict[str, str] = {}
        self.rebuild: list[dict[str, Any]] = []
        self.missing: list[str] = []
        self.file_bytes = 0

    def _result(self, name: str) -> dict[str, Any]:
        record = json.loads((self.out / STAGES_DIR / f"{name}.json").read_text())
        old = record.get("root") or str(self.root)
        self.roots.add(old)
        return reroot(record["result"], old, str(self.root))

    def here(self, value: str) -> Path:
        """A path a record or searcher.json names, moved from where it was written to where OUT is now."""
        for old in self.roots:
            value = reroot(value, old, str(self.root))
        return Path(value)

    def select(self) -> _Claim:
        pending = [s for s in self.plan if s not in self.done]
        needed = [
            self._needed(ref) for s in pending for ref in self.plan[s] if self._stage_of(ref) in self.done
        ]
        referenced = [self.here(v) for r in self.results.values() for v in _strings(r) if v.startswith("/")]
        for path in dict.fromkeys(p for p in needed if p is not None):
            if _is_export(path):
                source = self.here(json.loads((path / SEARCHER_FILE).read_text())["exported_from"])
                self._add_checkpoint(source, whole=False)
                self.rebuild.append(
                    {
                        "kind": "export",
                        "dir": self._rel(path),
                        "source": self._rel(source),
                        "files": _digests(path, EXPORT_UNCHECKED),
                        # the record as it was (its world and training settings), written back after the export
                        "record": _read_json(path / WORLD_RECORD),
                    }
                )
            else:
                self._add_checkpoint(path, whole=False)
        exports = [p for p in referenced if p.is_dir() and _is_export(p)]
        referenced += [
            self.here(json.loads((p / SEARCHER_FILE).read_text())["exported_from"]) for p in exports
        ]
        sft_data = self._sft_data()
        for run in self._runs():
            if not any(p == run or _under(p, run / CHECKPOINTS) for p in referenced):
                self._in_flight(run, sft_data)
        if "world" in self.done and (self.out / "world").is_dir():
            self.rebuild.insert(
                0, {"kind": "world", "dir": "world", "files": _digests(self.out / "world", WORLD_UNCHECKED)}
            )
        self._small_files(sft_data)
        self.file_bytes = sum(f.stat().st_size for f in self.files.values())
        return self

    def _stage_of(self, ref: str) -> str:
        """The stage a load names: "sft_s3.sft_checkpoint" -> sft_s3, a later seed's "sft_s3.seed1.sft_checkpoint"
        -> sft_s3.seed1 (the longest leading part that is one of the claim's stages)."""
        parts = ref.split("/")[0].split(".")
        for cut in range(len(parts) - 1, 0, -1):
            if ".".join(parts[:cut]) in self.plan:
                return ".".join(parts[:cut])
        return parts[0]

    def _needed(self, ref: str) -> Path | None:
        name = self._stage_of(ref)
        key, _, sub = ref[len(name) + 1 :].partition("/")
        path = Path(self.results[name][key]) / sub if sub else Path(self.results[name][key])
        if not path.exists():
            self.missing.append(self._rel(path))  # pruned or deleted: the stage that loads it will say so
            return None
        return path

    def _rel(self, path: Path) -> str:
        if not _under(path, self.root):
            raise BundleError(
                f"{path}: a stage still to run loads it, and it lies outside {self.root}; a bundle "
                "carries only what is under the run directory"
            )
        return path.relative_to(self.root).as_posix()

    def _add(self, path: Path) -> None:
        self.files[self._rel(path)] = path

    def _add_checkpoint(self, ckpt: Path, whole: bool) -> None:
        if self.checkpoints.get(self._rel(ckpt)) == "whole":
            return
        self.checkpoints[self._rel(ckpt)] = "whole" if whole else "without optimizer state"
        for f in sorted(ckpt.rglob("*")):
            if f.is_file() and (whole or f.name != TRAINING_STATE):
                self._add(f)

    def _runs(self) -> list[Path]:
        """Every training run under OUT: a directory holding checkpoints/step_*."""
        return sorted(c.parent for c in self.root.rglob(CHECKPOINTS) if c.is_dir() and any(c.glob("step_*")))

    def _sft_data(self) -> dict[Path, Path]:
        """Each SFT run's data file (its checkpoints' searcher.json names it): run directory -> data."""
        data = {}
        for info in self.root.rglob(f"{CHECKPOINTS}/step_*/{SEARCHER_FILE}"):
            named = json.loads(info.read_text()).get("data")
            if named:
                data[info.parent.parent.parent] = self.here(named)
        return data

    def _in_flight(self, run: Path, sft_data: dict[Path, Path]) -> None:
        """A run no finished stage names: its stage was cut short; carry what resuming it reads."""
        ckpt = latest_checkpoint(run)
        if ckpt is None:
            return
        self._add_checkpoint(ckpt, whole=True)
        if (run / CHECKPOINTS / LATEST).is_file():
            self._add(run / CHECKPOINTS / LATEST)
        data = sft_data.get(run)
        if data is not None and data.is_file() and _under(data, self.root):
            self._add(data)

    def _small_files(self, sft_data: dict[Path, Path]) -> None:
        """Every other file but the world, checkpoints, exports, rollouts and SFT data (added above if needed);
        the stage records are those read at the start, so the bundle never holds a record without its files."""
        skipped = {self.root / "world", self.root / STAGES_DIR, self.root / LOCKS_DIR, *sft_data.values()}
        exports = {p.parent for p in self.root.rglob(SEARCHER_FILE) if _is_export(p.parent)}
        for f in sorted(self.root.rglob("*")):
            if not f.is_file() or f in skipped or any(_under(f, d) for d in skipped | exports):
                continue
            parts = f.relative_to(self.root).parts
            if CHECKPOINTS in parts[:-1] or any(d in parts[:-1] for d in SKIPPED_DIRS):
                continue
            self._add(f)
        for name in self.done:
            self._add(self.root / STAGES_DIR / f"{name}.json")

    def info(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "profile": self.profile,
            "root": str(self.root),
            "done": self.done,
            "pending": [s for s in self.plan if s not in self.done],
            "checkpoints": self.checkpoints,
            "rebuild": self.rebuild,
            "missing": self.missing,
            "files": len(self.files),
            "file_bytes": self.file_bytes,
        }


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


class PartWriter:
    """A write-only stream cut into files PREFIX000, PREFIX001, ... of at most `part_bytes` each."""

    def __init__(self, folder: Path, prefix: str, part_bytes: int) -> None:
        self.folder, self.prefix, self.part_bytes = folder, prefix, part_bytes
        self.parts: list[dict[str, Any]] = []
        self.whole = hashlib.sha256()
        self._file: IO[bytes] | None = None
        self._digest = hashlib.sha256()
        self._size = 0

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            if self._file is None or self._size == self.part_bytes:
                self._roll()
            assert self._file is not None
            take = min(len(view), self.part_bytes - self._size)
            self._file.write(view[:take])
            self._digest.update(view[:take])
            self.whole.update(view[:take])
            self._size += take
            view = view[take:]
        return len(data)

    def flush(self) -> None:
        pass

    def _roll(self) -> None:
        self._finish()
        name = f"{self.prefix}{len(self.parts):03d}"
        self._file = open(self.folder / name, "wb")  # noqa: SIM115 - closed by _finish, part after part
        self.parts.append({"name": name})
        self._digest, self._size = hashlib.sha256(), 0

    def _finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self.parts[-1].update(bytes=self._size, sha256=self._digest.hexdigest())
            self._file = None

    def close(self) -> list[dict[str, Any]]:
        """Closes the last part; the parts' names, sizes and sha256."""
        self._finish()
        return self.parts


def join_parts(folder: Path, parts: list[dict[str, Any]], dest: IO[bytes]) -> str:
    """Copies the parts, in order, to `dest`, checking each one's size and sha256; returns the whole's sha256."""
    whole = hashlib.sha256()
    for part in parts:
        path = folder / part["name"]
        if not path.is_file():
            raise BundleError(f"{path}: part {part['name']} of the bundle is missing")
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(MIB), b""):
                digest.update(chunk)
                whole.update(chunk)
                dest.write(chunk)
        if path.stat().st_size != part["bytes"] or digest.hexdigest() != part["sha256"]:
            raise BundleError(
                f"{path}: {path.stat().st_size} bytes, sha256 {digest.hexdigest()[:12]}; the index "
                f"says {part['bytes']} bytes, {part['sha256'][:12]} (damaged, or from another bundle)"
            )
    return whole.hexdigest()


def _link(src: Path, dest: Path) -> None:
    """A hard link (checkpoint files never change once written, and a link keeps one a pruning run deletes),
    else a copy."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    link_or_copy(src, dest)


def pack(runs: Path, dest: Path, part_bytes: int) -> dict[str, Any]:
    """Bundle every claim run directory under `runs` (those with claim.json) into DEST/bundle.json and
    DEST/bundle.NNN; runs may go on meanwhile (the files are linked into a staging folder first)."""
    dest.mkdir(parents=True, exist_ok=True)
    snapshot = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{os.getpid()}"
    staging = dest / f".staging-{snapshot}"
    for attempt in range(3):
        try:
            claims = {
                d.name: _Claim(d).select() for d in sorted(runs.iterdir()) if read_claim_file(d) is not None
            }
            for name, claim in claims.items():
                for rel, src in claim.files.items():
                    _link(src, staging / name / rel)
            break
        except FileNotFoundError:  # a running stage pruned a checkpoint while it was selected: select again
            shutil.rmtree(staging, ignore_errors=True)
            if attempt == 2:
                raise
    for old in _part_files(dest):
        old.unlink()
    writer = PartWriter(dest, PART_PREFIX, part_bytes)
    try:
        # level 1: the weights barely compress at any level, and packing runs beside the training
        with (
            gzip.GzipFile(fileobj=writer, mode="wb", compresslevel=1, mtime=0) as gz,
            tarfile.open(fileobj=gz, mode="w|") as tar,
        ):
            for name in sorted(claims):
                if (staging / name).is_dir():
                    tar.add(staging / name, arcname=name)
    finally:
        parts = writer.close()
        shutil.rmtree(staging, ignore_errors=True)
    index = {
        "format": FORMAT,
        "snapshot": snapshot,
        "bytes": sum(p["bytes"] for p in parts),
        "sha256": writer.whole.hexdigest(),
        "parts": parts,
        "claims": {name: c.info() for name, c in claims.items()},
    }
    atomic_write_json(dest / INDEX, index)
    (dest / "sent.json").unlink(missing_ok=True)
    return index


def _part_files(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"{PART_PREFIX}[0-9][0-9][0-9]"))


def read_index(folder: Path) -> dict[str, Any] | None:
    path = folder / INDEX
    if not path.is_file():
        return None
    index = json.loads(path.read_text())
    if index.get("format") != FORMAT:
        raise BundleError(f"{path}: format {index.get('format')!r}, this sleuth reads {FORMAT!r}")
    return index


def send(bundle: Path, out: Path, limits: CallLimits, only: list[int] | None = None) -> list[str]:
    """Copy the index and the parts not sent yet (or those `only` names) into OUT within one call's `limits`,
    counting what OUT already holds; returns the parts sent."""
    index = read_index(bundle)
    if index is None:
        raise BundleError(f"{bundle}: no {INDEX}; run pack first")
    sent_file = bundle / "sent.json"
    sent = set(json.loads(sent_file.read_text())) if sent_file.exists() and only is None else set()
    present = [p for p in out.iterdir() if p.is_file()]
    files, room = len(present) + 1, limits.out_bytes - sum(p.stat().st_size for p in present) - MIB
    shutil.copy2(bundle / INDEX, out / INDEX)
    wanted = [
        p for i, p in enumerate(index["parts"]) if (i in only if only is not None else p["name"] not in sent)
    ]
    now = []
    for part in wanted:
        if files + 1 > limits.out_files or part["bytes"] > room:
            break
        shutil.copy2(bundle / part["name"], out / part["name"])
        files, room = files + 1, room - part["bytes"]
        now.append(part["name"])
    atomic_write_json(sent_file, sorted(sent | set(now)))
    return now


def take(returned: Path, claims: Path) -> dict[str, Any]:
    """Copy a call's returned index and parts into the carried folder (a newer snapshot replaces an older
    one); returns the snapshot, the parts there and the parts still to send."""
    index = read_index(returned)
    if index is None:
        raise BundleError(f"{returned}: no {INDEX} among the returned files")
    claims.mkdir(parents=True, exist_ok=True)
    held = read_index(claims)
    if held is not None and held["snapshot"] != index["snapshot"]:
        if held["snapshot"] > index["snapshot"]:
            raise BundleError(
                f"{returned}: snapshot {index['snapshot']} is older than {claims}'s "
                f"{held['snapshot']}; not taken"
            )
        for old in _part_files(claims):
            old.unlink()
    for part in index["parts"]:
        src = returned / part["name"]
        if src.is_file() and sha256_file(src) == part["sha256"]:
            shutil.copyfile(src, claims / part["name"])
    shutil.copyfile(returned / INDEX, claims / INDEX)
    return {"snapshot": index["snapshot"], **_completeness(claims, index)}


def _completeness(folder: Path, index: dict[str, Any]) -> dict[str, Any]:
    have = [
        p["name"]
        for p in index["parts"]
        if (folder / p["name"]).is_file() and (folder / p["name"]).stat().st_size == p["bytes"]
    ]
    return {
        "have": have,
        "missing": [p["name"] for p in index["parts"] if p["name"] not in have],
        "bytes": index["bytes"],
    }


def carry_plan(
    index: dict[str, Any], folder: str, beside: list[list[str]], limits: CallLimits, tree: int = 0
) -> list[list[str]]:
    """The paths each call carries: the calls' own paths (`beside`: the wheels, the GGUF halves...) with as many
    parts as fit next to them in `limits.carry_bytes`, the index with the first call; then calls of parts alone. `tree`:
    the bytes of the working tree that travels with every call (the limit counts it with the carried paths)."""
    calls = [list(paths) for paths in beside] or [[]]
    room = [limits.carry_bytes - MIB - tree - sum(tree_bytes(Path(p)) for p in paths) for paths in calls]
    calls[0].append(f"{folder}/{INDEX}")
    k = 0
    for part in index["parts"]:
        while k < len(calls) and part["bytes"] > room[k]:
            k += 1
        if k == len(calls):
            calls.append([])
            room.append(limits.carry_bytes - MIB - tree)
        calls[k].append(f"{folder}/{part['name']}")
        room[k] -= part["bytes"]
    return calls


def restore(claims: Path, runs: Path, done_dir: Path | None = None) -> dict[str, Any]:
    """Lay out the carried bundle's claims under RUNS (a claim that already has finished stages there is
    kept as it is), rebuild what was left out, and mark finished claims in `done_dir`. Status "none" (no
    bundle), "incomplete" (parts still to carry), "restored" or "restored earlier"."""
    index = read_index(claims)
    if index is None:
        return {"status": "none"}
    state = _completeness(claims, index)
    if state["missing"]:
        return {"status": "incomplete", **state}
    runs.mkdir(parents=True, exist_ok=True)
    marker = runs / f".restored-{index['snapshot']}.json"
    if marker.exists():
        return {"status": "restored earlier", **json.loads(marker.read_text())}
    joined, unpacked = runs / f".bundle-{index['snapshot']}.tgz", runs / f".restore-{index['snapshot']}"
    try:
        with open(joined, "wb") as f:
            whole = join_parts(claims, index["parts"], f)
        if whole != index["sha256"]:
            raise BundleError(
                f"{claims}: the joined parts' sha256 {whole[:12]} is not the index's {index['sha256'][:12]}"
            )
        with tarfile.open(joined, "r:gz") as tar:
            tar.extractall(unpacked, filter="data")
        result = {
            name: _restore_claim(unpacked / name, runs / name, info, index["snapshot"])
            for name, info in index["claims"].items()
        }
    finally:
        joined.unlink(missing_ok=True)
        shutil.rmtree(unpacked, ignore_errors=True)
    for name, claim in result.items():
        if claim.get("complete") and done_dir is not None:
            done_dir.mkdir(parents=True, exist_ok=True)
            (done_dir / name).touch()
    atomic_write_json(marker, {"claims": result})
    return {"status": "restored", "claims": result}


def _restore_claim(unpacked: Path, target: Path, info: dict[str, Any], snapshot: str) -> dict[str, Any]:
    if target.is_dir() and finished_stages(target):
        return {"kept": f"{target} has {len(finished_stages(target))} finished stages of its own"}
    if not unpacked.is_dir():
        return {"kept": "nothing packed"}
    shutil.rmtree(target, ignore_errors=True)
    shutil.move(unpacked, target)
    try:
        warnings = rebuild(target, info)
    except Exception as err:
        # a claim half restored would pair new answers with old ones: start it again instead
        shutil.rmtree(target, ignore_errors=True)
        return {"failed": f"{type(err).__name__}: {err}", "starts again": True}
    atomic_write_json(
        target / RESTORED,
        {"snapshot": snapshot, "from": info["root"], "stages": info["done"], "warnings": warnings},
    )
    complete = not info["pending"] and (target / "report.json").is_file()
    return {"stages": len(info["done"]), "complete": complete, "warnings": warnings}


def rebuild(out: Path, info: dict[str, Any]) -> list[str]:
    """Re-root OUT's JSON files from the packed OUT to this one, then rebuild what the bundle left out and
    check it against the packed sha256; returns the warnings (an export that came out different)."""
    old, new = info["root"], str(out.resolve())
    for path in sorted(out.rglob("*.json")):
        if CHECKPOINTS in path.relative_to(out).parts:
            continue  # a checkpoint's manifest lists its files' sha256: they stay as written
        text = path.read_text()
        if old in text:
            atomic_write_json(path, reroot(json.loads(text), old, new))
    warnings = []
    for entry in info["rebuild"]:
        folder = out / entry["dir"]
        shutil.rmtree(folder, ignore_errors=True)
        if entry["kind"] == "world":
            build_world(folder, claim_profile(info["method"], info["profile"]))
            unchecked: tuple[str, ...] = WORLD_UNCHECKED
        else:
            # deferred: loading a model needs torch and transformers, which packing does not
            from sleuth.agent.searcher import export_searcher

            export_searcher(out / entry["source"], folder, overwrite=True)
            if entry.get("record") is not None:  # the reader's record (sleuth.claims.reuse), as packed
                atomic_write_json(folder / WORLD_RECORD, entry["record"])
            elif (
                WORLD_RECORD in entry["files"]
            ):  # a bundle packed before records travelled: rebuilt from the world
                # a reader trained on a world of its own keeps it beside its folder (qagent's other reader)
                own = folder.parent / "world"
                write_world_record(folder, own if (own / "test.jsonl").is_file() else out / "world")
            unchecked = EXPORT_UNCHECKED
        rebuilt = _digests(folder, unchecked)
        differ = sorted(
            k for k in set(rebuilt) | set(entry["files"]) if rebuilt.get(k) != entry["files"].get(k)
        )
        if differ and entry["kind"] == "world":
            raise BundleError(
                f"{folder}: the rebuilt world differs from the packed one in {', '.join(differ)}"
            )
        if differ:
            warnings.append(
                f"{entry['dir']}: exported again, differs from the packed export in {', '.join(differ)}"
            )
    return warnings


def _limit_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-files", type=int, required=True, help="files one call hands back")
    parser.add_argument("--out-mib", type=float, required=True, help="MiB one call hands back in all")
    parser.add_argument(
        "--carry-mib", type=float, required=True, help="MiB one call carries in (tree counted)"
    )


def _limits(args: argparse.Namespace) -> CallLimits:
    return CallLimits(args.out_files, int(args.out_mib * MIB), int(args.carry_mib * MIB))


def main(argv: list[str] | None = None) -> int:
    """`python bench/claim_bundle.py pack|send|take|restore ...` (bench/gpu_claims.sh calls it with its
    lender's limits)."""
    parser = argparse.ArgumentParser(prog="python bench/claim_bundle.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="bundle the claims under RUNS into BUNDLE")
    p.add_argument("runs", type=Path)
    p.add_argument("bundle", type=Path)
    p.add_argument(
        "--part-mib", type=float, required=True, help="largest part, under the largest file a call hands back"
    )
    s = sub.add_parser("send", help="copy the index and the parts not sent yet into OUT")
    s.add_argument("bundle", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--parts", default=None, help="comma-separated part numbers to send (again)")
    _limit_options(s)
    t = sub.add_parser("take", help="copy a call's returned bundle files into the carried folder")
    t.add_argument("returned", type=Path)
    t.add_argument("claims", type=Path)
    t.add_argument(
        "--beside",
        action="append",
        default=[],
        help="what a call of the next lease carries anyway (space-separated paths), one option a call",
    )
    t.add_argument(
        "--tree-bytes",
        type=int,
        default=0,
        help="bytes of the working tree that travels with every call (counted in --carry-mib)",
    )
    _limit_options(t)
    r = sub.add_parser(
        "restore", help="restore the carried bundle's claims under RUNS (exit 3: parts missing)"
    )
    r.add_argument("claims", type=Path)
    r.add_argument("runs", type=Path)
    r.add_argument("--done-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except SleuthError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.command == "pack":
        index = pack(args.runs, args.bundle, int(args.part_mib * MIB))
        print(f"bundle {index['snapshot']}: {index['bytes'] / MIB:.1f} MiB in {len(index['parts'])} parts")
        for name, c in index["claims"].items():
            print(
                f"  {name}: {len(c['done'])} stages done, {len(c['pending'])} to run, checkpoints "
                f"{c['checkpoints'] or '-'}, rebuilt {[e['dir'] for e in c['rebuild']] or '-'}"
            )
    elif args.command == "send":
        only = [int(x) for x in args.parts.split(",")] if args.parts else None
        now = send(args.bundle, args.out, _limits(args), only)
        total = len(read_index(args.bundle)["parts"])
        left = total - len(json.loads((args.bundle / "sent.json").read_text()))
        print(
            f"sent {INDEX} and {len(now)} of {total} parts ({', '.join(now) or 'none'}); {left} not sent yet"
            + (": `bash bench/gpu_claims.sh send` again" if left else "")
        )
    elif args.command == "take":
        state = take(args.returned, args.claims)
        print(
            f"bundle {state['snapshot']} in {args.claims}: {len(state['have'])} parts, "
            f"{len(state['missing'])} still to send ({', '.join(state['missing']) or 'complete'})"
        )
        if not state["missing"]:
            plan = carry_plan(
                read_index(args.claims),
                args.claims.as_posix(),
                [b.split() for b in args.beside],
                _limits(args),
                args.tree_bytes,
            )
            print("next lease, what each call carries:")
            for k, paths in enumerate(plan, 1):
                print(f"  call {k}: {json.dumps(paths)}")
    else:
        result = restore(args.claims, args.runs, args.done_dir)
        print(json.dumps(result, indent=1))
        return 3 if result["status"] == "incomplete" else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
