"""Ceilings measured in the same run as the figures they bound, and a dense model's bytes
and FLOPs per token.

- `measure_ceilings`: device-to-device copy bandwidth (a 2 GiB bf16 copy, bytes read +
  written) and the bf16 matmul rate (8192^3), each the median of 10 timed runs after 3.
- `roofline_decode_ms`: a decode step can be no faster than (weight bytes + KV bytes
  read) / copy bandwidth, nor than FLOPs / matmul rate.
- `disk_read_ceiling`: what a file system reads, cold (its pages dropped from the page
  cache with posix_fadvise(DONTNEED) after an fsync: no root needed, only this file's
  pages go) one stream at a time and with N reader threads, then hot, and zlib.crc32's
  rate on one thread. If the cold figures come out as high as the hot one, the drop did
  not take (a file system that ignores the advice): say so when quoting them.
"""

from __future__ import annotations

import functools
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

from benchmarks.harness.timing import median_cuda_ms


def measure_ceilings(device) -> dict:
    """{"copy_bytes_per_s", "bf16_matmul_flops"} on a CUDA device; {} elsewhere."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return {}
    n = 1 << 30  # 1 Gi bf16 elements = 2 GiB
    a = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    bw = 2 * a.numel() * 2 / (median_cuda_ms(functools.partial(b.copy_, a), 10, 3) / 1e3)
    del a, b
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    y = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    flops = 2 * m**3 / (median_cuda_ms(functools.partial(torch.matmul, x, y), 10, 3) / 1e3)
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": bw, "bf16_matmul_flops": flops}


def model_bytes_and_flops(arch, dtype_bytes: int = 2) -> dict:
    """A dense Llama-layout model's parameters, weight bytes, embedding bytes (looked up,
    not streamed per step), KV bytes per token and FLOPs per token."""
    h, i, L, v = arch.hidden_size, arch.intermediate_size, arch.num_hidden_layers, arch.vocab_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    params = L * per_layer + 2 * v * h  # embedding + lm_head (untied)
    return {
        "params": params,
        "weight_bytes": params * dtype_bytes,
        "embedding_bytes": v * h * dtype_bytes,
        "kv_bytes_per_token": 2 * L * kv * dtype_bytes,
        "flops_per_token": 2 * (L * per_layer + v * h),
    }


def roofline_decode_ms(info: dict, ceilings: dict, batch: int, context: int) -> dict:
    """The memory and compute bounds of one decode step of `batch` rows of `context`
    tokens; {} without measured ceilings."""
    if not ceilings:
        return {}
    read = (
        info["weight_bytes"]
        - info["embedding_bytes"]
        + batch * context * info["kv_bytes_per_token"]
    )
    mem_ms = read / ceilings["copy_bytes_per_s"] * 1e3
    flop_ms = batch * info["flops_per_token"] / ceilings["bf16_matmul_flops"] * 1e3
    return {
        "bytes_read": read,
        "memory_ms": mem_ms,
        "compute_ms": flop_ms,
        "roofline_ms": max(mem_ms, flop_ms),
    }


# ---------------------------------------------------------------- disk ------------
CHUNK = 8 << 20  # bytes per write and per sequential read


def _drop_cached_pages(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write(path: str, size: int) -> float:
    chunk = os.urandom(CHUNK)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        while written < size:
            written += os.write(fd, chunk[: min(CHUNK, size - written)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return size / (time.perf_counter() - start) / 1e9


def _read_sequential(path: str, size: int) -> float:
    view = memoryview(bytearray(CHUNK))
    fd = os.open(path, os.O_RDONLY)
    start = time.perf_counter()
    try:
        offset = 0
        while offset < size:
            got = os.preadv(fd, [view], offset)
            if got == 0:
                break
            offset += got
    finally:
        os.close(fd)
    return offset / (time.perf_counter() - start) / 1e9


def _read_parallel(path: str, size: int, threads: int, piece: int) -> float:
    """`piece`-byte reads (one KV block each, as the disk tier does), `threads` at a time."""
    fd = os.open(path, os.O_RDONLY)
    buffers = [bytearray(piece) for _ in range(threads)]

    def read(index: int) -> int:
        return os.preadv(fd, [memoryview(buffers[index % threads])], index * piece)

    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(read, range(size // piece)))
    finally:
        os.close(fd)
    return total / (time.perf_counter() - start) / 1e9


def _crc32_rate(piece: int) -> float:
    data = os.urandom(piece)
    rounds = max(1, (256 << 20) // piece)
    start = time.perf_counter()
    for _ in range(rounds):
        zlib.crc32(data)
    return rounds * piece / (time.perf_counter() - start) / 1e9


def disk_read_ceiling(directory: str, size: int, threads: int, piece: int) -> dict:
    """GB/s figures of the file system under `directory` (its test file removed after)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f".pagoda-disk-ceiling-{os.getpid()}")
    size -= size % piece
    try:
        write = _write(path, size)
        _drop_cached_pages(path)
        cold_sequential = _read_sequential(path, size)
        _drop_cached_pages(path)
        cold_parallel = _read_parallel(path, size, threads, piece)
        hot_parallel = _read_parallel(path, size, threads, piece)
    finally:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
    return {
        "file_bytes": size,
        "read_bytes": piece,
        "threads": threads,
        "cold_method": "fsync + posix_fadvise(DONTNEED)",
        "write_gb_per_s": write,
        "cold_sequential_read_gb_per_s": cold_sequential,
        "cold_parallel_read_gb_per_s": cold_parallel,
        "hot_parallel_read_gb_per_s": hot_parallel,
        "crc32_one_thread_gb_per_s": _crc32_rate(piece),
    }


def describe_disk_ceiling(ceiling: dict) -> str:
    return (
        f"disk ceiling ({ceiling['file_bytes'] / 2**30:.2f} GiB file): write "
        f"{ceiling['write_gb_per_s']:.2f} GB/s; cold read "
        f"{ceiling['cold_sequential_read_gb_per_s']:.2f} GB/s sequential, "
        f"{ceiling['cold_parallel_read_gb_per_s']:.2f} GB/s with {ceiling['threads']} "
        f"readers; page-cache read {ceiling['hot_parallel_read_gb_per_s']:.2f} GB/s; "
        f"crc32 {ceiling['crc32_one_thread_gb_per_s']:.2f} GB/s a thread"
    )
