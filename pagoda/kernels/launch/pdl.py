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
weight rows, fused_ops' RMSNorm weight, qk_rope_store's cos / sin, slots and norm
weights, and paged_decode's decode and merge kernels their query start and context
length. A kernel must never be launched with ``launch_pdl=True`` without the wait:
``launch_options`` hands out the two together.

The one-row GEMVs' weight slabs and the one-token MoE down GEMV's weights are loaded
after the wait: loading them before it delays the short kernel ahead of them and
measures slower in the step (docs/performance.md, "Rejected designs").

Whether a device launches with PDL is a property of the device
(pagoda.kernels.launch.config.LaunchConfig): on wherever it can run (compute capability
9.0 or newer, a Triton with griddepcontrol, not the interpreter), where the batch-1
steps measure faster with it: Llama-8B bf16 / FP8 batch 1 4.40 / 2.86 -> 4.27 / 2.70
ms, Qwen3-30B-A3B 3.00 -> 2.96 (H200; docs/performance.md, "Measured reasons: Launch").
The release comes after the wait: released first, Qwen3's batch-1 step is 139 us a
token slower (H100). Elsewhere USE_PDL=False removes the wait at compile time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.launch.config import LaunchConfig


def launch_options(device: torch.device) -> dict:
    """The keyword arguments of a participating kernel's launch on device: USE_PDL (its
    constexpr) and, only together with it, Triton's launch_pdl option."""
    return LaunchConfig.for_device(device).options()


@triton.jit
def pdl_wait_and_release(USE_PDL: tl.constexpr):
    """First statement of a participating kernel: wait for the predecessor grid to
    complete and flush, then let the next kernel in the stream begin launching (its
    programs wait in turn at their own first statement)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
