"""`sleuth index` (build a retrieval index) and `sleuth search` (query one)."""

from __future__ import annotations

from pathlib import Path

import typer

from sleuth.errors import SleuthError
from sleuth.retrieval.bulk_encode import EncodePlan, encode_docstore_parallel
from sleuth.retrieval.encoders import EncoderConfig
from sleuth.retrieval.index import KINDS, build_index, load_retriever


def _fail(message: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(2)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GB"


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _print_index_summary(out: Path, manifest: dict, seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"index {out}", show_header=False)
    table.add_row("kind", manifest["kind"])
    table.add_row("passages", f"{manifest['num_docs']:,}")
    table.add_row("build time", f"{seconds:.1f} s")
    table.add_row("size on disk", _human_bytes(dir_size(out)))
    if manifest["kind"] == "dense":
        enc = manifest["encoder"]
        table.add_row("encoder", f"{enc['name']} (dim {enc['dim']})")
        table.add_row("faiss", ", ".join(f"{k}={v}" for k, v in manifest["faiss"].items()))
        if "shards" in manifest:
            table.add_row("shards", ", ".join(f"[{s['start']}, {s['end']})" for s in manifest["shards"]))
        if "ivf_build" in manifest:
            ivf = manifest["ivf_build"]
            phases = ", ".join(f"{k} {v:.1f} s" for k, v in ivf["seconds"].items())
            table.add_row("ivf build", f"{ivf['path']} on {ivf['device']}: {phases}")
    else:
        table.add_row("bm25", ", ".join(f"{k}={v}" for k, v in manifest["bm25"].items()))
        table.add_row("build", ", ".join(f"{k}={v}" for k, v in manifest["bm25_build"].items()))
    Console().print(table)


def register(app: typer.Typer) -> None:
    def index_cmd(
        corpus: Path | None = typer.Argument(
            None, help="Corpus jsonl ({'id', 'contents'} per line); optional with --docstore-from."
        ),
        out: Path = typer.Option(..., "--out", "-o", help="Directory to write the index to."),
        kind: str = typer.Option("bm25", "--kind", help="bm25 or dense."),
        encoder: str = typer.Option(
            "minilm", "--encoder", help="Dense: alias 'minilm', a model dir or hub name."
        ),
        faiss_type: str = typer.Option("flat", "--faiss", help="Dense: flat, hnsw or ivfpq."),
        query_prefix: str = typer.Option(
            "", "--query-prefix", help="Dense: prepended to queries (E5: 'query: ')."
        ),
        passage_prefix: str = typer.Option(
            "", "--passage-prefix", help="Dense: prepended to passages (E5: 'passage: ')."
        ),
        batch_size: int = typer.Option(64, "--batch-size", help="Dense: encoder batch size."),
        device: str | None = typer.Option(None, "--device", help="Dense: torch device (cpu, cuda)."),
        hnsw_m: int = typer.Option(32, "--hnsw-m", help="HNSW: neighbours per node (M)."),
        ef_search: int = typer.Option(128, "--ef-search", help="HNSW: efSearch."),
        nlist: int = typer.Option(1024, "--nlist", help="IVF-PQ: number of lists."),
        pq_m: int = typer.Option(48, "--pq-m", help="IVF-PQ: sub-quantizers (must divide the dimension)."),
        nprobe: int = typer.Option(16, "--nprobe", help="IVF-PQ: lists probed per query."),
        nbits: int = typer.Option(
            8,
            "--nbits",
            help="IVF-PQ: bits per sub-quantizer code; 4 writes faiss's fast-scan layout (several "
            "times faster to search at the same bytes with twice --pq-m; re-rank with --keep-vectors).",
        ),
        shards: int | None = typer.Option(
            None, "--shards", help="Dense: split the faiss index into this many contiguous shards."
        ),
        train_sample: int | None = typer.Option(
            None, "--train-sample", help="IVF-PQ (sharded layout): vectors sampled to train the quantizers."
        ),
        ivf_device: str | None = typer.Option(
            None,
            "--ivf-device",
            help="IVF-PQ: where the coarse k-means and list assignment run: auto (a GPU "
            "when torch sees one, else cpu), cpu (faiss alone), torch-cpu, cuda or cuda:N.",
        ),
        embeddings: Path | None = typer.Option(
            None,
            "--embeddings",
            help="Dense: precomputed float16 [passages x dim] passage embeddings "
            "(sleuth.retrieval.index.encode_docstore, e.g. made on a GPU) instead of encoding here.",
        ),
        keep_vectors: bool = typer.Option(
            False, "--keep-vectors", help="Dense (sharded layout): keep float16 vectors for exact re-ranking."
        ),
        k1: float = typer.Option(0.9, "--k1", help="BM25 k1."),
        b: float = typer.Option(0.4, "--b", help="BM25 b."),
        threads: int = typer.Option(1, "--threads", help="CPU threads for encoding."),
        workers: int = typer.Option(1, "--workers", help="BM25: processes tokenizing and filling shards."),
        shard_docs: int | None = typer.Option(
            None,
            "--shard-docs",
            help="BM25: passages per build shard (memory per worker grows with it; default 250,000).",
        ),
        docstore_from: Path | None = typer.Option(
            None,
            "--docstore-from",
            help="An index of the same corpus (e.g. its BM25 index) whose docstore is "
            "hard-linked instead of reading the corpus again (the corpus file may then be omitted).",
        ),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing index in --out."),
    ) -> None:
        """Build a BM25 or dense index of a corpus (docstore + index + manifest.json)."""
        import time

        if kind not in KINDS:
            _fail(f"--kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if corpus is None and docstore_from is None:
            _fail("give a corpus file, or --docstore-from an index of the corpus")
        if corpus is not None and not corpus.is_file():
            _fail(f"corpus {corpus} does not exist (expected a jsonl file with 'id' and 'contents')")
        if kind == "bm25":
            params: dict = {"k1": k1, "b": b, "workers": workers}
            if shard_docs is not None:
                params["shard_docs"] = shard_docs
        else:
            if faiss_type not in ("flat", "hnsw", "ivfpq"):
                _fail(f"--faiss must be flat, hnsw or ivfpq, got {faiss_type!r}")
            params = {
                "encoder": encoder,
                "faiss": faiss_type,
                "query_prefix": query_prefix,
                "passage_prefix": passage_prefix,
                "batch_size": batch_size,
                "device": device,
            }
            if faiss_type == "hnsw":
                params.update(M=hnsw_m, ef_search=ef_search)
            elif faiss_type == "ivfpq":
                params.update(nlist=nlist, m=pq_m, nprobe=nprobe, nbits=nbits)
                if ivf_device is not None:
                    params["ivf_device"] = ivf_device
            elif ivf_device is not None:
                _fail(f"--ivf-device applies to --faiss ivfpq, got --faiss {faiss_type}")
            if shards is not None:
                params["shards"] = shards
            if train_sample is not None:
                params["train_sample"] = train_sample
            if keep_vectors:
                params["keep_vectors"] = True
            if embeddings is not None:
                params["embeddings"] = str(embeddings)
        t0 = time.perf_counter()
        try:
            manifest = build_index(
                corpus, kind, out, overwrite=overwrite, threads=threads, docstore_from=docstore_from, **params
            )
        except (SleuthError, FileExistsError, FileNotFoundError, ValueError) as err:
            _fail(str(err))
        _print_index_summary(out, manifest, time.perf_counter() - t0)

    app.command("index")(index_cmd)
    # `serve-retriever`'s help names `sleuth build-index`; keep that spelling working.
    app.command("build-index", hidden=True)(index_cmd)

    @app.command("encode")
    def encode_cmd(
        index_dir: Path = typer.Argument(..., help="An index directory (any kind): its docstore is encoded."),
        out: Path = typer.Option(..., "--out", "-o", help="The float16 [passages x dim] file to write."),
        devices: str = typer.Option(
            "all", "--devices", help="all (one process per visible GPU), cuda:0,cuda:1, or cpu / cpu,cpu."
        ),
        encoder: str = typer.Option("minilm", "--encoder", help="Alias 'minilm', a model dir or hub name."),
        passage_prefix: str = typer.Option(
            "", "--passage-prefix", help="Prepended to passages (E5: 'passage: ')."
        ),
        batch_size: int = typer.Option(512, "--batch-size", help="Passages per forward pass."),
        max_length: int | None = typer.Option(
            None, "--max-length", help="Truncate passages to this many tokens."
        ),
        fp32: bool = typer.Option(
            False, "--fp32", help="Keep the model in float32 on GPUs (default: float16)."
        ),
        procs_per_gpu: int | None = typer.Option(
            None,
            "--procs-per-gpu",
            help="Worker processes per GPU (default: cores / GPUs: tokenizing needs the cores).",
        ),
    ) -> None:
        """Encode an index's passages for `sleuth index --embeddings`, one worker per device; a rerun
        after an interruption resumes."""
        if batch_size <= 0:
            _fail(f"--batch-size must be positive, got {batch_size}")
        if not (index_dir / "docstore" / "docstore.json").is_file():
            _fail(f"{index_dir} has no docstore/; build an index of the corpus first (`sleuth index`)")
        config = EncoderConfig(
            name=encoder, passage_prefix=passage_prefix, batch_size=batch_size, max_length=max_length
        )
        try:
            result = encode_docstore_parallel(
                index_dir / "docstore",
                out,
                config,
                devices,
                EncodePlan(fp16=not fp32, procs_per_gpu=procs_per_gpu),
            )
        except (SleuthError, FileNotFoundError, ValueError, RuntimeError) as err:
            _fail(str(err))
        rate = result["passages_per_second"]
        typer.echo(
            f"wrote {out}: {result['rows']:,} x {result['dim']} float16 on {','.join(result['devices'])} "
            f"({result['workers']} processes) in "
            f"{result['seconds']:.1f} s"
            + (f" ({rate:,.0f} passages/s encoding)" if rate else "")
            + (
                f"; {result['resumed_ranges']} ranges kept from an earlier run"
                if result["resumed_ranges"]
                else ""
            )
        )

    @app.command("search")
    def search_cmd(
        index_dir: Path = typer.Argument(..., help="Index directory built by `sleuth index`."),
        query: str = typer.Argument(..., help="The query text."),
        k: int = typer.Option(5, "-k", "--top-k", help="Number of passages to show."),
        corpus: Path | None = typer.Option(
            None, "--corpus", help="Check the index was built from this corpus."
        ),
        width: int = typer.Option(300, "--width", help="Characters of passage text to show."),
    ) -> None:
        """Search an index and print the top-k passages."""
        from rich.console import Console
        from rich.table import Table

        if k <= 0:
            _fail(f"-k must be a positive integer, got {k}")
        if not query.strip():
            _fail("the query is empty; pass the text to search for")
        try:
            retriever = load_retriever(index_dir, corpus=corpus)
            hits = retriever.search([query], k)[0]
        except (SleuthError, FileNotFoundError, ValueError) as err:
            _fail(str(err))
        table = Table(title=f"{query!r} in {index_dir}")
        table.add_column("#", justify="right")
        table.add_column("score", justify="right")
        table.add_column("id")
        table.add_column("title")
        table.add_column("text")
        for rank, hit in enumerate(hits, start=1):
            text = hit.text if len(hit.text) <= width else hit.text[:width] + "…"
            table.add_row(str(rank), f"{hit.score:.3f}", hit.doc_id, hit.title, text)
        console = Console()
        console.print(table)
        if not hits:
            console.print("no passage matched the query")
