"""Start-up warm-up: run every kernel variant a step can need once, before serving.

Triton compiles a kernel the first time it meets a new set of compile-time constants:
pure prefill batches at each width where a kernel changes its tiles (see
PREFILL_WIDTHS), a mixed batch (prefill chunks beside decode rows, which the
decode kernel takes) and a decode-only eager batch with or without context splits.
Met mid-run, each compilation stalls the step that meets it (docs/performance.md,
"measured reasons"). Here they are met at start-up, on KV
blocks no request holds yet; what they write there is overwritten before it is read.

`warm_up_logits` does the same for cuBLAS and the greedy sampler: the LM head at every
bucketed row count (shape_buckets) and the argmax kernel at every row count it takes,
whose first calls would otherwise stall a step mid-run; and for the pending-token fill
of async-scheduled steps (kernels/pending_fill.py).
"""

from __future__ import annotations

import logging
import time

import torch

from pagoda.attention.forward_context import forward_context
from pagoda.attention.metadata import build_attention_metadata
from pagoda.sample.sampler import greedy_argmax
from pagoda.worker.shape_buckets import logits_row_buckets

logger = logging.getLogger(__name__)

# Prefill widths (rows of one step) past which a kernel picks other tiles, each run once
# where a step may be that wide (max_num_batched_tokens), besides the widest step itself:
# 520 > 512, where qk_rope_store's default_heads_per_program switches (tests/worker/test_warmup.py
# ties the two); 4096 tokens, the middle tile tier of the MoE grouped GEMMs
# (fused_moe.pick_config by rows per expert: 256 for 128 experts x top 8, 384 for 64 x 6),
# which neither the short prefill nor the widest step reaches.
WIDE_PREFILL_ROWS = 520
PREFILL_WIDTHS = (WIDE_PREFILL_ROWS, 4096)


def warmup_batches(
    max_model_len: int, num_blocks: int, block_size: int, max_num_tokens: int = 0
) -> list[tuple[list[int], list[int]]]:
    """(query_lens, seq_lens) of the warm-up batches that fit the pool and max_model_len;
    the wide prefills (PREFILL_WIDTHS and max_num_tokens itself) only where a step may
    hold that many rows, as sequences of at most max_model_len tokens."""
    long_ctx = min(600, max_model_len)  # > MIN_SPLIT_TOKENS: the decode kernel splits
    short = min(48, max_model_len)
    widths = sorted(
        {w for w in PREFILL_WIDTHS + (max_num_tokens,) if 2 * short < w <= max_num_tokens}
    )
    batches = [([short, short], [short, short])]  # prefill only
    batches += [_prefill_of(width, max_model_len) for width in widths]
    batches += [
        ([1, 1, short], [long_ctx, min(300, max_model_len), short]),  # mixed, split decode
        ([1, 1], [min(8, max_model_len), long_ctx]),  # decode only
        ([1], [min(8, max_model_len)]),  # decode only, one slice: direct output
    ]
    fits = []
    for query_lens, seq_lens in batches:
        blocks = sum(-(-n // block_size) for n in seq_lens)
        if blocks <= num_blocks:
            fits.append((query_lens, seq_lens))
    return fits


def _prefill_of(width: int, max_model_len: int) -> tuple[list[int], list[int]]:
    """A prefill-only batch of width rows: whole prompts of max_model_len, then the rest."""
    lens = [max_model_len] * (width // max_model_len)
    if width % max_model_len:
        lens.append(width % max_model_len)
    return lens, list(lens)


@torch.inference_mode()
def warm_up_kernels(runner, max_model_len: int) -> float:
    """Runs the warm-up batches eagerly through the runner's model; returns seconds."""
    start = time.perf_counter()
    device, bs = runner.device, runner.block_size
    max_tokens = runner.config.scheduler.max_num_batched_tokens
    for query_lens, seq_lens in warmup_batches(max_model_len, runner.num_blocks, bs, max_tokens):
        tables, next_block = [], 0
        for n in seq_lens:
            count = -(-n // bs)
            tables.append(list(range(next_block, next_block + count)))
            next_block += count
        metadata = build_attention_metadata(query_lens, seq_lens, tables, bs, device)
        num_tokens = sum(query_lens)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        pos = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)]).to(device)
        with forward_context(
            runner.backend, runner.backend.build_metadata(metadata), runner.kv_pool
        ):
            hidden = runner.model(ids, pos)
        runner.model.compute_logits(hidden[-1:])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    logger.info("kernel warm-up in %.1fs", seconds)
    return seconds


@torch.inference_mode()
def warm_up_logits(runner, max_rows: int) -> float:
    """The LM head once at each row count _sample can use (1..max_rows bucketed), and on
    CUDA the greedy argmax at every row count it takes (its chunking, a compile-time
    constant, follows the exact row count; the sampler passes len(sample_rows) rows),
    on the logits in the head's dtype (what an all-greedy step takes) and in float32
    (the other steps' processed logits)."""
    start = time.perf_counter()
    hidden = torch.zeros(
        max_rows, runner.arch.hidden_size, dtype=runner.dtype, device=runner.device
    )
    logits = None
    for rows in logits_row_buckets(max_rows):
        logits = runner.model.compute_logits(hidden[:rows], float32=False)
    if runner.device.type == "cuda" and logits is not None:
        from pagoda.kernels.sample.argmax import argmax_covers  # Triton: CUDA only

        for table in {logits.dtype: logits, torch.float32: logits.float()}.values():
            for rows in range(1, table.shape[0] + 1):
                if not argmax_covers(table[:rows]):
                    break
                greedy_argmax(table[:rows])
        from pagoda.kernels.sample.pending_fill import fill_pending  # Triton: CUDA only

        ids = torch.zeros(2, dtype=torch.long, device=runner.device)
        fill_pending(ids, torch.zeros(2, 1, dtype=torch.long, device=runner.device), ids)
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - start
