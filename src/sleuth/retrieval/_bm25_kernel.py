"""BM25 top-k over bm25s' saved score matrix, compiled once and cached on disk.

bm25s' own numba kernels are not cached, so every new process spends ~5-9 s compiling them
before its first query; these `cache=True` kernels load from `__pycache__` after the first run.
The arithmetic is bm25s': a query's score for a passage is the sum over its query tokens of the
precomputed per-(token, passage) BM25 weight stored column-wise (CSC: indptr over tokens).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _sift_down(heap_s, heap_i, size, pos):
    # Min-heap on (score, -index): the root is the weakest kept hit; on equal scores the larger
    # passage index counts as weaker, so ties keep the smaller index (deterministic order).
    while True:
        left = 2 * pos + 1
        if left >= size:
            return
        child = left
        right = left + 1
        if right < size and (
            heap_s[right] < heap_s[left] or (heap_s[right] == heap_s[left] and heap_i[right] > heap_i[left])
        ):
            child = right
        if heap_s[child] < heap_s[pos] or (heap_s[child] == heap_s[pos] and heap_i[child] > heap_i[pos]):
            heap_s[pos], heap_s[child] = heap_s[child], heap_s[pos]
            heap_i[pos], heap_i[child] = heap_i[child], heap_i[pos]
            pos = child
        else:
            return


@njit(cache=True, nogil=True)
def bm25_topk_batch(query_ids, query_ptr, data, indices, indptr, num_docs, k, out_ids, out_scores, out_count):
    """Fill out_ids/out_scores[q, :out_count[q]] with query q's top-k passages (score > 0), best first."""
    scores = np.zeros(num_docs, dtype=np.float32)
    heap_s = np.empty(k, dtype=np.float32)
    heap_i = np.empty(k, dtype=np.int64)
    for q in range(len(query_ptr) - 1):
        toks = query_ids[query_ptr[q] : query_ptr[q + 1]]
        n_post = 0
        for t in toks:
            n_post += indptr[t + 1] - indptr[t]
        touched = np.empty(n_post, dtype=np.int64)
        n_touched = 0
        for t in toks:
            for j in range(indptr[t], indptr[t + 1]):
                d = indices[j]
                if scores[d] == 0.0:
                    touched[n_touched] = d
                    n_touched += 1
                scores[d] += data[j]
        size = 0
        for a in range(n_touched):
            d = touched[a]
            s = scores[d]
            if s <= 0.0:
                continue
            if size < k:
                # Insert and restore heap order by sifting the new leaf up.
                pos = size
                heap_s[pos] = s
                heap_i[pos] = d
                size += 1
                while pos > 0:
                    parent = (pos - 1) // 2
                    if heap_s[pos] < heap_s[parent] or (
                        heap_s[pos] == heap_s[parent] and heap_i[pos] > heap_i[parent]
                    ):
                        heap_s[pos], heap_s[parent] = heap_s[parent], heap_s[pos]
                        heap_i[pos], heap_i[parent] = heap_i[parent], heap_i[pos]
                        pos = parent
                    else:
                        break
            elif s > heap_s[0] or (s == heap_s[0] and d < heap_i[0]):
                heap_s[0] = s
                heap_i[0] = d
                _sift_down(heap_s, heap_i, size, 0)
        # Pop the heap weakest-first into the output from the back.
        out_count[q] = size
        for pos in range(size - 1, -1, -1):
            out_scores[q, pos] = heap_s[0]
            out_ids[q, pos] = heap_i[0]
            last = pos
            heap_s[0] = heap_s[last]
            heap_i[0] = heap_i[last]
            _sift_down(heap_s, heap_i, last, 0)
        for a in range(n_touched):
            scores[touched[a]] = 0.0


def bm25_topk(
    query_token_ids: list[list[int]],
    data: np.ndarray,
    indices: np.ndarray,
    indptr: np.ndarray,
    num_docs: int,
    k: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids [Q, k], scores [Q, k], counts [Q]) for a batch of tokenized queries."""
    lengths = np.fromiter((len(q) for q in query_token_ids), dtype=np.int64, count=len(query_token_ids))
    ptr = np.zeros(len(query_token_ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=ptr[1:])
    flat = np.fromiter((t for q in query_token_ids for t in q), dtype=np.int64, count=int(ptr[-1]))
    out_ids = np.zeros((len(query_token_ids), k), dtype=np.int64)
    out_scores = np.zeros((len(query_token_ids), k), dtype=np.float32)
    counts = np.zeros(len(query_token_ids), dtype=np.int64)
    bm25_topk_batch(flat, ptr, data, indices, indptr, num_docs, k, out_ids, out_scores, counts)
    return out_ids, out_scores, counts
