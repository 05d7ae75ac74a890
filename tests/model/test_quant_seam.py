"""The quantization seam: shard plans load any method's parameters exactly, the LM head
hook, and resolving --quantization against a checkpoint's quantization_config."""

from __future__ import annotations

import pytest
import torch

from pagoda.model.layers.embedding import ParallelLMHead
from pagoda.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagoda.model.layers.matmul import linear
from pagoda.model.quant.base import WEIGHT_DIMS, LinearMethod, ShardDims
from pagoda.model.quant.registry import resolve_quant_config


class BlockScaledMethod(LinearMethod):
    """A test method: a float weight, a [out/4, in/4] block tensor and a per-shard scalar."""

    name = "test-blocks"

    def create_weights(self, layer, in_per_rank, out_per_rank, num_shards):
        layer.register_weight("weight", torch.empty(out_per_rank, in_per_rank), WEIGHT_DIMS)
        layer.register_weight(
            "blocks",
            torch.empty(-(-out_per_rank // 4), -(-in_per_rank // 4)),
            ShardDims(output_dim=0, input_dim=1, output_block=4, input_block=4),
        )
        layer.register_weight("per_shard", torch.empty(num_shards), ShardDims(per_shard=True))

    def apply(self, layer, x, bias=None):
        return linear(
            x, layer.weight * layer.blocks.repeat_interleave(4, 0).repeat_interleave(4, 1), bias
        )


def _full(rows, cols, seed):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def _load(layer, shard, weight, blocks, scalar):
    layer.weight_loader(layer.weight, weight, shard)
    layer.weight_loader(layer.blocks, blocks, shard)
    layer.weight_loader(layer.per_shard, torch.tensor(scalar), shard)


@pytest.mark.parametrize("rank", [0, 1])
def test_qkv_shard_plan_slices_every_parameter_kind(rank):
    # 4 heads of 8, 2 kv heads, hidden 16, tp 2: q rows 16, kv rows 8 per rank.
    layer = QKVParallelLinear(16, 8, 4, 2, tp_rank=rank, tp_size=2)
    layer.set_quant_method(BlockScaledMethod())
    q, k, v = _full(32, 16, 1), _full(16, 16, 2), _full(16, 16, 3)
    qb, kb, vb = _full(8, 4, 4), _full(4, 4, 5), _full(4, 4, 6)
    for shard, w, b, s in (("q", q, qb, 1.0), ("k", k, kb, 2.0), ("v", v, vb, 3.0)):
        _load(layer, shard, w, b, s)
    assert torch.equal(
        layer.weight,
        torch.cat(
            [q[16 * rank : 16 * rank + 16], k[8 * rank : 8 * rank + 8], v[8 * rank : 8 * rank + 8]]
        ),
    )
    assert torch.equal(
        layer.blocks,
        torch.cat(
            [qb[4 * rank : 4 * rank + 4], kb[2 * rank : 2 * rank + 2], vb[2 * rank : 2 * rank + 2]]
        ),
    )
    assert layer.per_shard.tolist() == [1.0, 2.0, 3.0]
    assert layer.shard_sizes() == [16, 8, 8]


def test_row_parallel_plan_narrows_the_input_dim_in_blocks():
    layer = RowParallelLinear(16, 8, tp_rank=1, tp_size=2)
    layer.set_quant_method(BlockScaledMethod())
    w, b = _full(8, 16, 7), _full(2, 4, 8)
    _load(layer, None, w, b, 5.0)
    assert torch.equal(layer.weight, w[:, 8:]) and torch.equal(layer.blocks, b[:, 2:])
    assert layer.per_shard.tolist() == [5.0]


def test_a_shard_off_the_block_grid_is_refused():
    layer = MergedColumnParallelLinear(8, [6, 6])  # the second shard starts at row 6
    layer.set_quant_method(BlockScaledMethod())
    with pytest.raises(ValueError, match="shard 1: shard starts at 6, not on a block of 4"):
        layer.weight_loader(layer.blocks, _full(2, 2, 9), 1)


def test_shape_and_dtype_mismatches_name_the_layer():
    layer = RowParallelLinear(16, 8)
    with pytest.raises(
        ValueError, match="RowParallelLinear: checkpoint shape \\(8, 15\\) has no \\[0, 16\\)"
    ):
        layer.weight_loader(layer.weight, torch.zeros(8, 15))
    with pytest.raises(ValueError, match="dtype torch.int8 cannot be stored"):
        layer.weight_loader(layer.weight, torch.zeros(8, 16, dtype=torch.int8))


def test_set_quant_method_replaces_the_weight_parameters():
    layer = MergedColumnParallelLinear(8, [4, 4], bias=True)
    assert sorted(n for n, _ in layer.named_parameters()) == ["bias", "weight"]
    layer.set_quant_method(BlockScaledMethod())
    assert sorted(n for n, _ in layer.named_parameters()) == [
        "bias",
        "blocks",
        "per_shard",
        "weight",
    ]


class ScaledCopyMethod(LinearMethod):
    """An online test method: keeps a float weight, halves it after loading."""

    name = "test-halve"

    def create_weights(self, layer, in_per_rank, out_per_rank, num_shards):
        layer.register_weight("weight", torch.empty(out_per_rank, in_per_rank), WEIGHT_DIMS)

    def process_weights_after_loading(self, layer):
        layer.weight.data.mul_(0.5)

    def apply(self, layer, x, bias=None):
        return linear(x, layer.weight, bias)


def test_lm_head_method_quantizes_a_copy_and_leaves_the_tied_weight():
    head = ParallelLMHead(6, 4)
    head.weight.data.copy_(_full(6, 4, 10))
    original = head.weight.detach().clone()
    head.set_quant_method(ScaledCopyMethod())
    head.process_weights_after_loading()
    hidden = _full(3, 4, 11)
    assert torch.equal(head.weight, original)  # the embedding's rows are untouched
    torch.testing.assert_close(head(hidden), hidden @ (0.5 * original).T)


def test_resolution_errors_name_the_problem():
    with pytest.raises(ValueError, match="quantized with 'gptq', which Pagoda cannot run"):
        resolve_quant_config(None, {"quant_method": "gptq", "bits": 4}, "safetensors")
    with pytest.raises(
        ValueError,
        match="--quantization int8 does not match the checkpoint's quantization_config \\(fp8\\)",
    ):
        resolve_quant_config("int8", {"quant_method": "fp8"}, "safetensors")
    with pytest.raises(ValueError, match="this one has no quantization_config"):
        resolve_quant_config("compressed-tensors", None, "safetensors")
    with pytest.raises(
        ValueError,
        match="--quantization gguf keeps a GGUF file's quantized blocks: it needs a .gguf model",
    ):
        resolve_quant_config("gguf", None, "safetensors")
    with pytest.raises(ValueError, match="dummy weights for a fp8-quantized config"):
        resolve_quant_config(None, {"quant_method": "fp8"}, "dummy")
    with pytest.raises(ValueError, match="unknown quantization 'awq'"):
        resolve_quant_config("awq", None, "safetensors")
    assert resolve_quant_config(None, None, "safetensors") is None


def test_quantization_none_keeps_float_weights_or_says_why_not():
    assert resolve_quant_config("none", None, "safetensors") is None
    assert resolve_quant_config("none", {"quant_method": "fp8"}, "dummy") is None
    with pytest.raises(
        ValueError,
        match="--quantization none asks for float weights, but this checkpoint is quantized "
        "\\(fp8\\)",
    ):
        resolve_quant_config("none", {"quant_method": "fp8"}, "safetensors")


def test_processing_after_loading_visits_the_lm_heads_private_layer_once():
    from pagoda.model.quant.registry import process_loaded_weights

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = ParallelLMHead(6, 4)

    model = Model()
    model.lm_head.weight.data.copy_(_full(6, 4, 12))
    original = model.lm_head.weight.detach().clone()
    model.lm_head.set_quant_method(ScaledCopyMethod())
    process_loaded_weights(model)
    torch.testing.assert_close(model.lm_head.quantized.weight, 0.5 * original)  # not 0.25
