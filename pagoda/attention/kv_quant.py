"""FP8 KV cache (kv_cache_dtype fp8): the storage dtype a config asks for, and the torch
reference of writing and reading scaled float8 e4m3 entries.

Convention (vLLM's): each attention layer holds two float32 scales, K and V
(``Attention.kv_scales`` = [k_scale, v_scale], 1.0 unless the checkpoint carries
``self_attn.k_scale`` / ``v_scale``). An entry x is stored as
``e4m3(clamp(x / scale, -448, 448))`` (round to nearest, ties to even; 448 is e4m3's
largest finite value, so nothing saturates to NaN) and read back as ``stored * scale``.
The Triton kernels (kernels/store_kv.py, paged_attention.py, paged_decode.py) follow
the same rule: the store is bit-exact with ``quantize_kv``; the attention kernels fold
the K scale into the softmax scale and the V scale into the output, which is the same
value up to float32 rounding.

The scales are tensors on the device, read by the kernels through a pointer, so a
captured CUDA graph reads whatever they hold at replay and never bakes a value in.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
# The kv_cache_dtype values that mean an e4m3 cache (config.KV_CACHE_DTYPES).
_FP8_NAMES = ("fp8", "fp8_e4m3")
# FP8 conversions in hardware: Ada (8.9) and Hopper (9.0) onwards.
_MIN_FP8_CAPABILITY = (8, 9)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def resolve_kv_cache_dtype(
    cache_dtype: str, model_dtype: torch.dtype, device: torch.device | str, is_mla: bool = False
) -> torch.dtype:
    """The dtype the KV pool stores entries in, for config.cache.cache_dtype; raises
    with the reason where this machine or model cannot do it."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype not in _FP8_NAMES:
        raise ValueError(
            f"kv_cache_dtype {cache_dtype!r} is not supported; use auto, fp8 or fp8_e4m3"
        )
    if is_mla:
        raise ValueError(
            "an FP8 KV cache (kv_cache_dtype fp8) is not supported for MLA "
            "models yet; use kv_cache_dtype auto"
        )
    device = torch.device(device)
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) < _MIN_FP8_CAPABILITY:
            raise ValueError(
                f"kv_cache_dtype {cache_dtype} needs a GPU with FP8 support (compute "
                f"capability >= 8.9: Ada, Hopper or later); this GPU is "
                f"sm_{capability[0]}{capability[1]}. Use kv_cache_dtype auto"
            )
    return FP8_KV_DTYPE


def check_scales(scales: torch.Tensor | None, cache: torch.Tensor) -> torch.Tensor:
    """scales ([k_scale, v_scale] float32 on the cache's device) for an FP8 cache."""
    if scales is None:
        raise ValueError("an FP8 KV cache needs the layer's kv_scales ([k_scale, v_scale])")
    if scales.shape != (2,) or scales.dtype != torch.float32 or scales.device != cache.device:
        raise ValueError(
            f"kv_scales must be float32 [2] on {cache.device}, got "
            f"{scales.dtype} {tuple(scales.shape)} on {scales.device}"
        )
    return scales


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (any float dtype) / scale, clamped to e4m3's range, rounded to float8 e4m3."""
    return (x.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache entries as float32: stored * scale for FP8, a plain cast otherwise."""
    if is_fp8(x.dtype):
        return x.float() * scale
    return x.float()


def as_bits(x: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor viewed as uint8, for copies torch has no float8 kernel for
    (index_copy_ on the CPU): the bytes move unchanged. Other dtypes as they are."""
    return x.view(torch.uint8) if is_fp8(x.dtype) else x
