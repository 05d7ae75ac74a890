"""MoE layers on the CPU: DeepseekMoE against transformers' DeepSeek V2 / V3 MoE blocks
(weights loaded through the HF per-expert names), FusedMoE's sharding loaders exact
against slices of the full tensors (tensor parallel and expert parallel), and the ranks'
partial outputs summing to the unsharded output."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from pagoda.model.arch_config import ArchConfig
from pagoda.model.layers.linear import materialize_module
from pagoda.model.layers.moe.deepseek_moe import DeepseekMoE, is_moe_layer
from pagoda.model.layers.moe.fused_moe import FusedMoE, map_expert_weight_name
from pagoda.model.moe_config import MoEConfig
from pagoda.model.parallel import SINGLE_RANK, TensorParallel
from pagoda.model.presets import get_preset

HIDDEN, INTER, EXPERTS = 32, 12, 8
GEN = torch.Generator().manual_seed(0)


def randn(*shape: int, scale: float = 0.3) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN) * scale


def hf_expert_tensors(block) -> list[tuple[str, torch.Tensor]]:
    """transformers keeps experts stacked in memory ([E, 2I, H] gate then up, [E, H, I])
    and saves them per expert: the names a checkpoint holds."""
    out = []
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        out.append((f"experts.{e}.gate_proj.weight", gate_up[e, :inter]))
        out.append((f"experts.{e}.up_proj.weight", gate_up[e, inter:]))
        out.append((f"experts.{e}.down_proj.weight", down[e]))
    return out


def load_block(block: DeepseekMoE, named: list[tuple[str, torch.Tensor]]) -> set[str]:
    """HF names -> the block's parameters, as a model's load_weights does."""
    params = dict(block.named_parameters())
    loaded = set()
    for name, tensor in named:
        mapped = map_expert_weight_name(name)
        if mapped is not None:
            target, shard = mapped
        elif ".gate_proj." in name or ".up_proj." in name:
            shard = 0 if ".gate_proj." in name else 1
            target = name.replace(".gate_proj.", ".gate_up_proj.").replace(
                ".up_proj.", ".gate_up_proj."
            )
        else:
            target, shard = name, None
        param = params[target]
        param.weight_loader(param, tensor, shard)
        loaded.add(target)
    return loaded


DEEPSEEK = {
    "v2_greedy": (
        DeepseekV2Config,
        DeepseekV2Moe,
        "DeepseekV2ForCausalLM",
        dict(
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            n_shared_experts=2,
            routed_scaling_factor=1.0,
        ),
    ),
    "v2_group_limited": (
        DeepseekV2Config,
        DeepseekV2Moe,
        "DeepseekV2ForCausalLM",
        dict(
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=4.0,
        ),
    ),
    "v3_noaux_tc": (
        DeepseekV3Config,
        DeepseekV3MoE,
        "DeepseekV3ForCausalLM",
        dict(
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        ),
    ),
}


def _arch_for(architecture: str, hf_config) -> ArchConfig:
    """An ArchConfig carrying the block's MoE config (the DeepSeek model files build the
    attention side; the block needs only hidden_size and moe)."""
    moe = MoEConfig.from_hf_config(hf_config.to_dict(), architecture)
    arch = ArchConfig(
        architecture="Qwen3MoeForCausalLM",
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        intermediate_size=64,
        vocab_size=10,
        moe=moe,
    )
    return arch


@pytest.mark.parametrize("case", sorted(DEEPSEEK))
def test_deepseek_moe_matches_transformers(case):
    config_cls, block_cls, architecture, fields = DEEPSEEK[case]
    hf_config = config_cls(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=3,
        **fields,
    )
    torch.manual_seed(0)
    hf = block_cls(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(randn(*p.shape))
        if case.startswith("v3"):
            hf.gate.e_score_correction_bias.copy_(randn(EXPERTS))
    named = [(n, t.detach()) for n, t in hf.state_dict().items() if not n.startswith("experts.")]
    named += hf_expert_tensors(hf)
    arch = _arch_for(architecture, hf_config)
    with torch.device("meta"):
        block = DeepseekMoE(arch, SINGLE_RANK, torch.float32)
    materialize_module(block, "cpu", torch.float32)
    loaded = load_block(block, named)
    assert loaded == {n for n, _ in block.named_parameters()}
    assert block.gate.weight.dtype == torch.float32
    x = randn(17, HIDDEN, scale=1.0)
    with torch.no_grad():
        expected = hf(x.unsqueeze(0)).squeeze(0)
        got = block(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if case.startswith("v3"):
        assert "gate.e_score_correction_bias" in dict(block.named_parameters())


def test_router_and_bias_stay_float32_in_a_bfloat16_block():
    _, _, architecture, fields = DEEPSEEK["v3_noaux_tc"]
    hf_config = DeepseekV3Config(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=3,
        **fields,
    )
    with torch.device("meta"):
        block = DeepseekMoE(_arch_for(architecture, hf_config), SINGLE_RANK, torch.bfloat16)
    materialize_module(block, "cpu", torch.bfloat16)
    assert block.gate.weight.dtype == torch.float32
    assert block.experts.e_score_correction_bias.dtype == torch.float32
    assert block.experts.w13_weight.dtype == torch.bfloat16
    assert block.shared_experts.down_proj.weight.dtype == torch.bfloat16


def _moe_cfg(top_k: int = 3) -> MoEConfig:
    return MoEConfig(
        num_experts=EXPERTS,
        num_experts_per_tok=top_k,
        moe_intermediate_size=INTER,
        renormalize=True,
    )


def _full_experts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        randn(EXPERTS, INTER, HIDDEN),
        randn(EXPERTS, INTER, HIDDEN),
        randn(EXPERTS, HIDDEN, INTER),
    )


def _load_layer(layer: FusedMoE, gate, up, down) -> None:
    for e in range(EXPERTS):
        for proj, full in (("gate", gate), ("up", up), ("down", down)):
            name, shard = map_expert_weight_name(
                f"model.layers.0.mlp.experts.{e}.{proj}_proj.weight"
            )
            param = layer.w2_weight if name.endswith("w2_weight") else layer.w13_weight
            param.weight_loader(param, full[e], shard)


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_fused_moe_loader_shards_exactly_and_partials_sum(tp_size, expert_parallel):
    gate, up, down = _full_experts()
    cfg = _moe_cfg()
    full = FusedMoE(EXPERTS, 3, HIDDEN, INTER, cfg, SINGLE_RANK, torch.float32)
    _load_layer(full, gate, up, down)
    assert torch.equal(full.w13_weight, torch.cat([gate, up], dim=1))
    x, logits = randn(9, HIDDEN, scale=1.0), randn(9, EXPERTS, scale=2.0)
    partials = []
    for rank in range(tp_size):
        tp = TensorParallel(rank, tp_size, expert_parallel)
        layer = FusedMoE(
            EXPERTS,
            3,
            HIDDEN,
            INTER,
            cfg,
            tp,
            torch.float32,
            reduce_results=False,
            expert_parallel=expert_parallel,
        )
        _load_layer(layer, gate, up, down)
        if expert_parallel:  # whole experts, this rank's contiguous range
            n = EXPERTS // tp_size
            experts = slice(rank * n, (rank + 1) * n)
            assert torch.equal(layer.w13_weight, torch.cat([gate[experts], up[experts]], dim=1))
            assert torch.equal(layer.w2_weight, down[experts])
        else:  # every expert, this rank's intermediate rows / columns
            i = INTER // tp_size
            cols = slice(rank * i, (rank + 1) * i)
            assert torch.equal(layer.w13_weight, torch.cat([gate[:, cols], up[:, cols]], dim=1))
            assert torch.equal(layer.w2_weight, down[:, :, cols])
        with torch.no_grad():
            partials.append(layer(x, logits))
    with torch.no_grad():
        expected = full(x, logits)
    torch.testing.assert_close(sum(partials), expected, rtol=1e-5, atol=1e-5)


def test_fused_moe_refusals():
    cfg = _moe_cfg()
    with pytest.raises(ValueError, match="disagrees with its MoEConfig"):
        FusedMoE(EXPERTS, 2, HIDDEN, INTER, cfg, SINGLE_RANK, torch.float32)
    with pytest.raises(
        ValueError,
        match=r"moe_intermediate_size \(12\) is not divisible by "
        r"tensor_parallel_size \(8\)",
    ):
        FusedMoE(EXPERTS, 3, HIDDEN, INTER, cfg, TensorParallel(0, 8), torch.float32)
    with pytest.raises(ValueError, match="8 experts do not split over 3 ranks"):
        FusedMoE(
            EXPERTS,
            3,
            HIDDEN,
            INTER,
            cfg,
            TensorParallel(0, 3),
            torch.float32,
            expert_parallel=True,
        )
    layer = FusedMoE(EXPERTS, 3, HIDDEN, INTER, cfg, SINGLE_RANK, torch.float32)
    with pytest.raises(ValueError, match="down_proj does not belong"):
        layer.w13_weight.weight_loader(layer.w13_weight, randn(HIDDEN, INTER), (0, "down"))
    with pytest.raises(ValueError, match="expert 8 out of range"):
        layer.w13_weight.weight_loader(layer.w13_weight, randn(INTER, HIDDEN), (8, "gate"))
    with pytest.raises(ValueError, match="checkpoint shape"):
        layer.w13_weight.weight_loader(layer.w13_weight, randn(INTER + 1, HIDDEN), (0, "up"))
    assert map_expert_weight_name("model.layers.0.mlp.gate.weight") is None
    assert map_expert_weight_name("model.layers.0.mlp.shared_experts.up_proj.weight") is None


def test_is_moe_layer():
    dense = get_preset("tiny-qwen3")
    assert not any(is_moe_layer(dense, i) for i in range(dense.num_hidden_layers))
    moe = MoEConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, mlp_only_layers=(0,)
    )
    arch = dense.replace(architecture="Qwen3MoeForCausalLM", moe=moe)
    assert [is_moe_layer(arch, i) for i in range(3)] == [False, True, True]


def test_expert_parallel_config_flag_and_split_checks():
    import argparse

    from pagoda.config import EngineArgs, ParallelConfig
    from pagoda.entrypoints.cli_args import add_engine_args, engine_args_from_namespace
    from pagoda.model.parallel import check_tensor_parallel, valid_tp_sizes

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--enable-expert-parallel", "-tp", "2", "--device", "cpu"])
    assert engine_args_from_namespace(ns).create_engine_config().parallel.enable_expert_parallel
    assert not EngineArgs(device="cpu").create_engine_config().parallel.enable_expert_parallel
    with pytest.raises(ValueError, match="enable_expert_parallel must be True or False"):
        ParallelConfig(enable_expert_parallel="yes")
    # 8 experts of 12: tp 8 splits the experts, not their 12 columns.
    moe = MoEConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12)
    arch = get_preset("tiny-qwen3").replace(
        architecture="Qwen3MoeForCausalLM", moe=moe, num_key_value_heads=4
    )
    check_tensor_parallel(arch, 4, expert_parallel=True)
    check_tensor_parallel(arch, 4)  # 12 / 4
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(12\) is not divisible"):
        check_tensor_parallel(arch, 8)
    assert valid_tp_sizes(arch) == [1, 2, 4] and valid_tp_sizes(arch, expert_parallel=True) == [
        1,
        2,
        4,
    ]
    with pytest.raises(ValueError, match="has no experts"):
        check_tensor_parallel(get_preset("tiny-qwen3"), 1, expert_parallel=True)
