"""The floating dtypes Pagoda runs in, by name, and the one rule for dtype "auto".

Used by the engine (worker/model_runner.py: the dtype of weights, activations and
KV cache) and by every weight loader, so a name means the same dtype everywhere.
"""

from __future__ import annotations

import torch

# Canonical names first (those of config.DTYPES and of ArchConfig.torch_dtype), then aliases.
DTYPES_BY_NAME = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "float": torch.float32,
}
_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


def resolve_dtype(
    dtype: str | torch.dtype, device: str | torch.device, checkpoint_dtype: str | None = None
) -> torch.dtype:
    """The torch dtype for `dtype`: a name (or alias) above, or a floating torch.dtype.

    "auto" is the checkpoint's dtype when the caller knows it (a loader, from the
    model's config), else bfloat16 on CUDA and float32 elsewhere (the engine, before any
    checkpoint is read; it hands the resolved dtype to the loader).
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _SUPPORTED:
            raise ValueError(f"unsupported dtype {dtype}; supported: float32, float16, bfloat16")
        return dtype
    if dtype == "auto":
        if checkpoint_dtype is not None:
            return DTYPES_BY_NAME[checkpoint_dtype]
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in DTYPES_BY_NAME:
        raise ValueError(
            f"unsupported dtype {dtype!r}; supported: auto, {', '.join(DTYPES_BY_NAME)}"
        )
    return DTYPES_BY_NAME[dtype]
