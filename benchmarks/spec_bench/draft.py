"""spec_decode draft: a draft model, `matched` (the target's width with a few layers, both
models' residual branches zeroed and the head shared, so the draft is always right) or
a preset (random weights, almost always wrong). Batch-1 ms/token and tok/s at each
concurrency for off, always and adaptive."""

from __future__ import annotations

from benchmarks.harness.workloads import config_dir
from benchmarks.spec_bench.bench import Bench, make_prompts, zero_residual_branches


def matched_draft_config(target: str, num_layers: int) -> dict:
    """The target preset's shape with num_layers layers (the engine gives a dummy
    target's draft random weights of that shape)."""
    from pagoda.model.presets import get_preset

    arch = get_preset(target)
    return {
        "architectures": [arch.architecture],
        "model_type": "llama",
        "hidden_size": arch.hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "intermediate_size": arch.intermediate_size,
        "vocab_size": arch.vocab_size,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": arch.rope_scaling,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def run_draft(args) -> dict:
    import torch

    if args.smoke:
        args.model, args.input_len, args.output_len = "tiny-llama", 16, 12
        args.batch1_requests, args.concurrency, args.draft_layers = 2, [1, 4], 1
    matched = args.draft == "matched"
    draft = (
        config_dir(matched_draft_config(args.model, args.draft_layers), "matched-draft-")
        if matched
        else args.draft
    )
    bench = Bench(args, {"model": draft, "num_speculative_tokens": args.k})
    engine = bench.engine
    if matched:  # neither model writes to the residual; the draft reads the target's head
        runner = engine.executor.runner
        zero_residual_branches(runner.model, 2 * engine.model_info.num_hidden_layers)
        zero_residual_branches(runner.draft.model, 2 * runner.draft.arch.num_hidden_layers)
        theirs, mine = (
            dict(runner.model.named_parameters()),
            dict(runner.draft.model.named_parameters()),
        )
        with torch.no_grad():
            for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
                mine[name].copy_(theirs[name])
    info = engine.model_info
    fraction = info.draft_weight_bytes / info.weight_bytes
    print(
        f"\n== {args.model} + draft {args.draft} (k={args.k}, async scheduling "
        f"{'on' if engine.async_scheduling else 'off'}, draft bytes {fraction:.3f} of the "
        f"target's), {args.input_len} in / {args.output_len} out"
    )
    print(
        f"{'conc':>6}{'off':>10}{'always':>10}{'adaptive':>10}{'adapt/off':>10}"
        f"{'accept':>8}{'mean len':>9}   (batch 1: ms/token; else tok/s)"
    )
    bench.run("off", make_prompts(1, args.input_len, bench.vocab, 0), 1)  # warm-up
    rows = []
    for concurrency in args.concurrency:
        count = args.batch1_requests if concurrency == 1 else 2 * concurrency
        prompts = make_prompts(count, args.input_len, bench.vocab, seed=concurrency)
        row = {m: bench.run(m, prompts, concurrency) for m in ("off", "always", "adaptive")}
        same = row["off"]["outputs"] == row["always"]["outputs"] == row["adaptive"]["outputs"]
        for r in row.values():
            del r["outputs"], r["verify_steps"]
        rows.append({"concurrency": concurrency, "outputs_equal": same, **row})
        key = "ms_per_token" if concurrency == 1 else "tok_per_s"
        ratio = (
            row["off"][key] / row["adaptive"][key]
            if concurrency == 1
            else row["adaptive"][key] / row["off"][key]
        )
        acc, length = row["always"]["acceptance"], row["always"]["mean_accepted_length"]
        print(
            f"{concurrency:>6}{row['off'][key]:>10.2f}{row['always'][key]:>10.2f}"
            f"{row['adaptive'][key]:>10.2f}{ratio:>9.2f}x{acc or 0:>8.2f}{length or 0:>9.2f}"
            f"{'' if same else '   OUTPUTS DIFFER'}"
        )
    result = {
        "model": args.model,
        "draft": args.draft,
        "draft_layers": args.draft_layers if matched else None,
        "k": args.k,
        "draft_weight_fraction": fraction,
        "async_scheduling": engine.async_scheduling,
        "rows": rows,
    }
    engine.shutdown()
    return result
