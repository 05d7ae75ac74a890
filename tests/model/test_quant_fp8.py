"""FP8 linear methods on the CPU (the kernels' torch references compute what the GPU
kernels do): loading and processing every FP8 layout exactly, the checkpoint readers,
and an FP8 checkpoint end to end through the engine against its float original."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.fp8.linear import fp8_block_linear_ref, fp8_linear_ref
from pagoda.kernels.fp8.quant import (
    dequantize_blockwise,
    dequantize_per_channel,
    quantize_weight_blockwise,
    quantize_weight_per_channel,
)
from pagoda.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from pagoda.model.quant import fp8 as fp8_module
from pagoda.model.quant.fp8 import Fp8CheckpointLinearMethod, Fp8OnlineLinearMethod, is_ignored
from pagoda.model.quant.fp8_checkpoint import compressed_tensors_config_from_hf, fp8_config_from_hf
from pagoda.model.quant.fp8_export import quantization_config


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _qkv(method, rank=0, size=1):
    # 4 heads of 32 (q 128 rows), 2 kv heads (k, v 64 rows each), hidden 128.
    layer = QKVParallelLinear(128, 32, 4, 2, tp_rank=rank, tp_size=size)
    layer.set_quant_method(method)
    return layer


def test_online_fp8_quantizes_each_output_channel_after_loading():
    layer = _qkv(Fp8OnlineLinearMethod())
    full = {
        s: _rand(rows, 128, seed=i)
        for i, (s, rows) in enumerate((("q", 128), ("k", 64), ("v", 64)))
    }
    for shard, w in full.items():
        layer.weight_loader(layer.weight, w, shard)
    fp8_module.Fp8OnlineLinearMethod().process_weights_after_loading(layer)
    want_w, want_s = quantize_weight_per_channel(torch.cat(list(full.values())))
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(layer.weight.view(torch.uint8), want_w.view(torch.uint8))
    assert torch.equal(layer.weight_scale, want_s)
    x = _rand(3, 128, seed=9, dtype=torch.float16)
    out = layer(x)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, fp8_linear_ref(x, want_w, want_s))
    # and close to the float product: e4m3 keeps 3 mantissa bits
    exact = x.float() @ torch.cat(list(full.values())).T
    assert (out.float() - exact).abs().max() < 0.08 * exact.abs().max()


def test_per_tensor_checkpoint_scales_spread_to_their_shards():
    method = Fp8CheckpointLinearMethod("tensor")
    layer = _qkv(method)
    weights, scales = {}, {"q": 0.5, "k": 0.25, "v": 2.0}
    for i, (shard, rows) in enumerate((("q", 128), ("k", 64), ("v", 64))):
        weights[shard] = (_rand(rows, 128, seed=i) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
        layer.weight_loader(layer.weight, weights[shard], shard)
        layer.weight_loader(layer.weight_scale, torch.tensor(scales[shard]), shard)
    method.process_weights_after_loading(layer)
    assert layer.weight_scale.tolist() == [0.5] * 128 + [0.25] * 64 + [2.0] * 64
    x = _rand(2, 128, seed=5, dtype=torch.float16)
    w = torch.cat([weights[s].float() * scales[s] for s in "qkv"])
    torch.testing.assert_close(layer(x).float(), (x.float() @ w.T).half().float())


@pytest.mark.parametrize("rank", [0, 1])
def test_block_checkpoint_loads_each_ranks_blocks(rank):
    method = Fp8CheckpointLinearMethod("block", (32, 32), "weight_scale_inv")
    layer = MergedColumnParallelLinear(64, [128, 128], tp_rank=rank, tp_size=2)
    layer.set_quant_method(method)
    full = {}
    for shard in (0, 1):
        w, s = quantize_weight_blockwise(_rand(128, 64, seed=shard), (32, 32))
        full[shard] = (w, s)
        layer.weight_loader(layer.weight, w, shard)
        layer.weight_loader(layer.weight_scale_inv, s, shard)
    method.process_weights_after_loading(layer)
    rows = slice(64 * rank, 64 * rank + 64)
    blocks = slice(2 * rank, 2 * rank + 2)
    want = torch.cat(
        [dequantize_blockwise(full[s][0][rows], full[s][1][blocks], (32, 32)) for s in (0, 1)]
    )
    assert torch.equal(dequantize_blockwise(layer.weight, layer.weight_scale_inv, (32, 32)), want)
    x = _rand(4, 64, seed=3, dtype=torch.float16)
    torch.testing.assert_close(
        layer(x), fp8_block_linear_ref(x, layer.weight, layer.weight_scale_inv, (32, 32))
    )


def test_static_input_scale_takes_the_largest_shard_scale():
    method = Fp8CheckpointLinearMethod("tensor", static_input=True)
    layer = MergedColumnParallelLinear(64, [32, 32])
    layer.set_quant_method(method)
    w = (_rand(32, 64) * 40).to(torch.float8_e4m3fn)
    for shard, input_scale in ((0, 0.02), (1, 0.05)):
        layer.weight_loader(layer.weight, w, shard)
        layer.weight_loader(layer.weight_scale, torch.tensor(0.1), shard)
        layer.weight_loader(layer.input_scale, torch.tensor(input_scale), shard)
    method.process_weights_after_loading(layer)
    assert layer.input_scale.tolist() == [pytest.approx(0.05)]
    x = _rand(20, 64, seed=4, dtype=torch.float16)
    xq = (x.float() / 0.05).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 0.05
    want = xq @ dequantize_per_channel(layer.weight, layer.weight_scale).T
    torch.testing.assert_close(layer(x).float(), want.half().float())


def test_checkpoint_readers_pick_the_method_or_refuse_by_name():
    block = fp8_config_from_hf(quantization_config("block"))
    assert block.method.strategy == "block" and block.method.block == (128, 128)
    assert block.method.scale_name == "weight_scale_inv"
    channel = compressed_tensors_config_from_hf(quantization_config("channel"))
    assert channel.method.strategy == "channel" and channel.ignored == ("lm_head",)
    static = fp8_config_from_hf({"quant_method": "fp8", "activation_scheme": "static"})
    assert static.method.strategy == "tensor" and static.method.static_input
    int4 = quantization_config("channel")
    int4["config_groups"]["group_0"]["weights"].update(num_bits=4, type="int")
    with pytest.raises(ValueError, match="weights of 4-bit int are not supported"):
        compressed_tensors_config_from_hf(int4)
    weight_only = quantization_config("channel")
    del weight_only["config_groups"]["group_0"]["input_activations"]
    with pytest.raises(ValueError, match="weight-only FP8 .* not supported yet"):
        compressed_tensors_config_from_hf(weight_only)
    with pytest.raises(ValueError, match="format 'e5m2' is not supported"):
        fp8_config_from_hf({"quant_method": "fp8", "fmt": "e5m2"})


def test_ignored_layers_match_merged_parts_all_or_none():
    assert is_ignored(
        "model.layers.0.self_attn.qkv_proj",
        [
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.k_proj",
            "model.layers.0.self_attn.v_proj",
        ],
    )
    assert is_ignored("model.layers.3.mlp.down_proj", ["re:.*layers\\.3\\..*"])
    assert not is_ignored("model.layers.0.mlp.down_proj", ["lm_head"])
    with pytest.raises(ValueError, match="keeps only some of"):
        is_ignored("model.layers.0.mlp.gate_up_proj", ["model.layers.0.mlp.gate_proj"])


def test_fp8_is_refused_on_the_cpu_and_for_float32():
    from pagoda.model.loader import load_model

    with pytest.raises(ValueError, match="fp8 quantization runs on NVIDIA GPUs"):
        load_model("smollm2-135m", "dummy", "bfloat16", "cpu", quantization="fp8")
    with pytest.raises(ValueError, match="computes in bfloat16 or float16, not torch.float32"):
        fp8_module.check_fp8_activation_dtype(torch.float32)


def _dequantized_copy(src, dst, scheme):
    """The FP8 checkpoint's weights dequantized into a float checkpoint (what the FP8
    model should compute, up to activation rounding)."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, dst / f.name)
    import json

    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith(("weight_scale", "weight_scale_inv")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            stem = name[: -len("weight")]
            t = (
                dequantize_per_channel(t, tensors[stem + "weight_scale"])
                if scheme == "channel"
                else dequantize_blockwise(t, tensors[stem + "weight_scale_inv"], (128, 128))
            )
        out[name] = t.contiguous()
    save_file(out, str(dst / "model.safetensors"))


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_fp8_checkpoint_end_to_end_matches_its_dequantized_weights(tmp_path, monkeypatch, scheme):
    """A tiny Llama (dims on the 128 grid, as real FP8 checkpoints' are) exported as an FP8
    checkpoint and served on the CPU (the kernels' torch references): one short request
    keeps every matmul on the decode-size path, where activations are not quantized, so
    it must match the same weights dequantized into a float checkpoint."""
    from helpers.tiny_models import save_tiny_hf_model

    from pagoda import LLM, SamplingParams
    from pagoda.model.quant.fp8_export import export_fp8

    monkeypatch.setattr(fp8_module, "check_fp8_device", lambda device: None)
    save_tiny_hf_model(
        tmp_path / "float",
        "llama",
        hidden_size=256,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
    )
    export_fp8(tmp_path / "float", tmp_path / "fp8", scheme)
    _dequantized_copy(tmp_path / "fp8", tmp_path / "dequantized", scheme)
    prompt = {"prompt_token_ids": [17, 250, 3, 99, 140, 7, 301, 62]}
    # Three tokens: prefill and two decode steps (each step runs the FP8 kernel under the
    # interpreter; the prompt logprobs carry most of the comparison).
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1)
    outs = {}
    for name, dtype in (("fp8", "float16"), ("dequantized", "float32")):
        llm = LLM(
            str(tmp_path / name),
            dtype=dtype,
            device="cpu",
            skip_tokenizer_init=True,
            max_model_len=64,
        )
        outs[name] = llm.generate([prompt], params, use_tqdm=False)[0]
    fp8, ref = outs["fp8"], outs["dequantized"]
    ids = prompt["prompt_token_ids"]
    errors = [
        abs(a[t].logprob - b[t].logprob)
        for a, b, t in zip(fp8.prompt_logprobs[1:], ref.prompt_logprobs[1:], ids[1:])
    ]
    assert max(errors) < 0.05, errors  # float16 rounding only (measured <= 0.02)
    assert fp8.outputs[0].token_ids == ref.outputs[0].token_ids


def test_fp8_is_refused_on_a_gpu_without_fp8_tensor_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match="needs compute capability 8.9\\+ .*NVIDIA A100 has 8.0"):
        fp8_module.check_fp8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fp8_module.check_fp8_device(torch.device("cuda", 0))  # Hopper: accepted


def test_gate_up_takes_the_fused_silu_step_where_the_method_has_one(monkeypatch):
    """MergedColumnParallelLinear.forward_silu_and_mul: per-channel and per-tensor FP8
    layers hand [gate | up] to the gated kernel's entry; a None from it (more rows, the
    CPU) and unquantized layers run the linear and the activation apart."""
    from pagoda.kernels.fp8 import linear as kernels
    from pagoda.model.layers.activation import SiluAndMul

    calls = []

    def spy(x, w, s):
        calls.append(x.shape[0])
        return None if x.shape[0] > 1 else torch.full((1, w.shape[0] // 2), 7.0)

    monkeypatch.setattr(kernels, "fp8_linear_silu_and_mul", spy)
    act = SiluAndMul()
    for method in (Fp8OnlineLinearMethod(), Fp8CheckpointLinearMethod("tensor")):
        layer = MergedColumnParallelLinear(64, [32, 32])
        layer.set_quant_method(method)
        layer.to_empty(device="cpu")
        for shard in (0, 1):
            layer.weight_loader(layer.weight, _rand(32, 64, seed=shard), shard)
            if isinstance(method, Fp8CheckpointLinearMethod):
                layer.weight_loader(layer.weight_scale, torch.tensor(0.01), shard)
        method.process_weights_after_loading(layer)
        assert torch.equal(layer.forward_silu_and_mul(_rand(1, 64), act), torch.full((1, 32), 7.0))
        x = _rand(3, 64, seed=5)
        assert torch.equal(layer.forward_silu_and_mul(x, act), act(layer(x)))
    assert calls == [1, 3, 1, 3]
    plain = MergedColumnParallelLinear(64, [32, 32])
    plain.to_empty(device="cpu")
    plain.weight.data.copy_(_rand(64, 64, seed=7))
    x = _rand(1, 64, seed=6)
    assert torch.equal(plain.forward_silu_and_mul(x, act), act(plain(x)))
    assert calls == [1, 3, 1, 3]  # the unquantized method has no fused step
