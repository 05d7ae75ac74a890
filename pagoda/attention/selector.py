"""Choosing a rank's attention backend: `make_attention_backend(name, device, shape)`.

The backend is built for an `AttentionShape` (pagoda/attention/shape.py), which the
model builds (`ArchConfig.attention_shape`), so attention never reads a model config.
"""

from __future__ import annotations

import torch

from pagoda.attention.backend import AttentionBackend
from pagoda.attention.mla_backend import MLATorchBackend
from pagoda.attention.shape import AttentionShape
from pagoda.attention.torch_ref import TorchRefBackend
from pagoda.kernels.attention.decode_config import DecodeAttentionConfig
from pagoda.kernels.attention.dsa_config import DSAKernelConfig
from pagoda.kernels.attention.mla_config import MLAKernelConfig


def make_attention_backend(
    name: str,
    device: str,
    shape: AttentionShape,
    *,
    decode_config: DecodeAttentionConfig | None = None,
    mla_config: MLAKernelConfig | None = None,
) -> AttentionBackend:
    """The backend named ("auto": Triton on CUDA, the torch reference elsewhere). The
    Triton backends take their kernels' config (decode_config, mla_config; default:
    the family's config for device)."""
    if name == "auto":
        name = "triton" if device == "cuda" else "torch_ref"
    if shape.is_mla:
        args = (shape.num_heads, shape.kv_lora_rank, shape.qk_rope_head_dim, shape.scale)
        latent_rows = "all" if shape.sparse else "decode"
        if name == "triton":
            from pagoda.attention.mla_triton import MLATritonBackend  # Triton: CUDA only

            return MLATritonBackend(
                *args,
                config=mla_config or MLAKernelConfig.for_device(torch.device(device)),
                latent_rows=latent_rows,
                dsa_config=DSAKernelConfig.for_device(torch.device(device)),
            )
        return MLATorchBackend(*args, latent_rows)
    args = (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.scale)
    if name == "triton":
        from pagoda.attention.triton_backend import TritonBackend  # Triton: CUDA only

        return TritonBackend(
            *args, config=decode_config or DecodeAttentionConfig.for_device(torch.device(device))
        )
    return TorchRefBackend(*args)
