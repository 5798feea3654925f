"""Passages/s of the bulk encoder's parts on this machine (issue 24: can tokenizing keep GPUs busy?).

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/encode_rate.py --docstore runs/big/bm25/docstore \
        --tokenize-procs 1 2 --encode-devices cpu cpu,cpu --encode-rows 1024

`--tokenizers preprocess fast`: sentence-transformers' preprocess (the bulk encoder's tokenizer before issue 24)
and sleuth.retrieval.fast_tokenize (now), each measured below (keys `_fast_tokenizer` for the latter).
`--tokenize-procs`: P processes each read, length-sort and tokenize (MiniLM's tokenizer, batch 512, to the
tensors the model takes) their own share of the first `--tokenize-rows` passages, 3 passes; the rate is all
passages over first start to last end. `--encode-devices`: `encode_docstore_parallel` over the first
`--encode-rows` passages for each device list (the model on those devices), and sentence-transformers' own
`encode` in one process for reference. Prints and writes JSON.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from _common import out_path, write_json
from sleuth.data.formats import Passage
from sleuth.retrieval.bulk_encode import EncodePlan, encode_docstore_parallel
from sleuth.retrieval.dense import passage_text
from sleuth.retrieval.docstore import DocStore
from sleuth.retrieval.encoders import Encoder, EncoderConfig
from sleuth.retrieval.fast_tokenize import BatchTokenizer


def _tokenize(docstore: str, lo: int, hi: int, out: Any, fast: bool) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    os.environ["RAYON_NUM_THREADS"] = "1"
    store = DocStore(docstore)
    model = Encoder(EncoderConfig(name="minilm")).model
    preprocess = getattr(model, "preprocess", None) or model.tokenize
    if fast:  # what the bulk encoder uses (it checks agreement with preprocess first, as here)
        sample = [passage_text(t, x) for _, t, x in store.get(np.arange(lo, min(lo + 256, hi)))]
        tokenizer = BatchTokenizer(model)
        if not tokenizer.agrees_with(preprocess, sample):
            raise SystemExit("fast tokenizer disagrees with preprocess on this docstore")
        preprocess = tokenizer
    t0, n = time.perf_counter(), 0
    for _ in range(3):
        texts = [passage_text(t, x) for _, t, x in store.get(np.arange(lo, hi))]
        order = np.argsort([-len(t) for t in texts], kind="stable")
        for b in range(0, len(order), 512):
            preprocess([texts[r] for r in order[b : b + 512]])
        n += len(texts)
    out.put((n, t0, time.perf_counter()))


def tokenize_rate(docstore: str, rows: int, procs: int, fast: bool = False) -> float:
    # perf_counter is CLOCK_MONOTONIC on Linux: comparable across processes of one machine.
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    bounds = np.linspace(0, rows, procs + 1).astype(int)
    workers = [
        ctx.Process(target=_tokenize, args=(docstore, bounds[i], bounds[i + 1], results, fast))
        for i in range(procs)
    ]
    for w in workers:
        w.start()
    done = [results.get() for _ in workers]
    for w in workers:
        w.join()
    return sum(d[0] for d in done) / (max(d[2] for d in done) - min(d[1] for d in done))


def encode_rates(
    docstore: DocStore, rows: int, device_lists: list[str], batch: int, fast: bool
) -> dict[str, float]:
    config = EncoderConfig(name="minilm", batch_size=batch)
    with tempfile.TemporaryDirectory(prefix="encode-rate-") as tmp:
        sample = DocStore.build(
            [Passage(id=i, title=t, text=x) for i, t, x in docstore.get(range(rows))], Path(tmp) / "docstore"
        )
        encoder = Encoder(config)
        t0 = time.perf_counter()
        encoder.encode_passages([passage_text(t, x) for _, t, x in sample.get(range(rows))])
        out = {"sentence_transformers_encode_1_process": rows / (time.perf_counter() - t0)}
        for devices in device_lists:
            run = encode_docstore_parallel(
                sample,
                Path(tmp) / f"{devices}.f16",
                config,
                devices,
                EncodePlan(chunk=256, range_chunks=1, cores=len(devices.split(",")), fast_tokenizer=fast),
            )
            out[f"encode_docstore_parallel_{devices}" + ("_fast_tokenizer" if fast else "")] = run[
                "passages_per_second"
            ]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docstore", required=True, help="A docstore directory (e.g. an index's docstore/).")
    p.add_argument("--tokenize-procs", type=int, nargs="*", default=[1, 2])
    p.add_argument("--tokenize-rows", type=int, default=2700)
    p.add_argument("--encode-devices", nargs="*", default=["cpu", "cpu,cpu"])
    p.add_argument("--encode-rows", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument(
        "--tokenizers",
        nargs="*",
        default=["preprocess", "fast"],
        choices=["preprocess", "fast"],
        help="preprocess: sentence-transformers' (the bulk encoder before issue 24's fix); fast: "
        "sleuth.retrieval.fast_tokenize (the bulk encoder's default now).",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    store = DocStore(args.docstore)
    result: dict[str, Any] = {
        "bench": "encode_rate",
        "cpus": os.cpu_count(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_average_before": os.getloadavg(),
        "tokenize": {},
        "encode": {},
    }
    for procs in args.tokenize_procs:
        for name in args.tokenizers:
            rate = tokenize_rate(
                args.docstore, min(args.tokenize_rows, store.num_docs), procs, name == "fast"
            )
            key = f"{procs}_processes" + ("_fast_tokenizer" if name == "fast" else "")
            result["tokenize"][key] = round(rate, 1)
            print(f"tokenize ({name}), {procs} process(es): {rate:,.0f} passages/s", flush=True)
    if args.encode_devices:
        rates = {}
        for name in args.tokenizers:
            rates |= encode_rates(
                store, min(args.encode_rows, store.num_docs), args.encode_devices, args.batch, name == "fast"
            )
        result["encode"] = {k: round(v, 1) for k, v in rates.items()}
        print("\n".join(f"{k}: {v:,.1f} passages/s" for k, v in rates.items()))
    result["load_average_after"] = os.getloadavg()
    write_json(out_path(args.out, "encode_rate.json"), result)


if __name__ == "__main__":
    main()
