"""The disk's own read ceiling, for stating a disk KV tier's load figure against it:
write a file, then read it back cold (its pages dropped from the page cache with
posix_fadvise(DONTNEED) after an fsync: no root needed, only this file's pages go)
one stream at a time and with the disk tier's number of reader threads, then read it
again hot (from the page cache), and time zlib.crc32 (the tier's checksum) on one
thread.

    python benchmarks/disk_ceiling.py --dir /tmp --size-gib 2

If the cold figures come out as high as the hot one, the drop did not take (a file
system that ignores the advice): say so when quoting them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

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
            written += os.write(fd, chunk[:min(CHUNK, size - written)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return size / (time.perf_counter() - start) / 1e9


def _read_sequential(path: str, size: int) -> float:
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
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
    """`piece`-byte reads (one KV block each, as the tier does), `threads` at a time."""
    fd = os.open(path, os.O_RDONLY)
    buffers = [bytearray(piece) for _ in range(threads)]

    def read(index: int) -> int:
        view = memoryview(buffers[index % threads])
        return os.preadv(fd, [view], index * piece)

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


def measure(directory: str, size: int, threads: int, piece: int) -> dict:
    """GB/s figures of the file system under `directory` (the file is removed after)."""
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
    return {"file_bytes": size, "read_bytes": piece, "threads": threads,
            "cold_method": "fsync + posix_fadvise(DONTNEED)",
            "write_gb_per_s": write, "cold_sequential_read_gb_per_s": cold_sequential,
            "cold_parallel_read_gb_per_s": cold_parallel,
            "hot_parallel_read_gb_per_s": hot_parallel,
            "crc32_one_thread_gb_per_s": _crc32_rate(piece)}


def describe(ceiling: dict) -> str:
    return (f"disk ceiling ({ceiling['file_bytes'] / 2**30:.2f} GiB file): write "
            f"{ceiling['write_gb_per_s']:.2f} GB/s; cold read {ceiling['cold_sequential_read_gb_per_s']:.2f} "
            f"GB/s sequential, {ceiling['cold_parallel_read_gb_per_s']:.2f} GB/s with "
            f"{ceiling['threads']} readers; page-cache read {ceiling['hot_parallel_read_gb_per_s']:.2f} "
            f"GB/s; crc32 {ceiling['crc32_one_thread_gb_per_s']:.2f} GB/s a thread")


def main() -> int:
    from pagoda.kv_offload.disk_tier import DEFAULT_IO_THREADS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=".", help="a directory on the disk to measure")
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--piece-mib", type=float, default=2.0, help="bytes per parallel read")
    parser.add_argument("--threads", type=int, default=DEFAULT_IO_THREADS)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    ceiling = measure(args.dir, int(args.size_gib * 2**30), args.threads,
                      int(args.piece_mib * 2**20))
    print(describe(ceiling))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(ceiling, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
