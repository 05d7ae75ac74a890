"""ArchConfig: the shape and numerics of a model architecture, independent of its weights.

Owns parsing a Hugging Face ``config.json`` dict (GGUF metadata is turned into one by
pagoda/model/loader/gguf_arch.py; presets are built directly) into one frozen
dataclass, and rejecting (with a ValueError naming the field) everything the model code
does not implement: unknown architectures, rope scaling types other than
default/llama3/yarn, activations other than silu, sliding-window attention. MoE
fields are parsed by pagoda.model.moe_config into the ``moe`` field (None for dense
architectures); DeepSeek architectures carry their attention's shape in ``mla``
(pagoda/model/mla_config.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pagoda.attention.shape import AttentionShape
from pagoda.model.mla_config import MLA_ARCHITECTURES, MLAConfig, mla_softmax_scale
from pagoda.model.moe_config import MOE_ARCHITECTURES, MoEConfig

# Architecture name -> flags the Llama-family model code switches on. Qwen2 always has
# a bias on its q/k/v projections; Qwen3 always normalises q and k per head.
_ARCH_DEFAULTS: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"attention_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"attention_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"attention_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"attention_bias": False, "qk_norm": True},
    "Qwen3MoeForCausalLM": {"attention_bias": False, "qk_norm": True},
    "DeepseekV2ForCausalLM": {"attention_bias": False, "qk_norm": False},
    "DeepseekV3ForCausalLM": {"attention_bias": False, "qk_norm": False},
    "DeepseekV32ForCausalLM": {"attention_bias": False, "qk_norm": False},
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_ARCH_DEFAULTS)
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3", "yarn")
SUPPORTED_ACTIVATIONS: tuple[str, ...] = ("silu",)
SUPPORTED_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
# Fields a llama3 rope_scaling dict must carry.
_ROPE_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
# HF model_type -> architecture, for config.json files without an "architectures" list.
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
}


def check_architecture(name: str) -> None:
    if name not in _ARCH_DEFAULTS:
        raise ValueError(
            f"unsupported architecture {name!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def normalize_rope_scaling(rope_scaling: dict | None) -> dict | None:
    """Validated copy of a rope scaling dict with the type under "rope_type"; None = default."""
    if rope_scaling is None:
        return None
    scaling = {k: v for k, v in rope_scaling.items() if k not in ("type", "rope_theta")}
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_scaling type {rope_type!r}; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return None
    missing = [k for k in _ROPE_KEYS[rope_type] if scaling.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type} lacks {', '.join(missing)}")
    scaling["rope_type"] = rope_type
    return scaling


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None (plain rotary) or a dict with rope_type "llama3" / "yarn" and its fields.
    rope_scaling: dict | None = field(default=None, hash=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary (Qwen3)
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"  # the checkpoint's dtype, used when dtype="auto"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = field(default=None, hash=False)
    moe: MoEConfig | None = None  # experts and routing; None for dense models
    # Multi-head latent attention's shape: set exactly for the DeepSeek architectures,
    # whose head_dim is then the rotary width (qk_rope_head_dim).
    mla: MLAConfig | None = None
    # The checkpoint's quantization_config (config.json), as is; None: float weights.
    # pagoda.model.quant.registry turns it into the layers' methods or refuses it.
    quantization_config: dict | None = field(default=None, hash=False, compare=False)

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; supported: "
                f"{', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        if self.torch_dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"unsupported torch_dtype {self.torch_dtype!r}; supported: "
                f"{', '.join(SUPPORTED_DTYPES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if (self.moe is not None) != (self.architecture in MOE_ARCHITECTURES):
            raise ValueError(
                f"{self.architecture} "
                + (
                    "needs an MoE config (moe=MoEConfig(...))"
                    if self.moe is None
                    else "has no experts: moe must be None"
                )
            )
        object.__setattr__(self, "rope_scaling", normalize_rope_scaling(self.rope_scaling))
        _check_mla(self)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """eos_token_id as a tuple, whichever form the checkpoint used."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def attention_shape(self, tp_size: int = 1) -> AttentionShape:
        """What one of tp_size ranks' attention backend computes: its share of the heads."""
        heads = self.num_attention_heads // tp_size
        if self.mla is not None:
            return AttentionShape(
                heads,
                heads,
                self.mla.kv_lora_rank,
                mla_softmax_scale(self.mla, self.rope_scaling),
                kv_lora_rank=self.mla.kv_lora_rank,
                qk_rope_head_dim=self.mla.qk_rope_head_dim,
                sparse=self.mla.indexer is not None,
            )
        return AttentionShape(
            heads, max(1, self.num_key_value_heads // tp_size), self.head_dim, self.head_dim**-0.5
        )

    def replace(self, **changes: Any) -> ArchConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, config: dict) -> ArchConfig:
        """From a Hugging Face config.json dict (transformers 4.x or 5.x layout)."""
        arch = _hf_architecture(config)
        _reject_sliding_window(arch, config)
        _reject_unsupported_biases(arch, config)
        heads = config["num_attention_heads"]
        rope_theta, rope_scaling = _hf_rope(config)
        mla = _hf_mla(arch, config)
        return cls(
            architecture=arch,
            hidden_size=config["hidden_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=(
                mla.qk_rope_head_dim
                if mla is not None
                else config.get("head_dim") or config["hidden_size"] // heads
            ),
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(
                config.get("attention_bias", _ARCH_DEFAULTS[arch]["attention_bias"])
            ),
            qk_norm=_ARCH_DEFAULTS[arch]["qk_norm"],
            hidden_act=config.get("hidden_act", "silu"),
            torch_dtype=_hf_dtype(config),
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=config.get("eos_token_id"),
            moe=MoEConfig.from_hf_config(config, arch),
            mla=mla,
            quantization_config=_hf_quantization_config(config),
        )


def _hf_architecture(config: dict) -> str:
    archs = config.get("architectures") or []
    if len(archs) > 1:
        raise ValueError(f"config.json lists several architectures {archs}; expected one")
    if archs:
        arch = archs[0]
    elif config.get("model_type") in _MODEL_TYPE_TO_ARCH:
        arch = _MODEL_TYPE_TO_ARCH[config["model_type"]]
    else:
        raise ValueError(
            f"config.json names no architecture (model_type "
            f"{config.get('model_type')!r}); supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    check_architecture(arch)
    return arch


def _check_mla(arch: ArchConfig) -> None:
    is_mla = arch.architecture in MLA_ARCHITECTURES
    if is_mla != (arch.mla is not None):
        raise ValueError(
            f"{arch.architecture} {'needs' if is_mla else 'takes no'} an MLA config (mla=...)"
        )
    if is_mla and arch.head_dim != arch.mla.qk_rope_head_dim:
        raise ValueError(
            f"{arch.architecture}: head_dim ({arch.head_dim}) must be the rotary "
            f"width qk_rope_head_dim ({arch.mla.qk_rope_head_dim})"
        )


def _hf_mla(arch: str, config: dict) -> MLAConfig | None:
    """The MLA shape of a DeepSeek config (None for other architectures)."""
    if arch not in MLA_ARCHITECTURES:
        return None
    return MLAConfig.from_hf_config(arch, config)


def _hf_quantization_config(config: dict) -> dict | None:
    """config.json's quantization_config (None when absent); a value that is not an
    object with a quant_method is refused here, before any weight is read."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict) or not isinstance(quant.get("quant_method"), str):
        raise ValueError(
            f"config.json's quantization_config must be an object with a "
            f"quant_method, got {quant!r}"
        )
    return dict(quant)


def _reject_sliding_window(arch: str, config: dict) -> None:
    window = config.get("sliding_window")
    if window is None:
        return
    # Qwen2/3 configs carry a sliding_window value that only applies when
    # use_sliding_window is true; Mistral's applies whenever it is set.
    uses_window = config.get("use_sliding_window", arch == "MistralForCausalLM")
    if uses_window:
        raise ValueError(
            f"sliding_window={window} is not supported (sliding-window attention "
            f"is not implemented); only full attention models load"
        )


def _reject_unsupported_biases(arch: str, config: dict) -> None:
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported (MLP projections have no bias)")
    # Only Qwen2's layout (bias on q/k/v, none on o_proj) is implemented; Llama's and
    # Qwen3's attention_bias would also put a bias on o_proj.
    if config.get("attention_bias") and arch != "Qwen2ForCausalLM":
        raise ValueError(
            f"attention_bias=true is not supported for {arch} (it would add an "
            f"o_proj bias); only Qwen2ForCausalLM's q/k/v bias is"
        )


def _hf_rope(config: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from transformers 5's rope_parameters or 4.x's fields."""
    params = config.get("rope_parameters")
    if params is not None:
        if "rope_type" not in params and "type" not in params:
            raise ValueError(f"rope_parameters {params} names no rope_type")
        return float(params.get("rope_theta", config.get("rope_theta", 10000.0))), params
    return float(config.get("rope_theta", 10000.0)), config.get("rope_scaling")


def _hf_dtype(config: dict) -> str:
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return str(dtype).removeprefix("torch.")
