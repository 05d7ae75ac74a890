"""The kernel cases tools/compile_sm90.py compiles for Hopper, by group: `CASES` maps a
group's name to a generator of (name, kernel, args, kwargs), the launch of
kernel[grid](*args, **kwargs) as the engine's wrappers make it on an H100 or H200.

The cases are written by kernel family (moe, linear, attention); a group takes them in
the order a step runs them. They take their tiles and launch options from the kernel
families' configs for Hopper (`for_capability(HOPPER)`), with programmatic dependent
launch on (USE_PDL); CPU tensors stand in for device pointers (only dtype and alignment
matter).
"""

from __future__ import annotations

from .attention import (
    default_decode_cases,
    mla_prefill_cases,
    pdl_decode_cases,
    qk_rope_store_cases,
)
from .dsa import dsa_cases
from .linear import default_w8a16_cases, fp8_fused_quant_cases, pdl_norm_gemv_cases, pdl_w8a16_cases
from .moe import moe_cases, pdl_gate_up_cases, pdl_moe_down_cases, pdl_router_cases


def pdl_cases():
    """Batch-1 decode kernels of the Qwen3-30B-A3B shape with USE_PDL (pagoda.kernels.launch.pdl),
    in a layer's order: the wait on the predecessor grid must lower to griddepcontrol
    (checked in compile_sm90.main)."""
    yield from pdl_norm_gemv_cases()
    yield from pdl_router_cases()
    yield from pdl_gate_up_cases()
    yield from qk_rope_store_cases()
    yield from pdl_w8a16_cases()
    yield from pdl_decode_cases()
    yield from pdl_moe_down_cases()


def default_cases():
    """The decode attention and W8A16 GEMV kernels the engine runs by default."""
    yield from default_decode_cases()
    yield from default_w8a16_cases()


CASES = {
    "moe": moe_cases,
    "mla_prefill": mla_prefill_cases,
    "pdl": pdl_cases,
    "fp8_fused_quant": fp8_fused_quant_cases,
    "defaults": default_cases,
    "dsa": dsa_cases,
}
