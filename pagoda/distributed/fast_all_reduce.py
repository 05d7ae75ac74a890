"""One-shot all-reduce over peer-mapped symmetric memory: the tensor-parallel group's
path for small (decode-sized) messages on CUDA.

A decode step of a TP model makes two all-reduces per layer on a few KB each, where
NCCL's fixed cost dominates. Torch's symmetric memory maps every rank's buffer into
every peer's address space (CUDA IPC over NVLink: peer pointers, no multicast), and its
one-shot kernel has each rank copy its input into its own buffer, meet the peers at a
barrier on the signal pads, then read every rank's buffer and sum: one kernel.

Invariants:
- NVLink multicast stays off: the process runs with TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  (parallel_state.keep_multicast_off), only the peer-pointer one-shot op is called (never
  a multimem op), and `create` refuses a handle that came back with a multicast mapping.
- Every rank makes the same sequence of calls with the same sizes (all ranks run the
  same model on the same step), so the barriers inside the op pair up. The op ends with
  a barrier too, so the next call may overwrite the buffer.
- Whether a tensor takes this path depends only on its dtype and byte size, which are
  the same on every rank and fixed per captured graph, so capture and replay agree.
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Bytes of the symmetric buffer (one per rank); messages up to it may take the path.
BUFFER_BYTES = 8 << 20
# Largest message sent this way by default; above it NCCL's bandwidth-optimal algorithms
# win (measured on two H200s: docs/performance.md). PAGODA_FAST_ALL_REDUCE_MAX_BYTES
# overrides it (0 turns the path off).
DEFAULT_MAX_BYTES = 2 << 20
MAX_BYTES_ENV = "PAGODA_FAST_ALL_REDUCE_MAX_BYTES"
# The op reads whole 16-byte vectors.
_ALIGNMENT = 16


class SymmMemAllReduce:
    """Sums a tensor over the group through one symmetric buffer (see the module doc)."""

    def __init__(
        self,
        buffer: torch.Tensor,
        group_name: str,
        max_bytes: int,
        reduce_into: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
    ):
        self.buffer = buffer
        self.group_name = group_name
        self.max_bytes = max_bytes
        self._reduce_into = reduce_into

    def can_reduce(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (
            x.dtype == self.buffer.dtype
            and x.is_cuda
            and nbytes <= self.max_bytes
            and nbytes % _ALIGNMENT == 0
            and nbytes > 0
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the group, as a new tensor (x is left as it was)."""
        staged = self.buffer[: x.numel()].view(x.shape)
        out = torch.empty_like(x)
        self._reduce_into(staged, x.contiguous(), out)
        return out

    @classmethod
    def create(
        cls, group, device: torch.device, dtype: torch.dtype, buffer_bytes: int = BUFFER_BYTES
    ) -> SymmMemAllReduce | None:
        """The fast path for this group, or None (with a log line saying why) where the
        torch build, the dtype or the GPUs do not allow it. Collective: every rank calls
        it with the same arguments."""
        max_bytes = int(os.environ.get(MAX_BYTES_ENV, DEFAULT_MAX_BYTES))
        if max_bytes <= 0:
            logger.info("fast all-reduce off (%s=%d)", MAX_BYTES_ENV, max_bytes)
            return None
        if os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") != "1":
            raise RuntimeError(
                "the fast all-reduce needs TORCH_SYMM_MEM_DISABLE_MULTICAST=1 "
                "(pagoda.distributed.parallel_state.keep_multicast_off)"
            )
        reason = _unsupported_reason(dtype)
        if reason:
            logger.info("fast all-reduce unavailable (%s); using NCCL for every size", reason)
            return None
        try:
            fast = _build(group, device, dtype, buffer_bytes, min(max_bytes, buffer_bytes))
        except Exception as exc:  # noqa: BLE001 - any failure leaves NCCL in charge
            logger.warning(
                "fast all-reduce unavailable (%s: %s); using NCCL for every size",
                type(exc).__name__,
                exc,
            )
            return None
        return fast


def _unsupported_reason(dtype: torch.dtype) -> str:
    if dtype not in (torch.bfloat16, torch.float32):
        return f"dtype {dtype} (the one-shot op sums bfloat16 and float32)"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError:
        return "this torch build has no symmetric memory"
    ops = getattr(torch.ops, "symm_mem", None)
    if ops is None or not hasattr(ops, "one_shot_all_reduce_out"):
        return "this torch build has no symm_mem.one_shot_all_reduce_out"
    return ""


def _reduce_function(group_name: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """(staged, x, out) -> out = sum over ranks of x; staged is x's slot in the buffer."""
    ops = torch.ops.symm_mem
    if hasattr(ops, "one_shot_all_reduce_copy_out"):

        def reduce_copying_in_kernel(staged, x, out):
            ops.one_shot_all_reduce_copy_out(staged, x, "sum", group_name, out)

        return reduce_copying_in_kernel

    def reduce_after_copy(staged, x, out):
        staged.copy_(x)
        ops.one_shot_all_reduce_out(staged, "sum", group_name, out)

    return reduce_after_copy


def _build(
    group, device: torch.device, dtype: torch.dtype, buffer_bytes: int, max_bytes: int
) -> SymmMemAllReduce:
    import torch.distributed._symmetric_memory as symm_mem  # CUDA builds of torch only

    group_name = group.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        # Required before torch 2.9; later versions keep it as a deprecated no-op.
        with warnings.catch_warnings(action="ignore", category=FutureWarning):
            symm_mem.enable_symm_mem_for_group(group_name)
    buffer = symm_mem.empty(buffer_bytes // dtype.itemsize, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(buffer, group_name)
    if getattr(handle, "multicast_ptr", 0):
        raise RuntimeError(
            "symmetric memory came back with a multicast mapping despite "
            "TORCH_SYMM_MEM_DISABLE_MULTICAST=1"
        )
    fast = SymmMemAllReduce(buffer, group_name, max_bytes, _reduce_function(group_name))
    _check_against_nccl(fast, group, device, dtype)
    return fast


def _check_against_nccl(
    fast: SymmMemAllReduce, group, device: torch.device, dtype: torch.dtype
) -> None:
    """One reduction both ways at start-up; a disagreement refuses the fast path."""

    rank = dist.get_rank(group)
    generator = torch.Generator(device="cpu").manual_seed(1234 + rank)
    x = torch.randn(4, 1024, generator=generator).to(device=device, dtype=dtype)
    expected = x.clone()
    dist.all_reduce(expected, group=group)
    got = fast.all_reduce(x)
    torch.cuda.synchronize(device)
    if not torch.allclose(got.float(), expected.float(), rtol=1e-2, atol=1e-2):
        raise RuntimeError("the one-shot all-reduce disagreed with NCCL at start-up")
