"""The modes of `python -m benchmarks.fp8`, one module each: quality (FP8 weights and KV
cache against float32) and kv (the FP8 KV cache's capacity, decode step and calibrated
scales against the model-dtype cache). `common` holds the random checkpoints and the
greedy comparison they share."""
