"""The forward context: how a model's attention layers find the metadata and KV caches.

A non-nestable context manager rather than a bare global: entering it twice is a bug
(two forwards interleaved) and raises.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from pagoda.attention.backend import AttentionBackend, AttentionMetadata


@dataclass
class ForwardContext:
    backend: AttentionBackend
    metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]  # one per layer


_current: Optional[ForwardContext] = None


@contextlib.contextmanager
def forward_context(backend: AttentionBackend, metadata: AttentionMetadata,
                    kv_caches: list[torch.Tensor]) -> Iterator[ForwardContext]:
    global _current
    if _current is not None:
        raise RuntimeError("forward_context is not re-entrant: a forward is already running")
    _current = ForwardContext(backend, metadata, kv_caches)
    try:
        yield _current
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention called outside forward_context()")
    return _current
