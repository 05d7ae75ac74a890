"""Programmatic dependent launch (PDL) for the small kernels of a decode step.

At batch 1 a decode step is a chain of ~10 short kernels a layer, and each waits for the
one before it to finish before it is even launched. With PDL (Hopper and newer) a kernel
launched with the programmatic-serialization attribute may start while its predecessor
in the stream is still running; it must then wait (``griddepcontrol.wait``) for the
predecessor to complete and flush its memory before it touches any. What overlaps is
the launch itself and the kernel's prologue: the step's gaps between kernels.

The invariant every kernel that takes part keeps: ``pdl_wait_and_release(USE_PDL)`` is
the first thing it does, before any load or store. Then the chain stays serialised in
effect (each kernel's memory operations follow its predecessor's completion, so
transitively every earlier kernel's), whatever ran before it (cuBLAS, torch ops: a
predecessor that never signals is waited for to its end). A kernel must never be
launched with ``launch_pdl=True`` without that wait: ``launch_options`` hands out the
two together.

One thing may come before the wait: an L2 prefetch of memory no kernel of the step
writes (a GEMV's weights), ``prefetch_rows_l2``. It reads nothing into registers and
cannot observe the predecessor's writes; while the predecessor runs (a norm, attention:
short kernels that leave the memory bus idle) the prefetched weights stream into L2,
and the GEMV's own loads after the wait hit there. PREFETCH_WEIGHTS turns it on
(``prefetch_bytes`` says how much a launch may); it is off until measured. The first
version prefetched every program's whole slab and measured far slower (FP8 batch 1
2.67 -> 4.02 ms): the programs resident at once asked for more than L2 holds and evicted
each other's lines before their loads came. Now each row's prefetch is capped so that
the programs that can be resident together ask for PREFETCH_BUDGET_BYTES in all.

ENABLED is on: the batch-1 steps measured faster with it on the H200 (benchmarks/moe_bench.py
and gpu_compare.py --pdl on|off time both; docs/performance.md, 2026-12-02). Off, the
kernels compile and launch as before: USE_PDL=False removes the wait at compile time.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagoda.kernels.capability import cuda_capability, sm_count

# Whether the decode kernels launch with PDL where the device supports it.
ENABLED = True
# Whether GEMVs prefetch their weights into L2 before the wait (PAGODA_PDL_PREFETCH=1).
PREFETCH_WEIGHTS = os.environ.get("PAGODA_PDL_PREFETCH", "0") == "1"
# What the programs of one GEMV resident at once may prefetch together (PAGODA_PDL_PREFETCH_MB):
# a fraction of the H200's 50 MB L2, about what the bus moves during a 2-3 us predecessor.
PREFETCH_BUDGET_BYTES = int(float(os.environ.get("PAGODA_PDL_PREFETCH_MB", "8")) * 2**20)
# Programs of a 4-warp GEMV one SM may hold at once (an upper bound: registers allow 8).
_RESIDENT_PROGRAMS_PER_SM = 8

# A Triton with griddepcontrol in its CUDA extras (tl.extra.cuda.gdc_wait).
_TRITON_HAS_GDC = hasattr(getattr(tl.extra, "cuda", None), "gdc_wait")


def active(device: torch.device) -> bool:
    """PDL for launches on this device: enabled, CUDA, compute capability 9.0 or newer,
    and a Triton with griddepcontrol (not the CPU interpreter, which cannot run it)."""
    if not ENABLED or device.type != "cuda":
        return False
    return _TRITON_HAS_GDC and cuda_capability(device)[0] >= 9


def launch_options(device: torch.device) -> dict:
    """The keyword arguments of a participating kernel's launch: USE_PDL (its constexpr)
    and, only together with it, Triton's launch_pdl option."""
    if active(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


def prefetch_bytes(weight: torch.Tensor, k_per_split: int, programs: int,
                   rows_per_program: int) -> int:
    """Bytes of each weight row's K slice a GEMV program may prefetch before the PDL wait
    (0: none): PREFETCH_WEIGHTS and PDL itself active (without the early launch there is
    nothing to overlap), every slab's start and length 16-byte aligned
    (prefetch_rows_l2's rule), and at most PREFETCH_BUDGET_BYTES over the programs that
    can be resident at once, a multiple of 16 bytes."""
    size = weight.element_size()
    if not (PREFETCH_WEIGHTS and active(weight.device) and weight.data_ptr() % 16 == 0
            and weight.stride(0) * size % 16 == 0 and weight.shape[1] * size % 16 == 0
            and k_per_split * size % 16 == 0):
        return 0
    resident = min(programs, _RESIDENT_PROGRAMS_PER_SM * sm_count(weight.device))
    cap = PREFETCH_BUDGET_BYTES // (resident * rows_per_program) // 16 * 16
    return min(cap, k_per_split * size)


@triton.jit
def prefetch_rows_l2(row_ptrs, nbytes):
    """Asks L2 for nbytes starting at each of row_ptrs, without waiting for them
    (cp.async.bulk.prefetch.L2, sm_90): every address 16-byte aligned, nbytes a
    multiple of 16 (callers check). Threads holding the same element issue the same
    prefetch: harmless. Compiled only (the interpreter cannot run PTX)."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
        [row_ptrs.to(tl.int64), nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def pdl_wait_and_release(USE_PDL: tl.constexpr):
    """First statement of a participating kernel: wait for the predecessor grid to
    complete and flush, then let the next kernel in the stream begin launching (its
    programs wait in turn at their own first statement)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
