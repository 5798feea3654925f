"""Encode a docstore's passages into one float16 [N, dim] file with several processes (one per GPU).

The rows are cut into contiguous ranges of whole chunks. Worker processes (each `cpu` entry one; each
GPU several by default, one per core, since tokenizing is what limits the rate: measured on CPU,
one core tokenizes ~2,000 passages of ~235 tokens per second, far below what one GPU encodes) take
ranges from a queue and write their vectors straight into one preallocated float16 file at the
range's offset (`<out>.tmp`); a range's done-marker is written after its rows are flushed. The file
gets its final name only when every range is done, so a reader never sees a partial file, and a
rerun after a crash (a killed worker, a lease that ended) encodes only the ranges without a marker.

Inside a worker, reader threads fetch a chunk's passages, sort them by length (so a batch holds
passages of similar length and little padding) and tokenize batch after batch ahead of the model,
with the tokenizer's own thread pool on; the main thread only runs the model. Chunks and batches
do not depend on the number of workers, so the file is the same for any device list (tested
bit-exact on CPU).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sleuth.errors import ConfigError
from sleuth.retrieval.dense import passage_text
from sleuth.retrieval.docstore import DocStore
from sleuth.retrieval.encoders import Encoder, EncoderConfig
from sleuth.retrieval.fast_tokenize import BatchTokenizer, UnsupportedTokenizer
from sleuth.utils import atomic_write_json, atomic_write_text

PLAN = "plan.json"
DEFAULT_CHUNK = 16384
# Ranges are what a crash can lose and the unit of load balance: by default about this many ranges
# (at 21M passages in 16,384-passage chunks: 11 chunks each, ~7 per worker with 16
# workers, so the last round leaves few workers idle), whatever the worker count, so a rerun with
# other devices still resumes.
TARGET_RANGES = 128
# Reader threads per worker: the tokenizer runs without the GIL, the docstore reads and tensor
# building hold it, so two overlap the two halves.
READERS = 2


@dataclass(frozen=True)
class EncodeJob:
    """What every worker needs (picklable: workers are spawned, so CUDA starts clean in each)."""

    docstore: str
    tmp_path: str
    parts_dir: str
    num_docs: int
    dim: int
    chunk: int
    encoder: EncoderConfig | None = None
    # Instead of `encoder`: a picklable callable device -> object with encode_passages / config / dim
    # (tests: an encoder without a model; the worker then encodes chunk by chunk without a reader thread).
    factory: Callable[[str], Any] | None = None
    fp16: bool = True
    threads_per_worker: int = 1
    ranges: list[tuple[int, int]] = field(default_factory=list)
    fast_tokenizer: bool = True


def parse_devices(devices: str | Sequence[str], visible_gpus: int | None = None) -> list[str]:
    """`"all"` -> every visible GPU (`cuda:0`, ...); else a comma list of `cpu` (repeatable: one process
    each) and `cuda` / `cuda:N` (each GPU once). A clear error names what is wrong."""
    if visible_gpus is None:
        visible_gpus = _visible_gpus()
    if isinstance(devices, str):
        items = [d.strip() for d in devices.split(",") if d.strip()]
        if devices.strip() == "all":
            if visible_gpus == 0:
                raise ConfigError(
                    "--devices all: no GPU is visible; pass --devices cpu (or cpu,cpu for two processes)"
                )
            return [f"cuda:{i}" for i in range(visible_gpus)]
    else:
        items = [str(d).strip() for d in devices]
    if not items:
        raise ConfigError("--devices is empty; pass 'all', 'cuda:0,cuda:1' or 'cpu,cpu'")
    out: list[str] = []
    for item in items:
        if item == "cpu":
            out.append(item)
            continue
        gpu = _gpu_number(item)
        if gpu >= visible_gpus:
            seen = f"cuda:0..cuda:{visible_gpus - 1}" if visible_gpus else "none"
            raise ConfigError(
                f"--devices: {item} is not visible ({visible_gpus} GPU(s): {seen}); fix the device list"
            )
        name = f"cuda:{gpu}"
        if name in out:
            raise ConfigError(f"--devices: {name} is listed twice; name each GPU once")
        out.append(name)
    return out


def _gpu_number(item: str) -> int:
    if item == "cuda":
        return 0
    head, _, number = item.partition(":")
    if head != "cuda" or not number.isdigit():
        raise ConfigError(
            f"--devices: {item!r} is not a device; use cpu, cuda or cuda:N (comma-separated) or all"
        )
    return int(number)


def _visible_gpus() -> int:
    try:
        import torch  # deferred: heavy; device_count does not initialise CUDA in this process
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def worker_devices(devices: list[str], cores: int, procs_per_gpu: int | None = None) -> list[str]:
    """One entry per worker process: each `cpu` once, each GPU `procs_per_gpu` times (default: the
    cores divided between the GPUs, at least one each)."""
    gpus = sum(d != "cpu" for d in devices)
    per_gpu = procs_per_gpu or max(1, cores // max(gpus, 1))
    return [d for d in devices for _ in range(per_gpu if d != "cpu" else 1)]


def plan_ranges(num_docs: int, chunk: int, range_chunks: int | None = None) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of whole chunks covering every row (`range_chunks` chunks each;
    default: about TARGET_RANGES ranges)."""
    if range_chunks is None:
        range_chunks = max(1, -(-num_docs // (chunk * TARGET_RANGES)))
    step = chunk * range_chunks
    return [(s, min(s + step, num_docs)) for s in range(0, num_docs, step)]


@dataclass(frozen=True)
class EncodePlan:
    """How to run an encode: `chunk` passages read and length-sorted at a time, ranges of `range_chunks`
    chunks (the unit of resume; default: about TARGET_RANGES ranges), `fp16` model on CUDA, `cores` shared by the workers (default: this
    process's), `procs_per_gpu` worker processes on each GPU (default: cores // GPUs, so every core
    tokenizes: one process's tokenizer output is built under the GIL and tops out at a few thousand
    passages/s, below what one GPU encodes)."""

    chunk: int = DEFAULT_CHUNK
    range_chunks: int | None = None
    fp16: bool = True
    cores: int | None = None
    procs_per_gpu: int | None = None
    # Tokenize with sleuth.retrieval.fast_tokenize (when it agrees with sentence-transformers' preprocess on
    # the range's first passages); False: sentence-transformers' preprocess.
    fast_tokenizer: bool = True


def encode_docstore_parallel(
    docstore: DocStore | str | Path,
    path: str | Path,
    encoder: EncoderConfig | Callable[[str], Any],
    devices: str | Sequence[str] = "all",
    plan: EncodePlan | None = None,
) -> dict[str, Any]:
    """Encode every passage of `docstore` into the float16 [N, dim] file `path` (the layout
    `index.open_embeddings` reads), with worker processes on the devices (each `cpu` entry one process;
    each GPU `plan.procs_per_gpu`); resumes an interrupted run.

    `encoder`: an EncoderConfig (each worker loads the model) or a picklable factory device -> encoder.
    Workers are spawned: a script calling this needs the `if __name__ == "__main__":` guard.
    Returns {"rows", "dim", "devices", "workers", "ranges", "resumed_ranges", "encoded_rows", "seconds"
    (wall, with the workers' start-up), "encode_seconds" (first range begun to last range ended), "passages_per_second"
    (encoded_rows / encode_seconds)}.
    """
    plan = plan or EncodePlan()
    store = docstore if isinstance(docstore, DocStore) else DocStore(docstore)
    for name in ("chunk", "range_chunks", "cores", "procs_per_gpu"):
        if getattr(plan, name) is not None and getattr(plan, name) < 1:
            raise ConfigError(f"encode: {name} must be >= 1, got {getattr(plan, name)}")
    device_list = parse_devices(devices)
    cores = plan.cores or len(os.sched_getaffinity(0))
    workers = worker_devices(device_list, cores, plan.procs_per_gpu)
    path = Path(path)
    dim = _probe_dim(encoder)
    job = EncodeJob(
        docstore=str(store.directory.resolve()),
        tmp_path=str(path.with_name(path.name + ".tmp")),
        parts_dir=str(path.with_name(path.name + ".parts")),
        num_docs=store.num_docs,
        dim=dim,
        chunk=plan.chunk,
        encoder=encoder if isinstance(encoder, EncoderConfig) else None,
        factory=None if isinstance(encoder, EncoderConfig) else encoder,
        fp16=plan.fp16,
        threads_per_worker=max(1, cores // len(workers)),
        ranges=plan_ranges(store.num_docs, plan.chunk, plan.range_chunks),
        fast_tokenizer=plan.fast_tokenizer,
    )
    if job.num_docs == 0:
        path.write_bytes(b"")  # nothing to encode; np.memmap cannot map an empty file
        return {
            "rows": 0,
            "dim": dim,
            "devices": device_list,
            "workers": 0,
            "ranges": 0,
            "resumed_ranges": 0,
            "encoded_rows": 0,
            "seconds": 0.0,
            "encode_seconds": 0.0,
            "passages_per_second": None,
        }
    resumed = _prepare(job, store)
    t0 = time.perf_counter()
    todo = [i for i in range(len(job.ranges)) if not _marker(job, i).exists()]
    if todo:
        _run_workers(job, workers, todo)
    missing = [i for i in range(len(job.ranges)) if not _marker(job, i).exists()]
    if missing:
        raise RuntimeError(
            f"encode: ranges {missing} have no done-marker although every worker exited cleanly"
        )
    seconds = time.perf_counter() - t0
    # Encoding alone: from the first range this run began to the last it ended (worker start-up,
    # i.e. importing torch and loading the model, is in `seconds` only).
    marks = [json.loads(_marker(job, i).read_text()) for i in todo]
    span = max((m["ended"] for m in marks), default=0.0) - min((m["began"] for m in marks), default=0.0)
    Path(job.tmp_path).rename(path)
    shutil.rmtree(job.parts_dir, ignore_errors=True)
    encoded = sum(job.ranges[i][1] - job.ranges[i][0] for i in todo)
    return {
        "rows": job.num_docs,
        "dim": dim,
        "devices": device_list,
        "workers": len(workers),
        "ranges": len(job.ranges),
        "resumed_ranges": resumed,
        "encoded_rows": encoded,
        "seconds": round(seconds, 3),
        "encode_seconds": round(span, 3),
        "passages_per_second": round(encoded / span, 1) if span > 0 else None,
    }


def _probe_dim(encoder: EncoderConfig | Callable[[str], Any]) -> int:
    """The embedding dimension (loads the encoder once on the CPU: seconds, before the workers start)."""
    if not isinstance(encoder, EncoderConfig):
        return int(encoder("cpu").dim)

    return Encoder(encoder, device="cpu").dim


def _plan_record(job: EncodeJob, store: DocStore) -> dict[str, Any]:
    strings = store.directory / "strings.bin"
    encoder = asdict(job.encoder) if job.encoder is not None else repr(job.factory)
    return {
        "num_docs": job.num_docs,
        "dim": job.dim,
        "chunk": job.chunk,
        "ranges": [list(r) for r in job.ranges],
        "encoder": encoder,
        "fp16": job.fp16,
        "docstore": job.docstore,
        "docstore_bytes": strings.stat().st_size,
    }


def _prepare(job: EncodeJob, store: DocStore) -> int:
    """Keep a previous run's file and markers if it had the same plan; else start over. Returns the
    number of ranges already done."""
    parts, tmp = Path(job.parts_dir), Path(job.tmp_path)
    record = _plan_record(job, store)
    expected_bytes = job.num_docs * job.dim * 2
    try:
        same = json.loads((parts / PLAN).read_text()) == record and tmp.stat().st_size == expected_bytes
    except (OSError, ValueError):
        same = False
    if same:
        return sum(_marker(job, i).exists() for i in range(len(job.ranges)))
    shutil.rmtree(parts, ignore_errors=True)
    parts.mkdir(parents=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        f.truncate(expected_bytes)  # sparse: every worker writes its own rows into it
    atomic_write_json(parts / PLAN, record)
    return 0


def _marker(job: EncodeJob, i: int) -> Path:
    return Path(job.parts_dir) / f"range-{i:06d}.done"


def _run_workers(job: EncodeJob, devices: list[str], todo: list[int]) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # CUDA cannot be used in forked children
    tasks = ctx.Queue()
    for i in todo:
        tasks.put(i)
    for _ in devices:
        tasks.put(None)
    procs = [
        ctx.Process(target=_worker, args=(job, device, w, tasks), name=f"encode-{device}-{w}")
        for w, device in enumerate(devices)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [(w, devices[w], p.exitcode) for w, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        undone = [job.ranges[i] for i in todo if not _marker(job, i).exists()]
        why = "; ".join(
            f"worker {w} ({d}) exited with code {code}{_worker_error(job, w)}" for w, d, code in failed
        )
        raise RuntimeError(
            f"encode: {why}; {len(undone)} of {len(job.ranges)} row ranges not encoded (first: rows "
            f"{undone[0][0] if undone else '-'}..); the finished ranges are kept in {job.parts_dir}: "
            "run the same command again to resume"
        )


def _worker_error(job: EncodeJob, w: int) -> str:
    path = Path(job.parts_dir) / f"worker-{w}.error"
    return f": {path.read_text().strip()}" if path.exists() else ""


def _worker(job: EncodeJob, device: str, w: int, tasks: Any) -> None:
    """One process: load the encoder on `device`, encode ranges from `tasks` until a None."""
    # Set before the tokenizer library loads: its thread pool feeds the model (the bench driver turns
    # it off for the servers); RAYON_NUM_THREADS splits the cores between the workers.
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    os.environ.setdefault("RAYON_NUM_THREADS", str(job.threads_per_worker))
    try:
        encoder = _load_worker_encoder(job, device)
        store = DocStore(job.docstore)
        out = np.memmap(job.tmp_path, dtype=np.float16, mode="r+", shape=(job.num_docs, job.dim))
        while (i := tasks.get()) is not None:
            start, end = job.ranges[i]
            began = time.time()
            _encode_range(encoder, store, out, start, end, job.chunk, job.fast_tokenizer)
            out.flush()  # the rows are on disk before the marker says so
            atomic_write_json(
                _marker(job, i),
                {"rows": [start, end], "device": device, "began": began, "ended": time.time()},
            )
    except BaseException as err:
        atomic_write_text(Path(job.parts_dir) / f"worker-{w}.error", f"{type(err).__name__}: {err}"[:500])
        raise


def _load_worker_encoder(job: EncodeJob, device: str) -> Any:
    if job.factory is not None:
        return job.factory(device)
    import torch  # deferred: only workers with a real model need it

    torch.set_num_threads(job.threads_per_worker)
    encoder = Encoder(job.encoder, device=device)
    if job.fp16 and device.startswith("cuda"):
        encoder.model.half()  # the file stores float16 anyway
    return encoder


def _encode_range(
    encoder: Any,
    store: DocStore,
    out: np.ndarray,
    start: int,
    end: int,
    chunk: int,
    fast_tokenizer: bool = True,
) -> None:
    model = getattr(encoder, "model", None)
    if model is None or not hasattr(model, "forward"):
        for s in range(start, end, chunk):
            texts = [passage_text(t, x) for _, t, x in store.get(np.arange(s, min(s + chunk, end)))]
            out[s : s + len(texts)] = encoder.encode_passages(texts)
        return
    _encode_range_pipelined(encoder, store, out, start, end, chunk, fast_tokenizer)


# Passages of a range that sleuth.retrieval.fast_tokenize is checked on before it replaces preprocess.
AGREEMENT_ROWS = 256


def _tokenizer_for(model: Any, texts: list[str], fast: bool) -> Callable[[list[str]], dict[str, Any]]:
    """The fast batch tokenizer if `fast` and its features equal sentence-transformers' preprocess on
    `texts`, else preprocess. Either way preprocess has been called once before any reader thread: the
    tokenizer stores its truncation/padding settings on the first call (a write), and a write while
    another thread encodes fails ("Already borrowed"); later calls with the same settings only read."""
    preprocess = getattr(model, "preprocess", None) or model.tokenize
    if fast:
        try:
            tokenizer = BatchTokenizer(model)
        except UnsupportedTokenizer:
            tokenizer = None
        if tokenizer is not None and tokenizer.agrees_with(preprocess, texts):
            return tokenizer
    preprocess(texts[:1])
    return preprocess


def _encode_range_pipelined(
    encoder: Any,
    store: DocStore,
    out: np.ndarray,
    start: int,
    end: int,
    chunk: int,
    fast_tokenizer: bool = True,
) -> None:
    """Reader threads tokenize length-sorted batches ahead; this thread runs the model on them.

    Each reader takes every READERS-th chunk: the batches are the same whatever their order, and
    every batch carries its row numbers, so the order the model sees them in does not matter."""
    import torch  # deferred: heavy

    model, cfg = encoder.model, encoder.config
    sample = [
        cfg.passage_prefix + passage_text(t, x)
        for _, t, x in store.get(np.arange(start, min(start + AGREEMENT_ROWS, end)))
    ]
    preprocess = _tokenizer_for(model, sample, fast_tokenizer)
    ready: queue.Queue = queue.Queue(maxsize=8)
    failure: list[BaseException] = []
    starts = list(range(start, end, chunk))

    def read(mine: list[int]) -> None:
        try:
            for s in mine:
                texts = [
                    cfg.passage_prefix + passage_text(t, x)
                    for _, t, x in store.get(np.arange(s, min(s + chunk, end)))
                ]
                order = np.argsort([-len(t) for t in texts], kind="stable")
                for b in range(0, len(order), cfg.batch_size):
                    rows = order[b : b + cfg.batch_size]
                    ready.put((s + rows, preprocess([texts[r] for r in rows])))
        except BaseException as err:  # handed to the consumer, which raises it
            failure.append(err)
        finally:
            ready.put(None)

    readers = [
        threading.Thread(target=read, args=(starts[k::READERS],), daemon=True, name=f"encode-reader-{k}")
        for k in range(READERS)
    ]
    for reader in readers:
        reader.start()
    device = model.device
    running = len(readers)
    with torch.inference_mode():
        while running:
            item = ready.get()
            if item is None:
                running -= 1
                continue
            if failure:
                break
            rows, features = item
            features = {
                k: v.to(device, non_blocking=True) if hasattr(v, "to") else v for k, v in features.items()
            }
            vecs = model(features)["sentence_embedding"]
            if cfg.normalize:
                vecs = torch.nn.functional.normalize(vecs.float(), p=2, dim=1)
            out[rows] = vecs.to(torch.float16).cpu().numpy()
    if failure:
        raise failure[0]
