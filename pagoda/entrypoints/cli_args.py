"""Engine flags shared by every CLI subcommand, with vLLM's names, and sampling flags."""

from __future__ import annotations

import argparse

from pagoda.config import (ATTENTION_BACKENDS, BLOCK_SIZES, DEVICES,
                           DISTRIBUTED_EXECUTOR_BACKENDS, DTYPES, KV_CACHE_DTYPES,
                           LOAD_FORMATS, POLICIES, QUANTIZATION_METHODS,
                           REASONING_PARSERS, EngineArgs, _cuda_available)
from pagoda.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (EngineArgs' fields), in groups by what they set."""
    _add_model_args(parser.add_argument_group("model and weights"))
    _add_kv_cache_args(parser.add_argument_group("KV cache"))
    _add_scheduling_args(parser.add_argument_group("scheduling"))
    _add_parallel_args(parser.add_argument_group("parallelism"))
    _add_runtime_args(parser.add_argument_group("runtime"))
    _add_api_model_args(parser.add_argument_group("model in the API"))


def _add_model_args(g) -> None:
    g.add_argument("--model", default=None,
                   help="GGUF file, Hugging Face directory or hub id (org/name), or a preset "
                        "name with --load-format dummy (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    g.add_argument("--revision", default=None,
                   help="branch, tag or commit of a hub model (default: main)")
    g.add_argument("--download-dir", default=None,
                   help="cache directory for hub models (default: $HF_HUB_CACHE, else "
                        "$HF_HOME/hub, else ~/.cache/huggingface/hub)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer path or hub id (default: the model's)")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: prompts and outputs are token ids only")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights and activations dtype (auto: float32 on CPU, bfloat16 on GPU)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="maximum context length, prompt plus output (default: the model's)")
    g.add_argument("--seed", type=int, default=0, help="random seed of the engine")
    g.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="how to load weights; dummy makes random weights of the model's shape")
    g.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                   help="quantize the weights: fp8 (W8A8 on Hopper/Ada GPUs, from a float "
                        "checkpoint at load time), int8 or int4 (CPU), gguf (CPU: keep the "
                        "GGUF file's Q4_0/Q4_1/Q8_0 blocks); default: as the checkpoint says "
                        "(an FP8 or compressed-tensors checkpoint is read as such)")
    g.add_argument("--quantize-lm-head", action="store_true",
                   help="with fp8: quantize the LM head too (per-channel FP8, at load time); "
                        "by default it stays in bf16, as in vLLM. Faster small-batch decode "
                        "(the head is the largest single weight read per step), at some "
                        "logprob error (docs/performance.md)")


def _add_kv_cache_args(g) -> None:
    g.add_argument("--block-size", type=int, default=16, choices=BLOCK_SIZES,
                   help="tokens per KV cache block")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights, activations and KV cache")
    g.add_argument("--kv-cache-memory", type=int, default=None,
                   help="bytes of KV cache (sizes the pool directly; CPU default 1 GiB)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache storage: auto (the model's dtype), or fp8 / fp8_e4m3 "
                        "(float8 e4m3 with a per-layer K and V scale, 1.0 unless the "
                        "checkpoint has k_scale / v_scale: twice the tokens in the same "
                        "memory; GPUs with FP8, compute capability >= 8.9, or the CPU). "
                        "fp8_e5m2 is refused")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="number of KV blocks, overriding the memory-based sizing")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of identical prompt prefixes")
    g.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                   help="GiB of host memory for a CPU tier of the KV cache: blocks evicted "
                        "from the GPU are kept there and loaded back on a prefix hit")
    g.add_argument("--kv-offloading-disk-path", default=None, metavar="DIR",
                   help="directory of a disk tier below the CPU tier (kept across restarts; "
                        "one server per directory)")
    g.add_argument("--kv-offloading-disk-size", type=float, default=None, metavar="GIB",
                   help="size cap of the disk tier in GiB (least recently used blocks go first)")
    g.add_argument("--kv-offloading-tier", default=None, metavar="MODULE:CLASS",
                   help="an out-of-tree KV tier below the CPU tier, a subclass of "
                        "pagoda.worker.kv_tier_api.KVTier")
    g.add_argument("--kv-offloading-bandwidth", default=None, metavar="TIER=GBPS,...",
                   help="load bandwidths (GB/s) the KV tiers' cost model takes as given "
                        "instead of measuring, e.g. disk=2 ('inf': always load that tier's "
                        "hits); a hit is loaded only when that beats recomputing it")


def _add_scheduling_args(g) -> None:
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="maximum number of sequences running in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (default 16384 on GPU, 4096 on CPU)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=POLICIES,
                   help="order of service: first come first served, or by request priority")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True, help="split long prompts across steps")


def _add_parallel_args(g) -> None:
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="number of GPUs (one process each) the model is split across; the "
                        "model's attention heads must split evenly over them")
    g.add_argument("--distributed-executor-backend", default="mp",
                   choices=DISTRIBUTED_EXECUTOR_BACKENDS,
                   help="how tensor-parallel workers are started: mp (one process per GPU "
                        "on this machine), or ray (one Ray actor per GPU, on the machines of "
                        "the Ray cluster at $RAY_ADDRESS, else a local one; needs "
                        "pip install 'pagoda[ray]')")
    g.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="send every tensor-parallel all-reduce through NCCL (by default "
                        "small ones on CUDA go one-shot over peer-mapped GPU memory)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: split the experts whole across the tensor-parallel "
                        "ranks instead of splitting every expert (refused for dense models)")


def _add_runtime_args(g) -> None:
    g.add_argument("--device", default="auto", choices=DEVICES, help="where to run")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="attention implementation (auto: triton on GPU, torch_ref on CPU)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="never use CUDA graphs")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step while the device runs this one "
                        "(default: on with CUDA, off on CPU)")
    g.add_argument("--speculative-config", type=_json_object, default=None,
                   help='speculative decoding as JSON, vLLM\'s keys, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' or \'{"model": DRAFT, '
                        '"num_speculative_tokens": 4}\' (methods: ngram, layer_skip, '
                        'draft_model; default: off)')


def _add_api_model_args(g) -> None:
    g.add_argument("--served-model-name", default=None,
                   help="model name in the API (default: --model as given, e.g. its hub id)")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (file path or inline) instead of the model's")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="the model thinks in <think>...</think>: reasoning_content apart from "
                        "content, grammars start after the thinking, thinking budgets apply")
    g.add_argument("--thinking-token-budget", type=int, default=None,
                   help="thinking tokens after which </think> is forced, for requests that "
                        "set no thinking_token_budget (needs --reasoning-parser; default: none)")


def _json_object(text: str) -> dict:
    """A flag's JSON object (argparse reports the ValueError as an invalid value)."""
    import json
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object ({...})")
    return value


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    """EngineArgs from the parsed flags; a flag the machine cannot honour is a ValueError
    that names the flag to use instead (the CLI prints it as one line)."""
    if getattr(ns, "device", None) == "cuda" and not _cuda_available():
        raise ValueError("--device cuda: no CUDA GPU is available on this machine; "
                         "use --device cpu (or leave --device out to pick automatically)")
    chat_template = ns.chat_template
    if chat_template is not None:
        import os
        if os.path.isfile(chat_template):
            with open(chat_template, encoding="utf-8") as f:
                chat_template = f.read()
    values = {name: getattr(ns, name) for name in EngineArgs.field_names() if hasattr(ns, name)}
    values["chat_template"] = chat_template
    return EngineArgs(**values)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.7, help="0 means greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max prob")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="1.0 means off")
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of this request")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")


def sampling_params_from_namespace(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                          top_k=ns.top_k, min_p=ns.min_p, repetition_penalty=ns.repetition_penalty,
                          seed=ns.sampling_seed, stop=ns.stop, ignore_eos=ns.ignore_eos)
