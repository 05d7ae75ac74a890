"""Engine configuration: frozen dataclasses with vLLM-compatible field names.

Owns validation: an invalid value fails at construction with a ConfigError (a
ValueError) that names the field (EngineArgs' name, which the CLI shows as its flag)
and the allowed range. Values that depend on the machine ("auto" device, dtype,
batch-token budget) are resolved by `EngineArgs.create_engine_config()`. The flags
themselves (names, defaults, help) are defined once in pagoda.engine_flags; the nested
configs' fields take their defaults from there (`_from_flag`). Stdlib only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# The value sets live with the flags; they stay importable from here too.
from pagoda.engine_flags import (
    ATTENTION_BACKENDS,
    BLOCK_SIZES,
    DEVICES,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    DTYPES,
    ENGINE_FLAGS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    POLICIES,
    QUANTIZATION_METHODS,
    REASONING_PARSERS,
    EngineFlags,
    flag_default,
)

SPEC_METHODS = ("ngram", "layer_skip", "draft_model", "mtp")
# n-gram sizes tried when speculative_config gives neither bound.
NGRAM_LOOKUP_MIN, NGRAM_LOOKUP_MAX = 2, 5
GPU_MAX_NUM_BATCHED_TOKENS = 16384
CPU_MAX_NUM_BATCHED_TOKENS = 4096
CPU_KV_CACHE_MEMORY = 1 << 30


class ConfigError(ValueError):
    """An invalid engine argument; `fields` are the EngineArgs names the message uses
    (the CLI prints them as flags: pagoda.entrypoints.cli_args.cli_error_message)."""

    def __init__(self, message: str, *fields: str) -> None:
        super().__init__(message)
        self.fields = fields


def _fail(name: str, rule: str, value) -> ConfigError:
    return ConfigError(f"{name} must be {rule}, got {value!r}", name.split()[0])


def _from_flag(name: str, *, resolved: bool = False, **default):
    """A nested config field set from engine flag `name`, defaulting to the flag's
    default (or to default=..., for a value EngineArgs resolves, e.g. "auto" to a
    device). resolved: create_engine_config may change the flag's value on the way."""
    value = default["default"] if "default" in default else flag_default(name)
    return dataclasses.field(default=value, metadata={"flag": name, "resolved": resolved})


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise _fail(name, f"one of {', '.join(map(str, choices))}", value)


def _check_positive_int(name: str, value, minimum: int = 1) -> None:
    if value is not None and (
        not isinstance(value, int) or isinstance(value, bool) or value < minimum
    ):
        raise _fail(name, f"an integer >= {minimum}", value)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str | None = _from_flag("model")  # None: the embedded SmolLM2 GGUF
    tokenizer: str | None = _from_flag("tokenizer")
    dtype: str = _from_flag("dtype")
    max_model_len: int | None = _from_flag("max_model_len")  # None: the model's own limit
    seed: int = _from_flag("seed")
    load_format: str = _from_flag("load_format")
    served_model_name: str | None = _from_flag("served_model_name")
    chat_template: str | None = _from_flag("chat_template")
    skip_tokenizer_init: bool = _from_flag("skip_tokenizer_init")  # token ids in, token ids out
    # For a Hugging Face hub id: the branch, tag or commit (None: main), and the cache
    # directory to find or download it in (None: HF_HUB_CACHE / $HF_HOME/hub).
    revision: str | None = _from_flag("revision")
    download_dir: str | None = _from_flag("download_dir")
    # None: as the checkpoint says (unquantized unless its config.json has a
    # quantization_config); else one of QUANTIZATION_METHODS.
    quantization: str | None = _from_flag("quantization")
    # The LM head quantized too (FP8 only: --quantization fp8 or an FP8 checkpoint,
    # whose head stays in bf16 otherwise, as in vLLM); checked against the resolved
    # scheme when the model loads.
    quantize_lm_head: bool = _from_flag("quantize_lm_head")

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        if self.quantization is not None:
            _check_choice("quantization", self.quantization, QUANTIZATION_METHODS)
        if not isinstance(self.quantize_lm_head, bool):
            raise _fail("quantize_lm_head", "a bool", self.quantize_lm_head)
        if self.quantize_lm_head and self.quantization not in (None, "fp8"):
            raise ConfigError(
                f"quantize_lm_head quantizes the LM head to FP8: it needs "
                f"--quantization fp8 (or an FP8 checkpoint), not "
                f"{self.quantization}",
                "quantize_lm_head",
            )
        _check_positive_int("max_model_len", self.max_model_len, 2)
        if not isinstance(self.seed, int):
            raise _fail("seed", "an integer", self.seed)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = _from_flag("block_size")
    gpu_memory_utilization: float = _from_flag("gpu_memory_utilization")
    # Bytes; sizes the pool directly (None: from gpu_memory_utilization; resolved to
    # 1 GiB on CPU).
    kv_cache_memory: int | None = _from_flag("kv_cache_memory", resolved=True)
    enable_prefix_caching: bool = _from_flag("enable_prefix_caching")
    num_gpu_blocks_override: int | None = _from_flag("num_gpu_blocks_override")
    # KV offloading (vLLM's flag names): GiB of host memory for the CPU tier (None: off);
    # a directory and its size cap in GiB for a disk tier below it; an out-of-tree tier
    # "module.path:ClassName" (pagoda/kv_offload/tier_api.py). The lower tiers stage
    # through the CPU tier, so they need it.
    kv_offloading_size: float | None = _from_flag("kv_offloading_size")
    kv_offloading_disk_path: str | None = _from_flag("kv_offloading_disk_path")
    kv_offloading_disk_size: float | None = _from_flag("kv_offloading_disk_size")
    kv_offloading_tier: str | None = _from_flag("kv_offloading_tier")
    # "tier=GB/s,...": load bandwidths the cost model takes as given instead of measuring
    # them ("inf": always load that tier's hits; core/kv_cost.py). None: all measured.
    kv_offloading_bandwidth: str | None = _from_flag("kv_offloading_bandwidth")
    # "auto": the model's dtype; "fp8" / "fp8_e4m3": float8 e4m3 entries, one K and one
    # V scale per layer (the GPU needs FP8: compute capability >= 8.9; checked by the worker).
    cache_dtype: str = _from_flag("kv_cache_dtype")

    def __post_init__(self) -> None:
        _check_choice("block_size", self.block_size, BLOCK_SIZES)
        _check_choice("kv_cache_dtype", self.cache_dtype, KV_CACHE_DTYPES)
        if self.cache_dtype == "fp8_e5m2":
            raise ConfigError(
                "kv_cache_dtype fp8_e5m2 is not supported: Pagoda stores FP8 KV "
                "as e4m3 with per-layer scales; use kv_cache_dtype fp8 (or "
                "fp8_e4m3)",
                "kv_cache_dtype",
            )
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise _fail("gpu_memory_utilization", "in (0, 1]", self.gpu_memory_utilization)
        _check_positive_int("kv_cache_memory", self.kv_cache_memory)
        _check_positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override)
        _check_offloading(self)

    @property
    def kv_offloading(self) -> bool:
        return self.kv_offloading_size is not None


def parse_tier_bandwidths(text) -> dict[str, float]:
    """ "cpu=20,disk=0.5" -> {"cpu": 20e9, "disk": 0.5e9} (bytes/s; "inf" allowed)."""
    rule = "'tier=GB/s[,tier=GB/s...]' with each figure > 0 (inf allowed)"
    if not isinstance(text, str) or not text.strip():
        raise _fail("kv_offloading_bandwidth", rule, text)
    figures: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name = name.strip()
        try:
            gb_per_s = float(value)
        except ValueError:
            gb_per_s = float("nan")
        if not sep or not name or name in figures or not gb_per_s > 0:
            raise _fail("kv_offloading_bandwidth", rule, text)
        figures[name] = gb_per_s * 1e9
    return figures


def _check_offloading(cache: CacheConfig) -> None:
    for name in ("kv_offloading_size", "kv_offloading_disk_size"):
        value = getattr(cache, name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
        ):
            raise _fail(name, "a number of GiB > 0", value)
    if (cache.kv_offloading_disk_path is None) != (cache.kv_offloading_disk_size is None):
        raise ConfigError(
            "kv_offloading_disk_path and kv_offloading_disk_size go together: "
            "the disk tier needs a directory and a size cap",
            "kv_offloading_disk_path",
            "kv_offloading_disk_size",
        )
    if cache.kv_offloading_tier is not None and (
        not isinstance(cache.kv_offloading_tier, str) or ":" not in cache.kv_offloading_tier
    ):
        raise _fail("kv_offloading_tier", "'module.path:ClassName'", cache.kv_offloading_tier)
    if cache.kv_offloading_bandwidth is not None:
        parse_tier_bandwidths(cache.kv_offloading_bandwidth)
        if cache.kv_offloading_size is None:
            raise ConfigError(
                "kv_offloading_bandwidth tunes the KV offload tiers: set kv_offloading_size too",
                "kv_offloading_bandwidth",
                "kv_offloading_size",
            )
    lower = cache.kv_offloading_disk_path is not None or cache.kv_offloading_tier is not None
    if lower and cache.kv_offloading_size is None:
        raise ConfigError(
            "the disk and plugin KV tiers stage blocks through host memory: "
            "set kv_offloading_size (the CPU tier's size) too",
            "kv_offloading_size",
        )
    if cache.kv_offloading_size is not None and not cache.enable_prefix_caching:
        raise ConfigError(
            "KV offloading keeps prefix-cache blocks: it needs enable_prefix_caching",
            "enable_prefix_caching",
        )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = _from_flag("max_num_seqs")
    # None: resolved to 16384 on GPU, 4096 on CPU.
    max_num_batched_tokens: int | None = _from_flag("max_num_batched_tokens", resolved=True)
    policy: str = _from_flag("scheduling_policy")
    enable_chunked_prefill: bool = _from_flag("enable_chunked_prefill")
    # Schedule step N+1 while step N runs on the device (resolved: never None here).
    async_scheduling: bool = _from_flag("async_scheduling", resolved=True, default=False)

    def __post_init__(self) -> None:
        _check_positive_int("max_num_seqs", self.max_num_seqs)
        _check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_choice("scheduling_policy", self.policy, POLICIES)


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Only the names and ranges are checked here. Whether the model's heads split over
    tensor_parallel_size is checked once its shape is known
    (pagoda.model.parallel.check_tensor_parallel); whether the machine has that many
    GPUs, by EngineArgs.create_engine_config."""

    tensor_parallel_size: int = _from_flag("tensor_parallel_size")
    distributed_executor_backend: str = _from_flag("distributed_executor_backend")
    # Small all-reduces on CUDA go one-shot over peer-mapped symmetric memory unless
    # this is set (then NCCL carries every size), as vLLM's flag of the same name.
    disable_custom_all_reduce: bool = _from_flag("disable_custom_all_reduce")
    # MoE models: experts split whole across the tensor-parallel ranks (refused, once
    # the model is known, for a model without experts).
    enable_expert_parallel: bool = _from_flag("enable_expert_parallel")

    def __post_init__(self) -> None:
        if not isinstance(self.enable_expert_parallel, bool):
            raise _fail("enable_expert_parallel", "True or False", self.enable_expert_parallel)
        if self.tensor_parallel_size is None:
            raise _fail("tensor_parallel_size", "an integer >= 1", None)
        _check_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _check_choice(
            "distributed_executor_backend",
            self.distributed_executor_backend,
            DISTRIBUTED_EXECUTOR_BACKENDS,
        )
        if not isinstance(self.disable_custom_all_reduce, bool):
            raise _fail(
                "disable_custom_all_reduce", "True or False", self.disable_custom_all_reduce
            )


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    device: str = _from_flag("device", resolved=True)
    attention_backend: str = _from_flag("attention_backend")
    enforce_eager: bool = _from_flag("enforce_eager")

    def __post_init__(self) -> None:
        _check_choice("device", self.device, DEVICES)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` keys, plus Pagoda's own).

    method "ngram": prompt lookup over the request's prompt + output
    (prompt_lookup_min / prompt_lookup_max: the n-gram sizes tried, longest first);
    "layer_skip": the target's first num_layers layers + its final norm and LM head
    draft greedily; "draft_model": a second model (`model`) with the target's vocabulary;
    "mtp": the target checkpoint's own multi-token prediction layer (DeepSeek V3 family,
    num_nextn_predict_layers >= 1: checked when the worker loads it), applied again for
    each further draft.
    num_speculative_tokens: drafts proposed per step at most (k).
    adaptive: pick each request's k per step from its acceptance and the step's load
    (pagoda.spec_decode.planning.budget); compute_bound_tokens: tokens per step from which the
    forward is compute-bound and drafts stop paying (None: per device, resolved at start).
    draft_confidence_threshold: a model drafter (layer_skip, draft_model, mtp) stops once
    its own probability of its next guess falls below this.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    num_layers: int | None = None
    model: str | None = None
    draft_confidence_threshold: float | None = None
    adaptive: bool = True
    compute_bound_tokens: int | None = None

    # Which optional keys each method takes (others are refused, never ignored).
    _METHOD_KEYS = {
        "ngram": ("prompt_lookup_min", "prompt_lookup_max"),
        "layer_skip": ("num_layers", "draft_confidence_threshold"),
        "draft_model": ("model", "draft_confidence_threshold"),
        "mtp": ("draft_confidence_threshold",),
    }

    def __post_init__(self) -> None:
        _check_choice("speculative_config method", self.method, SPEC_METHODS)
        if self.num_speculative_tokens is None:
            raise _fail("num_speculative_tokens", "an integer >= 1", None)
        _check_positive_int("num_speculative_tokens", self.num_speculative_tokens)
        own = self._METHOD_KEYS.get(self.method, ())
        for key in dict.fromkeys(k for keys in self._METHOD_KEYS.values() for k in keys):
            if key not in own and getattr(self, key) is not None:
                owners = [m for m, keys in self._METHOD_KEYS.items() if key in keys]
                raise ValueError(
                    f"speculative_config key {key!r} belongs to method "
                    f"{' / '.join(map(repr, owners))}, not {self.method!r}"
                )
        if not isinstance(self.adaptive, bool):
            raise _fail("speculative_config adaptive", "true or false", self.adaptive)
        _check_positive_int("compute_bound_tokens", self.compute_bound_tokens)
        getattr(self, f"_check_{self.method}")()

    def _check_ngram(self) -> None:
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            _check_positive_int(key, getattr(self, key))
        if (
            self.prompt_lookup_min is None
            or self.prompt_lookup_max is None
            or self.prompt_lookup_min > self.prompt_lookup_max
        ):
            raise ValueError(
                "ngram speculation needs 1 <= prompt_lookup_min <= "
                f"prompt_lookup_max, got {self.prompt_lookup_min} and "
                f"{self.prompt_lookup_max}"
            )

    def _check_layer_skip(self) -> None:
        if self.num_layers is None:
            raise ValueError(
                "layer_skip speculation needs num_layers (the target's first layers that draft)"
            )
        _check_positive_int("num_layers", self.num_layers)
        self._check_confidence()

    def _check_draft_model(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("draft_model speculation needs 'model' (a path or preset)")
        self._check_confidence()

    def _check_mtp(self) -> None:
        self._check_confidence()

    def _check_confidence(self) -> None:
        threshold = self.draft_confidence_threshold
        if threshold is not None and (
            isinstance(threshold, bool)
            or not isinstance(threshold, (int, float))
            or not 0.0 <= threshold < 1.0
        ):
            raise _fail("draft_confidence_threshold", "a number in [0, 1)", threshold)

    @classmethod
    def from_dict(cls, values: dict) -> SpeculativeConfig:
        """From vLLM-style JSON keys; unknown keys are refused. Without "method", a
        "model" means a draft model ("ngram" / "[ngram]" as model: vLLM's old spelling)."""
        if not isinstance(values, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(values).__name__}")
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - allowed)
        if unknown:
            raise ValueError(
                f"unknown speculative_config key(s): {', '.join(unknown)}; "
                f"supported: {', '.join(sorted(allowed))}"
            )
        values = dict(values)
        if values.get("model") in ("ngram", "[ngram]") and values.get("method", "ngram") == "ngram":
            values.pop("model")
            values["method"] = "ngram"
        if "method" not in values:
            if values.get("model") is None:
                raise ValueError(
                    "speculative_config needs 'method' (one of "
                    f"{', '.join(SPEC_METHODS)}) or a draft 'model'"
                )
            values["method"] = "draft_model"
        if values["method"] == "ngram":
            low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
            if low is None and isinstance(high, int):
                low = min(NGRAM_LOOKUP_MIN, high)
            elif low is None:
                low = NGRAM_LOOKUP_MIN
            if high is None and isinstance(low, int):
                high = max(low, NGRAM_LOOKUP_MAX)
            values["prompt_lookup_min"], values["prompt_lookup_max"] = low, high
        if "num_speculative_tokens" not in values:
            raise ValueError("speculative_config needs num_speculative_tokens (k >= 1)")
        return cls(**values)

    def check_target(self, num_target_layers: int) -> None:
        """What can only be checked once the target model's shape is known."""
        if (
            self.method == "layer_skip"
            and self.num_layers is not None
            and self.num_layers >= num_target_layers
        ):
            raise ValueError(
                f"layer_skip num_layers ({self.num_layers}) must be smaller than "
                f"the target's {num_target_layers} layers"
            )


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    """reasoning_parser: how outputs mark their thinking (<think>...</think>), so that
    grammars start after it and thinking budgets can end it; thinking_token_budget: the
    budget of requests that set none (None: unlimited)."""

    reasoning_parser: str | None = _from_flag("reasoning_parser")
    thinking_token_budget: int | None = _from_flag("thinking_token_budget")

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None:
            _check_choice("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)
        _check_positive_int("thinking_token_budget", self.thinking_token_budget, 0)
        if self.thinking_token_budget is not None and self.reasoning_parser is None:
            raise ConfigError(
                f"thinking_token_budget needs a reasoning_parser ({', '.join(REASONING_PARSERS)})",
                "thinking_token_budget",
                "reasoning_parser",
            )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig
    speculative: SpeculativeConfig | None = None  # None: speculative decoding off
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()


def _cuda_available() -> bool:
    try:
        import torch  # the machine probe: config itself is torch-free
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return torch.cuda.is_available()


def _cuda_device_count() -> int:
    import torch  # the machine probe

    return torch.cuda.device_count()


def _check_gpus_for_tp(tensor_parallel_size: int) -> None:
    """On CUDA, one GPU per tensor-parallel rank must be visible to this process."""
    if tensor_parallel_size > 1:
        present = _cuda_device_count()
        if tensor_parallel_size > present:
            raise ConfigError(
                f"tensor_parallel_size is {tensor_parallel_size} but only "
                f"{present} CUDA GPU(s) are visible (one GPU per rank)",
                "tensor_parallel_size",
            )


@dataclass
class EngineArgs(EngineFlags):
    """Flat keyword arguments (vLLM's names; their defaults and help are EngineFlags'
    fields, pagoda.engine_flags), turned into an EngineConfig."""

    @classmethod
    def field_names(cls) -> set[str]:
        return set(ENGINE_FLAGS)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        unknown = sorted(set(kwargs) - cls.field_names())
        if unknown:
            raise TypeError(
                f"unknown engine argument(s): {', '.join(unknown)}; "
                f"supported: {', '.join(sorted(cls.field_names()))}"
            )
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        values = self._resolved_values()
        parallel = _build(ParallelConfig, values)
        if values["device"] == "cuda" and parallel.distributed_executor_backend != "ray":
            # Ray's ranks may be on other machines: its executor checks the cluster's GPUs.
            _check_gpus_for_tp(parallel.tensor_parallel_size)
        if values["kv_offloading_size"] is not None and parallel.tensor_parallel_size > 1:
            raise ConfigError(
                "KV offloading supports tensor_parallel_size 1 for now (each rank "
                "would need its own tiers, and the scheduler every rank's "
                "reports)",
                "kv_offloading_size",
                "tensor_parallel_size",
            )
        speculative = values["speculative_config"]
        return EngineConfig(
            model=_build(ModelConfig, values),
            cache=_build(CacheConfig, values),
            scheduler=_build(SchedulerConfig, values),
            parallel=parallel,
            device=_build(DeviceConfig, values),
            speculative=None if speculative is None else SpeculativeConfig.from_dict(speculative),
            structured_outputs=_build(StructuredOutputsConfig, values),
        )

    def _resolved_values(self) -> dict:
        """The flags' values, text parsed (sizes, JSON) and "auto" / None resolved for
        this machine (device, batch-token budget, async scheduling, CPU KV memory)."""
        values = {name: _parsed(name, getattr(self, name)) for name in ENGINE_FLAGS}
        device = values["device"]
        if device == "auto":
            device = "cuda" if _cuda_available() else "cpu"
        elif device == "cuda" and not _cuda_available():
            raise ConfigError(
                "device is 'cuda' but no CUDA GPU is available; use device='cpu'", "device"
            )
        if values["async_scheduling"] not in (None, True, False):
            raise _fail("async_scheduling", "True, False or None (auto)", self.async_scheduling)
        if values["async_scheduling"] is None:
            values["async_scheduling"] = device == "cuda"
        values["max_num_batched_tokens"] = values["max_num_batched_tokens"] or (
            GPU_MAX_NUM_BATCHED_TOKENS if device == "cuda" else CPU_MAX_NUM_BATCHED_TOKENS
        )
        if values["kv_cache_memory"] is None and device == "cpu":
            values["kv_cache_memory"] = CPU_KV_CACHE_MEMORY
        values["device"] = device
        return values


def _parsed(name: str, value):
    """A flag's value given as text (LLM(kv_cache_memory="2GiB")) read by the flag's
    parser; any other value as given (the config that takes it validates it)."""
    parse = ENGINE_FLAGS[name].metadata["parse"]
    if parse is None or not isinstance(value, str):
        return value
    try:
        return parse(value)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}", name) from None


def _build(cls, values: dict):
    """A nested config from the flags' values, each field from the flag it names."""
    return cls(
        **{
            f.name: values[f.metadata["flag"]]
            for f in dataclasses.fields(cls)
            if "flag" in f.metadata
        }
    )
