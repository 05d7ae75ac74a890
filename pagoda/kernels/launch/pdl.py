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

TRIGGER_FIRST (off; to be measured). A dependent grid launches once every program of
its predecessor has released it; released after the wait, a kernel's successor can start
at most one kernel's increment ahead: 0.2-0.8 us behind the short kernels (RMSNorm, the
q/k norm + rotary, the merge), less than a launch and its prologue take. Released first,
the successor launches as soon as this kernel's programs have all started. The wait
still orders every load and store after it behind the predecessor's completion (which
follows its own predecessor's, and so on), so only the loads before a wait see a longer
window: with TRIGGER_FIRST they may read nothing that a kernel of the chain writes during
the step, only weights and the step's inputs, which non-PDL copies and torch ops write
before the chain's first kernel (a PDL kernel waits for those to complete). The
preloading kernels above read only such data. USE_PDL carries the mode: 2 releases
first, any other true value waits first.

PREFER_MAX_SHARED (off; to be measured) is about where a dependent's programs can sit
while they wait. An SM divides its L1 / shared memory between the two per kernel, and a
program needing more shared memory than the SM's current split gives cannot start there
until the SM has drained (a guess, to be measured). The hint: the MoE down GEMV (51 KB
a program) started 2.3 us before the 14.9 us gate/up GEMV (none) ended, where the
register-preloading down kernel it replaced started 14.2 us early (step_timeline.py,
2026-12-04); the other kernels' head starts are bounded by the release rule above. With
it on, every participating kernel asks for the largest shared-memory split (`launched`,
called with each launch's compiled kernel), so no split changes along the chain; with it
off, kernels that it touched get the driver's default back at their next launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.launch.capability import cuda_capability

# Whether the decode kernels launch with PDL where the device supports it.
ENABLED = True
# Whether a participating kernel releases its dependents before its wait instead of after
# it (TRIGGER_FIRST in the module docstring; off, to be measured).
TRIGGER_FIRST = False
# Whether the participating kernels prefer the largest shared-memory split (the docstring).
PREFER_MAX_SHARED = False

# cuFuncSetAttribute's CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, and its values:
# percent of the most shared memory an SM has, -1 for no preference (the default).
_CARVEOUT_ATTRIBUTE = 9
_CARVEOUT_MAX_SHARED, _CARVEOUT_DEFAULT = 100, -1
# Function handle -> the carveout set on it (functions never touched are absent).
_carveouts: dict[int, int] = {}
_libcuda = None  # ctypes handle of the driver library, loaded at the first use

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
        return {"USE_PDL": 2 if TRIGGER_FIRST else True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def pdl_wait_and_release(USE_PDL: tl.constexpr):
    """First statement of a participating kernel: wait for the predecessor grid to
    complete and flush, then let the next kernel in the stream begin launching (its
    programs wait in turn at their own first statement). USE_PDL == 2 (TRIGGER_FIRST):
    let it begin launching first, then wait."""
    if USE_PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def launched(compiled) -> None:
    """Called with what a participating kernel's launch returned (its compiled kernel, or
    whatever the interpreter returns): applies PREFER_MAX_SHARED to its function once,
    and undoes it once the switch is off. Host-side only; a CUDA graph keeps what its
    captured launches had."""
    if not PREFER_MAX_SHARED and not _carveouts:  # never switched on: nothing to undo
        return
    wanted = _CARVEOUT_MAX_SHARED if PREFER_MAX_SHARED else _CARVEOUT_DEFAULT
    handle = getattr(compiled, "function", None)
    if not isinstance(handle, int) or not handle:
        return
    if _carveouts.get(handle, _CARVEOUT_DEFAULT) == wanted:
        return
    _set_function_attribute(handle, _CARVEOUT_ATTRIBUTE, wanted)
    _carveouts[handle] = wanted


def _set_function_attribute(handle: int, attribute: int, value: int) -> None:
    """cuFuncSetAttribute through the driver library; RuntimeError on a CUDA error."""
    import ctypes
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
        _libcuda.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        _libcuda.cuFuncSetAttribute.restype = ctypes.c_int
    status = _libcuda.cuFuncSetAttribute(ctypes.c_void_p(handle), attribute, value)
    if status != 0:
        raise RuntimeError(f"cuFuncSetAttribute({attribute}, {value}) failed: CUresult {status}")
