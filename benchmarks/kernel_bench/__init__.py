"""The kernel timer's modes (`python -m benchmarks.kernels MODE`), one module per kernel
family: attention (decode, prefill), linear (gemv, fp8-gemm, fp8-quant), moe (moe,
router), mla, small (rope-store, argmax) and steps (decode steps of one engine under
named kernel-config variants). `common` holds their timers and table printing."""
