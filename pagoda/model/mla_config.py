"""MLAConfig: the shape of Multi-head Latent Attention (DeepSeek V2/V3/V3.2), parsed from
a Hugging Face config, and the softmax scale it implies.

MLA keeps, per token and layer, one latent vector: kv_lora_rank values (the compressed
keys and values, normalised) followed by qk_rope_head_dim values (the rotated key part
shared by every head). Each head's key is [k_nope (qk_nope_head_dim), k_rope] and its
value v_head_dim wide; both are decompressed from the latent by kv_b_proj. Queries come
from q_proj, or from q_a_proj -> q_a_layernorm -> q_b_proj when q_lora_rank is set.

DeepSeek V3.2 adds sparse attention (DSA): a lightning indexer per layer scores every
cached token for each query with its own small heads (``SparseIndexerConfig``), and the
query attends only to the index_topk best. Its key is cached per token beside the latent.

rope_interleave: the checkpoint's rotary pairs are adjacent dimensions (2i, 2i+1), as
DeepSeek trained them (always for V2; V3's config says). The model loader permutes
those weight rows into Pagoda's half-split layout, so the same rotary code serves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# DeepSeek architectures: the ones whose attention is MLA.
MLA_ARCHITECTURES: tuple[str, ...] = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
)
# The ones with DeepSeek Sparse Attention (a lightning indexer in every layer).
SPARSE_MLA_ARCHITECTURES: tuple[str, ...] = ("DeepseekV32ForCausalLM",)


def _positive(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"MLA {name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class SparseIndexerConfig:
    """DeepSeek Sparse Attention's lightning indexer: num_heads query heads of head_dim
    (its first qk_rope_head_dim dims rotated, half-split), one key of head_dim per token,
    and the topk tokens each query keeps."""

    num_heads: int
    head_dim: int
    topk: int

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "topk"):
            _positive(f"index {name}", getattr(self, name))


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    indexer: SparseIndexerConfig | None = None  # DeepSeek V3.2's sparse attention

    def __post_init__(self) -> None:
        if self.indexer is not None:
            if self.q_lora_rank is None:
                raise ValueError(
                    "sparse MLA's indexer reads the query LoRA: q_lora_rank must be set"
                )
            if self.indexer.head_dim < self.qk_rope_head_dim:
                raise ValueError(
                    f"index_head_dim ({self.indexer.head_dim}) must hold the rotary part "
                    f"qk_rope_head_dim ({self.qk_rope_head_dim})"
                )
        if self.q_lora_rank is not None:
            _positive("q_lora_rank", self.q_lora_rank)
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _positive(name, getattr(self, name))
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"MLA qk_rope_head_dim must be even for rotary embeddings, "
                f"got {self.qk_rope_head_dim}"
            )

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's query and key: the unrotated part, then the rotated one."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: the compressed KV, then the rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf_config(cls, architecture: str, config: dict) -> MLAConfig:
        missing = [
            k
            for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
            if config.get(k) is None
        ]
        if missing:
            raise ValueError(f"{architecture} config lacks {', '.join(missing)}")
        # V2 always rotates interleaved pairs; V3 says so in rope_interleave (default true).
        interleave = True
        if architecture == "DeepseekV3ForCausalLM":
            interleave = bool(config.get("rope_interleave", True))
        indexer = None
        if architecture in SPARSE_MLA_ARCHITECTURES:
            indexer = SparseIndexerConfig(
                config.get("index_n_heads", 64),
                config.get("index_head_dim", 128),
                config.get("index_topk", 2048),
            )
        return cls(
            q_lora_rank=config.get("q_lora_rank"),
            kv_lora_rank=config["kv_lora_rank"],
            qk_nope_head_dim=config["qk_nope_head_dim"],
            qk_rope_head_dim=config["qk_rope_head_dim"],
            v_head_dim=config["v_head_dim"],
            rope_interleave=interleave,
            indexer=indexer,
        )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by factor (1 when not)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(mla: MLAConfig, rope_scaling: dict | None) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under a scaled rope
    with mscale_all_dim set: DeepSeek's YaRN also sharpens the softmax."""
    scale = mla.qk_head_dim**-0.5
    if rope_scaling is not None and rope_scaling.get("mscale_all_dim"):
        m = yarn_mscale(float(rope_scaling["factor"]), float(rope_scaling["mscale_all_dim"]))
        scale *= m * m
    return scale
