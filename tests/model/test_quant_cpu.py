"""CPU int8/int4 block methods: the kernel against dequantize-then-matmul, quantizers,
layers loaded and sharded (tp 2) through the seam, and clear errors."""

from __future__ import annotations

import pytest
import torch

from pagoda.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagoda.model.layers.matmul import linear
from pagoda.model.quant import cpu_kernels as ck
from pagoda.model.quant.cpu_int import Int4QuantConfig, Int8QuantConfig, OnlineBlockMethod
from pagoda.model.quant.registry import resolve_quant_config

KINDS = {"q8_0": ck.quantize_q8_0, "q4_1": ck.quantize_q4_1}


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(got, want, rel=2e-6):
    """Float32 sums in another order: relative to the largest output, within a few ulps
    per term (the inputs are O(1), K <= 256)."""
    scale = want.abs().max().clamp_min(1.0)
    assert (got - want).abs().max() <= rel * scale * 8, (got - want).abs().max()


def test_native_kernel_builds_here():
    # The machines Pagoda's CI runs on have a C compiler and AVX2; without them the
    # reference path would run and every speed figure would be wrong.
    assert ck.native_status() == "native"


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, ck.LARGE_M + 1])
def test_kernel_matches_dequantize_then_matmul(kind, m):
    """By default every batch size multiplies the activation as it is; with
    quantize_activations, batch 1 multiplies it quantized to 8 bits per block (as
    llama.cpp) and more rows as it is."""
    n, k = 13, 96  # 13 rows: full tiles of 4 and a tail of 1
    blocks = KINDS[kind](_randn(n, k, seed=1))
    weight = ck.dequantize(blocks, kind)
    x = _randn(m, k, seed=2)
    _close(ck.blocks_mm(x, blocks, kind), linear(x, weight))
    x_used = ck.quantize_activation_q8(x) if m == 1 else x
    eight_bit = ck.CpuBlocksConfig(quantize_activations=True)
    _close(ck.blocks_mm(x, blocks, kind, eight_bit), linear(x_used, weight))
    assert torch.equal(ck.native_dequantize(blocks, kind), ck.dequantize(blocks, kind))


@pytest.mark.parametrize("kind", list(KINDS))
def test_activation_quantization(kind):
    """The 8-bit activation: blocks of 32 scaled by amax / 127, rounded half to even;
    an all-zero block stays zero; with CpuBlocksConfig(quantize_activations=False)
    batch 1 multiplies the float activation."""
    x = _randn(1, 96, seed=4)
    x[0, 32:64] = 0.0
    q = ck.quantize_activation_q8(x).reshape(3, 32)
    d = x.reshape(3, 32).abs().amax(-1, keepdim=True) / 127
    assert torch.equal(q[1], torch.zeros(32))
    for b in (0, 2):
        steps = q[b] / d[b]  # integers, up to the rounding of q * d / d
        assert (steps - steps.round()).abs().max() < 1e-4
        assert steps.round().abs().max() == 127
    blocks = KINDS[kind](_randn(5, 96, seed=5))
    float_rows = ck.CpuBlocksConfig(quantize_activations=False)
    _close(ck.blocks_mm(x, blocks, kind, float_rows), linear(x, ck.dequantize(blocks, kind)))
    eight_bit = ck.CpuBlocksConfig(quantize_activations=True)
    _close(ck.blocks_mm(x, blocks, kind, eight_bit), ck.reference_gemv_q8(x, blocks, kind))
    assert torch.equal(ck.blocks_mm(x, blocks, kind), ck.blocks_mm(x, blocks, kind, float_rows))
    assert not torch.allclose(
        ck.blocks_mm(x, blocks, kind, float_rows), ck.blocks_mm(x, blocks, kind, eight_bit)
    )


@pytest.mark.parametrize("kind", list(KINDS))
def test_quantizers_error_bounds_and_round_trip(kind):
    w = _randn(8, 128, seed=3) * 0.5
    w[0, :32] = 0.25  # a constant block: d = 0 (int4) must not divide by zero
    blocks = KINDS[kind](w)
    deq = ck.dequantize(blocks, kind)
    d = ck._fp16_field(blocks, 0).repeat_interleave(32, dim=1)
    # Error within half a step, plus fp16 rounding of the scale/minimum.
    assert ((deq - w).abs() <= d * 0.5 + 1e-3 * w.abs().amax()).all()
    assert torch.equal(KINDS[kind](deq), blocks)  # dequantized blocks quantize back exactly


def test_q4_0_repack_is_exact():
    gguf_quants = pytest.importorskip("gguf.quants")
    import numpy as np
    from gguf import GGMLQuantizationType as T

    w = _randn(6, 64, seed=4).numpy()
    raw = gguf_quants.quantize(w, T.Q4_0)  # uint8 [6, 2 * 18]
    want = gguf_quants.dequantize(raw, T.Q4_0)
    blocks = ck.q4_0_to_q4_1(torch.from_numpy(raw).view(6, 2, 18))
    assert np.array_equal(ck.dequantize(blocks, "q4_1").numpy(), want)


@pytest.mark.parametrize("qtype,kind", [("Q4_1", "q4_1"), ("Q8_0", "q8_0")])
def test_gguf_blocks_dequantize_like_gguf(qtype, kind):
    gguf_quants = pytest.importorskip("gguf.quants")
    import numpy as np
    from gguf import GGMLQuantizationType as T

    w = _randn(5, 96, seed=5).numpy()
    raw = gguf_quants.quantize(w, T[qtype])
    blocks = torch.from_numpy(raw).view(5, 3, ck.BLOCK_BYTES[kind])
    assert np.array_equal(
        ck.dequantize(blocks, kind).numpy(), gguf_quants.dequantize(raw, T[qtype])
    )


def _layers(kind_config, rank, size):
    cfg = kind_config()
    layers = {
        "qkv": QKVParallelLinear(64, 16, 4, 2, tp_rank=rank, tp_size=size),
        "gate_up": MergedColumnParallelLinear(64, [128, 128], tp_rank=rank, tp_size=size),
        "down": RowParallelLinear(128, 64, tp_rank=rank, tp_size=size),
    }
    for name, layer in layers.items():
        layer.set_quant_method(cfg.linear_method(name, layer))
    return layers


@pytest.mark.parametrize("config", [Int8QuantConfig, Int4QuantConfig])
@pytest.mark.parametrize("rank", [0, 1])
def test_online_layers_shard_load_and_multiply(config, rank):
    """tp 2: each rank's blocks are the quantized rows/columns of its own slice, and
    apply equals the float matmul with those blocks dequantized."""
    kind = "q8_0" if config is Int8QuantConfig else "q4_1"
    layers = _layers(config, rank, 2)
    q, k, v = _randn(64, 64, seed=6), _randn(32, 64, seed=7), _randn(32, 64, seed=8)
    gate, up, down = _randn(128, 64, seed=9), _randn(128, 64, seed=10), _randn(64, 128, seed=11)
    for shard, w in (("q", q), ("k", k), ("v", v)):
        layers["qkv"].weight_loader(layers["qkv"].weight, w, shard)
    layers["gate_up"].weight_loader(layers["gate_up"].weight, gate, 0)
    layers["gate_up"].weight_loader(layers["gate_up"].weight, up, 1)
    layers["down"].weight_loader(layers["down"].weight, down)
    expected = {
        "qkv": torch.cat(
            [
                q[32 * rank : 32 * rank + 32],
                k[16 * rank : 16 * rank + 16],
                v[16 * rank : 16 * rank + 16],
            ]
        ),
        "gate_up": torch.cat([gate[64 * rank : 64 * rank + 64], up[64 * rank : 64 * rank + 64]]),
        "down": down[:, 64 * rank : 64 * rank + 64],
    }
    for name, layer in layers.items():
        layer.quant_method.process_weights_after_loading(layer)
        want_blocks = KINDS[kind](expected[name])
        assert torch.equal(layer.weight, want_blocks), name
        x = _randn(3, layer.in_per_rank, seed=12)
        _close(layer.quant_method.apply(layer, x), linear(x, ck.dequantize(want_blocks, kind)))


def test_online_method_keeps_bias_and_leading_dims():
    layer = ColumnParallelLinear(64, 32, bias=True)
    layer.set_quant_method(OnlineBlockMethod("q4_1"))
    w, b = _randn(32, 64, seed=13), _randn(32, seed=14)
    layer.weight_loader(layer.weight, w)
    layer.weight_loader(layer.bias, b)
    layer.quant_method.process_weights_after_loading(layer)
    x = _randn(2, 3, 64, seed=15)
    want = linear(x.reshape(6, 64), ck.dequantize(layer.weight, "q4_1"), b).reshape(2, 3, 32)
    _close(layer(x), want)


def test_lm_head_is_q8_0_and_the_embedding_keeps_its_float_weight():
    from pagoda.model.layers.embedding import ParallelLMHead

    head = ParallelLMHead(100, 64)
    w = _randn(100, 64, seed=16)
    head.weight_loader(head.weight, w)
    head.set_quant_method(Int4QuantConfig().lm_head_method())
    head.process_weights_after_loading()
    assert torch.equal(head.weight, w)
    blocks = ck.quantize_q8_0(w)
    assert torch.equal(head.quantized.weight, blocks)
    x = _randn(2, 64, seed=17)
    _close(head(x), linear(x, ck.dequantize(blocks, "q8_0")))


def test_layers_whose_input_is_not_whole_blocks_stay_float():
    layer = ColumnParallelLinear(40, 8)
    assert Int8QuantConfig().linear_method("x", layer) is None


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_cpu_schemes_refuse_a_gpu(name):
    cfg = resolve_quant_config(name, None, "safetensors")
    cfg.check_device(torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU method.*use --quantization fp8"):
        cfg.check_device(torch.device("cuda"))


def test_gguf_needs_a_gguf_checkpoint():
    with pytest.raises(ValueError, match="needs a .gguf model"):
        resolve_quant_config("gguf", None, "safetensors")


def test_fp16_overflow_is_refused():
    with pytest.raises(ValueError, match="overflows float16"):
        ck.quantize_q8_0(torch.full((1, 32), 1e7))
