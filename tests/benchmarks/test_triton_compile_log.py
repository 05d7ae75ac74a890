"""benchmarks.harness.compiles.CompileLog: it installs Triton's compile hooks for the
region, pairs the before/after calls Triton makes around a compilation, never asks
Triton to skip one, and puts the previous hooks back."""

from triton import knobs

from benchmarks.harness.compiles import CompileLog


class _Info:  # what Triton passes as fn= (triton.runtime.jit.JitFunctionInfo)
    name = "_moe_gemm_kernel"


def test_pairs_the_hooks_and_restores_them():
    def previous(**kwargs):
        return None

    knobs.runtime.jit_cache_hook = previous
    try:
        with CompileLog() as log:
            before, after = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
            variant = "_moe_gemm_kernel[num_warps=8](a: *bf16, N: i32)"
            # Triton calls both by keyword, and compiles only when the first returns falsy.
            assert not before(
                key=1,
                repr=variant,
                fn=_Info(),
                compile={},
                is_manual_warmup=False,
                already_compiled=False,
            )
            assert (
                after(
                    key=1,
                    repr=variant,
                    fn=_Info(),
                    compile={},
                    is_manual_warmup=False,
                    already_compiled=False,
                )
                is None
            )
        assert knobs.runtime.jit_cache_hook is previous
        assert knobs.runtime.jit_post_compile_hook is None
    finally:
        knobs.runtime.jit_cache_hook = None
    summary = log.summary()
    assert summary["available"] and summary["count"] == 1
    assert summary["kernels"][0]["kernel"] == "_moe_gemm_kernel"
    assert summary["kernels"][0]["seconds"] >= 0.0
