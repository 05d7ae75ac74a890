"""Programmatic dependent launch (PDL) for the small kernels of a decode step.

At batch 1 a decode step is a chain of ~10 short kernels a layer, and each waits for the
one before it to finish before it is even launched. With PDL (Hopper and newer) a kernel
launched with the programmatic-serialization attribute may start while its predecessor
in the stream is still running; it must then wait (``griddepcontrol.wait``) for the
predecessor to complete and flush its memory before it touches any. What overlaps is
the launch itself and the kernel's prologue: the step's gaps between kernels.

The invariant every kernel that takes part keeps: ``pdl_wait_and_release(USE_PDL)``
comes before any store and before any load of memory that a kernel writes. Then the
chain stays serialised in effect (each kernel's memory operations follow its
predecessor's completion, so transitively every earlier kernel's), whatever ran before
it (cuBLAS, torch ops: a predecessor that never signals is waited for to its end). Only
two kinds of load may come before the wait: weights (written by no kernel), and what was
written at least two launches back (by a kernel or by the step's input copies): every
kernel in between releases its dependents only after its own wait (as
pdl_wait_and_release does), so this kernel launches only after that write completed and
was flushed. The preloading kernels say which loads they move: the fused router's
PRELOAD_W, fused_ops' RMSNorm weight and
qk_rope_store's cos / sin, slots and norm weights, and paged_decode's decode and merge
kernels their query start and context length (PRELOAD_METADATA). A kernel must never be
launched with ``launch_pdl=True`` without the wait: ``launch_options`` hands out the two
together.
Loading the one-row GEMVs' weight slabs before the wait measured slower (it delays the
short kernel before them; docs/performance.md, 2026-12-03) and is not done; so did the
one-token MoE down GEMV's weights (a pipelined loop over the choices after the wait won
in the step, 2026-12-04).

ENABLED is on: the batch-1 steps measured faster with it on the H200 (benchmarks/moe_bench.py
and gpu_compare.py --pdl on|off time both; docs/performance.md, 2026-12-02). Off, the
kernels compile and launch as before: USE_PDL=False removes the wait at compile time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.capability import cuda_capability

# Whether the decode kernels launch with PDL where the device supports it.
ENABLED = True

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


@triton.jit
def pdl_wait_and_release(USE_PDL: tl.constexpr):
    """First statement of a participating kernel: wait for the predecessor grid to
    complete and flush, then let the next kernel in the stream begin launching (its
    programs wait in turn at their own first statement)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
