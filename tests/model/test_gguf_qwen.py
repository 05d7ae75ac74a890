"""Qwen2, Qwen3 and Qwen3-MoE GGUF files against transformers.

Tiny random checkpoints (float32, biases and norms random too) are written as GGUF the
way llama.cpp's converter writes these architectures: its tensor names, HF's Q/K rows as
they are (no rotary permutation, which the converter applies to ``llama`` alone), the
experts stacked [experts, rows, cols], a Qwen byte-level BPE vocabulary (pre-tokenizer
"qwen2") and a chat template. Each file is written twice, F32 and Q8_0 (gguf's own
quantizer; norms, biases and the router stay F32, as llama.cpp keeps them).

- F32: Pagoda's logits equal transformers' on the original checkpoint (1e-4), and so do
  its greedy tokens.
- Q8_0 expanded to float (``--quantization none``, and what MoE files get by default):
  the logits equal transformers' with the same Q8_0-rounded weights (1e-4).
- Q8_0 dense files on the CPU keep their blocks by default: the block kernel's decode
  rows equal the rounded-weight reference (float32 activations, the default: 1e-4 of
  the logit range), with the same greedy tokens.
- A Qwen3-MoE file under ``--quantization gguf`` is refused: its experts have no block path.
- The tokenizer built from the GGUF encodes as transformers' Qwen2Tokenizer of the same
  vocabulary; the chat template comes from the file.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from helpers.hf_compare import PagedRunner, hf_logits, pagoda_logits
from helpers.tiny_models import save_tiny_hf_model
from safetensors.torch import load_file, save_file

from pagoda import LLM, SamplingParams
from pagoda.model.loader import load_model
from pagoda.model.loader.gguf import FastGGUFReader
from pagoda.model.loader.gguf_arch import gguf_arch_config
from pagoda.model.quant.registry import describe_weights
from pagoda.model.tokenizer import apply_chat_template, load_tokenizer

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

# HF model_type -> (general.architecture, transformers class, tiny-config overrides).
ARCHS = {
    "qwen2": ("qwen2", transformers.Qwen2ForCausalLM, {}),
    "qwen3": ("qwen3", transformers.Qwen3ForCausalLM, {"tie_word_embeddings": True}),
    # llama.cpp's qwen3moe has a router on every layer.
    "qwen3_moe": ("qwen3moe", transformers.Qwen3MoeForCausalLM, {"mlp_only_layers": []}),
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = (
    "Pagoda reads weights from files written by other programs. The loader maps every "
    "tensor name, checks every shape, and refuses what it cannot run. Quantized blocks "
    "stay quantized where a kernel multiplies them; elsewhere they are expanded. It's "
    "1234 tokens, isn't it? We'll see: 56789 more, and then 42.\n\n"
    "Experts are stacked in one tensor per projection; the router picks two of eight.\n"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PROMPT = torch.randint(3, 300, (19,), generator=torch.Generator().manual_seed(5)).tolist()


# ---- a Qwen vocabulary, and its transformers tokenizer ----


def tiny_qwen_vocab() -> tuple[list[str], list[str]]:
    """(tokens in id order, merges "a b"): byte-level BPE trained on CORPUS with Qwen's
    split, the special tokens last."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=381, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([CORPUS] * 4, trainer)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__) + SPECIALS
    merges = [" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    return tokens, merges


def reference_tokenizer(tokens: list[str], merges: list[str]):
    ref = transformers.Qwen2Tokenizer(
        vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges]
    )
    ref.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    return ref


# ---- llama.cpp's layout, written from the HF checkpoint ----

_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_tensors(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """HF tensors under llama.cpp's names; per-expert projections stacked [E, rows, cols]."""
    out, experts = {}, {}
    for name, t in state.items():
        base, _, suffix = name.rpartition(".")
        if base in _TOP:
            out[f"{_TOP[base]}.{suffix}"] = t.numpy()
            continue
        parts = base.split(".")  # model.layers.{i}.<module path>
        layer, module = parts[2], ".".join(parts[3:])
        if parts[3:5] == ["mlp", "experts"]:
            experts.setdefault((layer, parts[6]), {})[int(parts[5])] = t.numpy()
        else:
            out[f"blk.{layer}.{_BLOCK[module]}.{suffix}"] = t.numpy()
    for (layer, proj), by_expert in experts.items():
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])
        out[f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight"] = stacked
    return out


def _quantized(name: str, data: np.ndarray) -> bool:
    """What a Q8_0 file stores in blocks: the matrices, not norms, biases or the router."""
    return data.ndim >= 2 and "ffn_gate_inp" not in name


def write_gguf(path, gguf_arch: str, config: dict, tensors: dict, tokens, merges, q8: bool):
    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if "head_dim" in config:  # llama.cpp writes both widths when the config names one
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    if gguf_arch == "qwen3moe":
        w.add_expert_count(config["num_local_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # 3: CONTROL
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, data in tensors.items():
        if q8 and _quantized(name, data):
            w.add_tensor(name, quantize(data, QT.Q8_0), raw_dtype=QT.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _randomize_vectors(model, seed: int) -> None:
    """Norms and biases random too (save_tiny_hf_model randomizes the matrices), so that
    a mis-mapped q_norm or bias shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                base = 0.5 + torch.rand(p.shape, generator=gen) if "norm" in name else 0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))


def _q8_rounded(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF tensors as a Q8_0 file holds them (quantized and dequantized again)."""
    rounded = {}
    for name, t in state.items():
        keep = t.dim() < 2 or name.endswith("mlp.gate.weight")
        q = t if keep else torch.from_numpy(dequantize(quantize(t.numpy(), QT.Q8_0), QT.Q8_0))
        rounded[name] = q.reshape(t.shape)
    return rounded


@pytest.fixture(scope="module")
def vocab():
    return tiny_qwen_vocab()


@pytest.fixture(scope="module")
def qwen_files(tmp_path_factory, vocab):
    """{model_type: (f32 gguf, q8_0 gguf, HF model, HF model with Q8_0-rounded weights)}."""
    tokens, merges = vocab
    files = {}
    for kind, (gguf_arch, cls, overrides) in ARCHS.items():
        hf_dir = tmp_path_factory.mktemp(f"hf-{kind}")
        model = save_tiny_hf_model(hf_dir, kind, vocab_size=len(tokens), **overrides)
        _randomize_vectors(model, seed=1)
        model.save_pretrained(hf_dir)
        config = json.loads((hf_dir / "config.json").read_text())
        state = load_file(hf_dir / "model.safetensors")
        out = tmp_path_factory.mktemp(f"gguf-{kind}")
        tensors = gguf_tensors(state)
        write_gguf(out / "f32.gguf", gguf_arch, config, tensors, tokens, merges, q8=False)
        write_gguf(out / "q8_0.gguf", gguf_arch, config, tensors, tokens, merges, q8=True)
        # The rounded weights saved beside the same config: from_pretrained maps the
        # per-expert names onto transformers' fused expert tensors.
        q8_dir = tmp_path_factory.mktemp(f"hf-q8-{kind}")
        (q8_dir / "config.json").write_text(json.dumps(config))
        save_file(_q8_rounded(state), q8_dir / "model.safetensors", metadata={"format": "pt"})
        hf = cls.from_pretrained(hf_dir, dtype=torch.float32).eval()
        hf_q8 = cls.from_pretrained(q8_dir, dtype=torch.float32).eval()
        for m in (hf, hf_q8):
            m.config._attn_implementation = "eager"
        files[kind] = (out / "f32.gguf", out / "q8_0.gguf", hf, hf_q8)
    return files


# ---- configs and names ----


def test_metadata_gives_the_hf_config(qwen_files):
    for kind, (f32, _, hf, _) in qwen_files.items():
        arch = gguf_arch_config(FastGGUFReader(str(f32)))
        c = hf.config
        assert arch.architecture == c.architectures[0]
        assert (arch.hidden_size, arch.num_hidden_layers, arch.intermediate_size) == (
            c.hidden_size,
            c.num_hidden_layers,
            c.intermediate_size,
        )
        assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (
            c.num_attention_heads,
            c.num_key_value_heads,
            getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        )
        assert arch.tie_word_embeddings == c.tie_word_embeddings
        assert arch.attention_bias == (kind == "qwen2")
        assert arch.qk_norm == (kind != "qwen2")
        assert (arch.bos_token_id, arch.eos_token_id) == (arch.vocab_size - 3, arch.vocab_size - 1)
        if kind == "qwen3_moe":
            moe = arch.moe
            assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (
                8,
                2,
                32,
            )
            assert moe.renormalize and moe.mlp_only_layers == ()
        else:
            assert arch.moe is None


def test_unsupported_gguf_architecture_is_named(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen2moe")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'qwen2moe'.*qwen3moe"):
        load_model(str(tmp_path / "m.gguf"))


# ---- weights: F32 and Q8_0 against transformers ----


@pytest.mark.parametrize("kind", list(ARCHS))
def test_f32_gguf_matches_transformers(qwen_files, kind):
    f32, _, hf, _ = qwen_files[kind]
    model, arch = load_model(str(f32), dtype="float32")
    expected = hf_logits(hf, PROMPT)
    assert (pagoda_logits(model, arch, PROMPT, [19]) - expected).abs().max().item() < 1e-4
    assert (pagoda_logits(model, arch, PROMPT, [7, 12]) - expected).abs().max().item() < 1e-4
    with torch.no_grad():
        hf_out = hf.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(PROMPT) :].tolist()
    runner = PagedRunner(model, arch)
    logits, tokens = runner.step({"a": PROMPT}), []
    for _ in range(6):
        tokens.append(int(logits["a"][-1].argmax()))
        logits = runner.step({"a": [tokens[-1]]})
    assert tokens == hf_out


@pytest.mark.parametrize("kind", list(ARCHS))
def test_q8_0_expanded_matches_the_rounded_weights(qwen_files, kind):
    _, q8, hf, hf_q8 = qwen_files[kind]
    model, arch = load_model(str(q8), dtype="float32", quantization="none")
    assert describe_weights(model) == "float32"
    got = pagoda_logits(model, arch, PROMPT, [19])
    assert (got - hf_logits(hf_q8, PROMPT)).abs().max().item() < 1e-4
    # What Q8_0 rounding alone costs against the float checkpoint (printed with -s): on
    # these random weights the mean |dlogit| is ~1 % of the logit range, the worst a few %
    # (more with experts, where a rounded router score may pick another expert).
    expected = hf_logits(hf, PROMPT)
    scale, diff = expected.abs().max().item(), (got - expected).abs()
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    print(
        f"{kind} Q8_0 vs float32 weights: |dlogit| mean {diff.mean():.4f} max "
        f"{diff.max():.4f} of {scale:.2f}; argmax agreement {agree:.2f}"
    )
    assert diff.mean().item() < 0.02 * scale


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_q8_0_dense_keeps_its_blocks_on_the_cpu(qwen_files, kind):
    from pagoda.model.quant.cpu_kernels import native_kernel, native_status

    if native_kernel() is None:
        pytest.skip(f"no native block kernel: {native_status()}")
    _, q8, _, hf_q8 = qwen_files[kind]
    model, arch = load_model(str(q8), dtype="float32")
    assert describe_weights(model).startswith("gguf blocks (Q8_0 ×8 linear layers")
    # The prompt's rows multiply the blocks expanded; each decode row goes through the
    # block kernel (float32 activation: CpuBlocksConfig's default).
    runner, tokens = PagedRunner(model, arch), list(PROMPT)
    got = [runner.step({"a": tokens})["a"][-1]]
    for _ in range(4):
        tokens.append(int(got[-1].argmax()))
        got.append(runner.step({"a": [tokens[-1]]})["a"][-1])
    expected = hf_logits(hf_q8, tokens)[len(PROMPT) - 1 :]
    got = torch.stack(got)
    scale, err = expected.abs().max().item(), (got - expected).abs().max().item()
    print(f"{kind} Q8_0 blocks (decode) vs rounded weights: max |dlogit| {err:.4f} of {scale:.2f}")
    assert err < 1e-4 * scale
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_q8_0_moe_expands_its_experts_and_refuses_blocks(qwen_files):
    _, q8, _, hf_q8 = qwen_files["qwen3_moe"]
    model, arch = load_model(str(q8), dtype="float32")  # the default: experts as float
    assert describe_weights(model) == "float32"
    assert model.model.layers[0].mlp.experts.w13_weight.dtype == torch.float32
    got = pagoda_logits(model, arch, PROMPT, [19])
    assert (got - hf_logits(hf_q8, PROMPT)).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="gguf quantization of Qwen3MoeForCausalLM is not"):
        load_model(str(q8), dtype="float32", quantization="gguf")


def test_qwen3_moe_layer_without_router_loads_as_dense(tmp_path, vocab):
    """A file whose layer 1 has a dense MLP (no ffn_gate_inp) loads it as one
    (mlp_only_layers), as transformers' config says it."""
    tokens, merges = vocab
    hf = save_tiny_hf_model(tmp_path / "hf", "qwen3_moe", vocab_size=len(tokens))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["mlp_only_layers"] == [1]
    tensors = gguf_tensors(load_file(tmp_path / "hf" / "model.safetensors"))
    assert "blk.1.ffn_gate.weight" in tensors and "blk.1.ffn_gate_inp.weight" not in tensors
    write_gguf(tmp_path / "m.gguf", "qwen3moe", config, tensors, tokens, merges, q8=False)
    model, arch = load_model(str(tmp_path / "m.gguf"), dtype="float32")
    assert arch.moe.mlp_only_layers == (1,)
    hf.config._attn_implementation = "eager"
    expected = hf_logits(hf, PROMPT)
    assert (pagoda_logits(model, arch, PROMPT, [19]) - expected).abs().max().item() < 1e-4


# ---- tokenizer and chat template ----

TEXTS = [
    "It's 1234, isn't it? We'LL see.",
    "Experts  are\n\n  stacked;\tthe router picks 2 of 8!",
    "caf\u0065\u0301 na\u00efve \u4f60\u597d",  # a decomposed accent: NFC joins it
    "<|im_start|>user\nhello<|im_end|>\n",
]


def test_gguf_tokenizer_encodes_as_qwen2_tokenizer(qwen_files, vocab):
    f32 = qwen_files["qwen3"][0]
    ref = reference_tokenizer(*vocab)
    tok = load_tokenizer(f32)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "It's 42?"}]
    text = ref.apply_chat_template(
        messages, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nIt's 42?<|im_end|>\n<|im_start|>assistant\n"
    assert apply_chat_template(tok, messages) == ref.encode(text, add_special_tokens=False)


def test_llm_generates_transformers_greedy_tokens(qwen_files):
    f32, _, hf, _ = qwen_files["qwen2"]
    llm = LLM(str(f32), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=2)
    try:
        text = "It's 1234, isn't it?"
        out = llm.generate([text], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    finally:
        llm.llm_engine.shutdown()
    prompt_ids = load_tokenizer(f32).encode(text)
    assert out[0].prompt_token_ids == prompt_ids
    with torch.no_grad():
        hf_out = hf.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=5,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt_ids) :].tolist()
    assert list(out[0].outputs[0].token_ids) == hf_out
