"""The compute capability of a CUDA device, looked up once per device.

Kernels that pick a path by architecture (TMA and PDL from Hopper, 9.0; FP8 GEMMs from
Ada, 8.9) ask on every launch; torch.cuda.get_device_capability queries the driver's
properties each time, so the answer is cached here by device index.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device; its index defaults to the current device."""
    return _capability_of(device.index if device.index is not None
                          else torch.cuda.current_device())
