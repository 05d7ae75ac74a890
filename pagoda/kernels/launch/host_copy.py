"""host_to_device: host data onto a device without making the host wait for the device.

On CUDA a copy from pageable memory synchronises with the stream (the host would wait
for every queued kernel); from pinned memory with non_blocking=True it is queued like
a kernel. The step path (input building, sampling metadata, logprob rows) copies
through here, so launching a step never blocks the host: what async scheduling needs.
(The step inputs' uploads reuse pinned buffers instead: pagoda/worker/staging.py.)
"""

from __future__ import annotations

import numpy as np
import torch


def host_to_device(data, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list (possibly nested) or numpy array as a `dtype` tensor on `device`."""
    if isinstance(data, np.ndarray):
        tensor = torch.from_numpy(data).to(dtype)
    else:
        tensor = torch.tensor(data, dtype=dtype)
    return tensor_to_device(tensor, device)


def tensor_to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device`: through a fresh pinned copy on CUDA (the caller may
    reuse `tensor` at once); the tensor itself on CPU."""
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
