"""Where the Ray executor's ranks find their GPU (no Ray needed): every rank sees the
group's GPUs on its node, in id order, and picks its own by index."""

from __future__ import annotations

import pytest

from pagoda.executor.ray_executor import cuda_layout


def test_ranks_on_one_node_see_every_gpu_of_the_group():
    placements = [("n1", ["3"]), ("n1", ["1"]), ("n1", ["10"]), ("n1", ["2"])]
    assert cuda_layout(placements) == [
        ("1,2,3,10", 2),
        ("1,2,3,10", 0),
        ("1,2,3,10", 3),
        ("1,2,3,10", 1),
    ]


def test_ranks_on_two_nodes_see_their_own_node_only():
    placements = [("a", ["0"]), ("a", ["1"]), ("b", ["1"]), ("b", ["0"])]
    assert cuda_layout(placements) == [("0,1", 0), ("0,1", 1), ("0,1", 1), ("0,1", 0)]


def test_a_rank_without_exactly_one_gpu_is_refused():
    with pytest.raises(
        RuntimeError,
        match=r"rank 1 the GPUs \['0', '1'\]; each rank needs "
        r"exactly one",
    ):
        cuda_layout([("a", ["2"]), ("a", ["0", "1"])])
