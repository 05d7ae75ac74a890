"""DeviceBlockTable (pagoda/worker/block_table.py): rows, diffs and the gathered tables.
Runs on CPU tensors; the same code keeps the table on the GPU."""

from __future__ import annotations

import random

import pytest

from pagoda.worker.block_table import DeviceBlockTable


def _rows(table: DeviceBlockTable, req_ids, widths) -> list[list[int]]:
    gathered = table.gather(req_ids)
    return [gathered[i, :w].tolist() for i, w in enumerate(widths)]


def test_rows_follow_adds_appends_and_removes():
    table = DeviceBlockTable(max_rows=3, max_blocks_per_req=4, device="cpu")
    table.add("a", [5, 6])
    table.add("b", [7])
    assert table.row_of == {"a": 0, "b": 1}
    assert _rows(table, ["b", "a"], [1, 2]) == [[7], [5, 6]]  # gathered in the asked order
    table.append("a", [8])
    table.append("b", [9, 10, 11])
    assert _rows(table, ["a", "b"], [3, 4]) == [[5, 6, 8], [7, 9, 10, 11]]
    table.remove("a")
    table.add("c", [1])  # reuses a's row; a's old columns are stale but never read
    assert table.row_of == {"b": 1, "c": 0}
    assert _rows(table, ["c"], [1]) == [[1]]
    assert table.num_blocks == {"b": 4, "c": 1}


def test_diffs_of_a_removed_request_are_dropped():
    table = DeviceBlockTable(max_rows=2, max_blocks_per_req=4, device="cpu")
    table.add("a", [5, 6])
    table.remove("a")  # before any flush: its pending diffs must not land in the row
    table.add("b", [])
    table.append("b", [3])
    gathered = table.gather(["b"])
    assert gathered[0].tolist() == [3, 0, 0, 0]


def test_truncate_keeps_the_first_blocks_and_drops_unflushed_ones_past_them():
    table = DeviceBlockTable(max_rows=2, max_blocks_per_req=6, device="cpu")
    table.add("a", [5, 6])
    table.gather(["a"])  # flushed
    table.append("a", [7, 8])  # pending
    table.truncate("a", 3)  # the scheduler freed block 8: its diff must not land later
    table.append("a", [9, 4])
    assert table.num_blocks == {"a": 5}
    assert _rows(table, ["a"], [5]) == [[5, 6, 7, 9, 4]]
    table.truncate("a", 1)
    table.append("a", [2])
    assert _rows(table, ["a"], [2]) == [[5, 2]]
    with pytest.raises(ValueError, match="holds 2 blocks, cannot keep 3"):
        table.truncate("a", 3)


def test_the_table_grows_and_rejects_too_many_blocks():
    table = DeviceBlockTable(max_rows=1, max_blocks_per_req=2, device="cpu")
    table.add("a", [1, 2])
    table.add("b", [3])  # a second row: the table doubles
    assert table.max_rows == 2
    assert _rows(table, ["a", "b"], [2, 1]) == [[1, 2], [3]]
    with pytest.raises(ValueError, match="holds 2 per request"):
        table.append("b", [4, 5])
    with pytest.raises(ValueError, match="already has"):
        table.add("a", [9])


def test_random_lifecycle_matches_host_lists():
    """Joins, growth, finishes and re-admissions in random order: the gathered rows always
    equal the per-request lists the host keeps."""
    rng = random.Random(0)
    table = DeviceBlockTable(max_rows=8, max_blocks_per_req=16, device="cpu")
    host: dict[str, list[int]] = {}
    next_id = 0
    for _step in range(300):
        for req in [r for r in host if rng.random() < 0.1]:
            table.remove(req)
            del host[req]
        while len(host) < 8 and rng.random() < 0.5:
            req = f"r{next_id}"
            next_id += 1
            host[req] = [rng.randrange(1000) for _ in range(rng.randrange(0, 5))]
            table.add(req, host[req])
        for req, blocks in host.items():
            if len(blocks) < 16 and rng.random() < 0.3:
                new = [rng.randrange(1000) for _ in range(rng.randrange(1, 17 - len(blocks)))]
                blocks.extend(new)
                table.append(req, new)
        order = list(host)
        rng.shuffle(order)
        assert _rows(table, order, [len(host[r]) for r in order]) == [host[r] for r in order]
    assert table.max_rows == 8
