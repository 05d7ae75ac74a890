"""--quantize-lm-head: the LM head quantized to FP8 beside the FP8 linears (opt-in; by
default it stays in the model's dtype, as in vLLM).

On the CPU the FP8 methods compute through the kernels' torch references (or the
interpreter): the option is refused without an FP8 scheme, and a tiny FP8 Llama with it
has a float8 head whose logits equal the product with its dequantized weight, close to
the float head's."""

from __future__ import annotations

import pytest
import torch

from pagoda.config import EngineArgs, ModelConfig
from pagoda.kernels.fp8.quant import dequantize_per_channel
from pagoda.model.quant import fp8 as fp8_module
from pagoda.model.quant.registry import resolve_quant_config


def test_the_option_needs_an_fp8_scheme():
    with pytest.raises(ValueError, match="needs --quantization fp8"):
        ModelConfig("m", quantization="int8", quantize_lm_head=True)
    with pytest.raises(ValueError, match="a bool"):
        ModelConfig("m", quantize_lm_head="yes")
    assert (
        EngineArgs(model="m", quantization="fp8", quantize_lm_head=True)
        .create_engine_config()
        .model.quantize_lm_head
    )
    with pytest.raises(ValueError, match="these weights are not quantized"):
        resolve_quant_config(None, None, "dummy", quantize_lm_head=True)
    with pytest.raises(ValueError, match="an FP8 option"):
        resolve_quant_config("int8", None, "dummy", quantize_lm_head=True)
    plain = resolve_quant_config("fp8", None, "dummy")
    with_head = resolve_quant_config("fp8", None, "dummy", quantize_lm_head=True)
    assert plain.lm_head_method() is None
    assert isinstance(with_head.lm_head_method(), fp8_module.Fp8OnlineLinearMethod)
    assert "FP8 LM head" in with_head.describe()


@pytest.fixture(scope="module")
def fp8_models():
    """(tiny FP8 Llama with a float head, the same with an FP8 head), float16 on the CPU."""
    from pagoda.model.loader import load_model

    mp = pytest.MonkeyPatch()
    mp.setattr(fp8_module, "check_fp8_device", lambda device: None)
    try:
        yield tuple(
            load_model(
                "tiny-llama",
                "dummy",
                torch.float16,
                "cpu",
                quantization="fp8",
                quantize_lm_head=head,
            )[0]
            for head in (False, True)
        )
    finally:
        mp.undo()


@pytest.mark.parametrize("rows", [1, 20])  # the W8A16 GEMV and the W8A8 GEMM
def test_fp8_head_logits_are_its_dequantized_product(fp8_models, rows):
    float_head, fp8_head = fp8_models
    assert float_head.lm_head.quantized is None
    head = fp8_head.lm_head.quantized
    assert head.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(float_head.lm_head.weight, fp8_head.lm_head.weight)  # same dummy seed
    gen = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, head.weight.shape[1], generator=gen).to(torch.float16)
    got = fp8_head.compute_logits(hidden)
    assert got.dtype == torch.float32
    assert fp8_head.compute_logits(hidden, float32=False).dtype == torch.float16
    dequantized = dequantize_per_channel(head.weight, head.weight_scale)
    want = hidden.float() @ dequantized.t()
    scale = want.abs().max()
    # Up to float16 rounding of the output (and, at 20 rows, the activation's FP8 steps).
    tol = 0.01 if rows == 1 else 0.08
    assert (got - want).abs().max() <= tol * scale
    ref = float_head.compute_logits(hidden)
    assert (got - ref).abs().max() <= 0.1 * ref.abs().max()
