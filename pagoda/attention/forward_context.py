"""The forward context: how a model's attention layers find the step's metadata and the KV pool.

A non-nestable context manager rather than a bare global: entering it twice is a bug
(two forwards interleaved) and raises. It holds the backend, the backend's metadata
for the step (built once, by build_metadata or metadata_for_capture) and the KV pool
that owns every layer's storage and its writes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagoda.attention.backend import AttentionBackend, BackendMetadata

if TYPE_CHECKING:  # the pool lives in the worker; attention only calls it
    from pagoda.attention.kv_pool import KVCachePool


@dataclass
class ForwardContext:
    backend: AttentionBackend
    metadata: BackendMetadata
    kv_pool: KVCachePool


_current: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(
    backend: AttentionBackend, metadata: BackendMetadata, kv_pool: KVCachePool
) -> Iterator[ForwardContext]:
    global _current
    if _current is not None:
        raise RuntimeError("forward_context is not re-entrant: a forward is already running")
    if not isinstance(metadata, BackendMetadata):
        raise TypeError(
            f"forward_context needs the backend's step metadata "
            f"(backend.build_metadata(common)), got {type(metadata).__name__}"
        )
    _current = ForwardContext(backend, metadata, kv_pool)
    try:
        yield _current
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention called outside forward_context()")
    return _current
