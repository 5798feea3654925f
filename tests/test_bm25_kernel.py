"""The pruned BM25 top-k kernel returns exactly what scoring every passage returns.

The reference here scores every passage by brute force (numpy, float32, summed in query-token
order) and ranks by (score desc, passage index asc), keeping scores > 0: the results the dense
kernel this one replaced produced. Corpora are random, with Zipf-like token frequencies so queries
mix long and short posting lists (the case pruning is for), and with weights drawn from a few
values so many passages tie exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sleuth.retrieval import load_retriever
from sleuth.retrieval._bm25_kernel import DENSE_RATIO, bm25_topk, token_weight_bounds

# Per query the kernel picks pruned document-at-a-time scoring or scoring every posting; these force
# each choice, and the last is the default mix.
DENSE_RATIOS = [0.0, float("inf"), DENSE_RATIO]


def random_csc(
    rng: np.random.Generator, num_docs: int, vocab: int, *, tie_values: bool, signed: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(data float32, indices int32 ascending per token, indptr int64) of a random token-by-passage matrix."""
    # Token t occurs in a passage with probability ~ 1/(t+1): a few tokens are in most passages.
    occurrence = np.minimum(0.9, 1.5 / (np.arange(vocab) + 1.0))
    data, indices, indptr = [], [], [0]
    for t in range(vocab):
        docs = np.flatnonzero(rng.random(num_docs) < occurrence[t]).astype(np.int32)
        if t % 17 == 5:
            docs = docs[:0]  # tokens with an empty posting list
        if tie_values:
            weights = rng.choice(np.array([0.25, 0.5, 1.0, 1.5], np.float32), size=len(docs))
        else:
            weights = rng.uniform(0.05, 3.0, size=len(docs)).astype(np.float32)
        # Rarer tokens weigh more, as idf makes them.
        weights = (weights * np.float32(1.0 + np.log1p(t))).astype(np.float32)
        if t % 13 == 7:
            weights[:] = 0.0  # an idf clamped to 0 (bm25s' robertson for very common tokens)
        if signed:
            weights = np.where(rng.random(len(docs)) < 0.3, -weights, weights).astype(np.float32)
        data.append(weights)
        indices.append(docs)
        indptr.append(indptr[-1] + len(docs))
    return np.concatenate(data), np.concatenate(indices), np.asarray(indptr, np.int64)


def brute_force_topk(
    query: list[int], data: np.ndarray, indices: np.ndarray, indptr: np.ndarray, num_docs: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    scores = np.zeros(num_docs, np.float32)
    for t in query:  # a repeated token adds its weight again, in query order
        cols = slice(indptr[t], indptr[t + 1])
        scores[indices[cols]] += data[cols]
    positive = np.flatnonzero(scores > 0)
    order = np.lexsort((positive, -scores[positive]))[:k]
    return positive[order], scores[positive][order]


def random_queries(rng: np.random.Generator, vocab: int, n: int) -> list[list[int]]:
    queries: list[list[int]] = [[], [0], [vocab - 1], [0, 0], [1, 1, 1, 2]]
    for _ in range(n):
        length = int(rng.integers(1, 9))
        common = rng.integers(0, 8, size=length)  # mostly common tokens ...
        rare = rng.integers(0, vocab, size=length)  # ... some rare ones
        query = np.where(rng.random(length) < 0.6, common, rare).tolist()
        if rng.random() < 0.2:
            query += query[:2]  # repeated tokens
        queries.append(query)
    return queries


def assert_matches_reference(
    queries: list[list[int]],
    data: np.ndarray,
    indices: np.ndarray,
    indptr: np.ndarray,
    num_docs: int,
    k: int,
    dense_ratio: float = DENSE_RATIO,
) -> None:
    scratch = np.zeros(num_docs, np.float32)
    upper, magnitude, ascending = token_weight_bounds(data, indices, indptr)
    assert ascending
    ids, scores, counts = bm25_topk(
        queries, data, indices, indptr, (upper, magnitude), k, scratch, dense_ratio
    )
    assert not scratch.any(), "the kernel must leave its scratch space zeroed"
    for q, query in enumerate(queries):
        want_ids, want_scores = brute_force_topk(query, data, indices, indptr, num_docs, k)
        n = int(counts[q])
        assert n == len(want_ids), f"query {query}, k={k}: {n} hits, expected {len(want_ids)}"
        np.testing.assert_array_equal(ids[q, :n], want_ids, err_msg=f"query {query}, k={k}")
        np.testing.assert_array_equal(scores[q, :n], want_scores, err_msg=f"query {query}, k={k}")


@pytest.mark.parametrize("dense_ratio", DENSE_RATIOS)
@pytest.mark.parametrize("tie_values", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_kernel_equals_brute_force_on_random_corpora(seed: int, tie_values: bool, dense_ratio: float) -> None:
    rng = np.random.default_rng(seed)
    num_docs = int(rng.integers(300, 3000))
    vocab = 200
    data, indices, indptr = random_csc(rng, num_docs, vocab, tie_values=tie_values)
    queries = random_queries(rng, vocab, 120)
    for k in (1, 3, 10, 100, num_docs + 5):  # k past the number of matching passages included
        assert_matches_reference(queries, data, indices, indptr, num_docs, k, dense_ratio)


@pytest.mark.parametrize("dense_ratio", DENSE_RATIOS)
def test_kernel_with_mixed_sign_weights(dense_ratio: float) -> None:
    """Pruning bounds stay valid when weights may be negative (no supported BM25 variant makes them)."""
    rng = np.random.default_rng(11)
    data, indices, indptr = random_csc(rng, 1500, 120, tie_values=True, signed=True)
    queries = random_queries(rng, 120, 150)
    for k in (1, 5, 40):
        assert_matches_reference(queries, data, indices, indptr, 1500, k, dense_ratio)


@pytest.mark.parametrize("dense_ratio", DENSE_RATIOS)
def test_kernel_on_hand_made_ties_and_empty_results(dense_ratio: float) -> None:
    # Passages 0..5; token 0 in all (weight 1), token 1 in passages 2 and 4 (weight 3), token 2 nowhere.
    data = np.array([1, 1, 1, 1, 1, 1, 3, 3], np.float32)
    indices = np.array([0, 1, 2, 3, 4, 5, 2, 4], np.int32)
    indptr = np.array([0, 6, 8, 8], np.int64)
    bounds = token_weight_bounds(data, indices, indptr)[:2]
    scratch = np.zeros(6, np.float32)
    queries = [[0, 1], [0], [2], [], [1, 1]]
    ids, scores, counts = bm25_topk(queries, data, indices, indptr, bounds, 3, scratch, dense_ratio)
    assert counts.tolist() == [3, 3, 0, 0, 2]
    assert ids[0].tolist() == [2, 4, 0] and scores[0].tolist() == [4.0, 4.0, 1.0]  # ties: smaller index first
    assert ids[1].tolist() == [0, 1, 2] and scores[1].tolist() == [1.0, 1.0, 1.0]
    assert ids[4, :2].tolist() == [2, 4] and scores[4, :2].tolist() == [
        6.0,
        6.0,
    ]  # repeated token counts twice


def test_token_weight_bounds_against_numpy() -> None:
    rng = np.random.default_rng(5)
    data, indices, indptr = random_csc(rng, 400, 60, tie_values=False, signed=True)
    upper, magnitude, ascending = token_weight_bounds(data, indices, indptr)
    assert ascending
    for t in range(60):
        column = data[indptr[t] : indptr[t + 1]].astype(np.float64)
        assert upper[t] == (max(0.0, column.max()) if len(column) else 0.0)
        assert magnitude[t] == (np.abs(column).max() if len(column) else 0.0)
    # A posting list out of passage order is reported (the pruned walk would miss passages).
    longest = int(np.argmax(np.diff(indptr)))
    shuffled = indices.copy()
    shuffled[indptr[longest] : indptr[longest] + 2] = shuffled[indptr[longest] : indptr[longest] + 2][::-1]
    assert not token_weight_bounds(data, shuffled, indptr)[2]


def test_retriever_equals_brute_force_over_its_index(small_world: Path) -> None:
    """BM25Retriever.search_indices on a real bm25s index equals scoring every passage."""
    retriever = load_retriever(small_world / "bm25")
    m = retriever.model.scores
    lines = (small_world / "train.jsonl").read_text(encoding="utf-8").splitlines()
    texts = [json.loads(line)["question"] for line in lines]
    texts += ["the the of", "capital capital capital", "zzzz-not-a-word", "born"]
    for k in (1, 5, 50):
        rows, scores = retriever.search_indices(texts, k)
        for text, tokens, got_rows, got_scores in zip(
            texts, retriever._tokenize(texts), rows, scores, strict=True
        ):
            want_rows, want_scores = brute_force_topk(
                tokens, m["data"], m["indices"], m["indptr"], retriever.num_indexed, k
            )
            np.testing.assert_array_equal(got_rows, want_rows, err_msg=text)
            np.testing.assert_array_equal(got_scores, want_scores, err_msg=text)
