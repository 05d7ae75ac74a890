"""The parts an LLMEngine is built from, once its executor is up.

Owns resolving the model's path (a hub id becomes its cached snapshot, nothing the
embedded model), the context length, the tokenizer and the end-of-sequence id, and
building the scheduler's side of the engine: the draft planner of speculative decoding,
the KV offload tiers' manager (from the workers' inventory) and the Scheduler itself.
"""

from __future__ import annotations

import logging
import os

from pagoda.config import EngineConfig, ModelConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.outputs import ModelInfo
from pagoda.core.scheduler import Scheduler
from pagoda.executor.base import Executor

logger = logging.getLogger(__name__)


def resolve_model_path(model_config: ModelConfig) -> str:
    """The model's local path (a hub id becomes its cached snapshot) or preset name."""
    from pagoda.model.hub import resolve_model

    model = resolve_model(model_config)
    if model is None:
        from pagoda.model.tokenizer import embedded_model_path

        return str(embedded_model_path())
    return model


def resolve_max_model_len(config: EngineConfig, info: ModelInfo) -> int:
    """--max-model-len, or the model's own limit; larger than the model's is refused."""
    limit = info.max_position_embeddings
    wanted = config.model.max_model_len
    if wanted is None:
        return limit
    if wanted > limit:
        raise ValueError(
            f"max_model_len ({wanted}) is larger than the model's maximum context length ({limit})"
        )
    return wanted


def load_engine_tokenizer(config: EngineConfig, model_path: str):
    """The tokenizer of --tokenizer, else the model's own; None when tokenizer init is
    skipped or the model is a preset shape (dummy weights) with no tokenizer given."""
    from pagoda.model.tokenizer import load_tokenizer

    if config.model.skip_tokenizer_init:
        return None
    from pagoda.model.hub import resolve_tokenizer

    source = resolve_tokenizer(config.model) or model_path
    if config.model.tokenizer is None and not os.path.exists(source):
        return None  # a preset shape (dummy weights) has no tokenizer: token ids only
    return load_tokenizer(source, chat_template=config.model.chat_template)


def eos_token_id(tokenizer, info: ModelInfo) -> int | None:
    """The tokenizer's end-of-sequence id, else the model's first."""
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    eos = info.eos_token_id
    if isinstance(eos, (list, tuple)):
        return int(eos[0]) if eos else None
    return eos


def build_kv_offload(config: EngineConfig, executor: Executor, kv_cache_manager: KVCacheManager):
    """The scheduler's side of the KV offload tiers, from the worker's inventory
    (a disk tier starts with the blocks it kept from an earlier run); None when off."""
    if not config.cache.kv_offloading:
        return None
    from pagoda.kv_offload.planning.manager import KVOffloadManager
    from pagoda.kv_offload.planning.tiers import TierIndex, TierStack

    inventory = executor.collective_rpc("kv_offload_inventory")[0]
    tiers = [TierIndex(inventory.tiers[0].name, inventory.tiers[0].capacity, slotted=True)]
    for entry in inventory.tiers[1:]:
        tier = TierIndex(entry.name, entry.capacity, slotted=False)
        kept = tier.add_ready(entry.contents)
        if entry.contents:
            logger.info("KV tier %s: %d blocks kept from an earlier run", entry.name, kept)
        tiers.append(tier)
    from pagoda.config import parse_tier_bandwidths
    from pagoda.kv_offload.planning.cost import LoadCostModel

    bandwidth = config.cache.kv_offloading_bandwidth
    cost = LoadCostModel(
        [t.name for t in tiers],
        inventory.block_bytes,
        kv_cache_manager.block_size,
        inventory.prefill_sample,
        inventory.load_samples,
        parse_tier_bandwidths(bandwidth) if bandwidth else None,
    )
    return KVOffloadManager(
        kv_cache_manager,
        TierStack(tiers),
        inventory.max_blocks_per_step,
        cost,
        max_inline_blocks_per_step=inventory.max_inline_blocks_per_step,
    )


def build_scheduler(
    config: EngineConfig,
    info: ModelInfo,
    max_model_len: int,
    kv_cache_manager: KVCacheManager,
    kv_offload,
) -> Scheduler:
    """The Scheduler, with speculative decoding's draft planner when it is on (the
    planner is the scheduler's `draft_planner`)."""
    from pagoda.spec_decode.engine_setup import build_draft_planner

    sched = config.scheduler
    planner, lookahead = build_draft_planner(
        config.speculative,
        config.device.device,
        max_model_len,
        info.num_hidden_layers,
        info.draft_weight_bytes / max(info.weight_bytes, 1),
        async_scheduling=sched.async_scheduling,
    )
    token_budget = sched.max_num_batched_tokens
    assert token_budget is not None, "EngineArgs.create_engine_config resolves the budget"
    return Scheduler(
        kv_cache_manager,
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=token_budget,
        max_model_len=max_model_len,
        policy=sched.policy,
        enable_chunked_prefill=sched.enable_chunked_prefill,
        async_scheduling=sched.async_scheduling,
        num_lookahead_tokens=lookahead,
        draft_planner=planner,
        kv_offload=kv_offload,
    )
