"""The kernel switches a GPU benchmark run may set from its command line.

Each is a module attribute that Pagoda's kernels read at launch (a preload before the
PDL wait, an L2 prefetch, a launch order): `--FLAG on|off` sets it before the model's
kernels first launch; without the flag the module's own default stands. gpu_compare,
moe_bench, step_timeline and the profilers all take the same flags.
"""

from __future__ import annotations

# Module switches a benchmark run may set (--FLAG on|off): flag, the module and its
# boolean attribute, and what it switches. Default: as the module sets it.
KERNEL_SWITCHES = (
    ("pdl", "pagoda.kernels.launch.pdl", "ENABLED",
     "programmatic dependent launch of the decode kernels"),
    ("fp8-fast-accum", "pagoda.kernels.fp8.linear", "SCALED_MM_FAST_ACCUM",
     "torch._scaled_mm's fast accumulation in the FP8 GEMMs"),
    ("input-stream", "pagoda.worker.input_stream", "ENABLED",
     "graph steps' inputs built on a side stream"),
    ("short-context-graphs", "pagoda.kernels.attention.paged_decode", "SHORT_CONTEXT_GRAPHS",
     "small-batch decode graphs also captured for short contexts"),
    ("fp8-qk-dot", "pagoda.kernels.attention.paged_decode", "FP8_QK_DOT",
     "FP8-cache decode attention with the queries in e4m3 and q.K one FP8 dot"),
    ("w8a16-short-k-tile", "pagoda.kernels.fp8.w8a16", "SHORT_K_GEMV_TILE",
     "one-row FP8 W8A16 GEMVs of K <= 4096 (qkv, o) on 16-column programs"),
    ("narrow-moe-down", "pagoda.kernels.moe.fused_moe_decode", "NARROW_DOWN",
     "batch-1 MoE down GEMV on two-column one-warp programs for narrow experts"),
    ("d2h-stream", "pagoda.worker.step_output", "COPY_STREAM",
     "sampled ids and logprobs copied to the host on a stream of their own"),
    ("pending-fill-kernel", "pagoda.kernels.sample.pending_fill", "ENABLED",
     "the pending-token fill as one Triton launch"),
    ("norm-preload", "pagoda.kernels.norm.fused_ops", "PRELOAD_NORM_WEIGHT",
     "RMSNorm loads its weight before the PDL wait (rows of one chunk)"),
    ("router-norm", "pagoda.kernels.moe.router_fused", "FUSE_NORM",
     "one-row MoE block input norm computed by the fused router's programs"),
    ("rope-preload", "pagoda.kernels.attention.qk_rope_store", "PRELOAD_OPERANDS",
     "q/k norm + rotary + KV store loads cos/sin, slots and norm weights before the PDL wait"),
    ("pdl-trigger-first", "pagoda.kernels.launch.pdl", "TRIGGER_FIRST",
     "PDL kernels release their dependents before their wait, not after it"),
    ("max-shared-carveout", "pagoda.kernels.launch.pdl", "PREFER_MAX_SHARED",
     "PDL chain kernels prefer the largest shared-memory split (dependents start early)"),
    ("router-preload", "pagoda.kernels.moe.router_fused", "PRELOAD_WEIGHTS",
     "one-token fused MoE router loads its weight rows before the PDL wait"),
    ("decode-metadata-preload", "pagoda.kernels.attention.paged_decode", "PRELOAD_METADATA",
     "decode attention and merge load query start and context length before the PDL wait"),
    ("l2-prefetch-next-qkv", "pagoda.kernels.launch.l2_prefetch", "NEXT_QKV_IN_MOE_DOWN",
     "MoE down GEMV prefetches the next layer's qkv weight into L2"),
)


def add_kernel_switches(parser) -> None:
    """--FLAG on|off for each of KERNEL_SWITCHES; apply_kernel_switches sets them."""
    for flag, module, attribute, what in KERNEL_SWITCHES:
        parser.add_argument(f"--{flag}", choices=("on", "off"), default=None,
                            help=f"Pagoda: {what} ({module}.{attribute}; default: as the "
                                 f"module sets it)")


def apply_kernel_switches(args) -> None:
    """Sets the switches from the flags; call before the model's kernels first launch."""
    import importlib
    for flag, module, attribute, _ in KERNEL_SWITCHES:
        value = getattr(args, flag.replace("-", "_"), None)
        if value is not None:
            setattr(importlib.import_module(module), attribute, value == "on")
