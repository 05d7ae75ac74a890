"""LaunchConfig: how kernels launch on one device (the launch family's config).

Programmatic dependent launch (pagoda.kernels.launch.pdl) is a property of the device:
on wherever it can run, off elsewhere. `LaunchConfig.for_device(device)` decides it
once per device; `pdl.launch_options` hands its launch keywords to every participating
kernel. Importing this module imports no triton (a CPU-only run never loads it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.kernels.launch.capability import cuda_capability

_CACHE: dict[tuple[str, int], LaunchConfig] = {}


@dataclass(frozen=True)
class LaunchConfig:
    """pdl: the decode kernels launch with programmatic dependent launch (USE_PDL and
    Triton's launch_pdl) and wait for their predecessor in the kernel."""

    pdl: bool = False

    @classmethod
    def for_device(cls, device: torch.device) -> LaunchConfig:
        """PDL where the device can run it: CUDA of compute capability 9.0 or newer and a
        Triton with griddepcontrol; never the CPU (the interpreter cannot run it)."""
        if not isinstance(device, torch.device):
            device = torch.device(device)
        if device.type != "cuda":
            return cls(pdl=False)
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (device.type, index)
        if key not in _CACHE:
            _CACHE[key] = cls(pdl=_triton_has_gdc() and cuda_capability(device)[0] >= 9)
        return _CACHE[key]

    def options(self) -> dict:
        """A participating kernel's launch keywords: USE_PDL and, only with it,
        launch_pdl."""
        return {"USE_PDL": True, "launch_pdl": True} if self.pdl else {"USE_PDL": False}


def _triton_has_gdc() -> bool:
    """Whether this Triton has griddepcontrol in its CUDA extras (tl.extra.cuda.gdc_wait)."""
    import triton.language as tl  # Triton: CUDA only

    return hasattr(getattr(tl.extra, "cuda", None), "gdc_wait")
