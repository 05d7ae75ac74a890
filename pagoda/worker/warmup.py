"""Start-up warm-up: run every kernel variant a step can need once, before serving.

Triton compiles a kernel the first time it meets a new set of compile-time constants:
a pure prefill batch (and a wide one, past the rows where the q/k rotary + store kernel
takes more heads per program), a mixed batch (prefill chunks beside decode rows, which the
decode kernel takes) and a decode-only eager batch with or without context splits.
Met mid-run, each compilation stalls the step that meets it (docs/performance.md,
"measured reasons"). Here they are met at start-up, on KV
blocks no request holds yet; what they write there is overwritten before it is read.

`warm_up_logits` does the same for cuBLAS: the LM head at every bucketed row count
(shape_buckets), whose first call would otherwise stall a step mid-run.
"""

from __future__ import annotations

import logging
import time

import torch

from pagoda.attention.forward_context import forward_context
from pagoda.attention.metadata import build_attention_metadata
from pagoda.worker.shape_buckets import logits_row_buckets

logger = logging.getLogger(__name__)

# A prefill step this wide compiles qk_rope_store's wide-step variant (its
# default_heads_per_program switches above 512 rows; tests/test_warmup.py ties the two).
WIDE_PREFILL_ROWS = 520


def warmup_batches(max_model_len: int, num_blocks: int, block_size: int,
                   max_num_tokens: int = 0) -> list[tuple[list[int], list[int]]]:
    """(query_lens, seq_lens) of the warm-up batches that fit the pool and max_model_len;
    the wide prefill only where a step may hold that many rows (max_num_tokens)."""
    long_ctx = min(600, max_model_len)  # > MIN_SPLIT_TOKENS: the decode kernel splits
    short = min(48, max_model_len)
    batches = [
        ([short, short], [short, short]),  # prefill only
        ([WIDE_PREFILL_ROWS], [WIDE_PREFILL_ROWS]),  # a wide prefill step
        ([1, 1, short], [long_ctx, min(300, max_model_len), short]),  # mixed, split decode
        ([1, 1], [min(8, max_model_len), long_ctx]),  # decode only
        ([1], [min(8, max_model_len)]),  # decode only, one slice: direct output
    ]
    fits = []
    for query_lens, seq_lens in batches:
        if max(seq_lens) > max_model_len or sum(query_lens) > max(max_num_tokens, 2 * short):
            continue
        blocks = sum(-(-n // block_size) for n in seq_lens)
        if blocks <= num_blocks:
            fits.append((query_lens, seq_lens))
    return fits


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
        with forward_context(runner.backend, runner.backend.build_metadata(metadata),
                             runner.kv_pool):
            hidden = runner.model(ids, pos)
        runner.model.compute_logits(hidden[-1:])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    logger.info("kernel warm-up in %.1fs", seconds)
    return seconds


@torch.inference_mode()
def warm_up_logits(runner, max_rows: int) -> float:
    """The LM head once at each row count _sample can use (1..max_rows bucketed)."""
    start = time.perf_counter()
    hidden = torch.zeros(max_rows, runner.arch.hidden_size, dtype=runner.dtype,
                         device=runner.device)
    for rows in logits_row_buckets(max_rows):
        runner.model.compute_logits(hidden[:rows])
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - start
