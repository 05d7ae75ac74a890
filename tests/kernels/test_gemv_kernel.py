"""The decode GEMV (pagoda.kernels.gemv.gemv) against its torch reference, and its routing from
the unquantized linear method.

Without CUDA the kernel runs under TRITON_INTERPRET=1 (set by conftest) in float16 and
float32 on small shapes. Covered: every inner product (one row, FMA rows, tl.dot rows),
1..GEMV_MAX_ROWS rows, N and K that are not multiples of the tiles (masks), bias, rows
of x with a stride, split-K in one launch (deterministic: two calls bitwise equal, the
counters back at zero), the rejected arguments, and the linear layers taking the kernel
exactly when their GemvConfig's table lists their shape and the switch is on.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
from helpers.interpreted_kernels import kernel_modules  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.fixture(scope="module")
def kg():
    return kernel_modules("gemv.gemv")[0]


def _rand(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * 0.5).to(dtype).to(DEVICE)


def _cfg(block_n=8, block_k=32, split=1, stages=2, dot=False, warps=4):
    from pagoda.kernels.gemv.config import GemvTiles

    return GemvTiles(
        block_n=block_n,
        block_k=block_k,
        split_k=split,
        loop_stages=stages,
        num_warps=warps,
        dot=dot,
    )


def _config(*entries):
    """A GemvConfig routing these ((N, K, rows bucket), tiles) entries."""
    from pagoda.kernels.gemv.config import GemvConfig

    return GemvConfig(dict(entries))


def _check_close(kg, x, w, b, cfg):
    y = kg.gemv(x, w, b, cfg)
    ref = kg.gemv_ref(x, w, b)
    assert y.shape == ref.shape and y.dtype == x.dtype
    torch.testing.assert_close(y.float(), ref.float(), **TOL[x.dtype])
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_fma_rows_odd_shapes(kg, dtype, m):
    """N = 37, K = 83: the last column block and every K step but the first are masked."""
    x, w, b = (
        _rand(m, 83, dtype=dtype, seed=m),
        _rand(37, 83, dtype=dtype, seed=9),
        _rand(37, dtype=dtype, seed=4),
    )
    _check_close(kg, x, w, b, _cfg(block_n=8, block_k=32))
    _check_close(kg, x, w, None, _cfg(block_n=4, block_k=16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_even_shapes_unmasked(kg, dtype):
    """Tiles that divide N and K (the unmasked loads), one and four rows."""
    w, b = _rand(64, 128, dtype=dtype, seed=1), _rand(64, dtype=dtype, seed=2)
    for m in (1, 4):
        _check_close(kg, _rand(m, 128, dtype=dtype, seed=m), w, b, _cfg(block_n=16, block_k=64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [2, 7, 16])
def test_dot_rows(kg, dtype, m):
    x, w, b = (
        _rand(m, 80, dtype=dtype, seed=m),
        _rand(40, 80, dtype=dtype, seed=3),
        _rand(40, dtype=dtype, seed=5),
    )
    _check_close(kg, x, w, b, _cfg(block_n=16, block_k=32, dot=True))


@pytest.mark.parametrize("dot", [False, True])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("split", [3, 16])
def test_split_k_deterministic_and_counters_reset(kg, dot, m, split):
    """K = 100 in 3 splits of 48 (the last one partial) or in 16 of 16 (the last nine
    empty: they add zeros): matches the reference, two calls are bitwise equal, and every
    counter is 0 afterwards (ready for the next launch or graph replay)."""
    if dot and m == 1:
        pytest.skip("DOT needs M > 1")
    x, w, b = _rand(m, 100, seed=11), _rand(48, 100, seed=12), _rand(48, seed=13)
    cfg = _cfg(block_n=16, block_k=16, split=split, dot=dot)
    y1 = _check_close(kg, x, w, b, cfg)
    y2 = kg.gemv(x, w, b, cfg)
    assert torch.equal(y1, y2)
    assert int(kg.arrival_counters(kg.COUNTERS_OWNER, x.device, 1).abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
def test_split_k_in_cuda_graph_replays(kg, m):
    """Split-K captured in a CUDA graph (counters allocated by the eager call first):
    every replay equals the eager output bitwise, and the counters end at zero."""
    x = _rand(m, 4096, dtype=torch.bfloat16, seed=14)
    w, b = _rand(2048, 4096, dtype=torch.bfloat16, seed=15), _rand(2048, dtype=torch.bfloat16)
    cfg = _cfg(block_n=8, block_k=256, split=4, stages=3)
    eager = kg.gemv(x, w, b, cfg)
    torch.testing.assert_close(eager.float(), kg.gemv_ref(x, w, b).float(), atol=3e-2, rtol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kg.gemv(x, w, b, cfg)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert int(kg.arrival_counters(kg.COUNTERS_OWNER, x.device, 1).abs().sum()) == 0


def test_split_k_equals_partial_sums_in_order(kg):
    """The split reduction sums the splits' float32 partials in split order: the result is
    exactly the reference built that way (and K = 64 in 4 even splits: no masks)."""
    x, w = _rand(2, 64, seed=21), _rand(24, 64, seed=22)
    y = kg.gemv(x, w, None, _cfg(block_n=8, block_k=16, split=4))
    parts = [x[:, s * 16 : (s + 1) * 16] @ w[:, s * 16 : (s + 1) * 16].t() for s in range(4)]
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    torch.testing.assert_close(y, total, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_strided_rows_and_leading_dims(kg, dtype):
    """x rows with a stride (a slice of a wider tensor) and x of shape [2, 2, K]."""
    wide = _rand(3, 200, dtype=dtype, seed=31)
    x = wide[:, 10:90]  # stride(0) = 200
    w, b = _rand(24, 80, dtype=dtype, seed=32), _rand(24, dtype=dtype, seed=33)
    _check_close(kg, x, w, b, _cfg(block_n=8, block_k=32))
    x4 = _rand(2, 2, 80, dtype=dtype, seed=34)
    y = kg.gemv(x4, w, b, _cfg(block_n=8, block_k=32))
    assert y.shape == (2, 2, 24)
    torch.testing.assert_close(y.float(), kg.gemv_ref(x4, w, b).float(), **TOL[dtype])


def test_default_and_table_configs(kg):
    """No tiles: the device table's entry for (N, K, rows bucket) when present, else
    default_tiles; both compute the same product."""
    from pagoda.kernels.gemv.config import GemvConfig, rows_bucket

    x, w = _rand(3, 96, seed=41), _rand(40, 96, seed=42)
    ref = kg.gemv_ref(x, w)
    torch.testing.assert_close(kg.gemv(x, w), ref, **TOL[torch.float32])
    tiles = _cfg(block_n=16, block_k=32, split=2)
    assert _config(((40, 96, 4), tiles)).lookup(40, 96, 3) is tiles
    torch.testing.assert_close(kg.gemv(x, w, None, tiles), ref, **TOL[torch.float32])
    assert rows_bucket(1) == 1 and rows_bucket(3) == 4 and rows_bucket(8) == 8
    hopper = GemvConfig.for_capability((9, 0))
    assert hopper.lookup(4096, 4096, 1) == _cfg(block_n=4, block_k=512, split=1, stages=4)
    assert hopper.lookup(4096, 4096, 3) is None  # bucket 4: cuBLAS keeps it
    assert GemvConfig.for_device(torch.device("cpu")) == hopper


def test_rejects_bad_arguments(kg):
    x, w = _rand(2, 32), _rand(16, 32)
    with pytest.raises(ValueError, match="rows"):
        kg.gemv(_rand(kg.GEMV_MAX_ROWS + 1, 32), w)
    with pytest.raises(ValueError, match=r"\[..., 32\]"):
        kg.gemv(_rand(2, 31), w)
    with pytest.raises(ValueError, match="float16"):
        kg.gemv(x.half(), w)
    with pytest.raises(ValueError, match="bias"):
        kg.gemv(x, w, _rand(15))
    with pytest.raises(ValueError, match="contiguous rows"):
        kg.gemv(x, _rand(32, 16).t())
    with pytest.raises(ValueError, match="power of two"):
        kg.gemv(x, w, None, _cfg(block_n=6))
    with pytest.raises(ValueError, match="dot product"):
        kg.gemv(x[:1], w, None, _cfg(block_n=16, dot=True))
    with pytest.raises(ValueError, match="GemvTiles"):
        kg.gemv(x, w, None, dict(BLOCK_N=8))


# ---------------------------------------------------------------- routing -------------
@pytest.fixture
def routed(kg, monkeypatch):
    """The kernel routed on this test's device, and a record of the calls it gets."""
    from pagoda.model.quant import unquantized

    monkeypatch.setattr(unquantized, "GEMV_DEVICES", ("cuda", "cpu"))
    monkeypatch.delenv(kg.ENV_SWITCH, raising=False)
    calls = []
    real = kg.gemv

    def spy(*args, **kwargs):
        calls.append(tuple(args[1].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(kg, "gemv", spy)
    return calls


def _layers(dtype):
    from pagoda.model.layers.linear import ColumnParallelLinear, RowParallelLinear

    col = ColumnParallelLinear(48, 40, bias=True).to(device=DEVICE, dtype=dtype)
    row = RowParallelLinear(40, 24).to(device=DEVICE, dtype=dtype)
    for i, layer in enumerate((col, row)):
        for j, p in enumerate(layer.parameters()):
            p.data.copy_(_rand(*p.shape, dtype=dtype, seed=50 + 10 * i + j))
    return col, row


def test_linear_takes_gemv_when_table_lists_shape(kg, routed):
    col, row = _layers(torch.float16)
    col.gemv_config = row.gemv_config = _config(((40, 48, 2), _cfg(block_n=8, block_k=16)))
    x = _rand(2, 48, dtype=torch.float16, seed=61)
    y = col(x)
    assert routed == [(40, 48)]
    torch.testing.assert_close(
        y.float(), kg.gemv_ref(x, col.weight, col.bias).float(), **TOL[torch.float16]
    )
    row(y)  # (24, 40) is not in the table: torch
    col(_rand(3, 48, dtype=torch.float16, seed=62))  # bucket 4: not in the table either
    assert routed == [(40, 48)]


def test_linear_keeps_torch_path_otherwise(kg, routed, monkeypatch):
    """Not routed: the switch off, float32 weights, too many rows, an empty table."""
    col, _ = _layers(torch.float16)
    col.gemv_config = _config(
        *(((40, 48, m), _cfg(block_n=8, block_k=16)) for m in (1, 2, 4, 8, 16, 32))
    )
    x = _rand(2, 48, dtype=torch.float16, seed=71)
    monkeypatch.setenv(kg.ENV_SWITCH, "0")
    y = col(x)
    assert routed == []
    torch.testing.assert_close(
        y.float(), kg.gemv_ref(x, col.weight, col.bias).float(), **TOL[torch.float16]
    )
    monkeypatch.setenv(kg.ENV_SWITCH, "1")
    col(_rand(kg.GEMV_MAX_ROWS + 1, 48, dtype=torch.float16, seed=72))
    col32, _ = _layers(torch.float32)
    col32.gemv_config = col.gemv_config
    col32(_rand(2, 48, seed=73))
    assert routed == []
    col(x)
    assert routed == [(40, 48)]
    col.gemv_config = _config()
    col(x)
    assert routed == [(40, 48)]


def test_cpu_layers_are_not_routed_by_default(kg, monkeypatch):
    """Without the test's device list, a CPU layer keeps torch even for a listed shape."""
    from pagoda.model.quant import unquantized

    assert unquantized.GEMV_DEVICES == ("cuda",)
    calls = []
    monkeypatch.setattr(kg, "gemv", lambda *a, **k: calls.append(a))
    col = _layers(torch.float16)[0].cpu()
    col.gemv_config = _config(((40, 48, 2), _cfg()))
    col(torch.randn(2, 48, dtype=torch.float16))
    assert calls == []
