"""Start-up memory profile on the GPU: how many bytes the KV cache may take.

Budget = total * gpu_memory_utilization - memory in use after loading the weights
- the activation peak of one forward over a full token budget (measured, not guessed).
"""

from __future__ import annotations

import logging

import torch

from pagoda.attention.forward_context import forward_context
from pagoda.attention.kv_pool import KVCachePool
from pagoda.attention.metadata import build_attention_metadata
from pagoda.core.kv_cache_spec import KVCacheConfig
from pagoda.model.layers.attention import kv_cache_specs

logger = logging.getLogger(__name__)


@torch.inference_mode()
def profile_kv_budget(runner) -> int:
    config = runner.config
    device = runner.device
    num_tokens = config.scheduler.max_num_batched_tokens
    num_seqs = max(1, min(config.scheduler.max_num_seqs, num_tokens))
    # Split the budget into num_seqs sequences (the worst case for logits rows).
    lens = [num_tokens // num_seqs] * num_seqs
    lens[-1] += num_tokens - sum(lens)
    bs = runner.block_size
    tables, next_block = [], 0
    for n in lens:
        nb = -(-n // bs)
        tables.append(list(range(next_block, next_block + nb)))
        next_block += nb
    torch.cuda.synchronize(device)
    free_before, total = torch.cuda.mem_get_info(device)
    weights_bytes = torch.cuda.memory_allocated(device)
    pool = KVCachePool(
        KVCacheConfig(next_block, kv_cache_specs(runner.model, bs, runner.kv_dtype)), device
    )
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    md = build_attention_metadata(lens, lens, tables, bs, device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    pos = torch.cat([torch.arange(n, device=device) for n in lens])
    with forward_context(runner.backend, runner.backend.build_metadata(md), pool):
        hidden = runner.model(ids, pos)
    last = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(len(lens))], device=device)
    runner.model.compute_logits(hidden[last])
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - base
    del pool, hidden
    torch.cuda.empty_cache()
    used = total - free_before  # weights, the CUDA context, other processes
    budget = int(total * config.cache.gpu_memory_utilization - used - activation_peak)
    logger.info(
        "memory profile: total %.1f GiB, in use after load %.2f GiB (weights %.2f GiB), "
        "activation peak %.2f GiB for %d tokens, KV cache budget %.2f GiB",
        total / 2**30,
        used / 2**30,
        weights_bytes / 2**30,
        activation_peak / 2**30,
        num_tokens,
        budget / 2**30,
    )
    runner.memory_report = dict(
        total=total,
        used_after_load=used,
        weights=weights_bytes,
        activation_peak=activation_peak,
        kv_budget=budget,
    )
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache at gpu_memory_utilization="
            f"{config.cache.gpu_memory_utilization}: raise it or lower max_num_batched_tokens"
        )
    return budget
