"""BM25 top-k over bm25s' saved score matrix, compiled once and cached on disk.

bm25s' own numba kernels are not cached, so every new process spends ~5-9 s compiling them
before its first query; these `cache=True` kernels load from `__pycache__` after the first run.
The arithmetic is bm25s': a query's score for a passage is the sum over its query tokens of the
precomputed per-(token, passage) BM25 weight stored column-wise (CSC: indptr over tokens, each
token's passage indices ascending).

Scoring every posting of every query token costs the summed posting-list length per query, which
the few very common tokens of a query dominate as the corpus grows. The kernel instead walks the
posting lists document-at-a-time with MaxScore pruning (Turtle & Flood 1995): with the current
k-th best score as threshold, the lowest-bound tokens whose bounds together cannot reach it are
"non-essential"; only passages in the other lists become candidates, and the non-essential lists
are probed (galloping search) for a candidate only while its bound can still reach the threshold.
Results are exactly those of scoring every passage: the same passages, the same float32 scores
(each kept passage's score is summed in query-token order, as a dense accumulation would), ties
keep the smaller passage index, and pruning bounds carry a margin for float32 rounding.
A query that pruning cannot help (most of its postings lie in lists that can still hold a top-k
passage) is scored posting by posting into a reused per-passage accumulator instead.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# 2**-23 is twice float32's unit roundoff: the margin per summed term that keeps pruning exact.
_F32_ROUNDING = 2.0**-23
# The seeding pass runs when the strongest terms' lists hold at most this share of the query's postings.
_SEED_SHARE = 8
# Document-at-a-time is chosen when at most 1/DENSE_RATIO of the query's postings are in lists that
# can hold a top-k passage (on bench/retrieval.py's 200k-passage corpus, ratios 3-8 ran alike and
# ~20% faster than always pruning).
DENSE_RATIO = 4.0


@njit(cache=True, nogil=True)
def token_weight_bounds(data, indices, indptr):
    """Per token: (largest weight, floored at 0; largest |weight|) over its posting list, and whether
    every posting list is in ascending passage order (the pruned walk relies on it)."""
    n_tokens = len(indptr) - 1
    upper = np.zeros(n_tokens, dtype=np.float64)
    magnitude = np.zeros(n_tokens, dtype=np.float64)
    ascending = True
    for t in range(n_tokens):
        hi = 0.0
        mag = 0.0
        for j in range(indptr[t], indptr[t + 1]):
            w = np.float64(data[j])
            if w > hi:
                hi = w
            if abs(w) > mag:
                mag = abs(w)
            if j > indptr[t] and indices[j] <= indices[j - 1]:
                ascending = False
        upper[t] = hi
        magnitude[t] = mag
    return upper, magnitude, ascending


@njit(cache=True, nogil=True)
def _weaker(heap_s, heap_i, a, b):
    # Min-heap order on (score, -index): on equal scores the larger passage index counts as weaker,
    # so ties keep the smaller index (deterministic order).
    return heap_s[a] < heap_s[b] or (heap_s[a] == heap_s[b] and heap_i[a] > heap_i[b])


@njit(cache=True, nogil=True)
def _swap(heap_s, heap_i, a, b):
    heap_s[a], heap_s[b] = heap_s[b], heap_s[a]
    heap_i[a], heap_i[b] = heap_i[b], heap_i[a]


@njit(cache=True, nogil=True)
def _sift_down(heap_s, heap_i, size, pos):
    # The root is the weakest kept hit.
    while True:
        left = 2 * pos + 1
        if left >= size:
            return
        child = left
        if left + 1 < size and _weaker(heap_s, heap_i, left + 1, left):
            child = left + 1
        if not _weaker(heap_s, heap_i, child, pos):
            return
        _swap(heap_s, heap_i, child, pos)
        pos = child


@njit(cache=True, nogil=True)
def _sift_up(heap_s, heap_i, pos):
    while pos > 0:
        parent = (pos - 1) // 2
        if not _weaker(heap_s, heap_i, pos, parent):
            return
        _swap(heap_s, heap_i, pos, parent)
        pos = parent


@njit(cache=True, nogil=True)
def _offer(heap_s, heap_i, size, k, score, doc):
    """Keep (score, doc) if the heap has room or it beats the weakest kept hit; returns the new size."""
    if size < k:
        heap_s[size] = score
        heap_i[size] = doc
        _sift_up(heap_s, heap_i, size)
        return size + 1
    if score > heap_s[0] or (score == heap_s[0] and doc < heap_i[0]):
        heap_s[0] = score
        heap_i[0] = doc
        _sift_down(heap_s, heap_i, size, 0)
    return size


@njit(cache=True, nogil=True)
def _seek(indices, pos, end, target):
    """First position in [pos, end) whose passage index is >= target (galloping, then binary search)."""
    if pos >= end or indices[pos] >= target:
        return pos
    # Invariant: indices[below] < target; the answer lies in (below, above].
    below = pos
    step = 1
    above = pos + 1
    while above < end and indices[above] < target:
        below = above
        step *= 2
        above = below + step
    if above > end:
        above = end
    lo = below + 1
    while lo < above:
        mid = (lo + above) // 2
        if indices[mid] < target:
            lo = mid + 1
        else:
            above = mid
    return lo


@njit(cache=True, nogil=True)
def _maxscore(
    data,
    indices,
    starts,
    stop,
    mult,
    below_bound,
    rank_of_pos,
    margin,
    k,
    essential_from,
    floor,
    heap_s,
    heap_i,
):
    """One document-at-a-time MaxScore pass; returns how many passages the heap keeps.

    Terms are given by rank (ascending bound). A passage is kept when its score is >= floor and
    beats the heap's threshold: > 0 while the heap fills, then > the k-th best. Candidates arrive in
    ascending passage order, so a tie never displaces a kept passage (ties keep the smaller index).
    Only passages in the lists of ranks >= essential_from can become candidates."""
    n_terms = len(starts)
    n_pos = len(rank_of_pos)
    cursor = starts.copy()
    weight = np.zeros(n_terms, dtype=np.float32)
    size = 0
    threshold = np.float32(0.0)
    first_essential = essential_from
    while first_essential < n_terms and (
        below_bound[first_essential + 1] + margin < floor
        or below_bound[first_essential + 1] + margin <= threshold
    ):
        first_essential += 1
    no_doc = np.iinfo(np.int64).max
    while True:
        doc = no_doc
        for r in range(first_essential, n_terms):
            if cursor[r] < stop[r] and indices[cursor[r]] < doc:
                doc = indices[cursor[r]]
        if doc == no_doc:
            return size
        partial = 0.0
        for r in range(first_essential, n_terms):
            weight[r] = 0.0
            if cursor[r] < stop[r] and indices[cursor[r]] == doc:
                weight[r] = data[cursor[r]]
                partial += mult[r] * weight[r]
                cursor[r] += 1
        pruned = False
        for r in range(first_essential - 1, -1, -1):
            reachable = partial + below_bound[r + 1] + margin
            if reachable < floor or reachable <= threshold:
                pruned = True
                break
            cursor[r] = _seek(indices, cursor[r], stop[r], doc)
            weight[r] = 0.0
            if cursor[r] < stop[r] and indices[cursor[r]] == doc:
                weight[r] = data[cursor[r]]
                partial += mult[r] * weight[r]
        if pruned:
            continue
        score = np.float32(0.0)
        for p in range(n_pos):
            score += weight[rank_of_pos[p]]
        if score < floor or not score > threshold:
            continue
        size = _offer(heap_s, heap_i, size, k, score, doc)
        if size == k:
            threshold = heap_s[0]
            while first_essential < n_terms and below_bound[first_essential + 1] + margin <= threshold:
                first_essential += 1


@njit(cache=True, nogil=True)
def _accumulate(toks, data, indices, indptr, k, floor, scores, touched, heap_s, heap_i):
    """Score every posting of the query into `scores` (all zero on entry and on return); keeps the
    top-k passages with score >= floor and > 0 in the heap; returns how many were kept."""
    n_touched = 0
    for t in toks:
        for j in range(indptr[t], indptr[t + 1]):
            d = indices[j]
            if scores[d] == 0.0:
                # A passage whose running sum returns to 0 is listed again; the pass below zeroes
                # each passage once it is ranked, so its repeat is skipped.
                touched[n_touched] = d
                n_touched += 1
            scores[d] += data[j]
    size = 0
    for a in range(n_touched):
        d = touched[a]
        s = scores[d]
        scores[d] = 0.0
        if s <= 0.0 or s < floor:
            continue
        size = _offer(heap_s, heap_i, size, k, s, d)
    return size


@njit(cache=True, nogil=True)
def _query_topk(
    toks, data, indices, indptr, token_upper, token_magnitude, k, dense_ratio, scores, touched, heap_s, heap_i
):
    """Query `toks`' top-k (score > 0) into the heap arrays; returns how many were kept.

    `scores` (zeros, one per passage, or empty) and `touched` are the dense pass's scratch space."""
    n_pos = len(toks)
    # Distinct tokens with their multiplicity: a repeated token counts once per occurrence.
    order = np.argsort(toks, kind="mergesort")
    distinct = np.empty(n_pos, dtype=np.int64)
    count = np.zeros(n_pos, dtype=np.int64)
    distinct_of_pos = np.empty(n_pos, dtype=np.int64)
    n_terms = 0
    for a in range(n_pos):
        p = order[a]
        if n_terms == 0 or distinct[n_terms - 1] != toks[p]:
            distinct[n_terms] = toks[p]
            n_terms += 1
        count[n_terms - 1] += 1
        distinct_of_pos[p] = n_terms - 1
    bound = np.empty(n_terms, dtype=np.float64)
    magnitude_sum = 0.0
    for u in range(n_terms):
        bound[u] = count[u] * token_upper[distinct[u]]
        magnitude_sum += count[u] * token_magnitude[distinct[u]]
    # Summing n_pos float32 terms in any order is within (n_pos - 1) roundoffs of the exact sum;
    # a passage is pruned only when its bound plus this margin cannot reach the threshold.
    margin = n_pos * _F32_ROUNDING * magnitude_sum

    # Terms by rank, weakest bound first; below_bound[r] = sum of the bounds of ranks < r.
    by_rank = np.argsort(bound)
    rank_of = np.empty(n_terms, dtype=np.int64)
    below_bound = np.zeros(n_terms + 1, dtype=np.float64)
    starts = np.empty(n_terms, dtype=np.int64)
    stop = np.empty(n_terms, dtype=np.int64)
    mult = np.empty(n_terms, dtype=np.float64)
    for r in range(n_terms):
        u = by_rank[r]
        rank_of[u] = r
        below_bound[r + 1] = below_bound[r] + bound[u]
        starts[r] = indptr[distinct[u]]
        stop[r] = indptr[distinct[u] + 1]
        mult[r] = count[u]
    rank_of_pos = np.empty(n_pos, dtype=np.int64)
    for p in range(n_pos):
        rank_of_pos[p] = rank_of[distinct_of_pos[p]]

    # The threshold starts at 0 and rises only as good passages turn up, which in passage order may
    # be late: until then the long lists of common tokens are walked in full. A first pass over just
    # the strongest terms' (short) lists finds k passages whose k-th score is a floor for the final
    # k-th score, so the full pass prunes with it from its first passage on.
    seed_from = n_terms - 1
    seed_postings = stop[seed_from] - starts[seed_from]
    while seed_from > 0 and seed_postings < k:
        seed_from -= 1
        seed_postings += stop[seed_from] - starts[seed_from]
    all_postings = 0
    for r in range(n_terms):
        all_postings += stop[r] - starts[r]
    floor = np.float32(0.0)
    if seed_from > 0 and _SEED_SHARE * seed_postings <= all_postings:
        size = _maxscore(
            data,
            indices,
            starts,
            stop,
            mult,
            below_bound,
            rank_of_pos,
            margin,
            k,
            seed_from,
            floor,
            heap_s,
            heap_i,
        )
        if size == k:
            floor = heap_s[0]
    # Document-at-a-time costs several times more per candidate than adding up a posting: when the
    # lists that can hold a top-k passage at the floor are a large share of all postings, score
    # every posting instead.
    essential_from = 0
    while essential_from < n_terms and below_bound[essential_from + 1] + margin < floor:
        essential_from += 1
    essential_postings = 0
    for r in range(essential_from, n_terms):
        essential_postings += stop[r] - starts[r]
    if dense_ratio * essential_postings > all_postings:
        return _accumulate(toks, data, indices, indptr, k, floor, scores, touched, heap_s, heap_i)
    return _maxscore(
        data, indices, starts, stop, mult, below_bound, rank_of_pos, margin, k, 0, floor, heap_s, heap_i
    )


@njit(cache=True, nogil=True)
def bm25_topk_batch(
    query_ids,
    query_ptr,
    data,
    indices,
    indptr,
    token_upper,
    token_magnitude,
    k,
    dense_ratio,
    scores,
    out_ids,
    out_scores,
    out_count,
):
    """Fill out_ids/out_scores[q, :out_count[q]] with query q's top-k passages (score > 0), best first.

    `scores` is float32 zeros, one per passage, and is all zeros again on return."""
    heap_s = np.empty(k, dtype=np.float32)
    heap_i = np.empty(k, dtype=np.int64)
    for q in range(len(query_ptr) - 1):
        toks = query_ids[query_ptr[q] : query_ptr[q + 1]]
        n_postings = 0
        for t in toks:
            n_postings += indptr[t + 1] - indptr[t]
        touched = np.empty(n_postings, dtype=np.int64)
        size = _query_topk(
            toks,
            data,
            indices,
            indptr,
            token_upper,
            token_magnitude,
            k,
            dense_ratio,
            scores,
            touched,
            heap_s,
            heap_i,
        )
        # Pop the heap weakest-first into the output from the back.
        out_count[q] = size
        for pos in range(size - 1, -1, -1):
            out_scores[q, pos] = heap_s[0]
            out_ids[q, pos] = heap_i[0]
            heap_s[0] = heap_s[pos]
            heap_i[0] = heap_i[pos]
            _sift_down(heap_s, heap_i, pos, 0)


def bm25_topk(
    query_token_ids: list[list[int]],
    data: np.ndarray,
    indices: np.ndarray,
    indptr: np.ndarray,
    token_bounds: tuple[np.ndarray, np.ndarray],
    k: int,
    scratch: np.ndarray,
    dense_ratio: float = DENSE_RATIO,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids [Q, k], scores [Q, k], counts [Q]) for a batch of tokenized queries.

    `token_bounds` is `token_weight_bounds(data, indices, indptr)[:2]`, computed once per index; `scratch` is a
    float32 array of zeros, one per passage, left all zeros (reuse it, one per thread). A query is
    scored posting by posting when more than 1/dense_ratio of its postings can hold a top-k passage,
    else document-at-a-time with pruning (0: always pruned; inf: always posting by posting)."""
    if k <= 0:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if scratch.dtype != np.float32 or scratch.ndim != 1:
        raise ValueError(
            f"scratch must be a 1-d float32 array, got {scratch.dtype} with shape {scratch.shape}"
        )
    lengths = np.fromiter((len(q) for q in query_token_ids), dtype=np.int64, count=len(query_token_ids))
    ptr = np.zeros(len(query_token_ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=ptr[1:])
    flat = np.fromiter((t for q in query_token_ids for t in q), dtype=np.int64, count=int(ptr[-1]))
    out_ids = np.zeros((len(query_token_ids), k), dtype=np.int64)
    out_scores = np.zeros((len(query_token_ids), k), dtype=np.float32)
    counts = np.zeros(len(query_token_ids), dtype=np.int64)
    upper, magnitude = token_bounds
    bm25_topk_batch(
        flat,
        ptr,
        data,
        indices,
        indptr,
        upper,
        magnitude,
        k,
        float(dense_ratio),
        scratch,
        out_ids,
        out_scores,
        counts,
    )
    return out_ids, out_scores, counts
