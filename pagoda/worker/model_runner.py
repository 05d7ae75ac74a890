"""ModelRunner: owns the model, the KV cache pool and the per-request state on one device.

execute_model_async(SchedulerOutput) -> AsyncRunnerOutput: apply the scheduler's diff,
build the flattened step inputs, run the forward inside the forward context and
sample, all without waiting for the device; the sampled ids come back through one
queued device-to-host copy (`AsyncRunnerOutput.result()`). execute_model() is the
same followed by result().
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from pagoda.attention.backend import AttentionBackend
from pagoda.attention.forward_context import forward_context
from pagoda.config import EngineConfig
from pagoda.core.kv_cache_spec import KVCacheConfig, num_blocks_for_budget
from pagoda.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagoda.model.layers.attention import kv_cache_specs
from pagoda.sample.logprobs import compute_token_logprobs, pack_token_logprobs
from pagoda.sample.metadata import (PendingOutputs, SamplingRow, build_sampling_metadata,
                                    make_generator, token_seed)
from pagoda.sample.sampler import Sampler
from pagoda.host_copy import host_to_device
from pagoda.worker.block_table import DeviceBlockTable
from pagoda.worker.input_batch import (CachedRequestState, PrevSampled, StepInputs,
                                       apply_scheduler_output, build_step_inputs)
from pagoda.worker.shape_buckets import eager_tokens_bucket, logits_rows_bucket
from pagoda.worker.step_output import AsyncRunnerOutput
from pagoda.worker.kv_pool import KVCachePool

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return _DTYPES[name]


def make_attention_backend(name: str, device: str, arch) -> AttentionBackend:
    scale = arch.head_dim ** -0.5
    args = (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, scale)
    if name == "auto":
        name = "triton" if device == "cuda" else "torch_ref"
    if name == "triton":
        from pagoda.attention.triton_backend import TritonBackend
        return TritonBackend(*args)
    from pagoda.attention.torch_ref import TorchRefBackend
    return TorchRefBackend(*args)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str) -> None:
        from pagoda.model.loader import load_model

        self.config = config
        self.device = torch.device(config.device.device)
        self.dtype = resolve_dtype(config.model.dtype, config.device.device)
        self.block_size = config.cache.block_size
        torch.manual_seed(config.model.seed)
        start = time.perf_counter()
        self.model, self.arch = load_model(model_path, config.model.load_format, self.dtype,
                                           self.device, config.model.seed)
        self.load_seconds = time.perf_counter() - start
        self.backend = make_attention_backend(config.device.attention_backend,
                                              config.device.device, self.arch)
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device).manual_seed(config.model.seed)
        self.states: dict[str, CachedRequestState] = {}
        self.kv_pool: Optional[KVCachePool] = None  # set by initialize_kv_cache
        self.num_blocks = 0
        self.graph_runner = None  # set when CUDA graphs are captured
        # The running requests' block ids on the device (CUDA; set with the KV cache).
        # On CPU the attention reads block tables on the host, so they are built there.
        self.block_table: Optional[DeviceBlockTable] = None
        self.warmup_seconds = 0.0
        # The last step's sampled ids, on the device, for tokens the host lacks yet.
        self._prev_sampled: Optional[PrevSampled] = None

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    # ---- start-up -------------------------------------------------------------------
    def determine_num_blocks(self, max_model_len: int) -> int:
        cache = self.config.cache
        specs = kv_cache_specs(self.model, self.block_size, self.dtype)
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if cache.kv_cache_memory is not None:
            budget = cache.kv_cache_memory
        else:
            budget = self._profile_kv_budget()
        return num_blocks_for_budget(budget, specs, max_model_len)

    def _profile_kv_budget(self) -> int:
        """GPU: what is left of gpu_memory_utilization after weights and a peak forward."""
        if self.device.type != "cuda":
            raise ValueError("kv_cache_memory must be set on CPU")
        from pagoda.worker.profiling import profile_kv_budget
        return profile_kv_budget(self)

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.num_blocks = num_blocks
        specs = kv_cache_specs(self.model, self.block_size, self.dtype)
        self.kv_pool = KVCachePool(KVCacheConfig(num_blocks, specs), self.device)
        if self.device.type == "cuda":
            self.block_table = DeviceBlockTable(self.config.scheduler.max_num_seqs,
                                                -(-max_model_len // self.block_size), self.device)
            from pagoda.worker.warmup import warm_up_kernels, warm_up_logits
            if self.backend.name == "triton":
                self.warmup_seconds = warm_up_kernels(self, max_model_len)
            self.warmup_seconds += warm_up_logits(self, logits_rows_bucket(
                self.config.scheduler.max_num_seqs))
        if self._use_cuda_graphs():
            from pagoda.worker.cuda_graph import CudaGraphRunner
            max_blocks = -(-max_model_len // self.block_size)
            self.graph_runner = CudaGraphRunner(self.model, self.backend, self.kv_pool,
                                                self.config.scheduler.max_num_seqs, max_blocks,
                                                self.device)
            self.graph_runner.capture()

    def _use_cuda_graphs(self) -> bool:
        return (self.device.type == "cuda" and not self.config.device.enforce_eager
                and self.backend.supports_cuda_graphs())

    # ---- one step -------------------------------------------------------------------
    def _make_generator(self, seed: int) -> torch.Generator:
        return make_generator(seed, self.device)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(out).result()

    @torch.inference_mode()
    def execute_model_async(self, out: SchedulerOutput) -> AsyncRunnerOutput:
        """Launches the step and returns without waiting for the device: no host sync.

        Tokens that the previous step sampled and the scheduler could not send yet
        (async scheduling) are read from that step's sampled ids on the device.
        """
        apply_scheduler_output(self.states, out, self._make_generator, self.block_table)
        if out.total_num_scheduled_tokens == 0:
            self._prev_sampled = None
            return AsyncRunnerOutput.empty()
        inputs = build_step_inputs(self.states, out, self.block_size, self.device,
                                   pad_to=self._eager_pad_to(out), prev=self._prev_sampled,
                                   block_table=self.block_table)
        graphs = self.graph_runner
        output_rows = None
        if graphs is not None and graphs.can_run(inputs.metadata, inputs.input_ids.shape[0]):
            hidden = graphs.run(inputs.input_ids, inputs.positions, inputs.metadata)
        else:
            output_rows = self._output_rows(inputs)
            step_metadata = self.backend.build_metadata(inputs.metadata)  # once per step
            with forward_context(self.backend, step_metadata, self.kv_pool):
                hidden = self.model(inputs.input_ids, inputs.positions, output_rows)
        sampled, packed_logprobs, wanted = self._sample(hidden, inputs,
                                                        compacted=output_rows is not None)
        prompt_logprobs = self._prompt_logprobs(hidden, inputs)
        self._prev_sampled = None if sampled is None else PrevSampled(
            sampled, {rid: i for i, rid in enumerate(inputs.sample_req_ids)})
        return AsyncRunnerOutput(inputs.req_ids, inputs.sample_req_ids, sampled,
                                 packed_logprobs, wanted, prompt_logprobs)

    def _eager_pad_to(self, out: SchedulerOutput) -> Optional[int]:
        """Rows of this step's forward on CUDA when it runs eagerly (shape_buckets);
        None for CPU and for decode-only steps a CUDA graph takes (it pads itself)."""
        if self.device.type != "cuda":
            return None
        n = out.total_num_scheduled_tokens
        if self.graph_runner is not None and self.graph_runner.takes(n, len(out.num_scheduled_tokens)):
            return None
        return eager_tokens_bucket(n, self.config.scheduler.max_num_batched_tokens)

    def _output_rows(self, inputs: StepInputs) -> Optional[torch.Tensor]:
        """The rows an eager forward's last layer computes (the model's output_rows): the
        sampled rows, bucketed. None (every row) when every row samples, when none does,
        or when prompt logprobs need the other rows too."""
        rows = inputs.sample_rows
        if (not rows or inputs.prompt_logprob_rows
                or len(rows) == inputs.metadata.num_actual_tokens):
            return None
        return host_to_device(self._bucketed(rows), torch.long, self.device)

    def _bucketed(self, rows: list[int]) -> list[int]:
        """On CUDA, rows padded (repeating the last) to a bucketed count: shape_buckets."""
        if self.device.type != "cuda":
            return rows
        return rows + [rows[-1]] * (logits_rows_bucket(len(rows)) - len(rows))

    def _sample(self, hidden: torch.Tensor, inputs: StepInputs, compacted: bool = False):
        """(sampled ids [B] on device, packed logprobs or None, logprobs asked per row).
        compacted: hidden holds only the (bucketed) sampled rows, in order."""
        if not inputs.sample_rows:
            return None, None, []
        if not compacted:
            rows_idx = host_to_device(self._bucketed(inputs.sample_rows), torch.long, self.device)
            hidden = hidden.index_select(0, rows_idx)
        logits = self.model.compute_logits(hidden)[: len(inputs.sample_rows)]
        rows = [self._sampling_row(req_id, inputs.pending_output)
                for req_id in inputs.sample_req_ids]
        metadata = build_sampling_metadata(rows, self.vocab_size, self.device, self.generator,
                                           pending_outputs=self._pending_outputs(inputs))
        out = self.sampler(logits, metadata)
        wanted = [r.params.logprobs for r in rows]
        if out.logprobs is None:
            return out.sampled_token_ids, None, wanted
        packed = pack_token_logprobs(out.logprobs_token_ids, out.logprobs, out.sampled_ranks)
        return out.sampled_token_ids, packed, wanted

    def _sampling_row(self, req_id: str, pending_output: dict[str, int]) -> SamplingRow:
        state = self.states[req_id]
        num_pending = int(req_id in pending_output)
        if state.generator is not None:  # a host-side re-seed: no device work, no sync
            num_outputs = len(state.output_token_ids) + num_pending
            state.generator.manual_seed(token_seed(state.params.seed, num_outputs))
        return SamplingRow(state.params, state.prompt_token_ids, state.output_token_ids,
                           state.generator, num_pending_outputs=num_pending)

    def _pending_outputs(self, inputs: StepInputs) -> Optional[PendingOutputs]:
        """The rows' output tokens that only the previous step's sampled ids hold."""
        if not inputs.pending_output:
            return None
        row_of = {rid: i for i, rid in enumerate(inputs.sample_req_ids)}
        pending = list(inputs.pending_output.items())
        return PendingOutputs([row_of[rid] for rid, _ in pending], [src for _, src in pending],
                              self._prev_sampled.token_ids)

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: StepInputs) -> dict[str, torch.Tensor]:
        """req_id -> packed prompt logprobs (on the device) of the rows this step computed."""
        result: dict[str, torch.Tensor] = {}
        for req_id, (first_row, positions) in inputs.prompt_logprob_rows.items():
            state = self.states[req_id]
            start = state.num_computed_tokens
            rows = host_to_device([first_row + p - start for p in positions], torch.long, self.device)
            targets = host_to_device([state.prompt_token_ids[p + 1] for p in positions],
                                     torch.long, self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            ids, lps, ranks = compute_token_logprobs(logits, targets, state.params.prompt_logprobs)
            result[req_id] = pack_token_logprobs(ids, lps, ranks)
        return result
