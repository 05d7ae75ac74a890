"""MoE routing and config: select_experts against transformers' own routers (Qwen3-MoE
greedy softmax, DeepSeek-V2 greedy and group_limited_greedy, DeepSeek-V3 noaux_tc with
its correction bias), and MoEConfig parsing / refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config, Qwen3MoeConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from pagoda.model.arch_config import ArchConfig
from pagoda.model.layers.moe.routing import select_experts
from pagoda.model.moe_config import MoEConfig

HIDDEN, TOKENS = 32, 40
GEN = torch.Generator().manual_seed(0)


def _hf_router(kind: str, **fields):
    common = dict(
        hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, moe_intermediate_size=8
    )
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(**common, **fields)
        return config, "Qwen3MoeForCausalLM", Qwen3MoeTopKRouter(config)
    if kind == "deepseek_v2":
        config = DeepseekV2Config(**common, **fields)
        return config, "DeepseekV2ForCausalLM", DeepseekV2TopkRouter(config)
    config = DeepseekV3Config(**common, **fields)
    return config, "DeepseekV3ForCausalLM", DeepseekV3TopkRouter(config)


CASES = {
    "qwen3_greedy": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)),
    "qwen3_greedy_norm": (
        "qwen3_moe",
        dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=True),
    ),
    "v2_greedy": (
        "deepseek_v2",
        dict(
            n_routed_experts=16,
            num_experts_per_tok=3,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            topk_method="greedy",
        ),
    ),
    "v2_group_limited": (
        "deepseek_v2",
        dict(
            n_routed_experts=16,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=16.0,
            topk_method="group_limited_greedy",
        ),
    ),
    "v3_noaux_tc": (
        "deepseek_v3",
        dict(
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
    ),
    "v3_noaux_tc_unnormalised": (
        "deepseek_v3",
        dict(
            n_routed_experts=32,
            num_experts_per_tok=6,
            n_group=8,
            topk_group=3,
            routed_scaling_factor=1.5,
            norm_topk_prob=False,
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_select_experts_matches_transformers(case):
    kind, fields = CASES[case]
    hf_config, arch, router = _hf_router(kind, **fields)
    cfg = MoEConfig.from_hf_config(hf_config.to_dict(), arch)
    bias = None
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=GEN))
        if kind == "deepseek_v3":
            # Large enough to change which experts (and groups) win.
            bias = torch.randn(cfg.num_experts, generator=GEN) * 0.3
            router.e_score_correction_bias.copy_(bias)
        hidden = torch.randn(TOKENS, HIDDEN, generator=GEN)
        logits, hf_weights, hf_ids = router(hidden)
        weights, ids = select_experts(logits, cfg, bias)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (TOKENS, cfg.num_experts_per_tok)
    # The order of the k choices is topk's; compare each row sorted by expert id.
    ours, order = ids.long().sort(dim=-1)
    theirs, hf_order = hf_ids.long().sort(dim=-1)
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(
        weights.gather(1, order), hf_weights.float().gather(1, hf_order), rtol=1e-6, atol=1e-7
    )
    if bias is not None:  # the bias is really used: without it other experts win
        _, unbiased_ids = select_experts(logits, cfg, torch.zeros_like(bias))
        assert not torch.equal(unbiased_ids.long().sort(dim=-1).values, ours)


def test_noaux_tc_needs_the_bias_and_others_refuse_it():
    fields = CASES["v3_noaux_tc"][1]
    cfg = MoEConfig.from_hf_config(
        DeepseekV3Config(hidden_size=HIDDEN, **fields).to_dict(), "DeepseekV3ForCausalLM"
    )
    logits = torch.randn(3, cfg.num_experts, generator=GEN)
    with pytest.raises(ValueError, match="needs an e_score_correction_bias"):
        select_experts(logits, cfg)
    greedy = MoEConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4)
    with pytest.raises(ValueError, match="takes no e_score_correction_bias"):
        select_experts(torch.randn(3, 8), greedy, torch.zeros(8))
    with pytest.raises(ValueError, match=r"router_logits must be \[T, 8\]"):
        select_experts(torch.randn(3, 7), greedy)


def _qwen3_moe_dict(**changes) -> dict:
    config = Qwen3MoeConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=100,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        norm_topk_prob=True,
    ).to_dict()
    config.update(changes)
    return config


def test_qwen3_moe_config_parses_and_places_sparse_layers():
    arch = ArchConfig.from_hf_config(_qwen3_moe_dict())
    assert arch.architecture == "Qwen3MoeForCausalLM" and arch.qk_norm
    moe = arch.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 16)
    assert (moe.renormalize, moe.scoring_func, moe.topk_method) == (True, "softmax", "greedy")
    assert (moe.decoder_sparse_step, moe.mlp_only_layers, moe.n_shared_experts) == (2, (3,), 0)
    # (i + 1) % 2 == 0 and not in mlp_only_layers: only layer 1.
    assert [moe.is_moe_layer_index(arch.architecture, i) for i in range(4)] == [
        False,
        True,
        False,
        False,
    ]
    # The released checkpoints name the count num_experts.
    released = _qwen3_moe_dict()
    released["num_experts"] = released.pop("num_local_experts")
    assert ArchConfig.from_hf_config(released).moe == moe


def test_deepseek_layer_placement():
    cfg = MoEConfig(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=4,
        first_k_dense_replace=2,
        moe_layer_freq=2,
    )
    assert [cfg.is_moe_layer_index("DeepseekV3ForCausalLM", i) for i in range(7)] == [
        False,
        False,
        True,
        False,
        True,
        False,
        True,
    ]
    v3 = MoEConfig.from_hf_config(
        DeepseekV3Config(hidden_size=HIDDEN, first_k_dense_replace=1, n_shared_experts=2).to_dict(),
        "DeepseekV3ForCausalLM",
    )
    assert (v3.scoring_func, v3.topk_method, v3.n_shared_experts) == ("sigmoid", "noaux_tc", 2)
    assert (v3.first_k_dense_replace, v3.routed_scaling_factor) == (1, 2.5)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("scoring_func", "sparsemax", "unknown scoring_func 'sparsemax'"),
        ("topk_method", "random", "unknown topk_method 'random'"),
    ],
)
def test_unknown_routing_is_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        ArchConfig.from_hf_config(_qwen3_moe_dict(**{field: value}))
    with pytest.raises(ValueError, match=message):
        MoEConfig.from_hf_config(
            {**DeepseekV3Config(hidden_size=HIDDEN).to_dict(), field: value},
            "DeepseekV3ForCausalLM",
        )


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(scoring_func="sigmoid"), "Qwen3MoeForCausalLM with scoring_func 'sigmoid'"),
        (dict(num_experts_per_tok=9), r"num_experts_per_tok \(9\) exceeds num_experts \(8\)"),
        (dict(shared_expert_intermediate_size=32), "shared_expert_intermediate_size"),
        (dict(num_local_experts=None), "names no expert count"),
    ],
)
def test_unsupported_moe_configs_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        ArchConfig.from_hf_config(_qwen3_moe_dict(**changes))


def test_group_configs_are_checked():
    with pytest.raises(ValueError, match=r"num_experts \(16\) is not divisible by n_group \(3\)"):
        MoEConfig(
            num_experts=16,
            num_experts_per_tok=2,
            moe_intermediate_size=4,
            topk_method="group_limited_greedy",
            n_group=3,
            topk_group=1,
        )
    with pytest.raises(ValueError, match="exceeds the 1 selected groups' 4 experts"):
        MoEConfig(
            num_experts=16,
            num_experts_per_tok=5,
            moe_intermediate_size=4,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            n_group=4,
            topk_group=1,
        )
    with pytest.raises(ValueError, match="norm_topk_prob=true is not supported for DeepseekV2"):
        MoEConfig.from_hf_config(
            DeepseekV2Config(
                hidden_size=HIDDEN, norm_topk_prob=True, num_experts_per_tok=2
            ).to_dict(),
            "DeepseekV2ForCausalLM",
        )
    with pytest.raises(ValueError, match="needs an MoE config"):
        ArchConfig(
            architecture="Qwen3MoeForCausalLM",
            hidden_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=4,
            intermediate_size=8,
            vocab_size=10,
        )
