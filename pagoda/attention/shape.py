"""`AttentionShape`: what an attention backend needs of the model (heads on this rank,
head size, softmax scale, and MLA's latent sizes). The model builds it
(`ArchConfig.attention_shape`), so attention never reads a model config; it imports no
torch, so the model's config and presets load without it (the CLI checks its arguments
before torch is imported)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionShape:
    """One rank's attention heads. MLA (DeepSeek latent attention) when kv_lora_rank is set."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    sparse: bool = False  # sparse MLA (an indexer picks each row's tokens): every row latent

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None
