"""The pending-token fill of an async-scheduled step in one Triton launch.

Under async scheduling a step is built before the previous step's sampled ids reach
the host: the rows of input_ids that take them are filled on the device from
``PrevSampled.token_ids`` (pagoda/worker/input_batch.py). ``fill_pending(ids, index,
tokens)`` does ``ids[index[0]] = tokens[index[1]]`` (index int64 [2, k]) as one
kernel where torch takes an index_select and an index_copy_, two launches on the
critical path between the LM head and the next CUDA graph at batch 1. Its reference
is ``fill_pending_ref`` (the torch code). The destination rows are distinct (one
pending token per request), so the order of the stores does not matter.

No host sync, nothing data dependent: the launch depends on k alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.launch.pdl import launch_options, pdl_wait_and_release

_BLOCK = 256
# A fill of more rows than this runs the torch reference (a prefill-sized batch's
# launch cost is no concern, and it keeps the grid to a few programs).
MAX_KERNEL_ROWS = 4096


# num_rows is not specialised: 1, multiples of 16 and the rest would be three compiles.
@triton.jit(do_not_specialize=["num_rows"])
def _fill_pending_kernel(
    ids_ptr, index_ptr, tokens_ptr, num_rows, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False
):
    pdl_wait_and_release(USE_PDL)  # before any load or store
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_rows
    dst = tl.load(index_ptr + offs, mask=ok, other=0)
    src = tl.load(index_ptr + num_rows + offs, mask=ok, other=0)
    token = tl.load(tokens_ptr + src, mask=ok, other=0)
    tl.store(ids_ptr + dst, token.to(ids_ptr.dtype.element_ty), mask=ok)


def fill_pending_ref(ids: torch.Tensor, index: torch.Tensor, tokens: torch.Tensor) -> None:
    """ids[index[0]] = tokens[index[1]] in torch."""
    ids.index_copy_(0, index[0], tokens.index_select(0, index[1]).to(ids.dtype))


def fill_pending(
    ids: torch.Tensor, index: torch.Tensor, tokens: torch.Tensor, use_kernel: bool | None = None
) -> None:
    """ids[index[0]] = tokens[index[1]]: one launch on CUDA, the reference elsewhere
    (use_kernel True: the kernel on any device, as the interpreter tests run it)."""
    if index.dim() != 2 or index.shape[0] != 2 or index.dtype != torch.long:
        raise ValueError(f"index must be int64 [2, k], got {index.dtype} {tuple(index.shape)}")
    num_rows = index.shape[1]
    if num_rows == 0:
        return
    if use_kernel is None:
        use_kernel = ids.device.type == "cuda" and num_rows <= MAX_KERNEL_ROWS
    if not use_kernel:
        fill_pending_ref(ids, index, tokens)
        return
    if ids.dim() != 1 or tokens.dim() != 1 or not ids.is_contiguous() or not tokens.is_contiguous():
        raise ValueError("ids and tokens must be contiguous 1-D tensors")
    _fill_pending_kernel[(triton.cdiv(num_rows, _BLOCK),)](
        ids, index.contiguous(), tokens, num_rows, BLOCK=_BLOCK, **launch_options(ids.device)
    )
