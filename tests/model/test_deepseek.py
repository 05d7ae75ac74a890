"""DeepSeek V2 / V3 (multi-head latent attention, dense and MoE layers) against Hugging
Face transformers.

Tiny random checkpoints (tests/helpers/tiny_models.py: DEEPSEEK_TINY: layer 0 dense, layer 1
MoE; V2 greedy and group-limited routing, V3 noaux_tc) are saved as safetensors
and loaded by Pagoda; the references are transformers' own DeepseekV2/V3ForCausalLM in
float32, eager attention. Pagoda runs through the paged latent cache:
- logits, step by step (chunked prefill with a cached prefix, decodes, a decode beside
  a prefill chunk), with the reference MLA backend planning decodes on the latent path
  and prefill chunks decompressed, and with every row on the latent path;
- greedy generation through the engine with prefix-cache hits and preemption.
The two attention paths are also compared directly on the reference backend.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.hf_compare import (
    PagedRunner,
    assert_engine_greedy_with_hits_and_preemption,
    hf_greedy,
    hf_logits,
    randomize,
)
from helpers.tiny_models import tiny_deepseek_config

from pagoda import LLM, SamplingParams
from pagoda.attention.mla_backend import MLATorchBackend
from pagoda.model.arch_config import ArchConfig
from pagoda.model.loader import load_model
from pagoda.model.mla_config import MLAConfig, mla_softmax_scale
from pagoda.model.presets import get_preset

torch.set_num_threads(1)

# kind -> (transformers architecture, config overrides)
KINDS = {
    "v2": ("deepseek_v2", {}),
    "v2_q_lora": ("deepseek_v2", dict(q_lora_rank=24, topk_method="group_limited_greedy")),
    "v3": ("deepseek_v3", dict(q_lora_rank=24)),
    "v3_no_interleave": ("deepseek_v3", dict(rope_interleave=False)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (directory, transformers model), each saved once."""
    saved = {}
    for seed, (kind, (arch, overrides)) in enumerate(KINDS.items()):
        config, cls = tiny_deepseek_config(arch, **overrides)
        torch.manual_seed(seed)
        hf = cls(config).eval()
        randomize(hf, seed)
        for name, buf in hf.named_buffers():  # V3's routing bias: loaded, and it matters
            if name.endswith("e_score_correction_bias"):
                buf.copy_(
                    0.1 * torch.randn(buf.shape, generator=torch.Generator().manual_seed(seed))
                )
        path = tmp_path_factory.mktemp(f"deepseek-{kind}")
        hf.save_pretrained(path, safe_serialization=True)
        saved[kind] = (str(path), hf)
    return saved


class MLARunner(PagedRunner):
    """PagedRunner with the MLA reference backend (latent_rows: which rows take the
    latent path)."""

    def __init__(self, model, arch: ArchConfig, latent_rows: str = "decode"):
        super().__init__(model, arch)
        self.backend = MLATorchBackend(
            arch.num_attention_heads,
            arch.mla.kv_lora_rank,
            arch.mla.qk_rope_head_dim,
            mla_softmax_scale(arch.mla, arch.rope_scaling),
            latent_rows,
        )


TOKENS = torch.randint(3, 384, (70,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.mark.parametrize("latent_rows", ["decode", "all"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_logits_match_transformers_through_the_paged_latent_cache(checkpoints, kind, latent_rows):
    path, hf = checkpoints[kind]
    model, arch = load_model(path, dtype="float32")
    assert arch.mla.rope_interleave == (kind != "v3_no_interleave")
    assert arch.mla.q_lora_rank == (24 if kind in ("v2_q_lora", "v3") else None)
    expected = hf_logits(hf, TOKENS)
    other = TOKENS[::-1][:12]
    expected_other = hf_logits(hf, other)
    runner = MLARunner(model, arch, latent_rows)
    # Positions run past the original 32 of the YaRN config; a 2nd chunk reads 40
    # cached tokens; decodes; then a decode beside the other request's prefill chunk.
    steps = [
        {"r": TOKENS[:40]},
        {"r": TOKENS[40:60]},
        {"r": TOKENS[60:61]},
        {"r": TOKENS[61:62]},
        {"r": TOKENS[62:63], "o": other[:7]},
        {"r": TOKENS[63:], "o": other[7:]},
    ]
    logits = runner.run(steps)
    got, got_other = logits["r"], logits["o"]
    assert (got - expected).abs().max().item() < 1e-4
    assert (got_other - expected_other).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_latent_and_decompressed_paths_agree_on_the_reference(checkpoints):
    """The absorbed path for every row and the decompressed path for prefills give the
    same hidden states, prefill chunk with a cached prefix included."""
    path, _ = checkpoints["v3"]
    model, arch = load_model(path, dtype="float32")
    results = []
    for latent_rows in ("decode", "all"):
        runner = MLARunner(model, arch, latent_rows)
        results.append(
            torch.cat(
                [runner.step({"r": TOKENS[:25]})["r"], runner.step({"r": TOKENS[25:50]})["r"]]
            )
        )
    assert (results[0] - results[1]).abs().max().item() < 1e-4


@pytest.mark.parametrize("kind", ["v2", "v3"])
def test_engine_greedy_matches_transformers_with_prefix_hits_and_preemption(checkpoints, kind):
    path, hf = checkpoints[kind]
    assert_engine_greedy_with_hits_and_preemption(path, hf)


def test_multi_token_prediction_layers_are_skipped_with_one_log_line(checkpoints, caplog):
    from pathlib import Path

    from pagoda.model.loader.safetensors import iter_safetensors_weights, safetensors_files

    path, hf = checkpoints["v3"]
    model, arch = load_model(path, dtype="float32")
    weights = list(iter_safetensors_weights(safetensors_files(Path(path))))
    # An MTP layer's tensors sit at index num_hidden_layers (here 2).
    weights += [
        ("model.layers.2.eh_proj.weight", torch.zeros(64, 128)),
        ("model.layers.2.self_attn.kv_a_proj_with_mqa.weight", torch.zeros(40, 64)),
    ]
    with caplog.at_level(logging.INFO, logger="pagoda.model.deepseek"):
        model.load_weights(weights)
    lines = [r.getMessage() for r in caplog.records if "multi-token prediction" in r.getMessage()]
    assert lines == [
        "skipped 2 checkpoint tensors of layers >= 2 (multi-token prediction "
        "layers, not run by Pagoda)"
    ]
    with pytest.raises(ValueError, match="matches no parameter"):
        model.load_weights([("model.layers.1.self_attn.q_proj.weight", torch.zeros(96, 64))])


def test_arch_config_parses_mla_and_rejects_what_is_not_implemented():
    config, _ = tiny_deepseek_config("deepseek_v2", q_lora_rank=24)
    hf = config.to_dict()
    arch = ArchConfig.from_hf_config(hf)
    assert arch.architecture == "DeepseekV2ForCausalLM"
    assert arch.mla == MLAConfig(24, 32, 16, 8, 16, rope_interleave=True)
    assert (arch.head_dim, arch.mla.latent_dim, arch.mla.qk_head_dim) == (8, 40, 24)
    assert arch.rope_scaling["rope_type"] == "yarn"
    # 1/sqrt(24) * (0.1 * 0.5 * ln 4 + 1)^2
    assert mla_softmax_scale(arch.mla, arch.rope_scaling) == pytest.approx(
        24**-0.5 * (0.05 * 1.3862943611198906 + 1) ** 2, rel=1e-12
    )
    assert (arch.moe.first_k_dense_replace, arch.moe.num_experts, arch.moe.n_shared_experts) == (
        1,
        4,
        1,
    )
    with pytest.raises(ValueError, match="lacks kv_lora_rank"):
        ArchConfig.from_hf_config(dict(hf, kv_lora_rank=None))
    with pytest.raises(ValueError, match="attention_bias=true is not supported"):
        ArchConfig.from_hf_config(dict(hf, attention_bias=True))
    with pytest.raises(ValueError, match="rope_scaling of type yarn lacks factor"):
        ArchConfig.from_hf_config(
            dict(
                hf,
                rope_parameters={
                    "rope_type": "yarn",
                    "factor": None,
                    "original_max_position_embeddings": 32,
                },
            )
        )
    with pytest.raises(ValueError, match="takes no an MLA config|takes no"):
        get_preset("tiny-llama").replace(mla=arch.mla)


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_gpu_engine_greedy_matches_transformers(checkpoints, enforce_eager):
    """On CUDA in float32: the Triton MLA backend eagerly (decodes on the latent kernel,
    prefills on the decompressed kernel, kernels/mla_prefill.py) and on CUDA graphs
    (decode and mixed graphs: every row on the latent kernel) give transformers' greedy
    tokens."""
    path, hf = checkpoints["v3"]
    llm = LLM(
        path,
        skip_tokenizer_init=True,
        device="cuda",
        dtype="float32",
        max_model_len=128,
        max_num_seqs=8,
        kv_cache_memory=64 << 20,
        enforce_eager=enforce_eager,
    )
    runner = llm.llm_engine.executor.runner
    assert runner.backend.name == "triton"
    assert (runner.graph_runner is not None) == (not enforce_eager)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 384, (n,), generator=gen).tolist() for n in (3, 17, 40, 9)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24)
