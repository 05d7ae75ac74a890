"""The fused Triton ops (pagoda.kernels.norm.fused_ops) against the layers' torch code.

Without CUDA the kernels run under TRITON_INTERPRET=1 in float32 and float16 (the
interpreter gets bfloat16 wrong); triton reads the variable when a kernel is
decorated, so it is set before the import and the module is reloaded if an earlier
test imported it compiled. With CUDA the same cases run compiled, plus bfloat16 at
Llama-8B shapes, the layers' dispatch to the kernels, and a CUDA graph replay.
The layers' dispatch on CPU is checked too: they must never import triton there.
"""

import importlib
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
from helpers.interpreted_kernels import kernel_modules  # noqa: E402

from pagoda.model.layers.activation import SiluAndMul  # noqa: E402
from pagoda.model.layers.layernorm import RMSNorm  # noqa: E402
from pagoda.model.layers.rotary import apply_rotary  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3}
gpu = pytest.mark.gpu


(fused_ops,) = kernel_modules("norm.fused_ops")


def _rand(*shape, dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


# The references: the layers' torch code, run with the kernels switched off.
def _ref_norm(x, weight, eps, residual=None):
    norm = RMSNorm(x.shape[-1], eps).to(DEVICE)
    norm.weight.data = weight
    old, fused_ops.FUSED_OPS_ENABLED = fused_ops.FUSED_OPS_ENABLED, False
    try:
        return norm(x) if residual is None else norm(x, residual)
    finally:
        fused_ops.FUSED_OPS_ENABLED = old


def _ref_silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _ref_rotary(x, cos, sin):
    old, fused_ops.FUSED_OPS_ENABLED = fused_ops.FUSED_OPS_ENABLED, False
    try:
        return apply_rotary(x, cos, sin)
    finally:
        fused_ops.FUSED_OPS_ENABLED = old


def _assert_close(actual, expected, tol):
    # tol bounds both the absolute and the relative error (float32 reductions in a
    # different order differ by an ulp or two on the larger values).
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 576), (3, 96)])
def test_rms_norm_matches_torch(dtype, rows, hidden):
    x = _rand(rows, hidden, dtype=dtype, scale=3.0)
    weight = _rand(hidden, dtype=dtype, seed=1)
    _assert_close(fused_ops.rms_norm(x, weight, 1e-5), _ref_norm(x, weight, 1e-5), TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (4, 576), (3, 96)])
def test_fused_add_rms_norm_matches_torch(dtype, rows, hidden):
    x = _rand(rows, hidden, dtype=dtype)
    residual = _rand(rows, hidden, dtype=dtype, seed=2, scale=4.0)
    weight = _rand(hidden, dtype=dtype, seed=1)
    out, new_residual = fused_ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_residual = _ref_norm(x, weight, 1e-6, residual)
    assert torch.equal(new_residual, ref_residual)  # one rounded add: bit exact
    _assert_close(out, ref_out, TOLERANCE[dtype])
    assert new_residual.data_ptr() != residual.data_ptr()  # inputs left untouched


def _norm_kernel(x, residual, weight, preload: bool):
    """fused_ops' RMSNorm kernel on contiguous 2-D rows of one chunk, its weight loaded
    before the PDL wait (preload, what the wrapper does for such rows) or after it:
    (out, new residual)."""
    rows, hidden = x.shape
    out, new_residual = torch.empty_like(x), torch.empty_like(x)
    block = fused_ops.triton.next_power_of_2(hidden)
    fused_ops._rms_norm_kernel[(rows,)](
        x,
        residual,
        weight,
        out,
        new_residual,
        1,
        hidden,
        0,
        hidden,
        0,
        1e-6,
        HIDDEN=hidden,
        BLOCK=block,
        HAS_RESIDUAL=True,
        PRELOAD_WEIGHT=preload,
        num_warps=fused_ops._num_warps(block),
    )
    return out, new_residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norm_with_preloaded_weight_is_bitwise_the_same(dtype):
    """The weight loaded before the PDL wait (one-chunk rows, 96 padded to 128): the
    same bits as the kernel that loads it after, and the wrapper's result."""
    x = _rand(3, 96, dtype=dtype)
    residual = _rand(3, 96, dtype=dtype, seed=2, scale=4.0)
    weight = _rand(96, dtype=dtype, seed=1)
    plain = _norm_kernel(x, residual, weight, preload=False)
    preloaded = _norm_kernel(x, residual, weight, preload=True)
    wrapper = fused_ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    for got in (preloaded, wrapper):
        assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


def test_rms_norm_chunked_row_and_3d_strided_input():
    # hidden above the single-chunk size walks the row in several chunks; a 3-D view
    # with padded rows (q of a fused qkv, normalised per head) is read in place.
    x = _rand(2, 8192 + 96, dtype=torch.float32)
    weight = _rand(8192 + 96, dtype=torch.float32, seed=1)
    _assert_close(fused_ops.rms_norm(x, weight, 1e-6), _ref_norm(x, weight, 1e-6), 1e-6)
    qkv = _rand(3, 4 * 32 + 40, dtype=torch.float16, seed=3)
    q = qkv[:, :128].view(3, 4, 32)
    weight = _rand(32, dtype=torch.float16, seed=4)
    _assert_close(fused_ops.rms_norm(q, weight, 1e-6), _ref_norm(q, weight, 1e-6), 1e-3)
    residual = _rand(3, 4, 32, dtype=torch.float16, seed=5)
    out, summed = fused_ops.fused_add_rms_norm(q, residual, weight, 1e-6)
    ref_out, ref_summed = _ref_norm(q, weight, 1e-6, residual)
    assert torch.equal(summed, ref_summed)
    _assert_close(out, ref_out, 1e-3)


def test_rms_norm_weight_promotes_like_torch():
    # A float32 weight on float16 rows gives a float32 result, as `weight * casted`.
    x = _rand(2, 96, dtype=torch.float16)
    weight = _rand(96, dtype=torch.float32, seed=1)
    _assert_close(fused_ops.rms_norm(x, weight, 1e-6), _ref_norm(x, weight, 1e-6), 1e-6)


def test_rms_norm_rejects_bad_shapes():
    x = _rand(2, 96, dtype=torch.float32)
    with pytest.raises(ValueError, match="weight"):
        fused_ops.rms_norm(x, _rand(64, dtype=torch.float32), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_ops.fused_add_rms_norm(
            x, _rand(3, 96, dtype=torch.float32), _rand(96, dtype=torch.float32), 1e-6
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,intermediate", [(1, 64), (3, 1536 + 48), (2, 96)])
def test_silu_and_mul_matches_torch(dtype, rows, intermediate):
    x = _rand(rows, 2 * intermediate, dtype=dtype, scale=4.0)
    _assert_close(fused_ops.silu_and_mul(x), _ref_silu_and_mul(x), TOLERANCE[dtype])


def test_silu_and_mul_strided_rows_and_odd_width():
    x = _rand(3, 2 * 96 + 8, dtype=torch.float16)[:, : 2 * 96]  # padded rows
    _assert_close(fused_ops.silu_and_mul(x), _ref_silu_and_mul(x), 1e-3)
    with pytest.raises(ValueError, match="even"):
        fused_ops.silu_and_mul(_rand(2, 7, dtype=torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 1, 64), (4, 3, 96), (2, 5, 128)])
def test_rotary_matches_torch(dtype, tokens, heads, head_dim):
    x = _rand(tokens, heads, head_dim, dtype=dtype)
    angles = _rand(tokens, head_dim // 2, dtype=torch.float32, seed=1, scale=10.0)
    cos, sin = angles.cos(), angles.sin()
    _assert_close(fused_ops.rotary(x, cos, sin), _ref_rotary(x, cos, sin), TOLERANCE[dtype])


def test_rotary_non_contiguous_views_and_input_kept():
    # q and k as reshaped column slices of a fused qkv projection: row stride != H * D.
    qkv = _rand(3, (4 + 2 + 2) * 64, dtype=torch.float16)
    q, k, _ = qkv.split([4 * 64, 2 * 64, 2 * 64], dim=-1)
    q, k = q.reshape(3, 4, 64), k.reshape(3, 2, 64)
    assert not q.is_contiguous() and not k.is_contiguous()
    angles = _rand(6, 32, dtype=torch.float32, seed=1, scale=10.0)[::2]  # strided rows
    cos, sin = angles.cos(), angles.sin()
    before = qkv.clone()
    for x in (q, k):
        out = fused_ops.rotary(x, cos, sin)
        assert out.is_contiguous()
        _assert_close(out, _ref_rotary(x, cos, sin), 1e-3)
    assert torch.equal(qkv, before)


def test_rotary_rejects_bad_shapes():
    x = _rand(2, 3, 64, dtype=torch.float32)
    table = _rand(2, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="cos"):
        fused_ops.rotary(x, table[:, :16], table)
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        fused_ops.rotary(x.reshape(6, 64), table, table)


def test_layers_on_cpu_never_import_triton():
    # A fresh interpreter: the layer modules and their CPU forwards must not import
    # triton (it is optional on CPU machines).
    script = (
        "import sys, torch\n"
        "from pagoda.model.layers.activation import SiluAndMul\n"
        "from pagoda.model.layers.layernorm import RMSNorm\n"
        "from pagoda.model.layers.rotary import apply_rotary\n"
        "x = torch.randn(2, 3, 8)\n"
        "RMSNorm(8)(x); RMSNorm(8)(x, x); SiluAndMul()(x)\n"
        "apply_rotary(x, x[:, 0, :4], x[:, 0, :4])\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "assert 'pagoda.kernels.norm.fused_ops' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, even on a GPU machine
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert result.returncode == 0, result.stderr


def test_env_switch_read_at_import(monkeypatch):
    # PAGODA_FUSED_OPS is read when the module is imported ("0" alone turns it off);
    # the reload keeps the module object the layers and this file refer to.
    try:
        for value, enabled in (("0", False), ("1", True), ("", True)):
            monkeypatch.setenv("PAGODA_FUSED_OPS", value)
            assert importlib.reload(fused_ops).FUSED_OPS_ENABLED is enabled
    finally:
        monkeypatch.undo()  # the caller's environment, then the module read from it
        importlib.reload(fused_ops)


# ---- CUDA only ---------------------------------------------------------------------


def _rel_err(actual, expected):
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


@gpu
@pytest.mark.parametrize("tokens", [1, 1000])
def test_bf16_llama8b_shapes(tokens):
    dtype = torch.bfloat16
    x = _rand(tokens, 4096, dtype=dtype)
    residual = _rand(tokens, 4096, dtype=dtype, seed=1, scale=5.0)
    weight = _rand(4096, dtype=dtype, seed=2)
    assert _rel_err(fused_ops.rms_norm(x, weight, 1e-5), _ref_norm(x, weight, 1e-5)) < 1e-2
    out, summed = fused_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_summed = _ref_norm(x, weight, 1e-5, residual)
    assert torch.equal(summed, ref_summed)
    assert _rel_err(out, ref_out) < 1e-2
    gate_up = _rand(tokens, 2 * 14336, dtype=dtype, seed=3, scale=3.0)
    assert _rel_err(fused_ops.silu_and_mul(gate_up), _ref_silu_and_mul(gate_up)) < 1e-2
    qkv = _rand(tokens, (32 + 8 + 8) * 128, dtype=dtype, seed=4)
    q = qkv[:, : 32 * 128].reshape(tokens, 32, 128)
    positions = torch.arange(tokens, device=DEVICE, dtype=torch.float32)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device=DEVICE).float() / 128))
    angles = torch.outer(positions, inv_freq)
    cos, sin = angles.cos(), angles.sin()
    assert _rel_err(fused_ops.rotary(q, cos, sin), _ref_rotary(q, cos, sin)) < 1e-2


@gpu
def test_layers_dispatch_to_kernels_on_cuda(monkeypatch):
    calls = []

    def spy(name):
        real = getattr(fused_ops, name)

        def wrapped(*args):
            calls.append(name)
            return real(*args)

        monkeypatch.setattr(fused_ops, name, wrapped)

    for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary"):
        spy(name)
    x = _rand(4, 3, 64, dtype=torch.bfloat16)
    norm = RMSNorm(64).to(DEVICE, torch.bfloat16)
    (
        norm(x),
        norm(x, x),
        SiluAndMul()(x),
        apply_rotary(x, x[:, 0, :32].float(), x[:, 0, :32].float()),
    )
    assert calls == ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary"]
    calls.clear()
    monkeypatch.setattr(fused_ops, "FUSED_OPS_ENABLED", False)
    (
        norm(x),
        norm(x, x),
        SiluAndMul()(x),
        apply_rotary(x, x[:, 0, :32].float(), x[:, 0, :32].float()),
    )
    assert calls == []


@gpu
def test_cuda_graph_capture_and_replay():
    x = _rand(8, 4096, dtype=torch.bfloat16)
    residual = _rand(8, 4096, dtype=torch.bfloat16, seed=1)
    weight = _rand(4096, dtype=torch.bfloat16, seed=2)
    gate_up = _rand(8, 2 * 512, dtype=torch.bfloat16, seed=3)
    q = _rand(8, 4, 128, dtype=torch.bfloat16, seed=4)
    angles = _rand(8, 64, dtype=torch.float32, seed=5)
    cos, sin = angles.cos(), angles.sin()

    def step():
        return (
            fused_ops.fused_add_rms_norm(x, residual, weight, 1e-5),
            fused_ops.silu_and_mul(gate_up),
            fused_ops.rotary(q, cos, sin),
        )

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (out, summed), act, rotated = step()
    for seed in (10, 11):  # new inputs copied in place, then replayed
        x.copy_(_rand(8, 4096, dtype=torch.bfloat16, seed=seed))
        gate_up.copy_(_rand(8, 2 * 512, dtype=torch.bfloat16, seed=seed))
        q.copy_(_rand(8, 4, 128, dtype=torch.bfloat16, seed=seed))
        graph.replay()
        (ref_out, ref_summed), ref_act, ref_rot = step()
        assert torch.equal(out, ref_out) and torch.equal(summed, ref_summed)
        assert torch.equal(act, ref_act) and torch.equal(rotated, ref_rot)
