"""The RMSNorm inside the one-row GEMVs (pagoda.kernels.norm_prologue, used by the FP8
W8A16 GEMV, its gated form and the bf16 GEMV) against the norm followed by the same
GEMV, and the seam that takes it (LinearBase.forward_rms_norm, the methods'
apply_rms_norm, the Llama layer).

Without CUDA the kernels run under TRITON_INTERPRET=1 (set by conftest) in float16 and
float32. The fused product must match the unfused pair up to the float32 order of the
norm's sum of squares (a normed value may then round one ulp apart), and the summed
residual it writes must equal x + residual exactly. Covered: masked and unmasked K
loops, split-K (one writer among several programs), bias, the gated form, the inputs
the fusion declines (several rows, no residual, mixed dtypes, too wide a row, the
switch off), and a tiny FP8 Llama whose one-row forward gives the unfused run's hidden
states with every norm but the first layer's input norm fused.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
from interpreted_kernels import kernel_modules  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float16, torch.float32]
EPS = 1e-5


@pytest.fixture(scope="module")
def kn():
    """(norm_prologue, fp8_quant, fp8_linear, gemv), interpreted where there is no GPU."""
    return kernel_modules("norm_prologue", "fp8_quant", "fp8_linear", "gemv")


def _rand(*shape, dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _row(k, dtype, seed=0):
    """(x, residual, norm weight) of one row of width k."""
    return (_rand(1, k, dtype=dtype, seed=seed), _rand(1, k, dtype=dtype, seed=seed + 1),
            _rand(k, dtype=dtype, seed=seed + 2, scale=0.3) + 1)


def _close(got, want):
    """Equal up to a normed value one ulp apart in the input: relative to the largest
    output, a few ulps of the activation dtype."""
    tol = 4 * torch.finfo(want.dtype).eps * max(want.float().abs().max().item(), 1e-6)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got.float() - want.float()).abs().max().item() <= tol


def _fp8_weight(kn, n, k, seed=7):
    _, fp8_quant, _, _ = kn
    w = _rand(n, k, dtype=torch.float32, seed=seed)
    return fp8_quant.quantize_weight_per_channel(w)


W8A16_CASES = [  # (n, k, config): unmasked K, masked K, split-K with a masked tail
    (48, 64, dict(BLOCK_N=8, BLOCK_K=32, SPLIT_K=1, num_warps=4, LOOP_STAGES=2)),
    (40, 83, dict(BLOCK_N=8, BLOCK_K=32, SPLIT_K=1, num_warps=4, LOOP_STAGES=2)),
    (32, 96, dict(BLOCK_N=8, BLOCK_K=32, SPLIT_K=2, num_warps=4)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,config", W8A16_CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_w8a16_with_the_norm_is_norm_then_w8a16(kn, dtype, n, k, config, with_bias):
    norm_prologue, _, fp8_linear, _ = kn
    x, residual, nw = _row(k, dtype)
    w, s = _fp8_weight(kn, n, k)
    bias = _rand(n, dtype=dtype, seed=5) if with_bias else None
    normed, summed = norm_prologue.add_rms_norm_ref(x, residual, nw, EPS)
    want = fp8_linear.w8a16_linear(normed, w, s, bias, config=dict(config))
    norm = norm_prologue.row_norm_for(x, residual, nw, EPS)
    got = fp8_linear.w8a16_linear(x, w, s, bias, config=dict(config), norm=norm)
    _close(got, want)
    assert torch.equal(norm.summed, summed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [64, 83])
def test_gated_w8a16_with_the_norm_is_norm_then_gated(kn, dtype, k):
    """The public entry, gated: silu(gate) * up of the normed row, and the summed row."""
    norm_prologue, _, fp8_linear, _ = kn
    x, residual, nw = _row(k, dtype, seed=3)
    w, s = _fp8_weight(kn, 2 * 24, k)
    normed, summed = norm_prologue.add_rms_norm_ref(x, residual, nw, EPS)
    want = fp8_linear.fp8_linear_silu_and_mul(normed, w, s)
    got, got_summed = fp8_linear.fp8_linear_rms_norm(x, residual, nw, EPS, w, s,
                                                     silu_and_mul=True)
    _close(got, want)
    assert torch.equal(got_summed, summed)
    plain, _ = fp8_linear.fp8_linear_rms_norm(x, residual, nw, EPS, w, s)
    _close(plain, fp8_linear.fp8_linear(normed, w, s))


def test_the_fused_entries_decline_what_they_do_not_take(kn, monkeypatch):
    norm_prologue, _, fp8_linear, gemv = kn
    x, residual, nw = _row(64, torch.float16)
    w, s = _fp8_weight(kn, 48, 64)
    two = torch.cat([x, x])
    assert fp8_linear.fp8_linear_rms_norm(two, torch.cat([residual] * 2), nw, EPS, w, s) is None
    assert norm_prologue.row_norm_for(x, None, nw, EPS) is None
    assert norm_prologue.row_norm_for(x, residual.float(), nw, EPS) is None
    assert norm_prologue.row_norm_for(x, residual, nw.float(), EPS) is None
    assert norm_prologue.row_norm_for(x, residual, nw[:32], EPS) is None
    wide = norm_prologue.MAX_HIDDEN * 2
    assert norm_prologue.row_norm_for(*_row(wide, torch.float16), EPS) is None
    assert fp8_linear.fp8_linear_rms_norm(x, residual, nw, EPS, w[:47], s[:47],
                                          silu_and_mul=True) is None  # odd: no gate/up pair
    assert gemv.maybe_gemv_rms_norm(x, residual, nw, EPS, _rand(40, 64, dtype=torch.float16)) \
        is None  # the shape is not in GEMV_CONFIGS
    monkeypatch.setattr(norm_prologue, "ENABLED", False)
    assert norm_prologue.row_norm_for(x, residual, nw, EPS) is None


GEMV_CASES = [  # (n, k, config)
    (40, 64, dict(BLOCK_N=8, BLOCK_K=32, SPLIT_K=1, LOOP_STAGES=2, num_warps=4, DOT=False)),
    (37, 83, dict(BLOCK_N=8, BLOCK_K=32, SPLIT_K=1, LOOP_STAGES=2, num_warps=4, DOT=False)),
    (32, 128, dict(BLOCK_N=4, BLOCK_K=32, SPLIT_K=2, LOOP_STAGES=2, num_warps=4, DOT=False)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,config", GEMV_CASES)
def test_gemv_with_the_norm_is_norm_then_gemv(kn, dtype, n, k, config):
    norm_prologue, _, _, gemv = kn
    x, residual, nw = _row(k, dtype, seed=11)
    weight, bias = _rand(n, k, dtype=dtype, seed=12, scale=0.5), _rand(n, dtype=dtype, seed=13)
    normed, summed = norm_prologue.add_rms_norm_ref(x, residual, nw, EPS)
    want = gemv.gemv(normed, weight, bias, dict(config))
    norm = norm_prologue.row_norm_for(x, residual, nw, EPS)
    got = gemv.gemv(x, weight, bias, dict(config), norm=norm)
    _close(got, want)
    assert torch.equal(norm.summed, summed)
    with pytest.raises(ValueError, match="one row"):
        gemv.gemv(torch.cat([x, x]), weight, bias, dict(config), norm=norm)


def test_unquantized_layer_takes_the_fused_gemv_where_the_table_routes_it(kn, monkeypatch):
    """QKVParallelLinear.forward_rms_norm through the unquantized method: the GEMV with
    the norm where GEMV_CONFIGS lists the shape (and the device takes the GEMV), else
    None; the result is the norm then the layer."""
    from pagoda.model.layers.layernorm import RMSNorm
    from pagoda.model.layers.linear import QKVParallelLinear, RowParallelLinear
    from pagoda.model.quant import unquantized
    norm_prologue, _, _, gemv = kn
    dtype = torch.float16
    layer = QKVParallelLinear(64, 16, 2, 1).to(DEVICE)
    layer.weight.data = _rand(64, 64, dtype=dtype, seed=21)
    norm = RMSNorm(64, EPS).to(DEVICE)
    norm.weight.data = _rand(64, dtype=dtype, seed=22, scale=0.2) + 1
    x, residual, _ = _row(64, dtype, seed=23)
    monkeypatch.setattr(unquantized, "GEMV_DEVICES", ("cuda", "cpu"))
    assert layer.forward_rms_norm(x, residual, norm) is None  # not in the table
    monkeypatch.setitem(gemv.GEMV_CONFIGS, (64, 64, 1), GEMV_CASES[0][2])
    got, summed = layer.forward_rms_norm(x, residual, norm)
    normed, want_summed = norm_prologue.add_rms_norm_ref(x, residual, norm.weight, EPS)
    _close(got, gemv.gemv(normed, layer.weight, None, GEMV_CASES[0][2]))
    assert torch.equal(summed, want_summed)
    row = RowParallelLinear(64, 64).to(DEVICE)
    assert row.forward_rms_norm(x, residual, norm) is None


def _one_row_forward(model, arch):
    """The hidden state of a one-row forward (a 3-token prompt's last token, its first
    two tokens' K/V already in the cache from a first forward)."""
    from pagoda.attention.forward_context import forward_context
    from pagoda.attention.metadata import build_attention_metadata
    from pagoda.attention.torch_ref import TorchRefBackend
    from pagoda.core.kv_cache_spec import KVCacheConfig
    from pagoda.model.layers.attention import kv_cache_specs
    from pagoda.worker.kv_pool import KVCachePool
    pool = KVCachePool(KVCacheConfig(4, kv_cache_specs(model, 16, torch.float16)), DEVICE)
    backend = TorchRefBackend(arch.num_attention_heads, arch.num_key_value_heads,
                              arch.head_dim, arch.head_dim ** -0.5)
    ids = torch.tensor([5, 17, 300], device=DEVICE)
    with torch.inference_mode():
        for rows, seq in ((slice(0, 2), 2), (slice(2, 3), 3)):
            md = build_attention_metadata([rows.stop - rows.start], [seq], [[0]], 16, DEVICE)
            pos = torch.arange(rows.start, rows.stop, device=DEVICE)
            with forward_context(backend, backend.build_metadata(md), pool):
                hidden = model(ids[rows], pos)
    return hidden


def test_fp8_llama_one_row_forward_with_the_norms_fused(kn, monkeypatch):
    from pagoda.model import llama
    from pagoda.model.loader import load_model
    from pagoda.model.quant import fp8 as fp8_module
    _, _, fp8_linear, _ = kn
    monkeypatch.setattr(fp8_module, "check_fp8_device", lambda device: None)
    model, arch = load_model("tiny-llama", "dummy", torch.float16, DEVICE, quantization="fp8")
    monkeypatch.setattr(llama, "NORM_FUSION_DEVICES", ())
    want = _one_row_forward(model, arch)
    calls = []
    real = fp8_linear.fp8_linear_rms_norm

    def spy(x, *args, **kwargs):
        out = real(x, *args, **kwargs)
        calls.append((x.shape[0], out is not None))
        return out
    monkeypatch.setattr(fp8_linear, "fp8_linear_rms_norm", spy)
    monkeypatch.setattr(llama, "NORM_FUSION_DEVICES", ("cuda", "cpu"))
    got = _one_row_forward(model, arch)
    layers = arch.num_hidden_layers
    # The 2-row forward asks nothing; the one-row forward fuses every norm but layer 0's
    # input norm (no residual yet); the final norm stays a kernel.
    assert calls == [(1, True)] * (2 * layers - 1)
    _close(got, want)
