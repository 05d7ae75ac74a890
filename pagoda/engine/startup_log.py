"""The engine's start-up summary: what a user reads before the first request.

One INFO line per subject, logged once the engine is ready: the model and where it
runs, how its weights are stored (a quantization scheme, or the float dtype), the KV
cache, the limits the scheduler works to (with the defaults resolved for this
device), and a line for each feature that is on: KV offload tiers, speculative
decoding, structured output and the reasoning parser, tensor parallelism.
"""

from __future__ import annotations

import importlib.util
import logging

logger = logging.getLogger(__name__)


def size_text(num_bytes: float) -> str:
    """Bytes as GiB from 1 GiB up, else MiB: '1.00 GiB', '98.3 MiB'."""
    if num_bytes >= 1 << 30:
        return f"{num_bytes / (1 << 30):.2f} GiB"
    return f"{num_bytes / (1 << 20):.1f} MiB"


def _on(value: bool) -> str:
    return "on" if value else "off"


def startup_lines(engine) -> list[str]:
    """The summary's lines for a started LLMEngine (see the module docstring)."""
    config, info, kv = engine.config, engine.model_info, engine.kv_cache_config
    sched = config.scheduler
    tp = config.parallel.tensor_parallel_size
    weights = engine.executor.collective_rpc("describe_weights")[0]
    # The weights' storage has a line of its own: "float32 on cpu" beside a model whose
    # linear layers hold Q4_1 blocks would misstate what runs.
    lines = [
        f"model {engine.model_path}: {info.architecture} on {config.device.device}, "
        f"activations {info.dtype or config.model.dtype}",
        f"weights: {weights}, {size_text(info.weight_bytes)}" + (" per rank" if tp > 1 else ""),
        f"KV cache: {engine.num_blocks} blocks of {kv.block_size} tokens "
        f"({engine.num_blocks * kv.block_size} tokens, "
        f"{getattr(kv.layer_specs[0], 'dtype', '?')}, {size_text(kv.total_bytes)}); "
        f"prefix caching {_on(config.cache.enable_prefix_caching)}",
        f"limits: max_model_len {engine.max_model_len}, max_num_seqs {sched.max_num_seqs}, "
        f"max_num_batched_tokens {sched.max_num_batched_tokens}; chunked prefill "
        f"{_on(sched.enable_chunked_prefill)}, async scheduling {_on(sched.async_scheduling)}",
    ]
    if engine.kv_offload is not None:
        tiers = [(row["tier"], row["capacity_blocks"]) for row in engine.kv_offload.stats()]
        lines.append(kv_offload_line(config.cache, tiers))
    if config.speculative is not None:
        lines.append(speculation_line(config.speculative))
    lines.append(structured_line(engine))
    if tp > 1:
        parallel = config.parallel
        extras = [parallel.distributed_executor_backend]
        if parallel.enable_expert_parallel:
            extras.append("expert parallel")
        if parallel.disable_custom_all_reduce:
            extras.append("every all-reduce through NCCL")
        lines.append(f"tensor parallel: {tp} ranks ({', '.join(extras)})")
    return lines


def speculation_line(spec) -> str:
    """Speculative decoding's method, k and what drafts (a SpeculativeConfig)."""
    if spec.method == "ngram":
        source = f"n-grams of {spec.prompt_lookup_min}-{spec.prompt_lookup_max} tokens"
    elif spec.method == "layer_skip":
        source = f"the first {spec.num_layers} layers draft"
    elif spec.method == "mtp":
        source = "the checkpoint's multi-token prediction layer drafts"
    else:
        source = f"draft model {spec.model}"
    budget = "adaptive per step" if spec.adaptive else "fixed"
    return (
        f"speculative decoding: {spec.method}, k={spec.num_speculative_tokens} ({budget}); {source}"
    )


def structured_line(engine) -> str:
    """What structured output runs on (or why it cannot), and the reasoning parser."""
    structured = engine.config.structured_outputs
    if engine.tokenizer is None:
        return "no tokenizer: prompts and outputs are token ids; no structured output"
    if importlib.util.find_spec("xgrammar") is None:
        backend = "unavailable (xgrammar is not installed)"
    else:
        backend = "xgrammar"
    line = f"structured output: {backend}"
    if structured.reasoning_parser is not None:
        line += f"; reasoning parser {structured.reasoning_parser}"
        if structured.thinking_token_budget is not None:
            line += f", default thinking budget {structured.thinking_token_budget} tokens"
    return line


def kv_offload_line(cache, tiers) -> str:
    """The KV offload tiers, top first: cache is the CacheConfig, tiers (name, capacity
    in blocks) pairs; the CPU tier's size and the disk tier's directory and cap come
    from the flags that set them."""
    parts = []
    for name, capacity in tiers:
        if name == "cpu":
            where = f"cpu {size_text(cache.kv_offloading_size * (1 << 30))}"
        elif name == "disk":
            where = (
                f"disk {cache.kv_offloading_disk_path} "
                f"{size_text(cache.kv_offloading_disk_size * (1 << 30))}"
            )
        else:
            where = f"{name} ({cache.kv_offloading_tier})"
        parts.append(f"{where} ({capacity} blocks)")
    return "KV offloading: " + ", ".join(parts)


def log_startup(engine) -> None:
    """Logs the summary, then how long the start took."""
    for line in startup_lines(engine):
        logger.info("%s", line)
    logger.info("engine ready in %.1fs", engine.startup_seconds)
