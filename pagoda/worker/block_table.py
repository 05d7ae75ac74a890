"""DeviceBlockTable: the running requests' block ids, kept on the device between steps.

One row per request, assigned when the request enters the worker's batch and freed
when it finishes or is preempted. The scheduler sends block ids as diffs (a new
request's in full, then only the blocks each step adds), and so does this table:
per step, the (row, column, block id) triples added since the last step travel to
the device in one pinned, non-blocking copy and are scattered into the table; the
step's [num_reqs, max_blocks] block table is then gathered on the device by row.
So the host never rebuilds or uploads a whole table: at batch 256 with 1k-token
contexts the upload is the new blocks (a few per step) plus 256 row indices, where
a rebuilt table is 256 x 72 ids.

Invariants:
- row_of holds exactly the requests whose state the worker keeps; their rows are
  distinct, and columns 0 .. num_blocks[req] - 1 of a row hold the request's blocks
  once flush() has run. Columns past that hold stale ids, never read: a kernel reads
  a request's blocks only up to its sequence length.
- Device updates are queued on the current stream behind earlier steps' kernels, so
  a row reused by a new request is rewritten only after every step that read the
  old request's blocks has run.
"""

from __future__ import annotations

import torch

from pagoda.kernels.launch.host_copy import host_to_device


class DeviceBlockTable:
    def __init__(self, max_rows: int, max_blocks_per_req: int, device) -> None:
        if max_rows < 1 or max_blocks_per_req < 1:
            raise ValueError(
                f"max_rows ({max_rows}) and max_blocks_per_req ({max_blocks_per_req}) must be >= 1"
            )
        self.device = torch.device(device)
        self.max_blocks_per_req = max_blocks_per_req
        self.table = torch.zeros(
            max_rows, max_blocks_per_req, dtype=torch.int32, device=self.device
        )
        self._free_rows = list(range(max_rows - 1, -1, -1))  # pop() takes the lowest
        self.row_of: dict[str, int] = {}
        self.num_blocks: dict[str, int] = {}
        self._pending: list[tuple[int, int, int]] = []  # (row, column, block id)

    @property
    def max_rows(self) -> int:
        return self.table.shape[0]

    def add(self, req_id: str, block_ids: list[int]) -> None:
        """A request entering the batch (new, or resumed after preemption) with all its blocks."""
        if req_id in self.row_of:
            raise ValueError(f"request {req_id!r} already has a block-table row")
        if not self._free_rows:
            self._grow()
        self.row_of[req_id] = self._free_rows.pop()
        self.num_blocks[req_id] = 0
        self.append(req_id, block_ids)

    def append(self, req_id: str, new_block_ids: list[int]) -> None:
        """Blocks a scheduled request gained this step."""
        row, start = self.row_of[req_id], self.num_blocks[req_id]
        end = start + len(new_block_ids)
        if end > self.max_blocks_per_req:
            raise ValueError(
                f"request {req_id!r} would hold {end} blocks; the table holds "
                f"{self.max_blocks_per_req} per request (max_model_len)"
            )
        self._pending.extend((row, col, b) for col, b in enumerate(new_block_ids, start))
        self.num_blocks[req_id] = end

    def truncate(self, req_id: str, num_blocks: int) -> None:
        """Keeps the request's first num_blocks blocks (the scheduler freed the rest);
        the columns past them are stale from here on."""
        row = self.row_of[req_id]
        if not 0 <= num_blocks <= self.num_blocks[req_id]:
            raise ValueError(
                f"request {req_id!r} holds {self.num_blocks[req_id]} blocks, "
                f"cannot keep {num_blocks}"
            )
        self.num_blocks[req_id] = num_blocks
        # Unflushed writes past the cut are void: a later append writes those columns.
        self._pending = [p for p in self._pending if p[0] != row or p[1] < num_blocks]

    def remove(self, req_id: str) -> None:
        """A request leaving the batch (finished or preempted); its row is free again."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        del self.num_blocks[req_id]
        # Diffs not flushed yet for this row are void: a later owner writes its own.
        self._pending = [p for p in self._pending if p[0] != row] if self._pending else []
        self._free_rows.append(row)

    def gather(self, req_ids: list[str]) -> torch.Tensor:
        """int32 [len(req_ids), max_blocks_per_req] on the device, in req_ids' order."""
        self.flush()
        rows = host_to_device([self.row_of[r] for r in req_ids], torch.long, self.device)
        return self.table.index_select(0, rows)

    def flush(self) -> None:
        """Queues the pending diffs onto the device table (one copy, one scatter)."""
        if not self._pending:
            return
        rows, cols, blocks = zip(*self._pending)
        self._pending = []
        diff = host_to_device([rows, cols, blocks], torch.long, self.device)
        self.table.index_put_((diff[0], diff[1]), diff[2].to(torch.int32))

    def _grow(self) -> None:
        """More requests than rows (never with max_num_seqs rows): double the table."""
        self.flush()
        old = self.max_rows
        grown = torch.zeros(2 * old, self.max_blocks_per_req, dtype=torch.int32, device=self.device)
        grown[:old].copy_(self.table)
        self.table = grown
        self._free_rows = list(range(2 * old - 1, old - 1, -1)) + self._free_rows
