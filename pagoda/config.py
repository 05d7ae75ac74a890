"""Engine configuration: frozen dataclasses with vLLM-compatible field names.

Owns validation: an invalid value fails at construction with a message that names
the field and the allowed range. Values that depend on the machine ("auto" device,
dtype, batch-token budget) are resolved by `EngineArgs.create_engine_config()`.
Stdlib only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
# --quantization, vLLM's names (pagoda.model.quant.registry says what each means). A
# checkpoint's own quantization_config ("fp8", "compressed-tensors") needs no flag.
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "int8", "int4", "gguf")
DEVICES = ("auto", "cpu", "cuda")
POLICIES = ("fcfs", "priority")
ATTENTION_BACKENDS = ("auto", "torch_ref", "triton")
BLOCK_SIZES = (8, 16, 32, 64)
# KV cache storage (vLLM's --kv-cache-dtype): "auto" = the model's dtype; "fp8" and
# "fp8_e4m3" = float8 e4m3 with a per-layer K and V scale. fp8_e5m2 is named so it can
# be refused with a reason rather than as an unknown value.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# "mp": one worker process per GPU on this host; "ray" is vLLM's name for workers placed
# by Ray (several hosts): accepted here, refused when the engine starts (not available).
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
SPEC_METHODS = ("ngram", "layer_skip", "draft_model")
# n-gram sizes tried when speculative_config gives neither bound.
NGRAM_LOOKUP_MIN, NGRAM_LOOKUP_MAX = 2, 5
# pagoda.structured.reasoning.REASONING_PARSERS holds what each one means.
REASONING_PARSERS = ("deepseek_r1", "qwen3")
GPU_MAX_NUM_BATCHED_TOKENS = 16384
CPU_MAX_NUM_BATCHED_TOKENS = 4096
CPU_KV_CACHE_MEMORY = 1 << 30


def _fail(name: str, rule: str, value) -> ValueError:
    return ValueError(f"{name} must be {rule}, got {value!r}")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise _fail(name, f"one of {', '.join(map(str, choices))}", value)


def _check_positive_int(name: str, value, minimum: int = 1) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < minimum):
        raise _fail(name, f"an integer >= {minimum}", value)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: Optional[str] = None  # None: the embedded SmolLM2 GGUF
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    max_model_len: Optional[int] = None  # None: the model's own limit
    seed: int = 0
    load_format: str = "auto"
    served_model_name: Optional[str] = None
    chat_template: Optional[str] = None
    skip_tokenizer_init: bool = False  # token ids in, token ids out
    # For a Hugging Face hub id: the branch, tag or commit (None: main), and the cache
    # directory to find or download it in (None: HF_HUB_CACHE / $HF_HOME/hub).
    revision: Optional[str] = None
    download_dir: Optional[str] = None
    # None: as the checkpoint says (unquantized unless its config.json has a
    # quantization_config); else one of QUANTIZATION_METHODS.
    quantization: Optional[str] = None
    # The LM head quantized too (FP8 only: --quantization fp8 or an FP8 checkpoint,
    # whose head stays in bf16 otherwise, as in vLLM); checked against the resolved
    # scheme when the model loads.
    quantize_lm_head: bool = False

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        if self.quantization is not None:
            _check_choice("quantization", self.quantization, QUANTIZATION_METHODS)
        if not isinstance(self.quantize_lm_head, bool):
            raise _fail("quantize_lm_head", "a bool", self.quantize_lm_head)
        if self.quantize_lm_head and self.quantization not in (None, "fp8"):
            raise ValueError(f"quantize_lm_head quantizes the LM head to FP8: it needs "
                             f"--quantization fp8 (or an FP8 checkpoint), not "
                             f"{self.quantization}")
        _check_positive_int("max_model_len", self.max_model_len, 2)
        if not isinstance(self.seed, int):
            raise _fail("seed", "an integer", self.seed)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: Optional[int] = None  # bytes; sizes the pool directly (CPU default 1 GiB)
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: Optional[int] = None
    # KV offloading (vLLM's flag names): GiB of host memory for the CPU tier (None: off);
    # a directory and its size cap in GiB for a disk tier below it; an out-of-tree tier
    # "module.path:ClassName" (pagoda/worker/kv_tier_api.py). The lower tiers stage
    # through the CPU tier, so they need it.
    kv_offloading_size: Optional[float] = None
    kv_offloading_disk_path: Optional[str] = None
    kv_offloading_disk_size: Optional[float] = None
    kv_offloading_tier: Optional[str] = None
    # "tier=GB/s,...": load bandwidths the cost model takes as given instead of measuring
    # them ("inf": always load that tier's hits; core/kv_cost.py). None: all measured.
    kv_offloading_bandwidth: Optional[str] = None
    # "auto": the model's dtype; "fp8" / "fp8_e4m3": float8 e4m3 entries, one K and one
    # V scale per layer (the GPU needs FP8: compute capability >= 8.9; checked by the worker).
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _check_choice("block_size", self.block_size, BLOCK_SIZES)
        _check_choice("kv_cache_dtype", self.cache_dtype, KV_CACHE_DTYPES)
        if self.cache_dtype == "fp8_e5m2":
            raise ValueError("kv_cache_dtype fp8_e5m2 is not supported: Pagoda stores FP8 KV "
                             "as e4m3 with per-layer scales; use kv_cache_dtype fp8 (or fp8_e4m3)")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise _fail("gpu_memory_utilization", "in (0, 1]", self.gpu_memory_utilization)
        _check_positive_int("kv_cache_memory", self.kv_cache_memory)
        _check_positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override)
        _check_offloading(self)

    @property
    def kv_offloading(self) -> bool:
        return self.kv_offloading_size is not None


def parse_tier_bandwidths(text) -> dict[str, float]:
    """"cpu=20,disk=0.5" -> {"cpu": 20e9, "disk": 0.5e9} (bytes/s; "inf" allowed)."""
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


def _check_offloading(cache: "CacheConfig") -> None:
    for name in ("kv_offloading_size", "kv_offloading_disk_size"):
        value = getattr(cache, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not value > 0):
            raise _fail(name, "a number of GiB > 0", value)
    if (cache.kv_offloading_disk_path is None) != (cache.kv_offloading_disk_size is None):
        raise ValueError("kv_offloading_disk_path and kv_offloading_disk_size go together: "
                         "the disk tier needs a directory and a size cap")
    if cache.kv_offloading_tier is not None and (
            not isinstance(cache.kv_offloading_tier, str) or ":" not in cache.kv_offloading_tier):
        raise _fail("kv_offloading_tier", "'module.path:ClassName'", cache.kv_offloading_tier)
    if cache.kv_offloading_bandwidth is not None:
        parse_tier_bandwidths(cache.kv_offloading_bandwidth)
        if cache.kv_offloading_size is None:
            raise ValueError("kv_offloading_bandwidth tunes the KV offload tiers: set "
                             "kv_offloading_size too")
    lower = cache.kv_offloading_disk_path is not None or cache.kv_offloading_tier is not None
    if lower and cache.kv_offloading_size is None:
        raise ValueError("the disk and plugin KV tiers stage blocks through host memory: "
                         "set kv_offloading_size (GiB of CPU tier) too")
    if cache.kv_offloading_size is not None and not cache.enable_prefix_caching:
        raise ValueError("KV offloading keeps prefix-cache blocks: it needs enable_prefix_caching")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None  # None: 16384 on GPU, 4096 on CPU
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    # Schedule step N+1 while step N runs on the device (resolved: never None here).
    async_scheduling: bool = False

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

    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    # Small all-reduces on CUDA go one-shot over peer-mapped symmetric memory unless
    # this is set (then NCCL carries every size), as vLLM's flag of the same name.
    disable_custom_all_reduce: bool = False
    # MoE models: experts split whole across the tensor-parallel ranks (refused, once
    # the model is known, for a model without experts).
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.enable_expert_parallel, bool):
            raise _fail("enable_expert_parallel", "True or False", self.enable_expert_parallel)
        if self.tensor_parallel_size is None:
            raise _fail("tensor_parallel_size", "an integer >= 1", None)
        _check_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _check_choice("distributed_executor_backend", self.distributed_executor_backend,
                      DISTRIBUTED_EXECUTOR_BACKENDS)
        if not isinstance(self.disable_custom_all_reduce, bool):
            raise _fail("disable_custom_all_reduce", "True or False", self.disable_custom_all_reduce)


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    device: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        _check_choice("device", self.device, DEVICES)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` keys, plus Pagoda's own).

    method "ngram": prompt lookup over the request's prompt + output
    (prompt_lookup_min / prompt_lookup_max: the n-gram sizes tried, longest first);
    "layer_skip": the target's first num_layers layers + its final norm and LM head
    draft greedily; "draft_model": a second model (`model`) with the target's vocabulary.
    num_speculative_tokens: drafts proposed per step at most (k).
    adaptive: pick each request's k per step from its acceptance and the step's load
    (pagoda.core.spec_budget); compute_bound_tokens: tokens per step from which the
    forward is compute-bound and drafts stop paying (None: per device, resolved at start).
    draft_confidence_threshold: a model drafter (layer_skip, draft_model) stops once its
    own probability of its next guess falls below this.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    num_layers: Optional[int] = None
    model: Optional[str] = None
    draft_confidence_threshold: Optional[float] = None
    adaptive: bool = True
    compute_bound_tokens: Optional[int] = None

    # Which optional keys each method takes (others are refused, never ignored).
    _METHOD_KEYS = {"ngram": ("prompt_lookup_min", "prompt_lookup_max"),
                    "layer_skip": ("num_layers", "draft_confidence_threshold"),
                    "draft_model": ("model", "draft_confidence_threshold")}

    def __post_init__(self) -> None:
        _check_choice("speculative_config method", self.method, SPEC_METHODS)
        if self.num_speculative_tokens is None:
            raise _fail("num_speculative_tokens", "an integer >= 1", None)
        _check_positive_int("num_speculative_tokens", self.num_speculative_tokens)
        own = self._METHOD_KEYS.get(self.method, ())
        for key in dict.fromkeys(k for keys in self._METHOD_KEYS.values() for k in keys):
            if key not in own and getattr(self, key) is not None:
                owners = [m for m, keys in self._METHOD_KEYS.items() if key in keys]
                raise ValueError(f"speculative_config key {key!r} belongs to method "
                                 f"{' / '.join(map(repr, owners))}, not {self.method!r}")
        if not isinstance(self.adaptive, bool):
            raise _fail("speculative_config adaptive", "true or false", self.adaptive)
        _check_positive_int("compute_bound_tokens", self.compute_bound_tokens)
        getattr(self, f"_check_{self.method}")()

    def _check_ngram(self) -> None:
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            _check_positive_int(key, getattr(self, key))
        if (self.prompt_lookup_min is None or self.prompt_lookup_max is None
                or self.prompt_lookup_min > self.prompt_lookup_max):
            raise ValueError("ngram speculation needs 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max, got {self.prompt_lookup_min} and "
                             f"{self.prompt_lookup_max}")

    def _check_layer_skip(self) -> None:
        if self.num_layers is None:
            raise ValueError("layer_skip speculation needs num_layers (the target's first "
                             "layers that draft)")
        _check_positive_int("num_layers", self.num_layers)
        self._check_confidence()

    def _check_draft_model(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("draft_model speculation needs 'model' (a path or preset)")
        self._check_confidence()

    def _check_confidence(self) -> None:
        threshold = self.draft_confidence_threshold
        if threshold is not None and (isinstance(threshold, bool)
                                      or not isinstance(threshold, (int, float))
                                      or not 0.0 <= threshold < 1.0):
            raise _fail("draft_confidence_threshold", "a number in [0, 1)", threshold)

    @classmethod
    def from_dict(cls, values: dict) -> "SpeculativeConfig":
        """From vLLM-style JSON keys; unknown keys are refused. Without "method", a
        "model" means a draft model ("ngram" / "[ngram]" as model: vLLM's old spelling)."""
        if not isinstance(values, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(values).__name__}")
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - allowed)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s): {', '.join(unknown)}; "
                             f"supported: {', '.join(sorted(allowed))}")
        values = dict(values)
        if values.get("model") in ("ngram", "[ngram]") and values.get("method", "ngram") == "ngram":
            values.pop("model")
            values["method"] = "ngram"
        if "method" not in values:
            if values.get("model") is None:
                raise ValueError("speculative_config needs 'method' (one of "
                                 f"{', '.join(SPEC_METHODS)}) or a draft 'model'")
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
        if self.method == "layer_skip" and self.num_layers >= num_target_layers:
            raise ValueError(f"layer_skip num_layers ({self.num_layers}) must be smaller than "
                             f"the target's {num_target_layers} layers")


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    """reasoning_parser: how outputs mark their thinking (<think>...</think>), so that
    grammars start after it and thinking budgets can end it; thinking_token_budget: the
    budget of requests that set none (None: unlimited)."""

    reasoning_parser: Optional[str] = None
    thinking_token_budget: Optional[int] = None

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None:
            _check_choice("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)
        _check_positive_int("thinking_token_budget", self.thinking_token_budget, 0)
        if self.thinking_token_budget is not None and self.reasoning_parser is None:
            raise ValueError("thinking_token_budget needs a reasoning_parser "
                             f"({', '.join(REASONING_PARSERS)})")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig
    speculative: Optional[SpeculativeConfig] = None  # None: speculative decoding off
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return torch.cuda.is_available()


def _cuda_device_count() -> int:
    import torch
    return torch.cuda.device_count()


def _check_gpus_for_tp(tensor_parallel_size: int) -> None:
    """On CUDA, one GPU per tensor-parallel rank must be visible to this process."""
    if tensor_parallel_size > 1:
        present = _cuda_device_count()
        if tensor_parallel_size > present:
            raise ValueError(f"tensor_parallel_size is {tensor_parallel_size} but only "
                             f"{present} CUDA GPU(s) are visible (one GPU per rank)")


@dataclass
class EngineArgs:
    """Flat keyword arguments (vLLM's names), turned into an EngineConfig."""

    model: Optional[str] = None
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    max_model_len: Optional[int] = None
    seed: int = 0
    load_format: str = "auto"
    served_model_name: Optional[str] = None
    chat_template: Optional[str] = None
    skip_tokenizer_init: bool = False
    revision: Optional[str] = None
    download_dir: Optional[str] = None
    quantization: Optional[str] = None
    quantize_lm_head: bool = False
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: Optional[int] = None
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: Optional[int] = None
    kv_offloading_size: Optional[float] = None
    kv_offloading_disk_path: Optional[str] = None
    kv_offloading_disk_size: Optional[float] = None
    kv_offloading_tier: Optional[str] = None
    kv_offloading_bandwidth: Optional[str] = None
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    scheduling_policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    disable_custom_all_reduce: bool = False
    enable_expert_parallel: bool = False
    device: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    # Overlap the host's scheduling and output processing with the device's forward
    # (vLLM's async scheduling). None: on for CUDA, off for CPU (no overlap to win).
    async_scheduling: Optional[bool] = None
    # Speculative decoding, vLLM's JSON keys (SpeculativeConfig.from_dict); None: off.
    speculative_config: Optional[dict] = None
    reasoning_parser: Optional[str] = None
    thinking_token_budget: Optional[int] = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        unknown = sorted(set(kwargs) - cls.field_names())
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}; "
                            f"supported: {', '.join(sorted(cls.field_names()))}")
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        device = self.device
        if device == "auto":
            device = "cuda" if _cuda_available() else "cpu"
        elif device == "cuda" and not _cuda_available():
            raise ValueError("device is 'cuda' but no CUDA GPU is available; use device='cpu'")
        budget = self.max_num_batched_tokens or (
            GPU_MAX_NUM_BATCHED_TOKENS if device == "cuda" else CPU_MAX_NUM_BATCHED_TOKENS)
        if self.async_scheduling not in (None, True, False):
            raise _fail("async_scheduling", "True, False or None (auto)", self.async_scheduling)
        async_scheduling = device == "cuda" if self.async_scheduling is None else self.async_scheduling
        parallel = ParallelConfig(self.tensor_parallel_size, self.distributed_executor_backend,
                                  disable_custom_all_reduce=self.disable_custom_all_reduce,
                                  enable_expert_parallel=self.enable_expert_parallel)
        if device == "cuda" and parallel.distributed_executor_backend != "ray":
            # Ray's ranks may be on other machines: its executor checks the cluster's GPUs.
            _check_gpus_for_tp(parallel.tensor_parallel_size)
        if self.kv_offloading_size is not None and parallel.tensor_parallel_size > 1:
            raise ValueError("KV offloading supports tensor_parallel_size 1 for now (each rank "
                             "would need its own tiers, and the scheduler every rank's reports)")
        kv_memory = self.kv_cache_memory
        if kv_memory is None and device == "cpu":
            kv_memory = CPU_KV_CACHE_MEMORY
        return EngineConfig(
            model=ModelConfig(self.model, self.tokenizer, self.dtype, self.max_model_len,
                              self.seed, self.load_format, self.served_model_name,
                              self.chat_template, self.skip_tokenizer_init, self.revision,
                              self.download_dir, quantization=self.quantization,
                              quantize_lm_head=self.quantize_lm_head),
            cache=CacheConfig(self.block_size, self.gpu_memory_utilization, kv_memory,
                              self.enable_prefix_caching, self.num_gpu_blocks_override,
                              self.kv_offloading_size, self.kv_offloading_disk_path,
                              self.kv_offloading_disk_size, self.kv_offloading_tier,
                              kv_offloading_bandwidth=self.kv_offloading_bandwidth,
                              cache_dtype=self.kv_cache_dtype),
            scheduler=SchedulerConfig(self.max_num_seqs, budget, self.scheduling_policy,
                                      self.enable_chunked_prefill, async_scheduling),
            parallel=parallel,
            device=DeviceConfig(device, self.attention_backend, self.enforce_eager),
            speculative=(None if self.speculative_config is None
                         else SpeculativeConfig.from_dict(self.speculative_config)),
            structured_outputs=StructuredOutputsConfig(self.reasoning_parser,
                                                       self.thinking_token_budget),
        )
