"""The compute capability and SM count of a CUDA device, looked up once per device.

Kernels that pick a path by architecture (TMA and PDL from Hopper, 9.0; FP8 GEMMs from
Ada, 8.9) ask on every launch; torch.cuda.get_device_capability queries the driver's
properties each time, so the answer is cached here by device index.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device; its index defaults to the current device."""
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (its index defaults to the current one);
    4 for any other device (the interpreter, where any value gives the same result)."""
    if device.type != "cuda":
        return 4
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())
