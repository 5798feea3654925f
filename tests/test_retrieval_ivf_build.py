"""The accelerator-assisted IVF-PQ build (sleuth.retrieval.ivf_build), run by torch on the CPU: the same
code runs on a GPU. References are independent of the code under test: exact numpy inner-product search,
numpy argmax, and faiss's own training and `index.add`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from sleuth.errors import ConfigError
from sleuth.retrieval import build_index, load_retriever, read_manifest
from sleuth.retrieval.dense import faiss_params, new_faiss_index
from sleuth.retrieval.ivf_build import (
    TORCH_CPU,
    IvfBuilder,
    KMeansConfig,
    _split_empty,
    assign,
    kmeans,
    resolve_ivf_device,
)
from test_retrieval_sharded import HashEncoder, _write_corpus

faiss = pytest.importorskip("faiss")
DIM = 32


def _clustered(n: int, centers: int, seed: int) -> np.ndarray:
    """Unit vectors around `centers` random directions (clustered like sentence embeddings)."""
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((centers, DIM)).astype(np.float32)
    x = c[rng.integers(0, centers, n)] + 0.35 * rng.standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _built(device: str, x: np.ndarray, params: dict, template=None, train: int = 4000):
    builder = IvfBuilder(device, seed=0)
    if template is None:
        template = new_faiss_index(DIM, params, len(x))
        builder.train(template, x[:train])
    index = faiss.clone_index(template)
    builder.fill(index, x, 0, len(x))
    return index, builder


def _lists(index) -> list[tuple[np.ndarray, np.ndarray]]:
    from faiss.contrib.inspect_tools import get_invlist

    ivf = faiss.extract_index_ivf(index)
    return [get_invlist(ivf.invlists, i) for i in range(ivf.nlist)]


def _recall(index, x: np.ndarray, queries: np.ndarray, k: int) -> float:
    exact = np.argsort(-(queries @ x.T), axis=1)[:, :k]
    _, got = index.search(queries, k)
    return float(np.mean([len(set(g) & set(e)) / k for g, e in zip(got, exact, strict=True)]))


def _list_recall(index, x: np.ndarray, queries: np.ndarray, nprobe: int, k: int = 10) -> float:
    """The coarse quantizer alone: the share of each query's exact top k that sits in a list it probes."""
    quantizer = faiss.extract_index_ivf(index).quantizer
    exact = np.argsort(-(queries @ x.T), axis=1)[:, :k]
    _, lists = quantizer.search(x, 1)
    _, probed = quantizer.search(queries, nprobe)
    return float(np.mean([np.isin(lists[e, 0], p).mean() for e, p in zip(exact, probed, strict=True)]))


def test_torch_kmeans_index_recalls_like_the_faiss_trained_one() -> None:
    faiss.omp_set_num_threads(1)
    x = _clustered(12000, 48, seed=1)
    queries = _clustered(300, 48, seed=2)
    params = faiss_params("ivfpq", nlist=32, m=16, nbits=8, nprobe=4)
    faiss_index, _ = _built("cpu", x, params, train=10000)
    torch_index, builder = _built(TORCH_CPU, x, params, train=10000)
    record = builder.record()
    assert record["path"] == "torch-assisted" and record["device"] == TORCH_CPU
    assert set(record["seconds"]) == {"train_coarse", "train_pq", "add"}
    assert record["kmeans"]["iterations"] >= 1 and record["kmeans"]["points"] == 8192  # 256 per list
    for nprobe in (1, 2, 4):
        ours, theirs = (
            _list_recall(torch_index, x, queries, nprobe),
            _list_recall(faiss_index, x, queries, nprobe),
        )
        assert ours >= theirs - 0.02, (nprobe, ours, theirs)
        faiss_index.nprobe = torch_index.nprobe = nprobe
        ours, theirs = _recall(torch_index, x, queries, 10), _recall(faiss_index, x, queries, 10)
        assert ours >= theirs - 0.03, (nprobe, ours, theirs)
    assert ours > 0.6
    # Spherical k-means for an inner-product IVF index, as faiss's IndexIVF sets it.
    centroids = faiss.extract_index_ivf(torch_index).quantizer.reconstruct_n(0, 32)
    np.testing.assert_allclose(np.linalg.norm(centroids, axis=1), 1, atol=1e-5)


def test_kmeans_is_seeded_and_its_objective_matches_faiss_clustering() -> None:
    x = _clustered(5000, 40, seed=3)
    config = KMeansConfig(niter=10, seed=7)
    a, b = kmeans(x, 40, TORCH_CPU, config), kmeans(x, 40, TORCH_CPU, config)
    np.testing.assert_array_equal(a.centroids, b.centroids)
    assert not np.array_equal(a.centroids, kmeans(x, 40, TORCH_CPU, KMeansConfig(niter=10, seed=8)).centroids)
    clus = faiss.Clustering(DIM, 40)
    clus.niter, clus.spherical = 10, True
    clus.train(x, faiss.IndexFlatIP(DIM))
    faiss_obj = clus.iteration_stats.at(clus.iteration_stats.size() - 1).obj
    assert a.objective >= 0.98 * faiss_obj, (a.objective, faiss_obj)


def test_kmeans_subsamples_like_faiss() -> None:
    x = _clustered(3000, 10, seed=4)
    result = kmeans(x, 10, TORCH_CPU, KMeansConfig(max_points_per_centroid=100))
    assert result.points == 1000


def test_assignment_equals_numpy_argmax_and_argmin() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3000, DIM)).astype(np.float32)
    c = rng.standard_normal((200, DIM)).astype(np.float32)
    scores = x @ c.T
    top2 = np.sort(scores, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-4  # ties aside
    labels, best = assign(torch.from_numpy(x), torch.from_numpy(c), inner_product=True)
    np.testing.assert_array_equal(labels.numpy()[clear], scores.argmax(axis=1)[clear])
    np.testing.assert_allclose(best.numpy(), scores.max(axis=1), rtol=1e-5, atol=1e-5)
    dist = ((x[:, None, :] - c[None, :, :]) ** 2).sum(-1)
    labels, _ = assign(torch.from_numpy(x), torch.from_numpy(c), inner_product=False)
    close = np.sort(dist, axis=1)[:, :2]
    clear = close[:, 1] - close[:, 0] > 1e-3
    np.testing.assert_array_equal(labels.numpy()[clear], dist.argmin(axis=1)[clear])
    assert clear.mean() > 0.95


def test_preassigned_add_gives_the_codes_index_add_gives() -> None:
    """Same trained template: `index.add` (faiss assigns) and the builder's fill (torch assigns, add_core)
    hold bit-identical lists (ids and PQ codes) and return the same neighbours."""
    faiss.omp_set_num_threads(1)
    x = _clustered(6000, 30, seed=6)
    params = faiss_params("ivfpq", nlist=24, m=8, nbits=6, nprobe=6)
    template = new_faiss_index(DIM, params, len(x))
    template.train(x[:3000])
    reference = faiss.clone_index(template)
    reference.add(x)
    _, faiss_labels = template.quantizer.search(x, 1)
    ours, _ = _built(TORCH_CPU, x, params, template=template)
    torch_labels, _ = assign(torch.from_numpy(x), torch.from_numpy(template.quantizer.reconstruct_n(0, 24)))
    assert np.array_equal(torch_labels.numpy(), faiss_labels[:, 0])  # no near-ties in this data
    assert ours.ntotal == reference.ntotal == len(x)
    for (ids_a, codes_a), (ids_b, codes_b) in zip(_lists(ours), _lists(reference), strict=True):
        np.testing.assert_array_equal(ids_a, ids_b)
        np.testing.assert_array_equal(codes_a, codes_b)
    queries = _clustered(100, 30, seed=7)
    np.testing.assert_array_equal(ours.search(queries, 10)[1], reference.search(queries, 10)[1])


def test_an_empty_cluster_takes_half_of_the_largest() -> None:
    centroids = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0] * 4, [5.0, 6.0, 7.0, 8.0], [0.0] * 4])
    counts = np.array([10.0, 0.0, 4.0, 0.0])
    assert _split_empty(centroids, counts) == 2
    eps, sign = 1 / 1024, np.array([1, -1, 1, -1])
    donor = np.array([1.0, 2.0, 3.0, 4.0])
    # First split: cluster 0 (10 points) gives half; then cluster 0 and 1 hold 5 each and 0 gives again.
    np.testing.assert_allclose(centroids[1].numpy(), donor * (1 + eps * sign), rtol=1e-6)
    np.testing.assert_allclose(centroids[3].numpy(), donor * (1 - eps * sign) * (1 + eps * sign), rtol=1e-6)
    np.testing.assert_allclose(centroids[0].numpy(), donor * (1 - eps * sign) ** 2, rtol=1e-6)
    np.testing.assert_array_equal(counts, [2.5, 5.0, 4.0, 2.5])


def test_kmeans_with_empty_clusters_keeps_every_centroid_usable() -> None:
    """Two distinct points, repeated, into 6 clusters: the initial centroids coincide, so clusters go
    empty every iteration and are refilled by splitting, never left as zero (or NaN) vectors."""
    rng = np.random.default_rng(8)
    points = _clustered(2, 2, seed=9)
    x = points[rng.integers(0, 2, 400)]
    result = kmeans(x, 6, TORCH_CPU, KMeansConfig(niter=5))
    assert result.splits > 0
    assert np.isfinite(result.centroids).all()
    np.testing.assert_allclose(np.linalg.norm(result.centroids, axis=1), 1, atol=1e-5)
    best = (points @ result.centroids.T).max(axis=1)
    np.testing.assert_allclose(best, 1, atol=1e-4)  # both points still have a centroid on them


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ivf") / "corpus.jsonl"
    _write_corpus(path, 1200, seed=2, words_per_doc=10)
    return path


def test_manifest_records_the_path_and_the_phases(corpus: Path, tmp_path: Path) -> None:
    encoder = HashEncoder()
    common = {
        "encoder": encoder,
        "faiss": "ivfpq",
        "nlist": 16,
        "m": 8,
        "nbits": 6,
        "nprobe": 16,
        "show_progress": False,
    }
    manifest = build_index(
        corpus, "dense", tmp_path / "a", shards=2, keep_vectors=True, ivf_device=TORCH_CPU, **common
    )
    ivf = read_manifest(tmp_path / "a")["ivf_build"]
    assert ivf == manifest["ivf_build"]
    assert ivf["path"] == "torch-assisted" and ivf["device"] == ivf["requested"] == TORCH_CPU
    assert set(ivf["seconds"]) == {"spool", "sample", "train_coarse", "train_pq", "add", "write"}
    retriever = load_retriever(tmp_path / "a", encoder=encoder)
    assert len(retriever.search(["w1 w2 w3"], 5)[0]) == 5
    default = build_index(corpus, "dense", tmp_path / "b", shards=2, **common)["ivf_build"]
    assert default["requested"] == "auto"
    if not torch.cuda.is_available():
        assert default["path"] == "faiss-cpu" and set(default["seconds"]) == {
            "spool",
            "sample",
            "train",
            "add",
            "write",
        }
    single = build_index(corpus, "dense", tmp_path / "c", ivf_device=TORCH_CPU, **common)["ivf_build"]
    assert single["path"] == "torch-assisted" and set(single["seconds"]) == {
        "train_coarse",
        "train_pq",
        "add",
    }
    assert "ivf_build" not in build_index(
        corpus, "dense", tmp_path / "d", encoder=encoder, show_progress=False
    )


def test_bad_ivf_device_is_a_clear_error(corpus: Path, tmp_path: Path) -> None:
    encoder = HashEncoder()
    for bad in ("gpu", "cuda:x", "CPU", 3):
        with pytest.raises(ConfigError, match="ivf_device must be one of"):
            build_index(
                corpus,
                "dense",
                tmp_path / "x",
                encoder=encoder,
                faiss="ivfpq",
                nlist=16,
                m=8,
                ivf_device=bad,
                show_progress=False,
            )
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="torch sees 0 CUDA device"):
            resolve_ivf_device("cuda:0")
        assert resolve_ivf_device("auto") == resolve_ivf_device(None) == "cpu"
    with pytest.raises(ConfigError, match="ivf_device applies to ivfpq"):
        build_index(
            corpus, "dense", tmp_path / "y", encoder=encoder, shards=2, ivf_device="cpu", show_progress=False
        )
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    from sleuth.cli import app

    res = CliRunner().invoke(
        app,
        [
            "index",
            str(corpus),
            "--kind",
            "dense",
            "--faiss",
            "ivfpq",
            "--ivf-device",
            "tpu",
            "--out",
            str(tmp_path / "z"),
        ],
    )
    assert res.exit_code != 0 and "ivf_device must be one of" in " ".join(res.output.split())
    res = CliRunner().invoke(
        app, ["index", str(corpus), "--kind", "dense", "--ivf-device", "cpu", "--out", str(tmp_path / "z")]
    )
    assert res.exit_code != 0 and "--ivf-device applies to --faiss ivfpq" in " ".join(res.output.split())


def test_faiss_trains_only_the_pq_once_the_centroids_are_in(capfd: pytest.CaptureFixture[str]) -> None:
    """IndexIVF.train skips its level-1 k-means when the quantizer is trained and holds nlist centroids
    (faiss 1.15.1 says so when verbose): the centroids after training are the torch k-means' own."""
    x = _clustered(3000, 20, seed=10)
    params = faiss_params("ivfpq", nlist=16, m=8, nbits=6, nprobe=4)
    template = new_faiss_index(DIM, params, len(x))
    template.verbose = True
    IvfBuilder(TORCH_CPU, seed=3).train(template, x)
    assert "IVF quantizer does not need training" in capfd.readouterr().out
    ivf = faiss.extract_index_ivf(template)
    expected = kmeans(x, 16, TORCH_CPU, KMeansConfig.from_index(ivf, 3)).centroids
    np.testing.assert_array_equal(ivf.quantizer.reconstruct_n(0, 16), expected)
    assert template.is_trained and template.pq.centroids.size() == 8 * 64 * (DIM // 8)
