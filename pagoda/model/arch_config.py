"""ArchConfig: the shape and numerics of a model architecture, independent of its weights.

Owns parsing a Hugging Face ``config.json`` dict (GGUF metadata is turned into one by
pagoda/model/loader/gguf_arch.py; presets are built directly) into one frozen
dataclass, and rejecting (with a ValueError naming the field) everything the model code
does not implement: unknown architectures, rope scaling types other than
default/llama3/yarn (and Gemma 3's linear), activations other than silu (Gemma 3's
tanh GELU), Qwen's sliding-window layers. Sliding windows are per layer
(``layer_sliding_window``): Mistral's on every layer, Gemma 3's on the layers its
layer_types call "sliding_attention". MoE
fields are parsed by pagoda.model.moe_config into the ``moe`` field (None for dense
architectures); DeepSeek architectures carry their attention's shape in ``mla``
(pagoda/model/mla_config.py). gpt-oss (GptOssForCausalLM) carries its experts in
``gpt_oss`` (a GptOssExperts: count, top-k, the clamped SwiGLU's alpha and limit, and
whether the checkpoint stores them as MXFP4 blocks); its q/k/v/o biases, attention
sinks and alternating sliding / full layers follow from the architecture.
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
    "Gemma3ForCausalLM": {"attention_bias": False, "qk_norm": True},
    "GptOssForCausalLM": {"attention_bias": True, "qk_norm": False},
}
GEMMA3 = "Gemma3ForCausalLM"
GPT_OSS = "GptOssForCausalLM"
# Gemma3TextConfig's defaults for the fields a saved config.json may leave out.
_GEMMA3_DEFAULTS = {
    "sliding_window": 4096,
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
}
# Layer kinds of a config's layer_types that the model code implements.
SLIDING, FULL = "sliding_attention", "full_attention"
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_ARCH_DEFAULTS)
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3", "yarn", "linear")
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
    "gemma3_text": GEMMA3,
    "gpt_oss": GPT_OSS,
}


@dataclass(frozen=True)
class GptOssExperts:
    """gpt-oss's routed experts: num_experts of width ArchConfig.intermediate_size, the
    top num_experts_per_tok of a biased router softmaxed over the chosen ones, each
    expert down((clamp(up) + 1) * g * sigmoid(alpha * g)), g = gate clamped to limit.
    mxfp4: the checkpoint holds the expert weights as MXFP4 blocks and scales."""

    num_experts: int
    num_experts_per_tok: int
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mxfp4: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                f"[1, num_local_experts ({self.num_experts})]"
            )
        if not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be > 0, got {self.swiglu_limit}")


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
    if rope_type == "linear":  # Gemma 3's global layers: positions divided by factor
        if scaling.get("factor") is None:
            raise ValueError("rope_scaling of type linear lacks factor")
        return {"rope_type": "linear", "factor": float(scaling["factor"])}
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
    # Sliding-window attention: a query sees its last sliding_window keys (its own
    # included) on the layers layer_types marks SLIDING; layer_types None: every layer
    # is SLIDING when sliding_window is set (Mistral), else FULL.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    # Gemma 3: softmax scale query_pre_attn_scalar^-0.5, the sliding layers' rotary base
    # (rope_theta and rope_scaling are the full layers'), final logits soft-capped as
    # cap * tanh(logits / cap) when final_logit_softcapping is set.
    query_pre_attn_scalar: float | None = None
    local_rope_theta: float | None = None
    final_logit_softcapping: float | None = None
    # gpt-oss: its experts (set exactly for GptOssForCausalLM).
    gpt_oss: GptOssExperts | None = None

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        activations = (
            ("gelu_pytorch_tanh",) if self.architecture == GEMMA3 else SUPPORTED_ACTIVATIONS
        )
        if self.hidden_act not in activations:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(activations)}"
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
        if (
            self.rope_scaling is not None
            and self.rope_scaling["rope_type"] == "linear"
            and self.architecture != GEMMA3
        ):
            raise ValueError(
                f"rope_scaling of type linear is not supported for {self.architecture}"
            )
        _check_mla(self)
        _check_sliding(self)
        if (self.gpt_oss is not None) != (self.architecture == GPT_OSS):
            raise ValueError(
                f"{self.architecture} {'needs' if self.gpt_oss is None else 'takes no'} "
                f"gpt_oss experts (gpt_oss=GptOssExperts(...))"
            )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """eos_token_id as a tuple, whichever form the checkpoint used."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """Layer layer_idx's window (None: full attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer_idx] == SLIDING:
            return self.sliding_window
        return None

    @property
    def softmax_scale(self) -> float:
        """The attention scores' scale: query_pre_attn_scalar^-0.5 (Gemma 3), else
        head_dim^-0.5."""
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return self.head_dim**-0.5

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
            heads, max(1, self.num_key_value_heads // tp_size), self.head_dim, self.softmax_scale
        )

    def replace(self, **changes: Any) -> ArchConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, config: dict) -> ArchConfig:
        """From a Hugging Face config.json dict (transformers 4.x or 5.x layout)."""
        arch = _hf_architecture(config)
        if arch == GEMMA3:  # transformers leaves out fields equal to its defaults
            config = {**_GEMMA3_DEFAULTS, **config}
        sliding_window, layer_types = _hf_sliding_window(arch, config)
        _reject_unsupported_biases(arch, config)
        heads = config["num_attention_heads"]
        if arch == GEMMA3:
            gemma = _hf_gemma3(config)
            rope_theta, rope_scaling = gemma.pop("rope_theta"), gemma.pop("rope_scaling")
        else:
            gemma = {}
            rope_theta, rope_scaling = _hf_rope(config)
        mla = _hf_mla(arch, config)
        gpt_oss, quantization = None, _hf_quantization_config(config)
        if arch == GPT_OSS:
            gpt_oss, quantization = _hf_gpt_oss(config, quantization)
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
            hidden_act=config.get("hidden_activation") or config.get("hidden_act", "silu"),
            torch_dtype=_hf_dtype(config),
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=config.get("eos_token_id"),
            moe=MoEConfig.from_hf_config(config, arch),
            mla=mla,
            quantization_config=quantization,
            sliding_window=sliding_window,
            layer_types=layer_types,
            gpt_oss=gpt_oss,
            **gemma,
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


def _hf_sliding_window(arch: str, config: dict) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) of a config: Mistral's window applies to every
    layer whenever it is set; Gemma 3's to the layers its layer_types (or the older
    sliding_window_pattern, 6 by default: every 6th layer full) call sliding. Qwen2/3
    configs carry a sliding_window value that only applies when use_sliding_window is
    true: refused then (their per-layer split by max_window_layers is not implemented)."""
    window = config.get("sliding_window")
    if arch in (GEMMA3, GPT_OSS):
        layers = config["num_hidden_layers"]
        types = config.get("layer_types")
        if types is None:  # gpt-oss alternates sliding and full layers, sliding first
            pattern = config.get("sliding_window_pattern") or (6 if arch == GEMMA3 else 2)
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
        if len(types) != layers or set(types) - {SLIDING, FULL}:
            raise ValueError(
                f"layer_types must name {layers} layers, each {SLIDING!r} or {FULL!r}; got {types}"
            )
        if window is None and SLIDING in types:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is null")
        return window, tuple(types)
    if window is None:
        return None, None
    if arch == "MistralForCausalLM":
        return int(window), None
    if config.get("use_sliding_window", False):
        raise ValueError(
            f"sliding_window={window} with use_sliding_window is not supported for {arch} "
            f"(its per-layer windows by max_window_layers are not implemented)"
        )
    return None, None


def _hf_gemma3(config: dict) -> dict:
    """Gemma 3's fields, refusing what the model code does not implement: the full
    layers' rope (rope_theta, rope_scaling: default or linear), the sliding layers'
    rotary base, the softmax scalar and the final logit soft-cap."""
    if config.get("attn_logit_softcapping") is not None:
        raise ValueError(
            f"attn_logit_softcapping={config['attn_logit_softcapping']} is not supported "
            f"(attention scores are not soft-capped)"
        )
    if config.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true is not supported (causal only)")
    params = config.get("rope_parameters")
    if params is not None and FULL in params:  # transformers 5: one dict per layer kind
        full, local = dict(params[FULL]), dict(params.get(SLIDING) or {})
        rope_theta = float(full.pop("rope_theta", 1_000_000.0))
        local_theta = float(local.pop("rope_theta", 10_000.0))
    else:  # the Hub's older fields
        full = dict(config.get("rope_scaling") or {"rope_type": "default"})
        local = {}
        rope_theta = float(config.get("rope_theta", 1_000_000.0))
        local_theta = float(config.get("rope_local_base_freq", 10_000.0))
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ValueError(f"sliding layers' rope {local} is not supported (only default)")
    if full.get("rope_type", full.get("type")) not in ("default", "linear"):
        raise ValueError(
            f"unsupported rope_scaling {full} for {GEMMA3}; supported: default, linear"
        )
    return dict(
        rope_theta=rope_theta,
        rope_scaling=full,
        local_rope_theta=local_theta,
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=config.get("final_logit_softcapping"),
    )


def _check_sliding(arch: ArchConfig) -> None:
    window, types = arch.sliding_window, arch.layer_types
    if window is not None and (isinstance(window, bool) or window < 1):
        raise ValueError(f"sliding_window must be >= 1, got {window}")
    if types is not None:
        if len(types) != arch.num_hidden_layers or set(types) - {SLIDING, FULL}:
            raise ValueError(
                f"layer_types must name {arch.num_hidden_layers} layers, each "
                f"{SLIDING!r} or {FULL!r}"
            )
        object.__setattr__(arch, "layer_types", tuple(types))
    if arch.architecture == GEMMA3:
        if arch.query_pre_attn_scalar is None or arch.local_rope_theta is None:
            raise ValueError(f"{GEMMA3} needs query_pre_attn_scalar and local_rope_theta")
    elif (
        arch.query_pre_attn_scalar is not None
        or arch.local_rope_theta is not None
        or arch.final_logit_softcapping is not None
    ):
        raise ValueError(
            f"{arch.architecture} takes no query_pre_attn_scalar, local_rope_theta or "
            f"final_logit_softcapping"
        )


def _reject_unsupported_biases(arch: str, config: dict) -> None:
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported (MLP projections have no bias)")
    # Qwen2's layout (bias on q/k/v, none on o_proj) and gpt-oss's (on all four) are
    # implemented; Llama's and Qwen3's attention_bias would also put a bias on o_proj.
    if config.get("attention_bias") and arch not in ("Qwen2ForCausalLM", GPT_OSS):
        raise ValueError(
            f"attention_bias=true is not supported for {arch} (it would add an "
            f"o_proj bias); only Qwen2ForCausalLM's q/k/v bias is"
        )


def _hf_gpt_oss(config: dict, quantization: dict | None) -> tuple[GptOssExperts, dict | None]:
    """gpt-oss's experts, and the quantization_config left for the other layers: an
    MXFP4 one covers the experts only (the model dequantizes them while loading), so
    the rest of the checkpoint is float and no other method applies."""
    if config.get("attention_bias") is False:
        raise ValueError("attention_bias=false is not supported for gpt-oss (q/k/v/o carry biases)")
    mxfp4 = quantization is not None and quantization["quant_method"] == "mxfp4"
    if quantization is not None and not mxfp4:
        raise ValueError(
            f"quantization_config {quantization['quant_method']!r} is not supported for "
            f"gpt-oss; supported: mxfp4 (experts)"
        )
    experts = GptOssExperts(
        num_experts=config.get("num_local_experts") or config.get("num_experts", 128),
        num_experts_per_tok=config.get("num_experts_per_tok", 4),
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        mxfp4=mxfp4,
    )
    return experts, None


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
