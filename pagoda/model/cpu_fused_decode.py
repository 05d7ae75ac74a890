"""The fused CPU decode step: a Llama-family model's whole decode step (every decoder
layer and the final norm) in one C call (pagoda/model/quant/cpu_layer.c), instead of
~170 torch calls per layer.

When it applies (otherwise LlamaModel.forward runs its layers, unchanged):
- per model, checked once (``fused_decode_blocker`` says why not): the native kernel
  library is built (a C compiler and AVX2: cpu_kernels.native_status), float32
  activations, every linear of every layer a block method (Q4_1 or Q8_0 blocks: the
  gguf, int4 and int8 schemes; the kind may differ per matrix), no biases, no qk_norm,
  a dense Llama MLP, tensor-parallel size 1, head_dim a multiple of 8 up to 256.
  Float32 checkpoints without quantization keep the existing path.
- per step: the input is on the CPU, the step is decode-only (one query token per
  request, AttentionMetadata.is_decode_only, and the rows are the requests in order),
  and the KV pool holds every layer as a float32 FullAttentionLayout written by torch
  (not FP8, not the Triton store): the kernel writes K/V exactly where the pool's
  store would (slot_mapping), and nothing else, with the values of the unfused path
  up to float32 rounding (the projections' inputs differ by the norms' rounding).
  Batch 1 multiplies 8-bit activations where the layers' CpuBlocksConfig says so
  (``blocks_config``), as their own block matmuls would.
- ``PAGODA_CPU_FUSED_DECODE=0`` turns it off (A/B, bisecting).

Packing: the layers' weight, norm and cache pointers go into ctypes structs once (the
caches again whenever the forward context brings another KV pool). Invariant: weights
are not replaced after the first decode step (loading, then serving); a model whose
weights change must drop its state (``reset_fused_decode``).

The attention backend's step plan is not built on a fused step: torch_ref builds it on
first use (LazyStepPlan), and a step that never used it counts as one without decode
rows for its decode workspace (nothing carries across a fused step).
"""

from __future__ import annotations

import ctypes
import os

import torch

from pagoda.attention.forward_context import ForwardContext, get_forward_context
from pagoda.attention.kv_pool import FullAttentionLayout
from pagoda.model.layers.mlp import LlamaMLP
from pagoda.model.quant.cpu_kernels import (
    DEFAULT_BLOCKS_CONFIG,
    CpuBlocksConfig,
    native_kernel,
    native_status,
)

ENV_SWITCH = "PAGODA_CPU_FUSED_DECODE"
_KINDS = {"q4_1": 0, "q8_0": 1}  # cpu_layer.c's KIND_Q4_1, KIND_Q8_0
_MAX_HEAD_DIM = 256  # cpu_layer.c's MAX_D_VECS * 8


class _Layer(ctypes.Structure):  # cpu_layer.c's pagoda_layer
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
        ("gate_up", ctypes.c_void_p),
        ("down", ctypes.c_void_p),
        ("qkv_kind", ctypes.c_int32),
        ("o_kind", ctypes.c_int32),
        ("gate_up_kind", ctypes.c_int32),
        ("down_kind", ctypes.c_int32),
        ("kv_cache", ctypes.c_void_p),
    ]


class _Model(ctypes.Structure):  # pagoda_model
    _fields_ = [
        ("num_layers", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("inter", ctypes.c_int64),
        ("cache_slots", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("quantize_one_row", ctypes.c_int32),
        ("final_norm", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
    ]


class _Step(ctypes.Structure):  # pagoda_step
    _fields_ = [
        ("rows", ctypes.c_int64),
        ("positions", ctypes.c_void_p),
        ("slot_mapping", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("max_seq_len", ctypes.c_int64),
    ]


def _library() -> ctypes.CDLL | None:
    so = native_kernel()
    if so is not None and so.pagoda_llama_decode.argtypes is None:
        ptr = ctypes.c_void_p
        so.pagoda_llama_decode.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
        so.pagoda_llama_decode.restype = ctypes.c_int
        so.pagoda_llama_scratch_bytes.argtypes = [ptr, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        so.pagoda_llama_scratch_bytes.restype = ctypes.c_int64
    return so


def _linears(layer) -> dict:
    attn, mlp = layer.self_attn, layer.mlp
    return {
        "qkv": attn.qkv_proj,
        "o": attn.o_proj,
        "gate_up": mlp.gate_up_proj,
        "down": mlp.down_proj,
    }


def blocks_config(model) -> CpuBlocksConfig:
    """The block kernels' config the model's linear layers multiply with (their
    `cpu_blocks_config`, set by the model runner's KernelConfigs; None: the defaults),
    which the fused step follows so that it multiplies as the layers would."""
    config = model.layers[0].self_attn.qkv_proj.cpu_blocks_config
    return config or DEFAULT_BLOCKS_CONFIG


def _f32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()


def _layer_blocker(layer, index: int, first) -> str | None:
    attn = layer.self_attn
    if attn.qk_norm:
        return f"layer {index} has qk_norm"
    if type(layer.mlp) is not LlamaMLP:
        return f"layer {index}'s feed-forward is not a dense Llama MLP"
    if (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (
        first.num_heads,
        first.num_kv_heads,
        first.head_dim,
    ):
        return f"layer {index} has another head geometry than layer 0"
    for name, linear in _linears(layer).items():
        if linear.tp_size != 1:
            return "tensor parallel (tp size > 1)"
        if linear.bias is not None:
            return f"layer {index}'s {name} has a bias"
        if getattr(linear.quant_method, "kind", None) not in _KINDS:
            return f"layer {index}'s {name} is not Q4_1/Q8_0 blocks ({linear.quant_method.name})"
        w = linear.weight
        if w.dtype != torch.uint8 or w.dim() != 3 or not w.is_cpu or not w.is_contiguous():
            return f"layer {index}'s {name} blocks are not a contiguous uint8 CPU tensor"
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        if not _f32(norm.weight):
            return f"layer {index}'s norms are not float32 CPU tensors"
    return None


def fused_decode_blocker(model) -> str | None:
    """Why the fused decode step cannot run this LlamaModel (None: it can, on the steps
    that qualify); the per-model half of the conditions in the module docstring."""
    if native_kernel() is None:
        return f"no native kernel: {native_status()}"
    if not model.layers:
        return "no layers"
    if not _f32(model.embed_tokens.weight):
        return "activations are not float32 (the embedding is not a float32 CPU tensor)"
    first = model.layers[0].self_attn
    if first.head_dim % 8 or first.head_dim > _MAX_HEAD_DIM:
        return f"head_dim {first.head_dim} (the kernel takes multiples of 8 up to 256)"
    eps = {model.norm.eps}
    scales = set()
    for i, layer in enumerate(model.layers):
        reason = _layer_blocker(layer, i, first)
        if reason is not None:
            return reason
        eps |= {layer.input_layernorm.eps, layer.post_attention_layernorm.eps}
        scales.add(layer.self_attn.attn.scale)
    if len(eps) != 1 or len(scales) != 1:
        return "the layers' norm eps or attention scales differ"
    rope = model.rotary_emb
    if rope.head_dim != first.head_dim or not (_f32(rope.cos_cache) and _f32(rope.sin_cache)):
        return "the rotary cache is not a float32 CPU table over the whole head"
    if not _f32(model.norm.weight):
        return "the final norm is not a float32 CPU tensor"
    return None


class FusedDecode:
    """One model's packed pointers, scratch and step struct (built by decode_step)."""

    def __init__(self, model, so: ctypes.CDLL) -> None:
        self.so, self.model = so, model
        first = model.layers[0]
        attn = first.self_attn
        self.hidden = model.embed_tokens.weight.shape[1]
        self.max_positions = model.rotary_emb.cos_cache.shape[0]  # rows of the cos/sin tables
        self.head_dim, self.kv_heads = attn.head_dim, attn.num_kv_heads
        self.desc = _Model(
            num_layers=len(model.layers),
            hidden=self.hidden,
            heads=attn.num_heads,
            kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            inter=first.mlp.down_proj.in_per_rank,
            eps=model.norm.eps,
            scale=attn.attn.scale,
            final_norm=model.norm.weight.data_ptr(),
            cos=model.rotary_emb.cos_cache.data_ptr(),
            sin=model.rotary_emb.sin_cache.data_ptr(),
        )
        self.layers = (_Layer * len(model.layers))()
        for slot, layer in zip(self.layers, model.layers):
            slot.input_norm = layer.input_layernorm.weight.data_ptr()
            slot.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            for name, linear in _linears(layer).items():
                setattr(slot, name, linear.weight.data_ptr())
                setattr(slot, f"{name}_kind", _KINDS[linear.quant_method.kind])
        # Kept alive: the structs hold raw pointers into them.
        self._held = [model.rotary_emb.cos_cache, model.rotary_emb.sin_cache]
        self.pool = None  # the KV pool the layers' cache pointers point into
        self.pool_ok = False
        self.step = _Step()
        self.scratch = torch.empty(0, dtype=torch.uint8)

    def _bind_pool(self, pool) -> bool:
        """Points every layer at its cache in pool; False when a cache does not qualify."""
        self.pool, self.pool_ok = pool, False
        slots = set()
        for slot, layer in zip(self.layers, self.model.layers):
            index = layer.self_attn.attn.layer_idx
            cache, layout = pool.cache(index), pool.layout(index)
            if (
                type(layout) is not FullAttentionLayout
                or layout.use_triton
                or not _f32(cache)
                or cache.dim() != 5
                or tuple(cache.shape[3:]) != (self.kv_heads, self.head_dim)
            ):
                return False
            slot.kv_cache = cache.data_ptr()
            slots.add((cache.shape[1] * cache.shape[2], cache.shape[2]))
        if len(slots) != 1:
            return False
        self.desc.cache_slots, self.desc.block_size = slots.pop()
        self.pool_ok = True
        return True

    def run(
        self, ctx: ForwardContext, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor | None:
        common = ctx.metadata.common
        rows = input_ids.shape[0]
        if not (
            common.is_decode_only
            and common.num_reqs == rows == common.num_actual_tokens
            and common.slot_mapping.shape[0] == rows
        ):
            return None
        if ctx.kv_pool is not self.pool and not self._bind_pool(ctx.kv_pool):
            return None
        if (
            not self.pool_ok
            or common.block_size != self.desc.block_size
            or common.max_seq_len > self.max_positions
        ):  # the layers raise on that
            return None
        seq_lens, tables, slots = common.seq_lens, common.block_tables, common.slot_mapping
        if (
            seq_lens.dtype != torch.int32
            or tables.dtype != torch.int32
            or slots.dtype != torch.int64
            or positions.dtype != torch.int64
            or tables.stride(1) != 1
            or not (
                seq_lens.is_contiguous() and slots.is_contiguous() and positions.is_contiguous()
            )
        ):
            return None
        threads = torch.get_num_threads()
        need = self.so.pagoda_llama_scratch_bytes(
            ctypes.byref(self.desc), rows, common.max_seq_len, threads
        )
        if self.scratch.numel() < need:
            self.scratch = torch.empty(2 * need, dtype=torch.uint8)
        step = self.step
        step.rows, step.positions = rows, positions.data_ptr()
        step.slot_mapping, step.seq_lens = slots.data_ptr(), seq_lens.data_ptr()
        step.block_tables, step.table_stride = tables.data_ptr(), tables.stride(0)
        step.max_seq_len = common.max_seq_len
        self.desc.quantize_one_row = blocks_config(self.model).quantize_activations
        embed = self.model.embed_tokens(input_ids)
        out = torch.empty(rows, self.hidden, dtype=torch.float32)
        if (
            self.so.pagoda_llama_decode(
                ctypes.byref(self.desc),
                self.layers,
                ctypes.byref(step),
                embed.data_ptr(),
                out.data_ptr(),
                self.scratch.data_ptr(),
                threads,
            )
            != 0
        ):
            raise MemoryError("the fused decode step could not allocate its tile buffers")
        return out


_STATE = "_cpu_fused_decode"  # the model attribute holding its FusedDecode or blocker


def reset_fused_decode(model) -> None:
    """Drops the packed state (after replacing weights); rebuilt on the next step."""
    model.__dict__.pop(_STATE, None)


def fused_decode_status(model) -> str:
    """'on' or 'off (<why>)', as cpu_kernels.native_status reports the kernel."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"off ({ENV_SWITCH}=0)"
    reason = fused_decode_blocker(model)
    return "on" if reason is None else f"off ({reason})"


def decode_step(model, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """The final hidden states [T, hidden] (final norm applied) of this step, computed
    by the fused kernel when it applies (module docstring), with every layer's new K/V
    stored; None otherwise (the caller runs its layers)."""
    if not input_ids.is_cpu or os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    state = model.__dict__.get(_STATE)
    if state is None:
        reason = fused_decode_blocker(model)
        state = reason if reason is not None else FusedDecode(model, _library())
        model.__dict__[_STATE] = state
    if isinstance(state, str):  # why it does not apply to this model
        return None
    try:
        ctx = get_forward_context()
    except RuntimeError:
        return None  # no forward context: the layers raise the error themselves
    return state.run(ctx, input_ids, positions)
