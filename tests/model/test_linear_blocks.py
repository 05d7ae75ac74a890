"""pagoda.model.layers.matmul.linear: the CPU column-block product equals F.linear bit for bit.

Bit-equality (not closeness) is the property that keeps Pagoda's greedy outputs
identical to Hugging Face's, which calls F.linear.
"""

import pytest
import torch
import torch.nn.functional as F

from pagoda.model.layers.matmul import linear, num_blocks


@pytest.mark.parametrize("rows", [1, 3, 32, 300])
@pytest.mark.parametrize(
    "out_features,in_features",
    [
        (960, 576),  # SmolLM2 fused qkv
        (3072, 576),  # SmolLM2 fused gate/up
        (576, 1536),  # SmolLM2 down
        (49152, 576),  # SmolLM2 LM head
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_blocks_equal_f_linear_exactly(rows, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    assert num_blocks(out_features, in_features, 4, torch.get_num_threads()) > 1
    got = linear(x, weight, bias)
    assert got.shape == (rows, out_features) and got.is_contiguous()
    assert torch.equal(got, F.linear(x, weight, bias))


def test_num_blocks_rules():
    # At least 4 blocks (and one per thread), blocks of at most 1 MiB, and a divisor.
    assert num_blocks(960, 576, 4, threads=2) == 4
    assert num_blocks(3072, 576, 4, threads=2) == 8  # 7 MiB -> 8 blocks of 384 columns
    assert num_blocks(49152, 576, 4, threads=2) == 128
    assert num_blocks(960, 576, 4, threads=6) == 6
    assert num_blocks(97, 64, 4, threads=2) == 1  # prime: no equal split
    assert num_blocks(192, 64, 4, threads=2) == 1  # blocks would be under 64 columns


def test_fallbacks_are_f_linear():
    x = torch.randn(5, 64)
    weight = torch.randn(97, 64)  # no split
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    xb, wb = x.bfloat16(), torch.randn(1024, 64).bfloat16()  # other dtypes: plain call
    assert torch.equal(linear(xb, wb), F.linear(xb, wb))
    x3 = torch.randn(2, 3, 64)  # not 2-D
    w = torch.randn(1024, 64)
    assert torch.equal(linear(x3, w), F.linear(x3, w))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 16, 32, 33])
def test_rows_linear_matches_f_linear(rows):
    """2..SMALL_ROWS rows take the register-tile kernel (float32 rounding apart from
    F.linear); other row counts stay bit-identical to it."""
    from pagoda.model.quant.cpu_kernels import SMALL_ROWS, native_status, rows_linear

    if native_status() != "native":
        pytest.skip(f"the compiled CPU kernel is unavailable here: {native_status()}")
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    weight = torch.randn(200, 96, generator=gen)  # 200 columns: a partial 4-row tile
    bias = torch.randn(200, generator=gen)
    want = F.linear(x, weight, bias)
    got = rows_linear(x, weight, bias)
    if 2 <= rows <= SMALL_ROWS:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not torch.equal(got, want)  # the kernel ran (other rounding)
    else:
        assert torch.equal(got, want)
