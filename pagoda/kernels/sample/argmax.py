"""Row-wise argmax of a small batch of long rows (the greedy sampler's logits) in one
Triton launch.

``argmax_rows(x)``: x [rows, V] float32, bfloat16 or float16 -> int64 [rows], exactly
``torch.argmax(x, dim=-1)`` (its reference, ``argmax_rows_ref``):
- among equal maxima the lowest index wins (so does -0.0 against a later +0.0: they
  compare equal);
- NaN counts as larger than everything: a row with a NaN gives its first NaN's index;
- a row of -inf gives 0.
torch's own reduction picks a slow launch configuration for some vocabulary sizes
(Llama-3's 128256 among them); this kernel's cost follows V smoothly.

Design, "the last program of a row reduces":
- the grid is (rows, chunks); program (r, c) reads the chunk of ``chunk`` elements
  c * chunk .. of row r, in its own dtype, widened to float32 (exact), and reduces it
  to one partial (value, index) with ``_first_max`` (the NaN-aware rule above), written
  to the workspace at [r, c];
- it then counts itself on row r's arrival counter (a CTA barrier so that the partial's
  stores precede the release, then one acq_rel atomic add at gpu scope: the pattern of
  pagoda.kernels.moe.router_fused); the program that arrives last reads the row's
  partials through L2 (cache modifier .cg) and reduces them in chunk order with the same
  ``_first_max``, stores the index and resets the counter to 0.
Partial indices grow with the chunk, so the lowest index among equal partial values is
the lowest index in the row; the result does not depend on the order of arrival.

Invariant of the workspace (``ArgmaxWorkspace``, one per device, made on the first call,
which must be outside CUDA-graph capture): every counter is 0 whenever no launch is
running, and no two launches on one device run at once. Both hold while the launches
are issued on one stream (the sampler's: eager or replayed from a CUDA graph): each
launch's last program of a row resets that row's counter before the launch ends, and
with PDL the next launch waits for this one to complete before its first load.

No host sync, the output allocated from the shape alone: CUDA-graph capturable.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagoda.kernels.launch.arrival_counters import arrival_counters
from pagoda.kernels.launch.pdl import launch_options, pdl_wait_and_release

# The most rows one launch takes (the workspace's rows). The kernel is for decode-sized
# batches; the sampler falls back to torch.argmax above it.
MAX_ROWS = 64
# Chunk sizes (elements, powers of two). The default aims at about _TARGET_PROGRAMS
# programs for the whole grid (one wave of an H200's 132 SMs): at one row of 128256,
# 1024-element chunks, 126 programs. Untuned: picked by that arithmetic, not measured.
_MIN_CHUNK = 1024
_MAX_CHUNK = 8192
_TARGET_PROGRAMS = 128
# The most chunks a row may have: the last program holds them all in one tile.
MAX_CHUNKS = 256
# The arrival counters' owner name (pagoda.kernels.launch.arrival_counters: one per row).
COUNTERS_OWNER = "argmax rows"
# The longest row a launch takes at the default chunk sizes.
MAX_VOCAB = MAX_CHUNKS * _MAX_CHUNK
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _first_max(values, indices, valid):
    """(value, index) of the first maximum among the valid lanes, NaN above everything:
    the first NaN if there is one (value NaN), else the largest value's lowest index.
    At least one lane is valid; 2**31 - 1 (above every row position) stands for "none"
    in the index minima."""
    is_nan = values != values
    nan_index = tl.min(tl.where(valid & is_nan, indices, 2147483647), axis=0)
    # The maximum over the other valid lanes. Matching by == (not by position of the
    # reduction's winner) makes -0.0 and +0.0 tie, as in torch, and lets a valid -inf
    # lane match a -inf maximum: a row of -inf gives its first index. With only NaN
    # lanes max_index is "none", unused.
    ordered = valid & ~is_nan
    largest = tl.max(tl.where(ordered, values, float("-inf")), axis=0)
    max_index = tl.min(tl.where(ordered & (values == largest), indices, 2147483647), axis=0)
    has_nan = nan_index != 2147483647
    value = tl.where(has_nan, float("nan"), largest)
    return value, tl.where(has_nan, nan_index, max_index)


@triton.jit
def _argmax_rows_kernel(
    x_ptr,
    out_ptr,
    part_val_ptr,
    part_idx_ptr,
    counter_ptr,
    vocab_size,
    stride_x,
    stride_part,
    num_chunks,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # pagoda.kernels.launch.pdl
):
    """Program (row, chunk): the chunk's partial; the row's last arrival reduces them."""
    pdl_wait_and_release(USE_PDL)  # before any load or store
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    # -- this chunk's partial ---------------------------------------------------------
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = cols < vocab_size
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=valid, other=float("-inf")).to(
        tl.float32
    )
    value, index = _first_max(x, cols, valid)
    slot = row * stride_part + chunk
    tl.store(part_val_ptr + slot, value)
    tl.store(part_idx_ptr + slot, index)
    # -- arrival: every thread's stores above precede the release of the add -----------
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == num_chunks - 1:
        # The row's last program: all its partials are written; reduce them in order.
        chunks = tl.arange(0, BLOCK_C)
        present = chunks < num_chunks
        base = row * stride_part
        values = tl.load(
            part_val_ptr + base + chunks, mask=present, other=float("-inf"), cache_modifier=".cg"
        )
        indices = tl.load(part_idx_ptr + base + chunks, mask=present, other=0, cache_modifier=".cg")
        _, best = _first_max(values, indices, present)
        tl.store(out_ptr + row, best.to(tl.int64))
        tl.store(counter_ptr + row, 0)  # ready for the next launch (and graph replay)


@dataclass
class ArgmaxWorkspace:
    """One device's partials (float32 values and int32 indices [MAX_ROWS, MAX_CHUNKS])
    and arrival counters (int32 [MAX_ROWS], 0 between launches: the module docstring)."""

    values: torch.Tensor
    indices: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def create(cls, device: torch.device) -> ArgmaxWorkspace:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the argmax workspace is made on the first argmax_rows call "
                "of a device, which must run eagerly, before CUDA-graph "
                "capture (or call argmax_workspace(device) first)"
            )
        return cls(
            torch.empty(MAX_ROWS, MAX_CHUNKS, dtype=torch.float32, device=device),
            torch.empty(MAX_ROWS, MAX_CHUNKS, dtype=torch.int32, device=device),
            arrival_counters(COUNTERS_OWNER, device, MAX_ROWS),
        )


_workspaces: dict[tuple[str, int | None], ArgmaxWorkspace] = {}


def argmax_workspace(device: torch.device) -> ArgmaxWorkspace:
    """The device's workspace, made on first use (outside CUDA-graph capture)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device.type, device.index)
    workspace = _workspaces.get(key)
    if workspace is None:
        workspace = _workspaces[key] = ArgmaxWorkspace.create(device)
    return workspace


@functools.lru_cache(maxsize=256)  # once per (rows, V): off the launch path
def default_chunk(rows: int, vocab_size: int) -> int:
    """About _TARGET_PROGRAMS programs in all, each chunk within [_MIN_CHUNK,
    _MAX_CHUNK] (a row shorter than _MIN_CHUNK is one chunk of its own size)."""
    wanted = triton.next_power_of_2(triton.cdiv(rows * vocab_size, _TARGET_PROGRAMS))
    chunk = min(max(wanted, _MIN_CHUNK), _MAX_CHUNK)
    return max(16, min(chunk, triton.next_power_of_2(vocab_size)))


def argmax_covers(x: torch.Tensor) -> bool:
    """Whether argmax_rows takes x (else: torch.argmax)."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and 0 < x.shape[1] <= MAX_VOCAB
        and x.dtype in _DTYPES
    )


def argmax_rows(x: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """x [rows, V] -> int64 [rows], equal to torch.argmax(x, dim=-1). chunk: elements per
    program (a power of two, at least 16; default: default_chunk)."""
    if not argmax_covers(x):
        raise ValueError(
            f"argmax_rows: x {tuple(x.shape)} {x.dtype} not covered (2-d, 1 to "
            f"{MAX_ROWS} rows, 1 to {MAX_VOCAB} columns, one of {_DTYPES})"
        )
    rows, vocab_size = x.shape
    chunk = chunk or default_chunk(rows, vocab_size)
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"argmax_rows: chunk {chunk} is not a power of two >= 16")
    num_chunks = triton.cdiv(vocab_size, chunk)
    if num_chunks > MAX_CHUNKS:
        raise ValueError(
            f"argmax_rows: {num_chunks} chunks of {chunk} for V={vocab_size}, "
            f"more than MAX_CHUNKS={MAX_CHUNKS}"
        )
    x = x if x.stride(1) == 1 else x.contiguous()
    workspace = argmax_workspace(x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    _argmax_rows_kernel[(rows, num_chunks)](
        x,
        out,
        workspace.values,
        workspace.indices,
        workspace.counters,
        vocab_size,
        x.stride(0),
        workspace.values.stride(0),
        num_chunks,
        CHUNK=chunk,
        BLOCK_C=max(16, triton.next_power_of_2(num_chunks)),
        num_warps=4 if chunk <= 2048 else 8,
        **launch_options(x.device),
    )
    return out


def argmax_rows_ref(x: torch.Tensor) -> torch.Tensor:
    """The reference: torch's argmax (lowest index among ties, first NaN wins)."""
    return torch.argmax(x, dim=-1)
