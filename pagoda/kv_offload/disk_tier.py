"""DiskTier: KV blocks as files under one directory (`--kv-offloading-disk-path`), kept
across restarts.

One file per block, `DIR/<hh>/<hash hex>.kvb` (hh: the hash's first byte, so no
directory grows past a few thousand entries). A file is a header then the block:

    b"PGKV" | u16 version | u32 header length | header (JSON) | block bytes

The header names the model, dtype, block size, layout and block bytes (the
KVBlockFormat), the block's hash and the CRC-32 of the block bytes. A block is served
only if its header matches this server's format and hash, its size is exact and its
checksum holds; otherwise the file is counted in `invalid_files` and never loaded
(files of our format that fail are deleted; foreign files are left alone).

Writes go to a temporary name and are renamed into place (os.replace), so a crash
mid-write never leaves a truncated file under a block's name; leftover temporaries
are deleted at start-up.

Concurrent servers: a lock file. The server holding `DIR/.pagoda-kv.lock` (an
exclusive flock, released by `close()`, when the tier is collected, or by the OS when
the process dies: a lock file left by a dead process is simply taken over) owns the
directory; a second server on the same directory fails at start-up with a message
naming the owner's pid, or saying that the owner is this very process (an engine not
shut down). One owner means the size cap and LRU order are never fought over.

Restart: at start-up the directory is scanned (headers only), and the intact blocks
of this format become `contents()`, least recently written first, trimmed to the
size cap (the oldest extra files are deleted).

Throughput: a batch of blocks is read (or written) by a pool of `io_threads` threads,
one block per task, so several reads are in flight (an NVMe drive wants a deep queue)
and the checksums run in parallel (zlib.crc32 releases the GIL on large buffers; one
thread checksums ~2.5 GB/s, which alone capped a serial reader). A block is read with
one preadv straight into its destination (the CPU tier's pinned slot), the header by
one or two small preads; a file is written with one writev. O_DIRECT is not used: the
header's length varies, so the payload is not page-aligned, and the page cache is
what serves a hot tier.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import struct
import threading
import weakref
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from pagoda.kv_offload.tier_api import KVBlockFormat, KVTier

MAGIC = b"PGKV"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")  # magic, version, header length
LOCK_NAME = ".pagoda-kv.lock"
SUFFIX = ".kvb"
# Room the header takes in a file (JSON of the format + hash + crc), for sizing the cap;
# also how much a read takes at first to find it (more is read when it is longer).
HEADER_RESERVE = 512
# Threads reading or writing one batch's blocks at once.
DEFAULT_IO_THREADS = max(1, min(8, os.cpu_count() or 1))
# What a block read found: intact, no file (or unreadable), or a file to drop.
_OK, _GONE, _CORRUPT = "ok", "gone", "corrupt"


class DiskTierError(ValueError):
    """The disk tier cannot start (directory missing rights, in use, too small)."""


def _flag() -> str:
    return "--kv-offloading-disk-path"


class DiskTier(KVTier):
    name = "disk"

    def __init__(
        self,
        block_format: KVBlockFormat,
        path: str,
        size_bytes: int,
        io_threads: int = DEFAULT_IO_THREADS,
    ) -> None:
        if not isinstance(io_threads, int) or io_threads < 1:
            raise ValueError(f"io_threads must be an integer >= 1, got {io_threads!r}")
        self.format = block_format
        self.path = os.path.abspath(path)
        self._identity = block_format.describe()
        self._io: ThreadPoolExecutor | None = None
        self._lock_fd: int | None = None
        self._release = None  # finalize(): the lock and the I/O pool, set with the lock
        self._held: dict[bytes, None] = {}  # insertion order = LRU at start-up
        self._guard = threading.Lock()
        self._counts = {"invalid_files": 0, "reads": 0, "writes": 0, "read_failures": 0}
        file_bytes = block_format.block_bytes + _PREFIX.size + HEADER_RESERVE
        self._capacity = int(size_bytes) // file_bytes
        if self._capacity < 1:
            raise DiskTierError(
                f"--kv-offloading-disk-size: {size_bytes} bytes hold no block of "
                f"{file_bytes} bytes; give more space"
            )
        self._open_directory()
        try:
            self._scan()
        except BaseException:
            self.close()
            raise
        self._io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="pagoda-kv-disk")
        self._release.detach()
        self._release = weakref.finalize(self, _release_directory, self._lock_fd, self._io)

    # ---- start-up ---------------------------------------------------------------------
    def _open_directory(self) -> None:
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as err:
            raise DiskTierError(
                f"{_flag()} {self.path}: cannot create the directory: {err.strerror}"
            ) from err
        if not os.path.isdir(self.path):
            raise DiskTierError(f"{_flag()} {self.path} is not a directory")
        lock_path = os.path.join(self.path, LOCK_NAME)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise DiskTierError(
                f"{_flag()} {self.path} is not writable ({err.strerror}): the "
                "disk tier needs a directory it can write to"
            ) from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if err.errno in (errno.EAGAIN, errno.EACCES):
                raise DiskTierError(_in_use_message(self.path, owner)) from err
            raise
        self._lock_fd = fd
        self._release = weakref.finalize(self, _release_directory, fd, None)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            probe = os.path.join(self.path, f".probe-{os.getpid()}")
            with open(probe, "wb") as f:
                f.write(b"x")
            os.remove(probe)
        except OSError as err:
            self.close()
            raise DiskTierError(
                f"{_flag()} {self.path} is not writable ({err.strerror}): the "
                "disk tier needs a directory it can write to"
            ) from err

    def _scan(self) -> None:
        found: list[tuple[float, bytes, str]] = []
        for sub in sorted(os.listdir(self.path)):
            subdir = os.path.join(self.path, sub)
            if not _is_fan_out(sub) or not os.path.isdir(subdir):
                continue  # not a directory this tier writes
            for name in os.listdir(subdir):
                file_path = os.path.join(subdir, name)
                if not os.path.isfile(file_path):
                    continue
                if name.endswith(".tmp"):
                    _unlink(file_path)  # a write cut short: ours, since we hold the lock
                    continue
                block_hash = self._check_header(file_path, name)
                if block_hash is not None:
                    found.append((os.path.getmtime(file_path), block_hash, file_path))
        found.sort()
        extra = max(0, len(found) - self._capacity)
        for _, _, file_path in found[:extra]:  # the cap shrank since they were written
            _unlink(file_path)
        self._held = {block_hash: None for _, block_hash, _ in found[extra:]}

    def _check_header(self, file_path: str, name: str) -> bytes | None:
        """The file's block hash if its header is ours and its size exact; else counts
        it invalid (deleting it when it is of our format but truncated)."""
        try:
            fd = os.open(file_path, os.O_RDONLY)
            try:
                header, data_offset = _read_header_at(fd)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
        except (OSError, ValueError):
            self._counts["invalid_files"] += 1
            return None
        if {k: header.get(k) for k in self._identity} != self._identity:
            self._counts["invalid_files"] += 1  # another model or format: not ours to touch
            return None
        hash_hex = str(header.get("block_hash", ""))
        if name != hash_hex + SUFFIX or size != data_offset + self.format.block_bytes:
            self._counts["invalid_files"] += 1
            _unlink(file_path)
            return None
        return bytes.fromhex(hash_hex)

    # ---- KVTier -----------------------------------------------------------------------
    def capacity_blocks(self) -> int:
        return self._capacity

    def contents(self) -> list[bytes]:
        with self._guard:
            return list(self._held)

    def _file(self, block_hash: bytes) -> str:
        hex_hash = block_hash.hex()
        return os.path.join(self.path, hex_hash[:2], hex_hash + SUFFIX)

    def store(self, block_hashes: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> None:
        for block in blocks:
            if block.numel() != self.format.block_bytes:
                raise ValueError(
                    f"block of {block.numel()} bytes, the format says {self.format.block_bytes}"
                )
        written: list[bytes] = []
        try:
            for block_hash in self._each(self._write_block, block_hashes, blocks):
                written.append(block_hash)
        except BaseException:
            self.evict(written)  # the engine counts the whole batch as not stored
            raise
        with self._guard:
            for block_hash in written:
                self._held[block_hash] = None
            self._counts["writes"] += len(written)

    def _each(self, fn, *columns):
        """fn over the rows, in order: on the pool when there are several."""
        if len(columns[0]) <= 1:
            return map(fn, *columns)
        return self._io.map(fn, *columns)

    def _write_block(self, block_hash: bytes, block: torch.Tensor) -> bytes:
        """One file, written under a temporary name then renamed into place."""
        data = memoryview(block.numpy())
        header = dict(self._identity, block_hash=block_hash.hex(), crc32=zlib.crc32(data))
        encoded = json.dumps(header, sort_keys=True).encode()
        final = self._file(block_hash)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = f"{final}.{threading.get_ident()}.tmp"
        parts = [_PREFIX.pack(MAGIC, VERSION, len(encoded)), encoded, data]
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, parts)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        return block_hash

    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        count = 0
        for block_hash in block_hashes:
            if not os.path.exists(self._file(block_hash)):
                break
            count += 1
        return count

    def load(self, block_hashes: Sequence[bytes], out: Sequence[torch.Tensor]) -> int:
        """Reads every block at once; the leading intact ones count. Only the first
        failure is acted on (counted, its file dropped when corrupt): what follows it
        is not loaded, so it is not judged either."""
        for index, status in enumerate(self._each(self._read_block, block_hashes, out)):
            if status != _OK:
                return self._reject(
                    block_hashes[index],
                    self._file(block_hashes[index]),
                    delete=status == _CORRUPT,
                    index=index,
                )
        with self._guard:
            self._counts["reads"] += len(block_hashes)
        return len(block_hashes)

    def _read_block(self, block_hash: bytes, target: torch.Tensor) -> str:
        """Reads the block's file into target and checks it (no side effect but target)."""
        try:
            fd = os.open(self._file(block_hash), os.O_RDONLY)
        except OSError:
            return _GONE
        try:
            size = os.fstat(fd).st_size
            header, data_offset = _read_header_at(fd)
            view = memoryview(target.numpy())
            if (
                size != data_offset + self.format.block_bytes
                or view.nbytes != self.format.block_bytes
            ):
                return _CORRUPT
            got = _read_all(fd, view, data_offset)
        except ValueError:
            return _CORRUPT
        except OSError:
            return _GONE
        finally:
            os.close(fd)
        ok = (
            {k: header.get(k) for k in self._identity} == self._identity
            and header.get("block_hash") == block_hash.hex()
            and got == self.format.block_bytes
            and header.get("crc32") == zlib.crc32(view)
        )
        return _OK if ok else _CORRUPT

    def _reject(self, block_hash: bytes, file_path: str, delete: bool, index: int) -> int:
        """Counts a failed read (the blocks before it were intact); returns index."""
        if delete:
            _unlink(file_path)
        with self._guard:
            self._counts["invalid_files"] += 1
            self._counts["read_failures"] += 1
            self._counts["reads"] += index
            self._held.pop(block_hash, None)
        return index

    def evict(self, block_hashes: Sequence[bytes]) -> None:
        for block_hash in block_hashes:
            _unlink(self._file(block_hash))
            with self._guard:
                self._held.pop(block_hash, None)

    def stats(self) -> dict[str, float]:
        with self._guard:
            return {
                "blocks": float(len(self._held)),
                **{k: float(v) for k, v in self._counts.items()},
            }

    def close(self) -> None:
        """Stops the I/O pool and releases the directory's lock (idempotent)."""
        if self._release is not None:
            self._release()
        self._lock_fd = None


def _release_directory(lock_fd: int, io: ThreadPoolExecutor | None) -> None:
    try:
        if io is not None:
            io.shutdown(wait=True)
    finally:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_UN)
        finally:
            os.close(lock_fd)


def _in_use_message(path: str, owner: str) -> str:
    """Why the directory's lock is taken, with what to do about it."""
    if owner == str(os.getpid()):
        return (
            f"{_flag()} {path} is in use by this process: an engine made earlier on "
            "this directory is still open; call LLM.shutdown() on it (or make it in "
            "`with LLM(...) as llm:`) before making another, or give each its own directory"
        )
    if owner.isdigit() and not _pid_alive(int(owner)):
        return (
            f"{_flag()} {path} is locked, though its owner (pid {owner}) has exited: a "
            "process it started still holds the lock; stop that process or give this "
            "server its own directory"
        )
    return (
        f"{_flag()} {path} is in use by another Pagoda server (pid {owner}); give each "
        "server its own directory"
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _read_header_at(fd: int) -> tuple[dict, int]:
    """The header of the open block file, and the offset its payload starts at."""
    head = os.pread(fd, _PREFIX.size + HEADER_RESERVE, 0)
    if len(head) < _PREFIX.size:
        raise ValueError("truncated prefix")
    magic, version, header_len = _PREFIX.unpack_from(head)
    if magic != MAGIC or version != VERSION or header_len > 1 << 16:
        raise ValueError("not a Pagoda KV block file of this version")
    end = _PREFIX.size + header_len
    raw = head[_PREFIX.size : end]
    if len(raw) < header_len:
        raw += os.pread(fd, header_len - len(raw), _PREFIX.size + len(raw))
    if len(raw) != header_len:
        raise ValueError("truncated header")
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("header is not an object")
    return header, end


def _read_all(fd: int, view: memoryview, offset: int) -> int:
    """Fills view from the file at offset (preadv may return short); the bytes read."""
    done = 0
    while done < view.nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


def _write_all(fd: int, parts: list) -> None:
    """writev of the parts, continuing after a short write."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        wrote = os.writev(fd, views)
        if wrote == 0:
            raise OSError("writev wrote nothing")
        while views and wrote >= views[0].nbytes:
            wrote -= views[0].nbytes
            views.pop(0)
        if views and wrote:
            views[0] = views[0][wrote:]


def _is_fan_out(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def _unlink(file_path: str) -> None:
    try:
        os.remove(file_path)
    except FileNotFoundError:
        pass
