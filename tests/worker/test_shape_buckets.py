"""Row-count buckets of eager steps and of the LM head (pagoda/worker/shape_buckets.py)."""

from __future__ import annotations

from pagoda.worker.shape_buckets import eager_tokens_bucket, logits_row_buckets, logits_rows_bucket


def test_logits_rows_bucket_is_the_graph_sizes():
    assert [logits_rows_bucket(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 239, 240, 256)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        16,
        32,
        240,
        240,
        256,
    ]
    assert logits_row_buckets(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert logits_row_buckets(20) == [1, 2, 4, 8, 16, 32]  # 17..20 -> 32


def test_eager_tokens_bucket_values():
    assert [eager_tokens_bucket(n, 16384) for n in (1, 3, 9, 16, 17, 33, 300, 1023)] == [
        1,
        4,
        16,
        16,
        32,
        48,
        304,
        1024,
    ]
    # From 1024 rows on: 32 sizes per power of two.
    assert [eager_tokens_bucket(n, 16384) for n in (1024, 1025, 2156, 4097, 8193, 16299)] == [
        1024,
        1056,
        2176,
        4224,
        8448,
        16384,
    ]


def test_eager_tokens_bucket_bounds():
    sizes = set()
    for n in range(1, 16385):
        padded = eager_tokens_bucket(n, 16384)
        assert n <= padded <= 16384
        if n >= 1024:
            assert (padded - n) * 32 < n  # under 1/32 of the rows are padding
        sizes.add(padded)
    assert len(sizes) == 196
    # Never past the token budget, unless the step itself is larger (it cannot be).
    assert eager_tokens_bucket(15990, 16000) == 16000
    assert eager_tokens_bucket(16000, 16000) == 16000
    assert eager_tokens_bucket(5, 5) == 5
