"""Content hashes of full KV cache blocks, the keys of the prefix cache.

A block's hash covers its parent's hash, its own token ids and any extra keys
(e.g. an adapter name), so equal hashes mean equal prefixes up to and including the
block. Hashes are sha256 digests of a byte encoding that does not depend on the
process (no Python `hash()`, whose seed changes per process), because KV offload
tiers will later key stored blocks on them across restarts.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, NewType

if TYPE_CHECKING:
    from pagoda.core.request import Request

# Raw digest bytes, typed apart from other bytes so they can't be mixed up.
BlockHash = NewType("BlockHash", bytes)

# Bumped if the encoding below ever changes, so old on-disk keys stop matching.
_DOMAIN = b"pagoda-kv-block-v1"
# Stands in for the parent of a request's first block.
_ROOT_PARENT = b"\x00" * 32


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra: tuple = (),
) -> BlockHash:
    """Hash of one block chained on its parent's hash (None for a first block).

    Tokens are packed as little-endian int64, prefixed by their count so that no two
    different (tokens, extra) pairs share an encoding; `extra` enters through repr(),
    so it must hold values with a stable repr (str, int, tuples of them).
    """
    digest = hashlib.sha256(_DOMAIN)
    digest.update(_ROOT_PARENT if parent is None else parent)
    digest.update(struct.pack("<Q", len(token_ids)))
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    digest.update(repr(tuple(extra)).encode("utf-8"))
    return BlockHash(digest.digest())


def extend_block_hashes(request: Request, block_size: int, extra: tuple = ()) -> None:
    """Appends to request.block_hashes the hashes of full blocks not yet hashed.

    Only whole blocks of request.all_token_ids are hashed (draft tokens never are);
    each new hash chains on the previous one, so calling this after every step costs
    only the blocks that filled up since the last call.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size!r}")
    hashes = request.block_hashes
    num_full_blocks = len(request.all_token_ids) // block_size
    for block_index in range(len(hashes), num_full_blocks):
        start = block_index * block_size
        parent = hashes[-1] if hashes else None
        tokens = request.all_token_ids[start : start + block_size]
        hashes.append(hash_block_tokens(parent, tokens, extra))
