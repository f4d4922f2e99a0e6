"""Table-driven tests of the stability / ragged-trim / round-robin arithmetic."""

import pytest

from kdsync.core.stream import ragged_trim, round_robin, stable_counts


@pytest.mark.parametrize(
    "vectors, expected",
    [
        ([[3, 2, 5]], [3, 2, 5]),
        ([[3, 2, 5], [3, 2, 5]], [3, 2, 5]),
        ([[3, 2, 5], [1, 4, 5], [2, 2, 0]], [1, 2, 0]),
        ([[0, 0], [7, 9]], [0, 0]),
        ([[10], [9], [11]], [9]),
    ],
)
def test_ragged_trim_is_elementwise_min(vectors, expected):
    assert ragged_trim(vectors) == expected
    assert stable_counts(vectors) == expected


def test_ragged_trim_needs_reports():
    with pytest.raises(ValueError):
        ragged_trim([])


@pytest.mark.parametrize(
    "limits, start, expected",
    [
        ([2, 2], (0, 0), [(0, 0), (0, 1), (1, 0), (1, 1)]),
        ([1, 3, 2], (0, 0), [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (2, 1)]),
        ([3, 1], (1, 0), [(1, 0), (2, 0)]),
        ([2, 2, 2], (0, 2), [(0, 2), (1, 0), (1, 1), (1, 2)]),
        ([0, 0], (0, 0), []),
        ([], (0, 0), []),
    ],
)
def test_round_robin_order(limits, start, expected):
    assert list(round_robin(limits, *start)) == expected


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_round_robin_positions_are_index_times_n_plus_rank(n):
    limits = [4] * n
    positions = [r * n + k for r, k in round_robin(limits)]
    assert positions == list(range(4 * n))
