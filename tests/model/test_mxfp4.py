"""MXFP4 expert weights (pagoda.model.quant.mxfp4): the dequantization against
transformers' own (integrations/mxfp4.py) on random blocks and scales, the reference
quantizer's round trip, and a gpt-oss checkpoint whose experts are stored as MXFP4
(as released) loading into logits equal to transformers' with the same dequantized
experts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.hf_compare import PagedRunner, hf_logits, randomize
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig
from transformers import GptOssForCausalLM as HFGptOss
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from pagoda.model.loader import load_model
from pagoda.model.quant import mxfp4

torch.set_num_threads(1)


def random_pair(experts: int, rows: int, cols: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=gen).to(torch.uint8)
    # Scales around 2^0 (127), wide enough to cover fractions and large values.
    scales = torch.randint(115, 135, (experts, rows, cols // 32), generator=gen).to(torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_matches_transformers(dtype):
    blocks, scales = random_pair(3, 10, 64, seed=1)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = mxfp4.expert_weight(blocks, scales, dtype)
    assert got.shape == (3, 64, 10) and got.dtype == dtype
    assert torch.equal(got, expected)


def test_dequantize_decodes_each_code():
    """Code c in the low nibble of byte j is column 2j, in the high nibble column 2j+1."""
    codes = torch.arange(16, dtype=torch.uint8)
    blocks = (codes[0::2] | (codes[1::2] << 4)).repeat(2).view(1, 1, 16)
    scales = torch.tensor([[128]], dtype=torch.uint8)  # 2^1
    values = mxfp4.dequantize(blocks, scales, torch.float32)
    expected = torch.tensor(mxfp4.E2M1_VALUES * 2) * 2.0
    assert torch.equal(values.view(-1), expected)


def test_quantize_reference_round_trip():
    weight = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(2))
    blocks, scales = mxfp4.quantize_reference(weight)
    back = mxfp4.dequantize(blocks, scales, torch.float32)
    # e2m1 keeps 1 mantissa bit: at most a quarter of the block's top value off.
    top = weight.abs().view(2, 6, 2, 32).amax(-1, keepdim=True)
    assert ((back - weight).abs().view(2, 6, 2, 32) <= 0.25 * top + 1e-6).all()
    # Values already on the grid come back unchanged.
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize_reference(back), torch.float32), back)


def test_bad_pairs_are_refused():
    blocks, scales = random_pair(1, 4, 32, seed=3)
    with pytest.raises(ValueError, match="disagree"):
        mxfp4.dequantize(blocks, scales[:, :3], torch.float32)
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.dequantize(blocks, scales.float(), torch.float32)


SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=512,
    max_position_embeddings=128,
    sliding_window=4,
)
PROJS = ("gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """A float checkpoint rewritten with MXFP4 experts, and transformers' model holding
    transformers' dequantization of those experts."""
    torch.manual_seed(0)
    config = GptOssConfig(**SHAPE)
    config._attn_implementation = "eager"
    hf = HFGptOss(config)
    randomize(hf, 0)
    hf.eval()
    path = Path(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    hf.save_pretrained(path, safe_serialization=True)
    tensors = load_file(path / "model.safetensors")
    for layer in hf.model.layers:
        for proj in PROJS:
            name = f"model.layers.{layer.self_attn.layer_idx}.mlp.experts.{proj}"
            weight = tensors.pop(name)  # [E, in, out]
            blocks, scales = mxfp4.quantize_reference(weight.transpose(1, 2))
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            with torch.no_grad():
                getattr(layer.mlp.experts, proj).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                )
    save_file(tensors, path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path), hf


def test_mxfp4_checkpoint_matches_transformers(mxfp4_checkpoint):
    path, hf = mxfp4_checkpoint
    model, arch = load_model(path, dtype="float32")
    assert arch.gpt_oss.mxfp4 and arch.quantization_config is None
    tokens = torch.randint(3, 512, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    runner = PagedRunner(model, arch)
    got = torch.cat(
        [runner.step({"r": tokens[:7]})["r"]] + [runner.step({"r": [t]})["r"] for t in tokens[7:]]
    )
    assert (got - hf_logits(hf, tokens)).abs().max().item() < 1e-4


def test_a_lone_half_of_a_pair_is_refused(mxfp4_checkpoint):
    path, _ = mxfp4_checkpoint
    model, _ = load_model(path, dtype="float32")
    blocks, _ = random_pair(4, 64, 32, seed=5)
    with pytest.raises(ValueError, match="without their pair"):
        model.load_weights([("model.layers.0.mlp.experts.down_proj_blocks", blocks)])
