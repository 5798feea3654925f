"""IVF-PQ build with an accelerator: the coarse k-means and the coarse assignment of every vector run in
torch (on a GPU when there is one), faiss trains the product quantizer and encodes the PQ codes on the CPU.

Why: at 21M passages, nlist 8192, 384 dims, faiss on the CPU spends its time in two dense products, the
k-means (sample x nlist x dim per iteration) and the assignment of every vector (21M x 8192 x 384, about
130 TFLOP); both are one matrix product and an argmax, seconds on a GPU. What is left on the CPU, the PQ
codes of the residuals, costs about 10 CPU-seconds per million vectors (bench/ivfpq_build_cost.py) and
faiss spreads it over all cores.

The k-means follows faiss's `Clustering` as `IndexIVF` configures it (`index.cp`): random distinct
training points as the initial centroids, `cp.niter` iterations, assignment by the index's metric (max
inner product, or min L2), centroid = mean of its points, renormalised when `cp.spherical` (faiss sets it
for inner-product IVF indexes), at most `cp.max_points_per_centroid` x nlist points (a random subsample
beyond), stop early when the objective does not change. An empty cluster takes half of the largest
cluster, as faiss's `split_clusters` does (copy its centroid, push the two copies apart by 1/1024 in
alternate coordinates); faiss picks the donor at random weighted by size and falls back to the
largest, this picks the largest always (deterministic). Random draws come from a CPU torch generator
seeded with the build's seed, so a CPU run is deterministic; on a GPU the per-cluster sums use atomic
adds and may differ in the last bits from run to run.

Faiss then gets the centroids in its quantizer and `index.train` trains only the PQ on residuals
(`IndexIVF::train` skips its level-1 training when the quantizer is trained and holds nlist vectors),
and vectors are added with their precomputed lists (`add_core`, as `faiss.contrib.ivf_tools.
add_preassigned` does), which computes the same codes `index.add` would for the same lists.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from sleuth.errors import ConfigError

# Vectors per faiss add call: bounds the float32 copy held in RAM.
ADD_CHUNK = 65536
FAISS_CPU = "cpu"
TORCH_CPU = "torch-cpu"
AUTO = "auto"
IVF_DEVICE_CHOICES = "'auto', 'cpu' (faiss alone), 'torch-cpu', 'cuda' or 'cuda:N'"
# Each (rows x nlist) float32 score block stays under this, so the assignment fits any device.
_SCORE_BLOCK_BYTES = 1 << 28
# faiss's split_clusters perturbation ("a bit above machine epsilon for float16").
_SPLIT_EPS = 1.0 / 1024.0
_CUDA = re.compile(r"cuda(?::(\d+))?")


def resolve_ivf_device(value: str | None) -> str:
    """Where an IVF build runs: 'cpu' (faiss alone, the build of sleuth <= this change), 'torch-cpu' (the
    assisted build run by torch on the CPU: for tests and comparisons) or 'cuda:N'. None or 'auto' picks
    the current CUDA device when torch sees one, else 'cpu'."""
    if value is None or value == AUTO:
        try:
            import torch  # deferred: torch is heavy and a faiss-only build does not need it
        except ImportError:
            return FAISS_CPU
        return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else FAISS_CPU
    if not isinstance(value, str):
        raise ConfigError(f"ivf_device must be one of {IVF_DEVICE_CHOICES}, got {value!r}")
    if value in (FAISS_CPU, TORCH_CPU):
        return value
    match = _CUDA.fullmatch(value)
    if match is None:
        raise ConfigError(f"ivf_device must be one of {IVF_DEVICE_CHOICES}, got {value!r}")
    import torch  # deferred: torch is heavy and a faiss-only build does not need it

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ordinal = (
        int(match.group(1)) if match.group(1) is not None else (torch.cuda.current_device() if count else 0)
    )
    if ordinal >= count:
        raise ConfigError(
            f"ivf_device={value!r}: torch sees {count} CUDA device(s); use 'auto', 'cpu' or a visible GPU"
        )
    return f"cuda:{ordinal}"


@dataclass(frozen=True)
class KMeansConfig:
    """faiss `ClusteringParameters` that the k-means follows (see the module docstring)."""

    niter: int = 10
    inner_product: bool = True
    spherical: bool = True
    max_points_per_centroid: int = 256
    seed: int = 0

    @classmethod
    def from_index(cls, ivf: Any, seed: int) -> KMeansConfig:
        import faiss  # deferred: faiss is heavy; only dense indexes need it

        if ivf.metric_type not in (faiss.METRIC_INNER_PRODUCT, faiss.METRIC_L2):
            raise ConfigError(
                f"the assisted IVF build supports inner product and L2, not metric {ivf.metric_type}"
            )
        cp = ivf.cp
        return cls(
            niter=int(cp.niter),
            inner_product=ivf.metric_type == faiss.METRIC_INNER_PRODUCT,
            spherical=bool(cp.spherical),
            max_points_per_centroid=int(cp.max_points_per_centroid),
            seed=seed,
        )


@dataclass(frozen=True)
class KMeansResult:
    centroids: np.ndarray  # (k, dim) float32
    iterations: int
    splits: int  # empty clusters refilled, summed over the iterations
    points: int  # training points after the subsample
    objective: float  # sum of max inner products (or of squared L2 distances) at the last assignment


def assign(x: Any, centroids: Any, inner_product: bool = True) -> tuple[Any, Any]:
    """Nearest centroid of each row of `x` (torch tensors on one device): (labels int64, best score).

    The score is the inner product, or for L2 `x.c - |c|^2 / 2` (same argmax as the smallest distance).
    """
    import torch  # deferred: torch is heavy and a faiss-only build does not need it

    n, k = x.shape[0], centroids.shape[0]
    half_norms = None if inner_product else 0.5 * (centroids * centroids).sum(dim=1)
    labels = torch.empty(n, dtype=torch.int64, device=x.device)
    best = torch.empty(n, dtype=torch.float32, device=x.device)
    step = max(1, _SCORE_BLOCK_BYTES // (4 * k))
    for start in range(0, n, step):
        scores = x[start : start + step] @ centroids.T
        if half_norms is not None:
            scores -= half_norms
        best[start : start + step], labels[start : start + step] = scores.max(dim=1)
    return labels, best


def _split_empty(centroids: Any, counts: np.ndarray) -> int:
    """Give every empty cluster half of the currently largest one (faiss's split, deterministic donor)."""
    import torch  # deferred: torch is heavy and a faiss-only build does not need it

    empty = np.flatnonzero(counts == 0)
    if empty.size == 0:
        return 0
    sign = torch.ones(centroids.shape[1], device=centroids.device)
    sign[1::2] = -1
    for ci in empty:
        cj = int(np.argmax(counts))
        donor = centroids[cj].clone()
        centroids[ci] = donor * (1 + _SPLIT_EPS * sign)
        centroids[cj] = donor * (1 - _SPLIT_EPS * sign)
        counts[ci] = counts[cj] / 2
        counts[cj] -= counts[ci]
    return int(empty.size)


def kmeans(x: np.ndarray, k: int, device: str, config: KMeansConfig) -> KMeansResult:
    """k-means of the rows of `x` on a torch device, following faiss's `Clustering` (module docstring)."""
    import torch  # deferred: torch is heavy and a faiss-only build does not need it

    n = len(x)
    if n < k:
        raise ConfigError(f"k-means needs at least k={k} training vectors, got {n}")
    device = "cpu" if device == TORCH_CPU else device
    generator = torch.Generator().manual_seed(config.seed)
    if n > k * config.max_points_per_centroid:
        keep = torch.randperm(n, generator=generator)[: k * config.max_points_per_centroid]
        x = x[np.sort(keep.numpy())]
    xt = torch.as_tensor(np.ascontiguousarray(x, dtype=np.float32)).to(device)
    first = torch.randperm(len(xt), generator=generator)[:k].to(device)
    centroids = xt[first].clone()
    if len(xt) == k:  # faiss's corner case: the points are the centroids
        return KMeansResult(centroids.cpu().numpy(), 0, 0, k, 0.0)

    def post_process(c: Any) -> Any:
        return torch.nn.functional.normalize(c, dim=1) if config.spherical else c

    centroids = post_process(centroids)
    squared_norms = None if config.inner_product else (xt * xt).sum(dim=1)
    previous, splits, iterations, objective = None, 0, 0, 0.0
    for _ in range(config.niter):
        labels, best = assign(xt, centroids, config.inner_product)
        objective = float(best.sum() if squared_norms is None else (squared_norms - 2 * best).sum())
        sums = torch.zeros_like(centroids).index_add_(0, labels, xt)
        counts = torch.bincount(labels, minlength=k)
        centroids = sums / counts.clamp(min=1).unsqueeze(1).to(sums.dtype)
        splits += _split_empty(centroids, counts.cpu().numpy().astype(np.float64))
        centroids = post_process(centroids)
        iterations += 1
        # faiss's default early_stop_threshold is 0: stop once the objective no longer changes at all.
        if previous is not None and objective == previous:
            break
        previous = objective
    return KMeansResult(centroids.cpu().numpy().astype(np.float32), iterations, splits, len(xt), objective)


def assigned_chunks(
    vectors: np.ndarray, start: int, stop: int, centroids: Any, device: str, inner_product: bool = True
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(float32 rows, list numbers) for rows `[start, stop)` of `vectors` (float16 or float32, e.g. a
    memory-mapped spool) in chunks of ADD_CHUNK; `centroids` is a tensor on `device`.

    The next chunk is read, converted and assigned in a background thread while the caller adds the
    current one (faiss releases the GIL). On a GPU the float16 rows travel as they are and come back
    as float32 (faster than numpy converting them on one core).
    """
    import torch  # deferred: torch is heavy and a faiss-only build does not need it

    on_cpu = device in (TORCH_CPU, "cpu")

    def prepare(lo: int) -> tuple[np.ndarray, np.ndarray]:
        block = vectors[lo : min(lo + ADD_CHUNK, stop)]
        if on_cpu:
            rows = np.ascontiguousarray(block, dtype=np.float32)
            xt = torch.from_numpy(rows)
        else:
            # A copy: torch refuses to wrap a read-only memory map without a warning.
            xt = torch.from_numpy(np.array(block)).to(device).float()
            rows = xt.cpu().numpy()
        labels, _ = assign(xt, centroids, inner_product)
        return rows, labels.cpu().numpy()

    starts = list(range(start, stop, ADD_CHUNK))
    if not starts:
        return
    with ThreadPoolExecutor(1, thread_name_prefix="sleuth-ivf-assign") as pool:
        pending = pool.submit(prepare, starts[0])
        for following in [*starts[1:], None]:
            ready = pending.result()
            if following is not None:
                pending = pool.submit(prepare, following)
            yield ready


class IvfBuilder:
    """Trains an empty IVF index and fills copies of it, by faiss alone ('cpu') or assisted by torch on
    `device` ('torch-cpu', 'cuda:N'); keeps the seconds of each phase for the index manifest."""

    def __init__(self, ivf_device: str | None, seed: int = 0):
        self.requested = AUTO if ivf_device is None else ivf_device
        self.device = resolve_ivf_device(ivf_device)
        self.assisted = self.device != FAISS_CPU
        self.seed = seed
        self.seconds: dict[str, float] = {}
        self.kmeans: dict[str, Any] | None = None
        self._centroids: Any = None
        self._inner_product = True

    def clock(self, phase: str, since: float) -> float:
        """Add the seconds since `since` to `phase`; returns now (the next phase's start)."""
        now = time.perf_counter()
        self.seconds[phase] = round(self.seconds.get(phase, 0.0) + now - since, 3)
        return now

    def train(self, template: Any, sample: np.ndarray) -> None:
        """Train `template` (an empty IVF index) on the float32 `sample`."""
        import faiss  # deferred: faiss is heavy; only dense indexes need it

        t0 = time.perf_counter()
        if not self.assisted:
            template.train(sample)
            self.clock("train", t0)
            return
        ivf = faiss.extract_index_ivf(template)
        config = KMeansConfig.from_index(ivf, self.seed)
        result = kmeans(sample, ivf.nlist, self.device, config)
        if ivf.quantizer.ntotal:
            raise RuntimeError("the IVF quantizer already holds centroids; give an untrained index")
        ivf.quantizer.add(result.centroids)
        t1 = self.clock("train_coarse", t0)
        # The quantizer is trained and holds nlist centroids, so faiss trains only the PQ on residuals.
        template.train(sample)
        if ivf.quantizer.ntotal != ivf.nlist:
            raise RuntimeError(
                f"faiss replaced the coarse centroids: {ivf.quantizer.ntotal} for nlist {ivf.nlist}"
            )
        self.clock("train_pq", t1)
        self.kmeans = {
            "iterations": result.iterations,
            "points": result.points,
            "empty_cluster_splits": result.splits,
            "objective": round(result.objective, 4),
        }
        self._inner_product = config.inner_product
        self._centroids = self._device_centroids(ivf)

    def _device_centroids(self, ivf: Any) -> Any:
        import torch  # deferred: torch is heavy and a faiss-only build does not need it

        centroids = ivf.quantizer.reconstruct_n(0, ivf.nlist)
        return torch.as_tensor(centroids).to("cpu" if self.device == TORCH_CPU else self.device)

    def fill(self, index: Any, vectors: np.ndarray, start: int, stop: int) -> None:
        """Add rows `[start, stop)` of `vectors` to `index` (a copy of the trained template)."""
        import faiss  # deferred: faiss is heavy; only dense indexes need it

        t0 = time.perf_counter()
        if not self.assisted:
            for lo in range(start, stop, ADD_CHUNK):
                index.add(np.ascontiguousarray(vectors[lo : min(lo + ADD_CHUNK, stop)], dtype=np.float32))
            self.clock("add", t0)
            return
        ivf = faiss.downcast_index(index)
        if not isinstance(ivf, faiss.IndexIVF):
            # add_core skips whatever a wrapper (a pre-transform) would apply first.
            raise ConfigError(f"the assisted IVF build fills plain IVF indexes, got {type(ivf).__name__}")
        if self._centroids is None:
            self._centroids = self._device_centroids(ivf)
        for rows, labels in assigned_chunks(
            vectors, start, stop, self._centroids, self.device, self._inner_product
        ):
            # IndexIVF.add without its quantizer search (faiss.contrib.ivf_tools.add_preassigned).
            ivf.add_core(len(rows), faiss.swig_ptr(rows), None, faiss.swig_ptr(labels))
        self.clock("add", t0)

    def record(self) -> dict[str, Any]:
        """The manifest's `ivf_build`: which path built the index, where, and the seconds of each phase."""
        out: dict[str, Any] = {
            "path": "torch-assisted" if self.assisted else "faiss-cpu",
            "device": self.device,
            "requested": self.requested,
            "seconds": dict(self.seconds),
        }
        if self.kmeans is not None:
            out["kmeans"] = dict(self.kmeans)
        return out
