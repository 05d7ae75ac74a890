"""`python -m benchmarks.sparse_mla fidelity`: Pagoda's bf16 DeepSeek-V3.2 against
transformers' own bf16 error, both against transformers in float32 (see sparse_mla.py)."""

from __future__ import annotations


def _hf_model(args, device):
    import torch
    import transformers

    shape = dict(
        hidden_size=7168,
        num_attention_heads=128,
        num_key_value_heads=128,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        intermediate_size=18432,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=2048,
    )
    if args.smoke:
        shape = dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=24,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            intermediate_size=128,
            index_n_heads=8,
            index_head_dim=16,
            index_topk=64,
        )
    config = transformers.DeepseekV32Config(
        vocab_size=args.vocab,
        num_hidden_layers=args.layers,
        first_k_dense_replace=args.layers,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        n_group=1,
        topk_group=1,
        max_position_embeddings=163840,
        **shape,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.DeepseekV32ForCausalLM(config).eval()


def _logprobs(logits, tokens):
    """Log-probabilities [T - 1] of each next token, in float32."""
    import torch

    lp = torch.log_softmax(logits[:-1].float(), dim=-1)
    return lp.gather(1, tokens[1:, None]).squeeze(1)


def run_fidelity(args) -> dict:
    import torch

    from benchmarks.sparse_mla import Steps
    from pagoda.model.arch_config import ArchConfig
    from pagoda.model.loader.build import build_model
    from pagoda.model.quant.registry import process_loaded_weights

    smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    if smoke:
        args.tokens, args.chunk, args.vocab = 200, 64, 512
    hf = _hf_model(args, device)
    tokens = torch.randint(0, args.vocab, (args.tokens,), device=device)
    with torch.inference_mode():
        ref = _logprobs(hf(tokens[None]).logits[0], tokens)
    state = {k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()}
    arch = ArchConfig.from_hf_config(hf.config.to_dict())
    with torch.inference_mode():
        hf_bf16 = _logprobs(hf.to(torch.bfloat16)(tokens[None]).logits[0], tokens)
    del hf
    model = build_model(arch, torch.bfloat16, device)
    model.load_weights(state.items())
    process_loaded_weights(model)
    del state
    steps = Steps(arch, device, torch.bfloat16, 64, -(-args.tokens // 64) + 1, model=model)
    logits = []
    for start in range(0, args.tokens, args.chunk):
        end = min(args.tokens, start + args.chunk)
        plan = steps.metadata([end - start], [end])
        pos = torch.arange(start, end, device=device)
        logits.append(steps.forward(plan, tokens[start:end], pos))
    ours = _logprobs(torch.cat(logits), tokens)
    result = {}
    for name, got in (("transformers_bf16", hf_bf16), ("pagoda_bf16", ours)):
        err = (got - ref).abs()
        result[name] = {"mean_abs": err.mean().item(), "max_abs": err.max().item()}
        print(f"{name:<18} |logprob error| mean {err.mean().item():.5f} max {err.max().item():.4f}")
    ratio = result["pagoda_bf16"]["mean_abs"] / result["transformers_bf16"]["mean_abs"]
    print(f"Pagoda's mean error over transformers' own: {ratio:.3f}")
    return {**result, "mean_error_ratio": ratio, "tokens": args.tokens}
