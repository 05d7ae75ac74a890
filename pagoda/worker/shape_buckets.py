"""Row-count buckets for the GEMMs of eager steps and of the LM head, on CUDA.

cuBLAS pays a large first-call cost in host time for every new (M, N, K), and on a
busy device the call also waits for the queued work to finish. That undoes async
scheduling's overlap on the step that meets the new shape: every step where some
requests finished (a new LM-head row count) stalled, and the device idled behind it
(figures in docs/performance.md, "measured reasons").

So row counts are rounded up to a small set of sizes, each met once per process:
- LM head rows (one per sampling request): 1, 2, 4, 8, then multiples of 16, the
  CUDA graph batch sizes; `warm_up_logits` meets every one of them at start-up.
- Eager forward rows (prefill and mixed steps): 32 sizes per power of two, so the
  padding is under 1/32 (3.1%) of the rows; never past max_num_batched_tokens.
Padding rows are cheap where it matters: decode-sized GEMMs are bound by reading
the weights, whatever their row count.
"""

from __future__ import annotations


def logits_rows_bucket(n: int) -> int:
    """Rows the LM head computes for n sampled rows (n >= 1)."""
    if n <= 8:
        return 1 << (n - 1).bit_length()
    return -(-n // 16) * 16


def logits_row_buckets(max_rows: int) -> list[int]:
    """Every logits_rows_bucket value for 1..max_rows (the warm-up list)."""
    return sorted({logits_rows_bucket(n) for n in range(1, max_rows + 1)})


def eager_tokens_bucket(n: int, max_tokens: int) -> int:
    """Rows of an eager forward of n tokens, at most max(n, max_tokens)."""
    if n < 1024:  # the LM head's buckets: 1, 2, 4, 8, then multiples of 16
        padded = logits_rows_bucket(n) if n > 0 else 0
    else:
        granule = 1 << (n.bit_length() - 6)  # 32 sizes per power of two
        padded = -(-n // granule) * granule
    return min(padded, max(n, max_tokens))
