"""L2 prefetch of a later kernel's weights from inside a latency-bound decode kernel.

At batch 1 a decode layer alternates kernels that stream weights (the GEMVs: qkv, o_proj,
the MoE gate/up and down) with kernels that barely touch memory (q/k norm + rotary +
KV store, decode attention, its merge, the router). While the latter run, the memory
bus idles, and each GEMV after them starts from an idle bus: it pays the ramp of its
first loads (the per-kernel increments in docs/performance.md put o_proj
and the MoE down GEMV well above their bytes' time). A kernel that knows which weights
come next can ask the memory system to bring them into L2 while it runs; the GEMV then
finds (some of) its lines there. Hopper's bulk prefetch (`cp.async.bulk.prefetch.L2`,
sm_90, issued by the TMA unit) takes a whole byte range in one instruction and nothing
waits for it: it is a hint, so results cannot change, only timing.

Owns the device functions the kernels call and the host-side rule of when they may
(`prefetch_bytes`). One prefetch uses them: the MoE down GEMV prefetches the next
decoder layer's qkv weight after its store (FusedMoE.set_next_linear; Qwen3-MoE wires
it), so it streams during the down kernel's tail and the input norm. It applies to steps
of at most MAX_ROWS rows (decode-sized batches, where the GEMV is memory-bound), on CUDA
devices of compute capability 9.0 or newer; never under the interpreter (the CPU
tests), which cannot run inline PTX.

Other prefetches measure slower (docs/performance.md, "Measured reasons"): o_proj's
weight from the q/k norm + rotary kernel (before its wait) or from the qkv GEMV's end,
and the chosen experts' down weights from the MoE gate/up GEMV (at each program's start
or after its store). Their bytes join kernels whose own loads, or the next kernels',
then end later; the down GEMV is itself bandwidth-bound and is followed by a kernel that
reads almost nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.launch.capability import cuda_capability

# Steps of more rows than this prefetch nothing (their GEMMs are not latency-bound).
MAX_ROWS = 16
# The most bytes one prefetch instruction asks for; a program's share is split into
# pieces of this size (issued one after another by one thread); a constexpr, as the
# kernels read it.
PIECE_BYTES = tl.constexpr(1 << 16)


def available(device: torch.device) -> bool:
    """Whether kernels on this device can issue bulk L2 prefetches: CUDA, compute
    capability 9.0 or newer (the interpreter only sees CPU tensors)."""
    return device.type == "cuda" and cuda_capability(device)[0] >= 9


def prefetch_bytes(weight: torch.Tensor | None, num_rows: int, device: torch.device) -> int:
    """How many bytes of weight a launch of num_rows rows on device should prefetch: its
    whole storage rounded down to 16 bytes (the instruction's granularity) where weight
    is a contiguous tensor on device starting at a 16-byte boundary (the instruction's
    alignment), the step is decode-sized and the device can; else 0 (prefetch nothing)."""
    if (
        weight is None
        or num_rows > MAX_ROWS
        or not available(device)
        or weight.device != device
        or not weight.is_contiguous()
        or weight.data_ptr() % 16
    ):
        return 0
    return weight.numel() * weight.element_size() // 16 * 16


def weight_of(layer: torch.nn.Module) -> torch.Tensor | None:
    """The tensor a linear layer's one-row GEMV streams: its `weight` (unquantized, or an
    FP8 method's e4m3 weight), or None where it has none."""
    weight = getattr(layer, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else None


@triton.jit
def _bulk_prefetch_l2(byte_ptr, nbytes):
    """One cp.async.bulk.prefetch.L2 of nbytes (a multiple of 16, > 0) at byte_ptr
    (16-byte aligned), issued by thread 0 of the program only."""
    tl.inline_asm_elementwise(
        "{ .reg .pred first; .reg .b32 tid; mov.u32 tid, %tid.x; setp.eq.u32 first, tid, 0; "
        "@first cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [byte_ptr, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def share_bounds(nbytes, part, parts):
    """[start, end) of share `part` of `parts` of nbytes bytes (a multiple of 16): equal
    shares of whole 16-byte units, the last ones shorter or empty (end <= start), so the
    shares tile [0, nbytes) without overlap."""
    units = nbytes // 16
    share = (units + parts - 1) // parts * 16
    start = part * share
    return start, tl.minimum(start + share, nbytes)


@triton.jit
def prefetch_program_share(base_ptr, nbytes):
    """Prefetches this program's share (share_bounds, one share per program of a 2-D grid
    in the order of its linear id, axis 0 major) of the nbytes bytes at base_ptr (16-byte
    aligned) into L2, in pieces of at most PIECE_BYTES."""
    start, end = share_bounds(
        nbytes,
        tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
        tl.num_programs(0) * tl.num_programs(1),
    )
    byte_ptr = base_ptr.to(tl.pointer_type(tl.int8))
    for offset in range(start, end, PIECE_BYTES):
        _bulk_prefetch_l2(byte_ptr + offset, tl.minimum(end - offset, PIECE_BYTES).to(tl.int32))
