"""Per-token FP8 quantization fused into the RMSNorm and SiLU-and-mul kernels
(pagoda/kernels/fp8/fused_quant.py) and the seam that hands their output to the FP8
linears (Fp8Activation, takes_fp8_input / apply_fp8, the layers, the Llama layer).

The exactness contract is checked bit for bit: the fused kernels' fp8 bytes (viewed as
uint8) and float32 scales equal the unfused composition's (fused_ops' norm or
silu_and_mul rounding to the activation dtype, then per_token_quant_fp8), and the norm's
residual output equals fused_add_rms_norm's. Without CUDA the kernels run under
TRITON_INTERPRET=1 (set by conftest) in float16 and float32. On the GPU the one
reduction whose order matters (the norm's sum of squares) must be laid out as in the
unfused kernel: a test compiles both for sm_90 and compares the layouts. At the model
level, an FP8 tiny Llama gives the same hidden states with the fusion on as off.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
from helpers.interpreted_kernels import kernel_modules  # noqa: E402

from pagoda.model.quant import fp8 as fp8_module  # noqa: E402
from pagoda.model.quant.base import Fp8Activation  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float16, torch.float32]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def k():
    """(fp8_quant, fused_ops, fp8_fused_quant), interpreted where there is no GPU."""
    return kernel_modules("fp8.quant", "norm.fused_ops", "fp8.fused_quant")


def _rand(*shape, dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


def _same_fp8(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _close_to_ref(q, s, ref_q, ref_s):
    """Dequantized values close to the torch reference's (its float32 reductions and
    silu may round differently, so a few bytes may differ by a step)."""
    assert torch.allclose(s, ref_s, rtol=1e-2, atol=0)
    a, b = q.float() * s, ref_q.float() * ref_s
    assert (a - b).abs().max() <= 0.07 * b.abs().max() + 1e-30


# ------------------------------------------------------------------ kernels ---------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 100, 8200])  # 8200: past one chunk of 8192
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_equals_the_norm_kernel_then_per_token_quant(k, dtype, hidden, with_residual):
    fq, fo, fused = k
    rows = 3 if hidden > 1000 else 7
    x = _rand(rows, hidden, dtype=dtype, seed=1, scale=3.0)
    residual = _rand(rows, hidden, dtype=dtype, seed=2) if with_residual else None
    weight = _rand(hidden, dtype=dtype, seed=3)
    x[1] = 0  # a row whose amax is 0 (with its residual too)
    if residual is not None:
        residual[1] = 0
    x[-1, :3] = 1e4  # a row whose amax sits far from the rest
    q, s, summed = fused.rms_norm_fp8(x, weight, 1e-6, residual)
    if residual is None:
        normed, want_summed = fo.rms_norm(x, weight, 1e-6), None
    else:
        normed, want_summed = fo.fused_add_rms_norm(x, residual, weight, 1e-6)
    want_q, want_s = fq.per_token_quant_fp8(normed)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (rows, 1) and s.dtype == torch.float32
    assert _same_fp8(q, want_q) and torch.equal(s, want_s)
    assert s[1].item() == fq.FLOAT32_TINY and not q[1].float().any()  # zeros (some -0)
    if residual is None:
        assert summed is None
    else:
        assert torch.equal(summed, want_summed)
    ref_q, ref_s, ref_summed = fused.rms_norm_fp8_ref(x, weight, 1e-6, residual)
    _close_to_ref(q, s, ref_q, ref_s)
    if residual is not None:
        assert torch.equal(summed, ref_summed)


def test_rms_norm_fp8_takes_3d_and_strided_rows(k):
    fq, fo, fused = k
    base = _rand(3, 4, 100, dtype=torch.float16, seed=4)
    x = base[:, :, :48]  # rows with a stride of 100
    residual = _rand(3, 4, 48, dtype=torch.float16, seed=5)
    weight = _rand(48, dtype=torch.float16, seed=6)
    q, s, summed = fused.rms_norm_fp8(x, weight, 1e-5, residual)
    normed, want_summed = fo.fused_add_rms_norm(x, residual, weight, 1e-5)
    want_q, want_s = fq.per_token_quant_fp8(normed.reshape(-1, 48))
    assert q.shape == (12, 48) and summed.shape == (3, 4, 48)
    assert _same_fp8(q, want_q) and torch.equal(s, want_s) and torch.equal(summed, want_summed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate,block", [(64, None), (100, None), (100, 32), (200, 64)])
def test_silu_and_mul_fp8_equals_silu_and_mul_then_per_token_quant(k, dtype, intermediate, block):
    """block None: the row held in registers; a smaller block: the two-pass path."""
    fq, fo, fused = k
    x = _rand(6, 2 * intermediate, dtype=dtype, seed=7, scale=2.0)
    x[2] = 0  # amax 0
    x[4, intermediate:] = 0  # up all zero: amax 0 with a non-zero gate
    x[5, 0], x[5, intermediate] = 30.0, 300.0  # one large product
    q, s = fused.silu_and_mul_fp8(x, block)
    want_q, want_s = fq.per_token_quant_fp8(fo.silu_and_mul(x))
    assert q.shape == (6, intermediate) and s.shape == (6, 1)
    assert _same_fp8(q, want_q) and torch.equal(s, want_s)
    assert s[2].item() == s[4].item() == fq.FLOAT32_TINY
    _close_to_ref(q, s, *fused.silu_and_mul_fp8_ref(x))


def test_fused_kernels_take_no_rows_and_refuse_bad_shapes(k):
    _, _, fused = k
    x = torch.empty(0, 32, dtype=torch.float16, device=DEVICE)
    w = torch.ones(32, dtype=torch.float16, device=DEVICE)
    q, s, summed = fused.rms_norm_fp8(x, w, 1e-6, x)
    assert q.shape == (0, 32) and s.shape == (0, 1) and summed.shape == (0, 32)
    q, s = fused.silu_and_mul_fp8(x)
    assert q.shape == (0, 16) and s.shape == (0, 1)
    with pytest.raises(ValueError, match="weight must be \\[32\\]"):
        fused.rms_norm_fp8(torch.ones(2, 32, device=DEVICE), torch.ones(31, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="even last dim"):
        fused.silu_and_mul_fp8(torch.ones(2, 33, device=DEVICE))
    with pytest.raises(ValueError, match="power of two"):
        fused.silu_and_mul_fp8(torch.ones(2, 64, device=DEVICE), block=24)


# Run in a subprocess without TRITON_INTERPRET (the test process interprets every
# kernel): both norms compiled for sm_90 at the widths and dtypes that matter, and the
# layout of the first tt.reduce's operand (the sum of squares) compared.
_LAYOUT_CHECK = r"""
import re, sys
sys.path[:0] = ["tools", "."]
import torch, triton
from compile_sm90 import compile_for_sm90
from pagoda.kernels.fp8 import fused_quant as fq
from pagoda.kernels.norm import fused_ops as fo

def reduce_layout(compiled):
    ir = compiled.asm["ttgir"]
    alias = re.search(r'"tt\.reduce"\(.*?\}\) : \(tensor<[^,]+, (#\w+)>\)', ir, re.S).group(1)
    return re.search(rf"^{alias} = (.*)$", ir, re.M).group(1)

bad = []
for dt, wdt in ((torch.bfloat16,) * 2, (torch.float16,) * 2, (torch.float32,) * 2,
                (torch.bfloat16, torch.float32)):
    for hidden in (100, 2048, 4096, 5120, 14336):
        for residual in (False, True):
            x, w = torch.empty(4, hidden, dtype=dt), torch.empty(hidden, dtype=wdt)
            row, out = fq.norm_dtypes(x, w, x if residual else None)
            o = torch.empty(4, hidden, dtype=out)
            q, s = torch.empty(4, hidden, dtype=torch.float8_e4m3fn), torch.empty(4, 1)
            block = min(triton.next_power_of_2(hidden), fo._MAX_NORM_BLOCK)
            common = dict(HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual,
                          num_warps=fo._num_warps(block))
            a = compile_for_sm90(fo._rms_norm_kernel, x, x, w, o, x, 1, hidden, 0, hidden, 0,
                                 1e-6, **common)
            b = compile_for_sm90(fq._rms_norm_fp8_kernel, x, x, w, q, s, x, hidden, hidden,
                                 1e-6, ROW_DTYPE=fq._tl_dtype(row), OUT_DTYPE=fq._tl_dtype(out),
                                 FP8_MAX_C=448.0, TINY=fq.FLOAT32_TINY, VEC=fq.norm_vec(dt),
                                 **common)
            if reduce_layout(a) != reduce_layout(b):
                bad.append((str(dt), str(wdt), hidden, residual, reduce_layout(a),
                            reduce_layout(b)))
print("checked" if not bad else bad)
sys.exit(1 if bad else 0)
"""


def _ptxas_present() -> bool:
    return os.path.exists(
        os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    )


@pytest.mark.skipif(not _ptxas_present(), reason="needs Triton with its CUDA backend")
def test_fused_norm_reduces_its_sum_of_squares_in_the_unfused_layout():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", _LAYOUT_CHECK],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "checked" in out.stdout


# ------------------------------------------------------------------- layers ---------
def _online_layer(cls, *args, **kwargs):
    from pagoda.model.quant.fp8 import Fp8OnlineLinearMethod

    layer = cls(*args, **kwargs)
    layer.set_quant_method(Fp8OnlineLinearMethod())
    layer.to_empty(device=DEVICE)
    gen = torch.Generator().manual_seed(11)
    layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=gen))
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.fixture
def fp8_input_on_cpu(monkeypatch):
    """The FP8 methods ask for pre-quantized input on the CPU too (their CUDA check)."""
    monkeypatch.setattr(fp8_module, "FP8_INPUT_DEVICES", ("cuda", "cpu"))


def test_fp8_methods_ask_only_where_they_would_quantize_per_token(fp8_input_on_cpu):
    from pagoda.kernels.fp8.linear import W8A16_MAX_M
    from pagoda.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from pagoda.model.quant.fp8 import Fp8CheckpointLinearMethod

    layer = _online_layer(RowParallelLinear, 64, 32)
    assert not layer.takes_fp8_input(W8A16_MAX_M) and layer.takes_fp8_input(W8A16_MAX_M + 1)
    for method, wanted in (
        (Fp8CheckpointLinearMethod("channel"), True),
        (Fp8CheckpointLinearMethod("tensor"), True),
        (Fp8CheckpointLinearMethod("tensor", static_input=True), False),
        (Fp8CheckpointLinearMethod("block", (32, 32)), False),
    ):
        other = MergedColumnParallelLinear(64, [32, 32])
        other.set_quant_method(method)
        other.to_empty(device=DEVICE)
        assert other.takes_fp8_input(100) is wanted, method.name
    plain = RowParallelLinear(64, 32)
    assert not plain.takes_fp8_input(100)


def test_fp8_methods_do_not_ask_off_their_devices():
    from pagoda.model.layers.linear import RowParallelLinear

    layer = _online_layer(RowParallelLinear, 64, 32)
    assert layer.takes_fp8_input(100) is ON_GPU


@pytest.mark.parametrize("rows", [20, 3])
def test_an_fp8_activation_gives_what_the_float_input_gives(rows):
    """apply_fp8 on per_token_quant_fp8's output equals apply on the float rows (the
    W8A8 path; also below W8A16_MAX_M rows, where apply itself would take the GEMV,
    apply_fp8 still computes the W8A8 product of the rows it is given)."""
    from pagoda.kernels.fp8.linear import fp8_linear_ref
    from pagoda.model.layers.linear import ColumnParallelLinear

    layer = _online_layer(ColumnParallelLinear, 64, 48, bias=True)
    layer.bias.data.copy_(torch.linspace(-1, 1, 48))
    x = _rand(rows, 64, dtype=torch.float16, seed=12)
    act = Fp8Activation.quantize(x)
    out = layer(act)
    assert out.dtype == torch.float16 and out.shape == (rows, 48)
    if rows > 16:
        assert torch.equal(out, layer(x))
    want = fp8_linear_ref(x, layer.weight, layer.weight_scale, layer.bias, act_quant=True)
    torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)


def test_row_parallel_shard_quantized_per_token_equals_its_float_shard():
    """down_proj at tp 2: each rank's Fp8Activation covers its shard of the
    intermediate, quantized per token over that shard, which is what the method itself
    does with the float shard (reduce_results=False: the partial product, no group)."""
    from pagoda.model.layers.linear import RowParallelLinear

    full = _rand(20, 128, dtype=torch.float16, seed=13)
    for rank in (0, 1):
        layer = _online_layer(
            RowParallelLinear, 128, 32, tp_rank=rank, tp_size=2, reduce_results=False
        )
        shard = full[:, 64 * rank : 64 * (rank + 1)]
        assert torch.equal(layer(Fp8Activation.quantize(shard)), layer(shard.contiguous()))


def test_methods_that_cannot_take_an_fp8_activation_refuse_it():
    from pagoda.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from pagoda.model.quant.fp8 import Fp8CheckpointLinearMethod

    act = Fp8Activation.quantize(_rand(20, 64, dtype=torch.float16, seed=14))
    plain = RowParallelLinear(64, 32)
    plain.to_empty(device=DEVICE)
    with pytest.raises(ValueError, match="unquantized linear method takes no pre-quantized"):
        plain(act)
    for method, why in (
        (Fp8CheckpointLinearMethod("block", (32, 32)), "groups of block"),
        (Fp8CheckpointLinearMethod("tensor", static_input=True), "static"),
    ):
        layer = MergedColumnParallelLinear(64, [32, 32])
        layer.set_quant_method(method)
        layer.to_empty(device=DEVICE)
        with pytest.raises(ValueError, match=f"{why}.*cannot take a per-token Fp8Activation"):
            layer(act)
        with pytest.raises(ValueError, match="cannot take"):
            method.apply(layer, act)


def test_fp8_activation_checks_its_parts():
    q = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    assert Fp8Activation(q, torch.ones(4, 1), torch.bfloat16).shape == (4, 8)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Fp8Activation(torch.zeros(4, 8), torch.ones(4, 1), torch.bfloat16)
    with pytest.raises(ValueError, match="scale must be \\[4, 1\\] float32"):
        Fp8Activation(q, torch.ones(4), torch.bfloat16)


@pytest.mark.parametrize("fused_kernels", [False, True])
def test_norm_and_activation_layers_give_the_quantized_output(monkeypatch, k, fused_kernels):
    """fp8_out on the CPU: the composition (layer, then per_token_quant_fp8); with the
    fused kernels' devices including the CPU, the interpreted kernels, which equal the
    unfused kernels' composition (the layers' torch code may round their float32 sums
    differently, so that one is compared within a step of e4m3)."""
    from pagoda.model.layers import activation, layernorm

    fq, fo, fused = k
    if fused_kernels:
        monkeypatch.setattr(layernorm, "FUSED_FP8_DEVICES", ("cuda", "cpu"))
        monkeypatch.setattr(activation, "FUSED_FP8_DEVICES", ("cuda", "cpu"))
    norm = layernorm.RMSNorm(40, 1e-6).to(DEVICE)
    norm.weight.data = _rand(40, dtype=torch.float16, seed=15)
    x, r = _rand(20, 40, dtype=torch.float16, seed=16), _rand(20, 40, dtype=torch.float16, seed=17)
    act, summed = norm(x, r, fp8_out=True)
    alone = norm(x, fp8_out=True)
    gate_up = _rand(20, 64, dtype=torch.float16, seed=18)
    silu = activation.SiluAndMul()(gate_up, fp8_out=True)
    assert all(
        isinstance(a, Fp8Activation) and a.dtype == torch.float16 for a in (act, alone, silu)
    )
    if fused_kernels:
        want = fo.fused_add_rms_norm(x, r, norm.weight, 1e-6)
        cases = (
            (act, want[0]),
            (alone, fo.rms_norm(x, norm.weight, 1e-6)),
            (silu, fo.silu_and_mul(gate_up)),
        )
        for got, float_out in cases:
            q, s = fq.per_token_quant_fp8(float_out)
            assert _same_fp8(got.data, q) and torch.equal(got.scale, s)
        assert torch.equal(summed, want[1])
    else:
        want_normed, want_summed = norm(x, r)
        cases = ((act, want_normed), (alone, norm(x)), (silu, activation.SiluAndMul()(gate_up)))
        for got, float_out in cases:
            q, s = fq.per_token_quant_fp8(float_out)
            assert _same_fp8(got.data, q) and torch.equal(got.scale, s)
        assert torch.equal(summed, want_summed)


# ------------------------------------------------------------------- model ----------
def _llama_forward(model, arch, output_rows=None):
    from pagoda.attention.forward_context import forward_context
    from pagoda.attention.kv_pool import KVCachePool
    from pagoda.attention.metadata import build_attention_metadata
    from pagoda.attention.torch_ref import TorchRefBackend
    from pagoda.core.kv_cache_spec import KVCacheConfig
    from pagoda.model.layers.attention import kv_cache_specs

    lens = [20, 5]  # 25 rows: past W8A16_MAX_M, the W8A8 path
    pool = KVCachePool(KVCacheConfig(16, kv_cache_specs(model, 16, torch.float16)), DEVICE)
    backend = TorchRefBackend(
        arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, arch.head_dim**-0.5
    )
    md = build_attention_metadata(lens, lens, [[0, 1], [2]], 16, DEVICE)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, arch.vocab_size, (sum(lens),), generator=gen).to(DEVICE)
    pos = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
    with torch.inference_mode(), forward_context(backend, backend.build_metadata(md), pool):
        return model(ids, pos, output_rows)


@pytest.fixture(scope="module")
def fp8_llama():
    from pagoda.model.loader import load_model

    mp = pytest.MonkeyPatch()
    mp.setattr(fp8_module, "check_fp8_device", lambda device: None)
    try:
        yield load_model("tiny-llama", "dummy", torch.float16, DEVICE, quantization="fp8")
    finally:
        mp.undo()


@pytest.mark.parametrize("output_rows", [None, [4, 19, 24]])
def test_fp8_llama_gives_the_same_hidden_states_with_the_fusion(
    monkeypatch, fp8_llama, output_rows
):
    """Fusion on (the methods ask for FP8 input on the CPU): every qkv, gate_up and down
    projection takes an Fp8Activation, except the last layer's MLP when output_rows
    leaves it few rows; the hidden states equal the unfused run's bit for bit."""
    model, arch = fp8_llama
    rows = None if output_rows is None else torch.tensor(output_rows, device=DEVICE)
    monkeypatch.setattr(fp8_module, "FP8_INPUT_DEVICES", ())  # off (on the GPU too)
    want = _llama_forward(model, arch, rows)
    calls = []
    real = fp8_module.linear_fp8_input

    def spy(x, *args):
        calls.append(x.num_rows)
        return real(x, *args)

    monkeypatch.setattr(fp8_module, "linear_fp8_input", spy)
    monkeypatch.setattr(fp8_module, "FP8_INPUT_DEVICES", ("cuda", "cpu"))
    got = _llama_forward(model, arch, rows)
    layers = arch.num_hidden_layers
    assert calls == ([25] * 3 * layers if rows is None else [25] * (3 * layers - 2))
    assert torch.equal(got, want)


def test_fp8_llama_with_the_fused_kernels_stays_close(monkeypatch, fp8_llama, k):
    """The interpreted fused kernels inside the model (their exactness against the unfused
    kernels is tested above; the unfused CPU run uses the layers' torch code, whose
    float32 sums may round differently): the hidden states stay close."""
    from pagoda.model.layers import activation, layernorm

    model, arch = fp8_llama
    monkeypatch.setattr(fp8_module, "FP8_INPUT_DEVICES", ())  # off (on the GPU too)
    want = _llama_forward(model, arch)
    monkeypatch.setattr(fp8_module, "FP8_INPUT_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(layernorm, "FUSED_FP8_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(activation, "FUSED_FP8_DEVICES", ("cuda", "cpu"))
    got = _llama_forward(model, arch)
    assert (got.float() - want.float()).abs().max() <= 0.05 * want.float().abs().max()
