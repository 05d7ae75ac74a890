"""The engine's flags, each defined once.

Owns every engine flag's name, type, default, help, choices and CLI extras (short
alias, metavar, argparse group, a parser for values given as text), written as
dataclass field metadata on `EngineFlags`, the base of `pagoda.config.EngineArgs`.
`pagoda.config` takes the nested configs' defaults from here and validates;
`pagoda.entrypoints.cli_args.add_engine_args` generates the argparse flags from here.
Also owns the value sets the flags choose from and the parsing of sizes ("2GiB").
Stdlib only: the torch-free core imports it through pagoda.config.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
# --quantization, vLLM's names (pagoda.model.quant.registry says what each means), and
# "none": float weights, a GGUF file's blocks expanded. A checkpoint's own
# quantization_config ("fp8", "compressed-tensors") needs no flag.
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "int8", "int4", "gguf", "none")
DEVICES = ("auto", "cpu", "cuda")
POLICIES = ("fcfs", "priority")
ATTENTION_BACKENDS = ("auto", "torch_ref", "triton")
BLOCK_SIZES = (8, 16, 32, 64)
# KV cache storage (vLLM's --kv-cache-dtype): "auto" = the model's dtype; "fp8" and
# "fp8_e4m3" = float8 e4m3 with a per-layer K and V scale. fp8_e5m2 is named so it can
# be refused with a reason rather than as an unknown value.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# "mp": one worker process per GPU on this host; "ray": one Ray actor per GPU, on the
# hosts of a Ray cluster (pagoda.executor.ray_executor; needs the ray extra).
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
# pagoda.structured.reasoning.REASONING_PARSERS holds what each one means.
REASONING_PARSERS = ("deepseek_r1", "qwen3")

# argparse groups of `pagoda generate/chat/serve --help`, in the order shown.
FLAG_GROUPS = (
    "model and weights",
    "KV cache",
    "scheduling",
    "parallelism",
    "runtime",
    "model in the API",
)

GIB = 1 << 30
# A size's unit, lower case: decimal kB/MB/GB/TB, binary KiB/MiB/GiB/TiB, and K/M/G/T
# as shorthand for the binary ones (as in `docker --memory 2g`).
SIZE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "t": 1 << 40,
}
_SIZE = re.compile(r"\s*((?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*")


def parse_size(text: str, bare_unit: int) -> float:
    """Bytes in a size such as "2GiB", "512MiB", "1.5GB" or "1e9"; a bare number is
    counted in bare_unit bytes. ValueError (naming no flag) if it is not one."""
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if match is not None:
        number, unit = match.groups()
        multiplier = SIZE_UNITS.get(unit.lower()) if unit else bare_unit
        if multiplier:
            return float(number) * multiplier
    raise ValueError(f"cannot read {text!r} as a size; use e.g. 2GiB or 512MiB")


def parse_bytes(text: str) -> int:
    """A size in bytes; a bare number is bytes."""
    return round(parse_size(text, 1))


def parse_gib(text: str) -> float:
    """A size in GiB; a bare number is GiB."""
    return parse_size(text, GIB) / GIB


def parse_json_object(text: str) -> dict:
    """A JSON object given as text."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object ({...})")
    return value


def flag(
    default: Any,
    help: str,
    *,
    group: str,
    choices: tuple | None = None,
    alias: str | None = None,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """An engine flag: a field of EngineFlags with its CLI description in metadata.

    The CLI flag is --name-with-dashes (plus `alias`, e.g. "-tp"), in argparse group
    `group`. Its type comes from the field's annotation, unless `parse` turns the text
    into the value (a ValueError from it is the flag's error message; the Python API
    applies it to a str too). A bool flag whose default is False is a switch
    (store_true); one defaulting to True or None (auto) takes --no-name too.
    """
    if group not in FLAG_GROUPS:
        raise ValueError(f"unknown flag group {group!r}")
    return dataclasses.field(
        default=default,
        metadata={
            "help": help,
            "group": group,
            "choices": choices,
            "alias": alias,
            "metavar": metavar,
            "parse": parse,
        },
    )


_MODEL, _KV, _SCHED, _PAR, _RUN, _API = FLAG_GROUPS


@dataclass
class EngineFlags:
    """Every engine flag (vLLM's names) with its default; see `flag` for the metadata.
    Grouped as in --help; keyword use only (the order is not an API)."""

    # model and weights
    model: str | None = flag(
        None,
        "GGUF file, Hugging Face directory or hub id (org/name), or a preset name with "
        "--load-format dummy (default: the embedded SmolLM2-135M-Instruct)",
        group=_MODEL,
    )
    revision: str | None = flag(
        None, "branch, tag or commit of a hub model (default: main)", group=_MODEL
    )
    download_dir: str | None = flag(
        None,
        "cache directory for hub models (default: $HF_HUB_CACHE, else $HF_HOME/hub, "
        "else ~/.cache/huggingface/hub)",
        group=_MODEL,
    )
    tokenizer: str | None = flag(
        None, "tokenizer path or hub id (default: the model's)", group=_MODEL
    )
    skip_tokenizer_init: bool = flag(
        False, "load no tokenizer: prompts and outputs are token ids only", group=_MODEL
    )
    dtype: str = flag(
        "auto",
        "weights and activations dtype (auto: float32 on CPU, bfloat16 on GPU)",
        group=_MODEL,
        choices=DTYPES,
    )
    max_model_len: int | None = flag(
        None, "maximum context length, prompt plus output (default: the model's)", group=_MODEL
    )
    seed: int = flag(0, "random seed of the engine", group=_MODEL)
    load_format: str = flag(
        "auto",
        "how to load weights; dummy makes random weights of the model's shape",
        group=_MODEL,
        choices=LOAD_FORMATS,
    )
    quantization: str | None = flag(
        None,
        "quantize the weights: fp8 (W8A8 on Hopper/Ada GPUs, from a float checkpoint at "
        "load time), int8 or int4 (CPU), gguf (CPU: keep the GGUF file's Q4_0/Q4_1/Q8_0 "
        "blocks), none (float weights: a GGUF file's blocks expanded to --dtype, the "
        "slower path on the CPU); default: as the checkpoint says (an FP8 or "
        "compressed-tensors checkpoint is read as such; a GGUF file keeps its blocks on "
        "the CPU for a dense model, and is expanded to float on a GPU or for MoE/MLA)",
        group=_MODEL,
        choices=QUANTIZATION_METHODS,
        alias="-q",
    )
    quantize_lm_head: bool = flag(
        False,
        "with fp8: quantize the LM head too (per-channel FP8, at load time); by default "
        "it stays in bf16, as in vLLM. Faster small-batch decode (the head is the largest "
        "single weight read per step), at some logprob error (docs/performance.md)",
        group=_MODEL,
    )

    # KV cache
    block_size: int = flag(16, "tokens per KV cache block", group=_KV, choices=BLOCK_SIZES)
    gpu_memory_utilization: float = flag(
        0.9, "fraction of GPU memory for weights, activations and KV cache", group=_KV
    )
    kv_cache_memory: int | str | None = flag(
        None,
        "size of the KV cache, sizing the pool directly: 2GiB, 512MiB, 1.5GB, 1e9; a "
        "bare number is bytes (default: from --gpu-memory-utilization on GPU, 1GiB on CPU)",
        group=_KV,
        metavar="SIZE",
        parse=parse_bytes,
    )
    kv_cache_dtype: str = flag(
        "auto",
        "KV cache storage: auto (the model's dtype), or fp8 / fp8_e4m3 (float8 e4m3 "
        "with a per-layer K and V scale, 1.0 unless the checkpoint has k_scale / v_scale: "
        "twice the tokens in the same memory; GPUs with FP8, compute capability >= 8.9, or "
        "the CPU). fp8_e5m2 is refused",
        group=_KV,
        choices=KV_CACHE_DTYPES,
    )
    num_gpu_blocks_override: int | None = flag(
        None, "number of KV blocks, overriding the memory-based sizing", group=_KV
    )
    enable_prefix_caching: bool = flag(
        True, "reuse KV blocks of identical prompt prefixes", group=_KV
    )
    kv_offloading_size: float | str | None = flag(
        None,
        "host memory for a CPU tier of the KV cache: blocks evicted from the GPU are "
        "kept there and loaded back on a prefix hit; e.g. 16GiB or 512MiB, a bare number is "
        "GiB (default: no CPU tier)",
        group=_KV,
        metavar="SIZE",
        parse=parse_gib,
    )
    kv_offloading_disk_path: str | None = flag(
        None,
        "directory of a disk tier below the CPU tier (kept across restarts; one server "
        "per directory)",
        group=_KV,
        metavar="DIR",
    )
    kv_offloading_disk_size: float | str | None = flag(
        None,
        "size cap of the disk tier (least recently used blocks go first); e.g. 100GiB, "
        "a bare number is GiB",
        group=_KV,
        metavar="SIZE",
        parse=parse_gib,
    )
    kv_offloading_tier: str | None = flag(
        None,
        "an out-of-tree KV tier below the CPU tier, a subclass of "
        "pagoda.kv_offload.tier_api.KVTier",
        group=_KV,
        metavar="MODULE:CLASS",
    )
    kv_offloading_bandwidth: str | None = flag(
        None,
        "load bandwidths (GB/s) the KV tiers' cost model takes as given instead of "
        "measuring, e.g. disk=2 ('inf': always load that tier's hits); a hit is loaded only "
        "when that beats recomputing it",
        group=_KV,
        metavar="TIER=GBPS,...",
    )

    # scheduling
    max_num_seqs: int = flag(256, "maximum number of sequences running in one step", group=_SCHED)
    max_num_batched_tokens: int | None = flag(
        None, "token budget per step (default 16384 on GPU, 4096 on CPU)", group=_SCHED
    )
    scheduling_policy: str = flag(
        "fcfs",
        "order of service: first come first served, or by request priority",
        group=_SCHED,
        choices=POLICIES,
    )
    enable_chunked_prefill: bool = flag(True, "split long prompts across steps", group=_SCHED)

    # parallelism
    tensor_parallel_size: int = flag(
        1,
        "number of GPUs (one process each) the model is split across; the model's "
        "attention heads must split evenly over them",
        group=_PAR,
        alias="-tp",
    )
    distributed_executor_backend: str = flag(
        "mp",
        "how tensor-parallel workers are started: mp (one process per GPU on this "
        "machine), or ray (one Ray actor per GPU, on the machines of the Ray cluster at "
        "$RAY_ADDRESS, else a local one; needs pip install 'pagoda[ray]')",
        group=_PAR,
        choices=DISTRIBUTED_EXECUTOR_BACKENDS,
    )
    disable_custom_all_reduce: bool = flag(
        False,
        "send every tensor-parallel all-reduce through NCCL (by default small ones on "
        "CUDA go one-shot over peer-mapped GPU memory)",
        group=_PAR,
    )
    enable_expert_parallel: bool = flag(
        False,
        "MoE models: split the experts whole across the tensor-parallel ranks instead "
        "of splitting every expert (refused for dense models)",
        group=_PAR,
    )

    # runtime
    device: str = flag("auto", "where to run", group=_RUN, choices=DEVICES)
    attention_backend: str = flag(
        "auto",
        "attention implementation (auto: triton on GPU, torch_ref on CPU)",
        group=_RUN,
        choices=ATTENTION_BACKENDS,
    )
    enforce_eager: bool = flag(False, "never use CUDA graphs", group=_RUN)
    # Overlap the host's scheduling and output processing with the device's forward
    # (vLLM's async scheduling). None: on for CUDA, off for CPU (no overlap to win).
    async_scheduling: bool | None = flag(
        None,
        "schedule the next step while the device runs this one (default: on with CUDA, off on CPU)",
        group=_RUN,
    )
    # SpeculativeConfig.from_dict's keys; None: off.
    speculative_config: dict | None = flag(
        None,
        'speculative decoding as JSON, vLLM\'s keys, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' or \'{"model": DRAFT, "num_speculative_tokens": 4}\' '
        "(methods: ngram, layer_skip, draft_model, mtp; default: off)",
        group=_RUN,
        parse=parse_json_object,
    )

    # model in the API
    served_model_name: str | None = flag(
        None, "model name in the API (default: --model as given, e.g. its hub id)", group=_API
    )
    chat_template: str | None = flag(
        None, "a Jinja chat template (file path or inline) instead of the model's", group=_API
    )
    reasoning_parser: str | None = flag(
        None,
        "the model thinks in <think>...</think>: reasoning_content apart from content, "
        "grammars start after the thinking, thinking budgets apply",
        group=_API,
        choices=REASONING_PARSERS,
    )
    thinking_token_budget: int | None = flag(
        None,
        "thinking tokens after which </think> is forced, for requests that set no "
        "thinking_token_budget (needs --reasoning-parser; default: none)",
        group=_API,
    )


ENGINE_FLAGS = {f.name: f for f in dataclasses.fields(EngineFlags)}


def flag_default(name: str) -> Any:
    """The default of engine flag `name` (KeyError for an unknown one)."""
    return ENGINE_FLAGS[name].default


def cli_flag(name: str) -> str:
    """The CLI spelling of engine flag (or field) `name`: --name-with-dashes."""
    return "--" + name.replace("_", "-")
