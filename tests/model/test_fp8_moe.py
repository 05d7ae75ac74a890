"""FP8 checkpoints of MoE and MLA models, and --quantization fp8 of a float MoE model.

A tiny random Qwen3-MoE and a tiny DeepSeek-V3 (query LoRA, interleaved rotary rows,
a shared expert) are saved as float safetensors, then written here as FP8 checkpoints in
the released models' own format: every decoder projection (experts included, per expert
``experts.{e}.{gate,up,down}_proj.weight``) in float8_e4m3fn with 128x128 block scales
``weight_scale_inv`` (or compressed-tensors per-channel ``weight_scale``); router gates,
norms, embedding and LM head stay float. Sizes (hidden 192, Qwen3's expert
intermediate 160) leave partial edge blocks. Pagoda serves each on the CPU (the kernels' torch references, FP8
device check lifted) in float16 and must match the same weights dequantized into a
float32 checkpoint: prompt logprobs within float16 rounding, the same greedy tokens.
Loader-level tests cover the scales' tensor- and expert-parallel slicing, kv_b_proj's
dequantization at load, and the refusals that remain.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.tiny_models import save_tiny_hf_model
from safetensors.torch import load_file, save_file

from pagoda import LLM, SamplingParams
from pagoda.kernels.fp8.quant import (
    dequantize_blockwise,
    dequantize_per_channel,
    quantize_weight_blockwise,
    quantize_weight_per_channel,
)
from pagoda.model.layers.moe.fused_moe import FusedMoE, map_expert_weight_name
from pagoda.model.parallel import TensorParallel
from pagoda.model.quant import fp8 as fp8_module
from pagoda.model.quant.fp8_checkpoint import fp8_config_from_hf
from pagoda.model.quant.fp8_export import quantization_config
from pagoda.model.quant.fp8_moe import Fp8CheckpointMoEMethod

# Merged layers (q/k/v, gate/up) need each part on whole blocks, as in the released
# models: 8 heads of 16, and DeepSeek's shared expert (one expert wide) 256 wide.
SIZES = dict(
    hidden_size=192,
    intermediate_size=256,
    moe_intermediate_size=160,
    num_attention_heads=8,
    num_key_value_heads=8,
)
DEEPSEEK = dict(SIZES, moe_intermediate_size=256, q_lora_rank=48, rope_interleave=True)
PROMPT = {"prompt_token_ids": [17, 250, 3, 99, 140, 7, 301, 62, 5, 77]}
# Prompt logprobs of the FP8 model (float16) against its dequantized weights (float32):
# float16 rounding only (measured below 0.02).
LOGPROB_TOL = 0.05


@pytest.fixture(autouse=True)
def _fp8_on_the_cpu(monkeypatch):
    monkeypatch.setattr(fp8_module, "check_fp8_device", lambda device: None)


def _is_projection(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(
        ("_proj.weight", "_proj_with_mqa.weight")
    )


def _write_fp8(src, dst, scheme: str) -> None:
    """src's float checkpoint as an FP8 one (scheme "block" or "channel") in dst."""
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme)
    if scheme == "channel":  # llm-compressor leaves the routers in float by name
        config["quantization_config"]["ignore"] += ["re:.*mlp\\.gate$"]
    (dst / "config.json").write_text(json.dumps(config))
    out = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not _is_projection(name):
            out[name] = t
        elif scheme == "block":
            out[name], out[f"{name}_scale_inv"] = quantize_weight_blockwise(t, (128, 128))
        else:
            out[name], scale = quantize_weight_per_channel(t)
            out[f"{name}_scale"] = scale.reshape(-1, 1).float()
    save_file(out, str(dst / "model.safetensors"))


def _write_dequantized(src, dst) -> None:
    """An FP8 checkpoint's weights dequantized into a float32 checkpoint."""
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith(("weight_scale", "weight_scale_inv")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            if name + "_scale_inv" in tensors:
                t = dequantize_blockwise(t, tensors[name + "_scale_inv"], (128, 128))
            else:
                t = dequantize_per_channel(t, tensors[name + "_scale"])
        out[name] = t.float().contiguous()
    save_file(out, str(dst / "model.safetensors"))


def _serve(path, dtype: str, **kwargs):
    llm = LLM(
        str(path),
        dtype=dtype,
        device="cpu",
        skip_tokenizer_init=True,
        max_model_len=64,
        **kwargs,
    )
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1)
    try:
        return llm.generate([PROMPT], params, use_tqdm=False)[0]
    finally:
        llm.shutdown()


def _compare(got, ref) -> None:
    ids = PROMPT["prompt_token_ids"]
    errors = [
        abs(a[t].logprob - b[t].logprob)
        for a, b, t in zip(got.prompt_logprobs[1:], ref.prompt_logprobs[1:], ids[1:])
    ]
    assert max(errors) < LOGPROB_TOL, f"prompt logprob errors {errors}"
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids


@pytest.mark.parametrize(
    "arch,scheme",
    [("qwen3_moe", "block"), ("qwen3_moe", "channel"), ("deepseek_v3", "block")],
)
def test_fp8_checkpoint_matches_its_dequantized_weights(tmp_path, arch, scheme):
    save_tiny_hf_model(tmp_path / "float", arch, **(DEEPSEEK if arch == "deepseek_v3" else SIZES))
    _write_fp8(tmp_path / "float", tmp_path / "fp8", scheme)
    _write_dequantized(tmp_path / "fp8", tmp_path / "dequantized")
    got = _serve(tmp_path / "fp8", "float16")
    ref = _serve(tmp_path / "dequantized", "float32")
    _compare(got, ref)


def test_online_fp8_quantizes_the_experts_of_a_float_moe_model(tmp_path):
    """--quantization fp8 on a float checkpoint: each expert's gate, up and down in
    128x128 blocks after loading, exactly as a block checkpoint stores them; the engine
    then serves it. (Against the float model the routing of random tiny weights flips
    under FP8 rounding, so the check is on the weights.)"""
    from pagoda.model.loader import load_model

    save_tiny_hf_model(tmp_path / "float", "qwen3_moe", **SIZES)
    model, _ = load_model(
        str(tmp_path / "float"), dtype="float16", device="cpu", quantization="fp8"
    )
    experts = model.model.layers[0].mlp.experts
    stored = load_file(str(tmp_path / "float" / "model.safetensors"))
    scales = experts.scales()
    assert scales.block == (128, 128) and experts.w13_weight.dtype == torch.float8_e4m3fn
    up = scales.up_offset(experts.local_intermediate)
    for e in (0, 7):
        prefix = f"model.layers.0.mlp.experts.{e}"
        gate = stored[f"{prefix}.gate_proj.weight"].half()  # loaded in the model's dtype
        q, s = quantize_weight_blockwise(gate, (128, 128))
        assert torch.equal(experts.w13_weight[e, :160].float(), q.float())
        assert torch.equal(experts.w13_weight_scale_inv[e, :up], s)
        q, s = quantize_weight_blockwise(stored[f"{prefix}.up_proj.weight"].half(), (128, 128))
        assert torch.equal(experts.w13_weight_scale_inv[e, up:], s)
        q, s = quantize_weight_blockwise(stored[f"{prefix}.down_proj.weight"].half(), (128, 128))
        assert torch.equal(experts.w2_weight[e].float(), q.float())
        assert torch.equal(experts.w2_weight_scale_inv[e], s)
    out = _serve(tmp_path / "float", "float16", quantization="fp8")
    assert len(out.outputs[0].token_ids) == 4


def test_online_fp8_of_a_float_deepseek_keeps_kv_b_proj_float(tmp_path):
    """--quantization fp8 on a float DeepSeek: experts FP8 in blocks, the MLA projections
    FP8 per channel, kv_b_proj (read directly by MLA) left in the model's dtype."""
    from pagoda.model.loader import load_model

    save_tiny_hf_model(tmp_path / "float", "deepseek_v3", **DEEPSEEK)
    model, _ = load_model(
        str(tmp_path / "float"), dtype="float16", device="cpu", quantization="fp8"
    )
    layer = model.model.layers[1]
    assert layer.self_attn.kv_b_proj.weight.dtype == torch.float16
    assert layer.self_attn.q_b_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.experts.w2_weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.shared_experts.down_proj.weight.dtype == torch.float8_e4m3fn
    out = _serve(tmp_path / "float", "float16", quantization="fp8")
    assert len(out.outputs[0].token_ids) == 4


def _loaded_experts(tp: TensorParallel, block=(128, 128), inter=256, hidden=192, experts=4):
    """A FusedMoE with FP8 block experts, loaded from per-expert FP8 tensors; returns it
    with the full float weights the tensors dequantize to."""
    from pagoda.model.moe_config import MoEConfig

    cfg = MoEConfig(num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=inter)
    with torch.device("meta"):
        layer = FusedMoE(
            experts, 2, hidden, inter, cfg, tp, torch.float16, expert_parallel=tp.expert_parallel
        )
    layer.set_quant_method(Fp8CheckpointMoEMethod(block, "weight_scale_inv"))
    from pagoda.model.layers.linear import materialize_module

    materialize_module(layer, "cpu", torch.float16)
    gen = torch.Generator().manual_seed(0)
    full = {}
    for e in range(experts):
        for proj, shape in (
            ("gate", (inter, hidden)),
            ("up", (inter, hidden)),
            ("down", (hidden, inter)),
        ):
            w = torch.randn(*shape, generator=gen)
            q, s = quantize_weight_blockwise(w, block)
            full[e, proj] = dequantize_blockwise(q, s, block)
            for suffix, tensor in (("weight", q), ("weight_scale_inv", s)):
                name, shard = map_expert_weight_name(f"experts.{e}.{proj}_proj.{suffix}")
                param = getattr(layer, name.removeprefix("experts."))
                param.weight_loader(param, tensor, shard)
    return layer, full


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_expert_scales_are_sliced_with_their_weights(rank, expert_parallel):
    tp = TensorParallel(rank, 2, expert_parallel)
    layer, full = _loaded_experts(tp)
    scales = layer.scales()
    from pagoda.kernels.moe.reference import dequantize_expert

    i = layer.local_intermediate
    for local in range(layer.num_local_experts):
        e = layer.first_expert + local
        w13, w2 = dequantize_expert(layer.w13_weight, layer.w2_weight, scales, local)
        rows = slice(0, i) if expert_parallel else slice(rank * i, (rank + 1) * i)
        assert torch.equal(w13[:i], full[e, "gate"][rows])
        assert torch.equal(w13[i:], full[e, "up"][rows])
        assert torch.equal(w2, full[e, "down"][:, rows])


def test_block_experts_refuse_a_tensor_parallel_split_inside_a_block():
    with pytest.raises(ValueError, match="enable-expert-parallel"):
        _loaded_experts(TensorParallel(0, 2), inter=320)  # 160 rows a rank


def test_expert_ids_of_fp8_experts_include_their_scales():
    layer, _ = _loaded_experts(TensorParallel())
    ids = layer.expected_shard_ids("mlp.experts.w2_weight")
    assert (3, "down") in ids and (3, "down", "weight_scale_inv") in ids
    assert len(ids) == 8


def test_kv_b_proj_is_dequantized_at_load_and_mla_projections_stay_fp8(tmp_path):
    from pagoda.model.loader import load_model
    from pagoda.model.quant.registry import describe_weights

    save_tiny_hf_model(tmp_path / "float", "deepseek_v3", **DEEPSEEK)
    _write_fp8(tmp_path / "float", tmp_path / "fp8", "block")
    model, _ = load_model(str(tmp_path / "fp8"), dtype="float16", device="cpu")
    attn = model.model.layers[1].self_attn
    assert attn.kv_b_proj.weight.dtype == torch.float16
    assert not hasattr(attn.kv_b_proj, "weight_scale_inv")
    stored = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    want = dequantize_blockwise(stored[name], stored[name + "_scale_inv"]).half()
    assert torch.equal(attn.kv_b_proj.weight, want)
    for proj in (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.o_proj):
        assert proj.weight.dtype == torch.float8_e4m3fn
    experts = model.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router
    described = describe_weights(model)
    assert "experts fp8 W8A16 (128x128) ×1" in described, described
    assert "float16, dequantized at load" not in described  # kv_b_proj reports its dtype


def test_what_has_no_fp8_path_is_refused(tmp_path):
    from pagoda.model.arch_config import ArchConfig  # noqa: F401  (the parser's module)
    from pagoda.model.quant.registry import check_moe_mla_support

    class Arch:
        moe, mla, architecture = object(), object(), "DeepseekV32ForCausalLM"

    config = fp8_config_from_hf({"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match="DeepseekV32ForCausalLM is not supported yet"):
        check_moe_mla_support(Arch, config)
    Arch.architecture = "DeepseekV3ForCausalLM"
    check_moe_mla_support(Arch, config)
    from pagoda.model.quant.cpu_int import Int8QuantConfig

    with pytest.raises(ValueError, match="int8 quantization of DeepseekV3ForCausalLM"):
        check_moe_mla_support(Arch, Int8QuantConfig())
    tensor_scales = fp8_config_from_hf({"quant_method": "fp8"})
    with pytest.raises(ValueError, match="FP8 experts with fp8 \\(tensor\\)"):
        tensor_scales.moe_method("model.layers.1.mlp.experts", None)
