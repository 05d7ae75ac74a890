"""ModelRunner: owns the model, the KV cache pool and the per-request state on one device.

The worker of the executor interface (pagoda.executor.base). A step is two calls, both
returning without waiting for the device:
- execute_model(SchedulerOutput): apply the scheduler's diff, build the flattened step
  inputs, run the forward inside the forward context (a CUDA graph for decode-only
  steps and for steps of up to 512 rows, worker/cuda_graph.py; a graph step's inputs
  are built on a side stream, beside the previous step's sampling:
  worker/input_stream.py);
- sample_tokens(StepExtras) -> AsyncRunnerOutput: compute the sampled rows' logits,
  apply what the engine learned after the launch (grammar bitmasks), sample, and queue
  one device-to-host copy of the results (`AsyncRunnerOutput.result()` waits for it).
A request verifying draft tokens samples one row per draft plus one; the host keeps
the longest matching prefix (pagoda.spec_decode.verify).

The penalties' history lives on the device between steps (worker/penalty_state.py):
created when a request enters, counted on the device after each single-row sample,
caught up from the host's kept tokens after a verify step. With `penalty_state` set
to None it is counted from the host's lists every step instead (the reference path).
What sampling takes from the request states, row by sampled row, is built by
worker/sampling_rows.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pagoda.attention.backend import AttentionBackend
from pagoda.attention.forward_context import forward_context
from pagoda.attention.kv_pool import KVCachePool
from pagoda.attention.kv_quant import resolve_kv_cache_dtype
from pagoda.attention.selector import make_attention_backend
from pagoda.config import EngineConfig
from pagoda.core.kv_cache_spec import KVCacheConfig, num_blocks_for_budget
from pagoda.core.outputs import ModelInfo, SchedulerOutput, StepExtras
from pagoda.kernels.launch.host_copy import host_to_device
from pagoda.model.dtypes import resolve_dtype
from pagoda.model.kernel_configs import KernelConfigs
from pagoda.model.layers.attention import kv_cache_specs
from pagoda.model.quant.registry import describe_weights
from pagoda.sample.logprobs import pack_token_logprobs
from pagoda.sample.metadata import (
    PendingOutputs,
    SamplingRow,
    build_sampling_metadata,
    make_generator,
)
from pagoda.sample.sampler import Sampler
from pagoda.sample.token_bitmask import apply_token_bitmask, stack_row_bitmasks
from pagoda.spec_decode.drafting import (
    draft_starts,
    feed_target_hidden,
    load_draft,
    make_drafter,
    reads_target_hidden,
    record_kept,
)
from pagoda.worker.block_table import DeviceBlockTable
from pagoda.worker.input_batch import (
    CachedRequestState,
    PrevSampled,
    StepInputs,
    apply_scheduler_output,
    build_step_inputs,
    fill_pending_tokens,
    single_row_index,
)
from pagoda.worker.input_stream import make_input_stream
from pagoda.worker.penalty_state import PenaltyState
from pagoda.worker.sampling_rows import (
    packed_prompt_logprobs,
    pending_outputs,
    sampling_rows,
    step_penalties,
)
from pagoda.worker.shape_buckets import eager_tokens_bucket, logits_rows_bucket
from pagoda.worker.staging import StagingRing
from pagoda.worker.step_output import AsyncRunnerOutput

logger = logging.getLogger(__name__)

# ModelRunner attributes holding device or pinned memory (or what references it),
# dropped by shutdown(); the graphs go before the pool and buffers they captured.
_RELEASED_ON_SHUTDOWN = (
    "graph_runner",
    "input_stream",
    "drafter",
    "draft",
    "_launched",
    "_prev_sampled",
    "_kv_report",
    "_kv_offload_inventory",
    "block_table",
    "staging",
    "penalty_state",
    "kv_pool",
    "sampler",
    "generator",
    "backend",
    "model",
)


@dataclass
class _LaunchedForward:
    """A step between its two calls: inputs None for an empty step."""

    inputs: StepInputs | None
    hidden: torch.Tensor | None
    compacted: bool  # hidden holds only the sampled rows (an eager output_rows forward)
    # Speculative decoding: req_id -> drafts the worker's drafter proposes after it.
    to_propose: dict[str, int] | None = None


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        rank: int = 0,
        kernel_configs: KernelConfigs | None = None,
    ) -> None:
        """rank: this worker's tensor-parallel rank; it builds and loads that share.
        kernel_configs: the kernels' configs (default: KernelConfigs.for_device of this
        worker's device; benchmarks pass named variants)."""
        from pagoda.model.loader import load_model
        from pagoda.model.parallel import TensorParallel

        self.config = config
        self.model_path = model_path
        self.device = torch.device(config.device.device)
        self.dtype = resolve_dtype(config.model.dtype, config.device.device)
        self.block_size = config.cache.block_size
        torch.manual_seed(config.model.seed)
        start = time.perf_counter()
        self.tp = TensorParallel(
            rank, config.parallel.tensor_parallel_size, config.parallel.enable_expert_parallel
        )
        self.model, self.arch = load_model(
            model_path,
            config.model.load_format,
            self.dtype,
            self.device,
            config.model.seed,
            self.tp,
            config.model.quantization,
            config.model.quantize_lm_head,
        )
        self.load_seconds = time.perf_counter() - start
        # What the KV pool stores: the model's dtype, or float8 e4m3 (kv_cache_dtype fp8).
        self.kv_dtype = resolve_kv_cache_dtype(
            config.cache.cache_dtype, self.dtype, self.device, is_mla=self.arch.mla is not None
        )
        self.kernel_configs = kernel_configs or KernelConfigs.for_device(self.device)
        self.kernel_configs.install(self.model)
        self.backend = self._make_backend()
        # A draft model (speculative decoding): loaded before the KV cache is sized,
        # since its layers take their share of every block.
        self.draft = load_draft(self)
        if self.draft is not None:
            self.kernel_configs.install(self.draft.model)
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device).manual_seed(config.model.seed)
        self.states: dict[str, CachedRequestState] = {}
        # Penalty history on the device; None: rebuilt from the host's lists each step.
        self.penalty_state: PenaltyState | None = PenaltyState(self.arch.vocab_size, self.device)
        self.kv_pool: KVCachePool | None = None  # set by initialize_kv_cache
        self.num_blocks = 0
        self.graph_runner = None  # set when CUDA graphs are captured
        # Graph steps' inputs built on a side stream (worker/input_stream.py); set with
        # the graphs.
        self.input_stream = None
        self.drafter = None  # a model drafter (speculative decoding), with the KV cache
        # The running requests' block ids on the device (CUDA; set with the KV cache).
        # On CPU the attention reads block tables on the host, so they are built there.
        self.block_table: DeviceBlockTable | None = None
        # Reused pinned buffers for the step inputs' uploads (nothing on CPU).
        self.staging = StagingRing(self.device)
        self.warmup_seconds = 0.0
        # The last step's sampled ids, on the device, for tokens the host lacks yet.
        self._prev_sampled: PrevSampled | None = None
        # The forward execute_model() launched, waiting for sample_tokens().
        self._launched: _LaunchedForward | None = None
        # KV offload tiers (worker/kv_offload.py): set with the KV cache when configured.
        self.kv_offload = None
        self._kv_offload_inventory = None
        self._kv_report = None  # this step's transfer report, handed out by sample_tokens

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    def _make_backend(self) -> AttentionBackend:
        """The model's attention backend, with this runner's kernel configs."""
        return make_attention_backend(
            self.config.device.attention_backend,
            self.config.device.device,
            self.arch.attention_shape(self.tp.size),
            decode_config=self.kernel_configs.decode,
            mla_config=self.kernel_configs.mla,
        )

    def use_kernel_configs(self, kernel_configs: KernelConfigs) -> None:
        """Switches the model and a new attention backend to kernel_configs (an A/B of
        kernel variants in one engine). CUDA graphs captured before keep the kernels
        they captured: capture them again (capture_cuda_graphs) before the next step."""
        self.kernel_configs = kernel_configs
        kernel_configs.install(self.model)
        if self.draft is not None:
            kernel_configs.install(self.draft.model)
        self.backend = self._make_backend()

    # ---- start-up -------------------------------------------------------------------
    def determine_kv_cache_config(self, max_model_len: int) -> KVCacheConfig:
        """The KV pool this worker can hold: its layers' specs, and as many blocks as
        the byte budget (kv_cache_memory, or the GPU memory profile) allows."""
        cache = self.config.cache
        specs = kv_cache_specs(self.model, self.block_size, self.kv_dtype)
        if self.draft is not None:  # its layers come after the target's in every block
            specs = specs + self.draft.kv_specs
        if cache.num_gpu_blocks_override is not None:
            return KVCacheConfig(cache.num_gpu_blocks_override, specs)
        if cache.kv_cache_memory is not None:
            budget = cache.kv_cache_memory
        else:
            budget = self._profile_kv_budget()
        return KVCacheConfig(num_blocks_for_budget(budget, specs, max_model_len), specs)

    def _profile_kv_budget(self) -> int:
        """GPU: what is left of gpu_memory_utilization after weights and a peak forward."""
        if self.device.type != "cuda":
            raise ValueError("kv_cache_memory must be set on CPU")
        from pagoda.worker.profiling import profile_kv_budget

        return profile_kv_budget(self)

    def initialize_kv_cache(self, kv_config: KVCacheConfig, max_model_len: int) -> None:
        self.num_blocks = kv_config.num_blocks
        self.kv_pool = KVCachePool(kv_config, self.device)
        self.drafter = make_drafter(self, max_model_len)
        if self.config.cache.kv_offloading:
            from pagoda.kv_offload.copy_engine import build_kv_offload

            self.kv_offload, self._kv_offload_inventory = build_kv_offload(
                self.config, self.kv_pool, self._model_id(), self.kv_dtype, self.device
            )
        if self.device.type == "cuda":
            self.block_table = DeviceBlockTable(
                self.config.scheduler.max_num_seqs,
                -(-max_model_len // self.block_size),
                self.device,
            )
            from pagoda.worker.warmup import warm_up_kernels, warm_up_logits

            if self.backend.name == "triton":
                self.warmup_seconds = warm_up_kernels(self, max_model_len)
            self.warmup_seconds += warm_up_logits(
                self, logits_rows_bucket(self.config.scheduler.max_num_seqs)
            )
        self.graph_runner = self.capture_cuda_graphs(self.model, self.backend, max_model_len)
        self.input_stream = make_input_stream(self.device, self.graph_runner is not None)

    def _model_id(self) -> str:
        """What the KV of these weights depends on (the disk tier's files name it)."""
        model = self.config.model
        model_id = f"{self.model_path}|{model.load_format}"
        if model.load_format == "dummy":
            model_id += f"|seed={model.seed}"  # random weights: another seed, other KV
        if self.draft is not None:  # its layers are part of every stored block
            spec = self.config.speculative
            model_id += f"|draft={'mtp' if spec.method == 'mtp' else spec.model}"
        return f"{model_id}|tp={self.tp.rank}/{self.tp.size}"

    def kv_offload_inventory(self):
        """The offload tiers for the engine's bookkeeping (None: offloading is off), with
        the start-up measurements of the tiers' cost model."""
        if self.kv_offload is None:
            return None
        from pagoda.kv_offload.cost_probe import measure_start_rates

        return measure_start_rates(self, self._kv_offload_inventory)

    def shutdown_kv_offload(self) -> None:
        """Stops the offload I/O threads and releases the tiers (the disk lock)."""
        if self.kv_offload is not None:
            self.kv_offload.close()
            self.kv_offload = None

    def shutdown(self) -> None:
        """Releases what this worker holds (idempotent): the offload tiers (threads, disk
        lock, pinned slots), then, once the device is idle, the CUDA graphs and their
        pool, the KV pool, the draft model, the staging and penalty buffers and the
        weights. Device memory goes back to torch's caching allocator; the engine
        empties it (engine/release.py). Mostly for the in-process executor: a worker
        process frees all of it by exiting."""
        self.shutdown_kv_offload()
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            try:
                torch.cuda.synchronize(self.device)  # no kernel still reads what goes
            except Exception:  # noqa: BLE001 - a failed device: release what we can
                logger.exception("synchronizing before the worker's release failed")
        for name in _RELEASED_ON_SHUTDOWN:
            setattr(self, name, None)
        self.states = {}

    def capture_cuda_graphs(self, model, backend, max_model_len: int):
        """CUDA graphs of model's steps over this worker's KV pool (the target's, or a
        draft model's with its own backend); None where graphs do not run (CPU,
        enforce_eager, a backend without graph support)."""
        if (
            self.device.type != "cuda"
            or self.config.device.enforce_eager
            or not backend.supports_cuda_graphs()
        ):
            return None
        from pagoda.worker.cuda_graph import CudaGraphRunner

        scheduler = self.config.scheduler
        graphs = CudaGraphRunner(
            model,
            backend,
            self.kv_pool,
            scheduler.max_num_seqs,
            -(-max_model_len // self.block_size),
            self.device,
            scheduler.max_num_batched_tokens,
        )
        graphs.capture()
        return graphs

    # ---- one step -------------------------------------------------------------------
    def _make_generator(self, seed: int) -> torch.Generator:
        return make_generator(seed, self.device)

    def model_info(self) -> ModelInfo:
        arch = self.arch
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return ModelInfo(
            arch.architecture,
            arch.vocab_size,
            arch.max_position_embeddings,
            arch.eos_token_id,
            str(self.dtype).removeprefix("torch."),
            weight_bytes,
            arch.num_hidden_layers,
            0 if self.draft is None else self.draft.weight_bytes,
        )

    def describe_weights(self) -> str:
        """How this rank's weights are stored, for the engine's start-up log."""
        return describe_weights(self.model)

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> None:
        """Applies the scheduler's diff and launches the step's forward, without waiting
        for the device; sample_tokens() must follow before the next execute_model().

        Tokens that the previous step sampled and the scheduler could not send yet
        (async scheduling) are read from that step's sampled ids on the device.
        """
        if self._launched is not None:
            raise RuntimeError(
                "execute_model() called twice without sample_tokens(): "
                "every launched forward must be sampled"
            )
        if out.kv_transfers is not None and self.kv_offload is not None:
            # Before the forward: the stores' gathers must read the old contents.
            self.kv_offload.execute(out.kv_transfers)
            report = self.kv_offload.poll(wait=out.total_num_scheduled_tokens == 0)
            if self._kv_report is not None:  # a step that failed before sampling kept it
                self._kv_report.merge(report)
                report = self._kv_report
            self._kv_report = report
        apply_scheduler_output(self.states, out, self._make_generator, self.block_table)
        if self.penalty_state is not None:
            self.penalty_state.apply(out, self.states)
        if out.total_num_scheduled_tokens == 0:
            self._launched = _LaunchedForward(None, None, False)
            return
        graphs, output_rows = self.graph_runner, None
        if (
            self.input_stream is not None
            and self.block_table is not None
            and graphs is not None
            and graphs.takes(out.total_num_scheduled_tokens, len(out.num_scheduled_tokens))
        ):
            inputs, hidden = self._staged_graph_step(out)
        else:
            inputs = build_step_inputs(
                self.states,
                out,
                self.block_size,
                self.device,
                pad_to=self._eager_pad_to(out),
                prev=self._prev_sampled,
                block_table=self.block_table,
                staging=self.staging,
            )
            if graphs is not None and graphs.can_run(inputs.metadata, inputs.input_ids.shape[0]):
                hidden = graphs.run(inputs.input_ids, inputs.positions, inputs.metadata)
            else:
                output_rows = self._output_rows(inputs)
                step_metadata = self.backend.build_metadata(inputs.metadata)  # once per step
                with forward_context(self.backend, step_metadata, self.kv_pool):
                    hidden = self.model(inputs.input_ids, inputs.positions, output_rows)
        if self.input_stream is not None:
            self.input_stream.release()
        self._launched = _LaunchedForward(
            inputs, hidden, output_rows is not None, out.num_drafts_to_propose
        )

    def _staged_graph_step(self, out: SchedulerOutput) -> tuple[StepInputs, torch.Tensor]:
        """A graph step whose inputs are built and staged into the graph's buffers on the
        input stream (worker/input_stream.py), beside the previous step's LM head and
        sampling; on the main stream only the tokens that step sampled are filled in
        before the replay. -> (inputs, hidden)."""
        graphs, stream = self.graph_runner, self.input_stream
        # A drafter reads the step's token ids afterwards (inputs.input_ids): the sampled
        # tokens go there, then into the graph. Without one, straight into the graph.
        ids_to_graph = self.drafter is None
        with stream.staging():
            inputs = build_step_inputs(
                self.states,
                out,
                self.block_size,
                self.device,
                prev=self._prev_sampled,
                block_table=self.block_table,
                staging=self.staging,
                defer_pending=True,
            )
            n = inputs.input_ids.shape[0]
            if not graphs.can_run(inputs.metadata, n):  # the device table fits every graph
                raise RuntimeError(
                    f"a step of {n} rows that the graphs take does not fit "
                    f"them (block tables {tuple(inputs.metadata.block_tables.shape)})"
                )
            key = graphs.stage(
                inputs.positions, inputs.metadata, inputs.input_ids if ids_to_graph else None
            )
        ids = graphs.input_ids if ids_to_graph else stream.hand_over(inputs.input_ids)
        if inputs.pending_index is not None:
            fill_pending_tokens(ids, stream.hand_over(inputs.pending_index), self._prev_sampled)
        return inputs, graphs.replay(key, n, None if ids_to_graph else inputs.input_ids)

    @torch.inference_mode()
    def sample_tokens(self, extras: StepExtras | None = None) -> AsyncRunnerOutput:
        """Launches the sampling of the forward execute_model() launched (with what the
        engine learned since: extras) and returns without waiting for the device."""
        launched, self._launched = self._launched, None
        if launched is None:
            raise RuntimeError("sample_tokens() called without a launched forward")
        inputs = launched.inputs
        kv_report, self._kv_report = self._kv_report, None
        if inputs is None:
            self._prev_sampled = None
            return AsyncRunnerOutput.empty(kv_report)
        sampled, packed_logprobs, wanted = self._sample(
            launched.hidden, inputs, launched.compacted, extras
        )
        prompt_logprobs = packed_prompt_logprobs(
            self.model, self.states, launched.hidden, inputs, self.device
        )
        self._prev_sampled = (
            None
            if sampled is None
            else PrevSampled(sampled, single_row_index(inputs.sample_req_ids))
        )
        proposals = None
        if self.drafter is not None:  # an MTP layer reads every step's hidden states
            feed_target_hidden(self.drafter, launched.hidden, inputs, sampled, self.states)
        if self.drafter is not None and launched.to_propose and sampled is not None:
            starts = draft_starts(self.states, inputs, sampled, launched.to_propose)
            proposals = self.drafter.propose(starts)
            record_kept(self.states, inputs, starts, proposals)
        return AsyncRunnerOutput(
            inputs.req_ids,
            inputs.sample_req_ids,
            sampled,
            packed_logprobs,
            wanted,
            prompt_logprobs,
            drafts=inputs.verified_drafts,
            spec_token_ids=proposals,
            kv_transfers=kv_report,
        )

    def _eager_pad_to(self, out: SchedulerOutput) -> int | None:
        """Rows of this step's forward on CUDA when it runs eagerly (shape_buckets);
        None for CPU and for steps a CUDA graph takes (it pads itself)."""
        if self.device.type != "cuda":
            return None
        n = out.total_num_scheduled_tokens
        if self.graph_runner is not None and self.graph_runner.takes(
            n, len(out.num_scheduled_tokens)
        ):
            return None
        return eager_tokens_bucket(n, self.config.scheduler.max_num_batched_tokens)

    def _output_rows(self, inputs: StepInputs) -> torch.Tensor | None:
        """The rows an eager forward's last layer computes (the model's output_rows): the
        sampled rows, bucketed. None (every row) when every row samples, when none does,
        or when prompt logprobs or the drafter (MTP) need the other rows too."""
        rows = inputs.sample_rows
        if not rows or inputs.prompt_logprob_rows or len(rows) == inputs.metadata.num_actual_tokens:
            return None
        if reads_target_hidden(self.drafter):
            return None
        return host_to_device(self._bucketed(rows), torch.long, self.device)

    def _bucketed(self, rows: list[int]) -> list[int]:
        """On CUDA, rows padded (repeating the last) to a bucketed count: shape_buckets."""
        if self.device.type != "cuda":
            return rows
        return rows + [rows[-1]] * (logits_rows_bucket(len(rows)) - len(rows))

    def _sample(
        self, hidden: torch.Tensor, inputs: StepInputs, compacted: bool, extras: StepExtras | None
    ):
        """(sampled ids [rows] on device, packed logprobs or None, logprobs asked per row).
        compacted: hidden holds only the (bucketed) sampled rows, in order."""
        if not inputs.sample_rows:
            return None, None, []
        if not compacted:
            bucketed = self._bucketed(inputs.sample_rows)
            if bucketed == list(range(len(bucketed))):  # every row samples: no gather
                hidden = hidden[: len(bucketed)]
            else:
                hidden = hidden.index_select(0, host_to_device(bucketed, torch.long, self.device))
        # In the head's dtype: the sampler widens them to float32 where it needs to (an
        # all-greedy step takes the argmax of these as they are).
        logits = self.model.compute_logits(hidden, float32=False)[: len(inputs.sample_rows)]
        if extras is not None and extras.grammar_bitmasks:
            apply_token_bitmask(
                logits,
                stack_row_bitmasks(extras.grammar_bitmasks, inputs.sample_req_ids, self.vocab_size),
                self.device,
            )
        rows = self._sampling_rows(inputs)
        penalties = step_penalties(self.penalty_state, self.states, inputs)
        pending = None if self.penalty_state is not None else self._pending_outputs(inputs)
        metadata = build_sampling_metadata(
            rows,
            self.vocab_size,
            self.device,
            self.generator,
            pending_outputs=pending,
            penalty_history=penalties,
        )
        out = self.sampler(logits, metadata)
        if penalties is not None:
            penalties.record_sampled(out.sampled_token_ids)
        wanted = [r.params.logprobs for r in rows]
        if out.logprobs is None:
            return out.sampled_token_ids, None, wanted
        packed = pack_token_logprobs(out.logprobs_token_ids, out.logprobs, out.sampled_ranks)
        return out.sampled_token_ids, packed, wanted

    def _sampling_rows(self, inputs: StepInputs) -> list[SamplingRow]:
        """One SamplingRow per sampled row (sampling_rows.sampling_rows)."""
        return sampling_rows(self.states, inputs, self._make_generator)

    def _pending_outputs(self, inputs: StepInputs) -> PendingOutputs | None:
        """The rows' output tokens that only the previous step's sampled ids hold."""
        return pending_outputs(inputs, self._prev_sampled)
