"""DecodeWorkspace: torch_ref's decode contexts kept contiguous from one step to the next.

Reading a decode row's context out of the paged cache means a gather: every step, every
layer, the whole context is copied (and then read again by the matmuls). On the CPU
that copy is memory traffic the matmuls' own reads do not need: at 32 rows of 160
tokens it doubles the attention time. The workspace keeps, per layer, a buffer
[2, slots, kv_heads, capacity, head_dim] (K and V) holding one decode request's context
per slot, and a step copies into them only what is new:

- a request that was a decode row of the previous forward and has grown by exactly
  one token keeps its slot; only its newest position is copied from the cache;
- any other decode row gets a free slot and its whole context is copied.

Why carrying is exact: a slot's key is the (block-table prefix, length) of the context
it holds. A position's K/V is written once into a block the request owns, and the block
is not written again while a running request's table holds it (prefix-cache sharing
only shares full, already computed blocks; a preempted or speculative request is not a
decode row in between, so it loses its slot). A row whose context minus its newest
token has exactly a slot's key therefore finds that context already in the slot.

Each layer's buffers remember the step they were last filled for; a layer that missed
the previous step (or a new layer cache, or new shapes) is filled from scratch. K and V
share one tensor per layer, so one index_select / index_copy_ pair moves both. Memory:
the buffers hold the live decode contexts once more, with up to 2x slack in positions
(capacity grows by doubling) and in slots (they are compacted below half use).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

SlotKey = tuple[tuple[int, ...], int]  # (block ids holding the context, context length)

_CAPACITY_ALIGN = 64  # positions: capacity grows to a multiple of this, at least doubling


@dataclass
class SlotAssignment:
    step: int  # this step's number; buffers filled for step - 1 may carry
    slots: list[int]  # per decode row
    carried: list[bool]  # per decode row: its slot already holds all but the newest token
    num_slots: int
    capacity: int  # positions per slot


@dataclass
class _LayerBuffers:
    cache: weakref.ref  # the layer's KV cache these copy from
    kv: torch.Tensor  # [2, slots, kv_heads, capacity, head_dim]: K then V, one tensor
    step: int


def slot_key(table: list[int], length: int, block_size: int) -> SlotKey:
    return tuple(table[: -(-length // block_size)]), length


class DecodeWorkspace:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.keys: list[SlotKey | None] = []  # per slot, after the last step
        self.capacity = 0
        self.step = 0
        self._layers: dict[int, _LayerBuffers] = {}

    def assign(self, tables: list[list[int]], lengths: list[int]) -> SlotAssignment:
        """Slots for this step's decode rows (host block tables and context lengths)."""
        self.step += 1
        previous = {key: slot for slot, key in enumerate(self.keys) if key is not None}
        needed = -(-max(lengths) // _CAPACITY_ALIGN) * _CAPACITY_ALIGN
        # Mostly idle slots or positions (the batch shrank, a long request left): start
        # over with buffers that fit; too few positions: grow. Nothing carries then.
        reset = len(self.keys) > 2 * len(lengths) or self.capacity > 4 * needed
        if reset or needed > self.capacity:
            self.capacity = needed if reset else max(2 * self.capacity, needed)
            reset, previous = True, {}
        slots = [
            previous.pop(slot_key(table, length - 1, self.block_size), None)
            for table, length in zip(tables, lengths)
        ]
        carried = [s is not None for s in slots]
        taken = {s for s in slots if s is not None}
        free = (s for s in range(len(lengths) + len(taken)) if s not in taken)
        slots = [s if s is not None else next(free) for s in slots]
        # Slot count only grows between resets, so buffer shapes (and carrying) hold.
        num_slots = max(slots) + 1 if reset else max(len(self.keys), max(slots) + 1)
        self.keys = [None] * num_slots
        for slot, table, length in zip(slots, tables, lengths):
            self.keys[slot] = slot_key(table, length, self.block_size)
        return SlotAssignment(self.step, slots, carried, num_slots, self.capacity)

    def skip_step(self) -> None:
        """A forward without decode rows: nothing carries past it."""
        self.step += 1
        self.keys = []

    def buffers(
        self, kv_cache: torch.Tensor, assignment: SlotAssignment
    ) -> tuple[torch.Tensor, bool]:
        """(KV, carry): this layer's buffers for the step, K and V in one tensor
        [2, slots, kv_heads, capacity, head_dim] (the cache's own K-then-V order, so one
        index copy fills both), and whether they hold the previous step's contexts (else
        every row must be filled from scratch)."""
        _, _, _, num_kv_heads, head_dim = kv_cache.shape
        shape = (2, assignment.num_slots, num_kv_heads, assignment.capacity, head_dim)
        held = self._layers.get(id(kv_cache))
        if held is not None and held.cache() is not kv_cache:  # an old cache's id, reused
            held = None
        carry = (
            held is not None and held.step == assignment.step - 1 and tuple(held.kv.shape) == shape
        )
        if held is None or tuple(held.kv.shape) != shape:
            # Zeroed: the matmuls read padded positions too (masked, but 0 * NaN = NaN).
            held = _LayerBuffers(
                weakref.ref(kv_cache),
                torch.zeros(shape, dtype=kv_cache.dtype, device=kv_cache.device),
                0,
            )
            self._layers = {k: b for k, b in self._layers.items() if b.cache() is not None}
            self._layers[id(kv_cache)] = held
        held.step = assignment.step
        return held.kv, carry
