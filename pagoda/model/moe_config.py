"""MoEConfig: the mixture-of-experts fields of an architecture, parsed from a Hugging Face
config.json dict.

Owns which config keys mean what for each MoE architecture (Qwen3-MoE, DeepSeek V2/V3),
their defaults where a config omits them (transformers' own defaults), and rejecting,
with a ValueError naming the field, every routing the model code does not implement:
unknown scoring functions or top-k methods, a combination the architecture's reference
(transformers) does not run, group counts that do not divide the experts.

Which layers are sparse is decided here too (`is_moe_layer_index`), so that the model
files and the layer helpers agree: DeepSeek's first_k_dense_replace / moe_layer_freq,
Qwen3-MoE's decoder_sparse_step / mlp_only_layers.
"""

from __future__ import annotations

from dataclasses import dataclass

SCORING_FUNCS: tuple[str, ...] = ("softmax", "sigmoid")
# greedy: plain top-k; group_limited_greedy (DeepSeek-V2): top-k within the topk_group
# groups of highest max score; noaux_tc (DeepSeek-V3): groups ranked by the sum of their
# two best biased scores, experts chosen on the biased scores, weighted by the unbiased.
TOPK_METHODS: tuple[str, ...] = ("greedy", "group_limited_greedy", "noaux_tc")

# Per architecture: (its default scoring_func, its default topk_method, the
# (scoring_func, topk_method) pairs its reference implementation runs). transformers
# hard-codes the routing of each model class, so another pair would load and silently
# compute something else than the reference: refuse it instead.
_ARCH_ROUTING: dict[str, tuple[str, str, tuple[tuple[str, str], ...]]] = {
    "Qwen3MoeForCausalLM": ("softmax", "greedy", (("softmax", "greedy"),)),
    "DeepseekV2ForCausalLM": (
        "softmax",
        "greedy",
        (("softmax", "greedy"), ("softmax", "group_limited_greedy")),
    ),
    "DeepseekV3ForCausalLM": ("sigmoid", "noaux_tc", (("sigmoid", "noaux_tc"),)),
    "DeepseekV32ForCausalLM": ("sigmoid", "noaux_tc", (("sigmoid", "noaux_tc"),)),
}
MOE_ARCHITECTURES: tuple[str, ...] = tuple(_ARCH_ROUTING)
# The keys a config may name its routed-expert count with (DeepSeek, Qwen3-MoE as
# released, transformers 5's save of Qwen3-MoE).
_NUM_EXPERTS_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int  # routed experts
    num_experts_per_tok: int  # top k
    moe_intermediate_size: int  # each routed expert's intermediate width
    renormalize: bool = False  # norm_topk_prob: top-k weights divided by their sum
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # multiplies the routed weights (after renormalising)
    n_shared_experts: int = 0  # DeepSeek: one dense MLP of n_shared * moe_intermediate
    first_k_dense_replace: int = 0  # DeepSeek: layers below this index are dense
    moe_layer_freq: int = 1  # DeepSeek: sparse when (index % freq == 0) past the dense ones
    decoder_sparse_step: int = 1  # Qwen3-MoE: sparse when (index + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and index not listed here

    def __post_init__(self) -> None:
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"unknown scoring_func {self.scoring_func!r}; supported: {', '.join(SCORING_FUNCS)}"
            )
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(
                f"unknown topk_method {self.topk_method!r}; supported: {', '.join(TOPK_METHODS)}"
            )
        for name in (
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "n_group",
            "topk_group",
            "moe_layer_freq",
            "decoder_sparse_step",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoE config field {name} must be an integer >= 1, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                f"num_experts ({self.num_experts})"
            )
        if self.n_shared_experts < 0 or self.first_k_dense_replace < 0:
            raise ValueError("n_shared_experts and first_k_dense_replace must be >= 0")
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if self.topk_method != "greedy":
            self._check_groups()

    def _check_groups(self) -> None:
        if self.num_experts % self.n_group:
            raise ValueError(
                f"num_experts ({self.num_experts}) is not divisible by n_group "
                f"({self.n_group}) ({self.topk_method} routing)"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
        group_size = self.num_experts // self.n_group
        if self.num_experts_per_tok > self.topk_group * group_size:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the "
                f"{self.topk_group} selected groups' {self.topk_group * group_size} "
                f"experts"
            )
        if self.topk_method == "noaux_tc" and group_size < 2:
            raise ValueError(
                f"noaux_tc routing scores each group by its two best experts; "
                f"groups of {group_size} expert(s) cannot be"
            )

    @property
    def grouped(self) -> bool:
        return self.topk_method != "greedy"

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    def is_moe_layer_index(self, architecture: str, layer_idx: int) -> bool:
        """Whether decoder layer layer_idx is sparse (else a dense MLP of intermediate_size)."""
        if architecture.startswith("Deepseek"):
            return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0
        return (
            layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_config(cls, config: dict, architecture: str) -> MoEConfig | None:
        """The MoE fields of an HF config dict; None for an architecture without experts."""
        if architecture not in _ARCH_ROUTING:
            return None
        default_scoring, default_method, allowed = _ARCH_ROUTING[architecture]
        scoring = config.get("scoring_func") or default_scoring
        method = config.get("topk_method") or default_method
        num_experts = next((config[k] for k in _NUM_EXPERTS_KEYS if config.get(k)), None)
        if num_experts is None:
            raise ValueError(
                f"{architecture} config names no expert count ({' / '.join(_NUM_EXPERTS_KEYS)})"
            )
        deepseek = architecture.startswith("Deepseek")
        moe = cls(
            num_experts=num_experts,
            num_experts_per_tok=config["num_experts_per_tok"],
            moe_intermediate_size=config["moe_intermediate_size"],
            renormalize=bool(config.get("norm_topk_prob", False)),
            scoring_func=scoring,
            topk_method=method,
            n_group=config.get("n_group") or 1,
            topk_group=config.get("topk_group") or 1,
            routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
            n_shared_experts=(config.get("n_shared_experts") or 0) if deepseek else 0,
            first_k_dense_replace=(config.get("first_k_dense_replace") or 0) if deepseek else 0,
            moe_layer_freq=(config.get("moe_layer_freq") or 1) if deepseek else 1,
            decoder_sparse_step=(config.get("decoder_sparse_step") or 1) if not deepseek else 1,
            mlp_only_layers=tuple(config.get("mlp_only_layers") or ()) if not deepseek else (),
        )
        if (scoring, method) not in allowed:
            raise ValueError(
                f"{architecture} with scoring_func {scoring!r} and topk_method "
                f"{method!r} is not supported; supported: "
                + ", ".join(f"{s}/{m}" for s, m in allowed)
            )
        _reject_unimplemented(architecture, config, moe)
        return moe


def _reject_unimplemented(architecture: str, config: dict, moe: MoEConfig) -> None:
    """Fields whose effect the model code (and its transformers reference) does not have."""
    if architecture == "DeepseekV2ForCausalLM" and moe.renormalize:
        # transformers' DeepseekV2 ignores norm_topk_prob, DeepSeek's own code divides by
        # the sum (and then skips routed_scaling_factor): no single answer to match.
        raise ValueError(
            "norm_topk_prob=true is not supported for DeepseekV2ForCausalLM "
            "(transformers ignores it; no released V2 checkpoint sets it)"
        )
    if architecture == "Qwen3MoeForCausalLM" and config.get("shared_expert_intermediate_size"):
        raise ValueError(
            "shared experts (shared_expert_intermediate_size) are not part of "
            "Qwen3MoeForCausalLM; Qwen2-MoE style checkpoints are not supported"
        )
    layer_types = config.get("mlp_layer_types")
    if layer_types is not None:
        # DeepSeek-V3.2 lists each layer's MLP kind; Pagoda derives it from
        # first_k_dense_replace / moe_layer_freq, so the two must agree.
        derived = [
            "sparse" if moe.is_moe_layer_index(architecture, i) else "dense"
            for i in range(config["num_hidden_layers"])
        ]
        if list(layer_types) != derived:
            raise ValueError(
                f"{architecture}: mlp_layer_types {list(layer_types)} differ from the "
                f"dense-then-sparse schedule first_k_dense_replace implies ({derived}); "
                "other schedules are not supported"
            )
