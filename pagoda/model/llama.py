"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3).

One model class; the variants differ only by ArchConfig flags: ``attention_bias``
(Qwen2's q/k/v bias) and ``qk_norm`` (Qwen3's per-head RMSNorm on q and k before
rotary); Mistral's sliding window reaches every layer's Attention
(``ArchConfig.layer_sliding_window``), and a windowed model skips the fused CPU decode
step, whose C attention reads whole contexts. Inputs are a flattened batch (no batch
dim): ``forward(input_ids [T], positions [T]) -> hidden [T, hidden_size]``; attention
reads its metadata and KV caches from the forward context. ``output_rows`` names the
only rows whose hidden states are wanted (the sampled ones): the last layer then runs
its attention output projection and MLP on those rows alone, since no later layer reads
the others (their keys and values are still computed and stored). In a 16k-token prefill
step of an 8B model that skips 1/32 of the step's GEMM work. Module names mirror Hugging
Face's so that ``load_weights`` only has to fold q/k/v and gate/up into merged
parameters.

FP8 W8A8 linears that quantize their input per token (more rows than the W8A16 GEMV
takes, on CUDA) ask for it already quantized (``takes_fp8_input``): the decoder layer
then has input_layernorm / post_attention_layernorm write FP8 rows for qkv_proj /
gate_up_proj, and the MLP has its SiLU-and-mul write them for down_proj (one kernel
each instead of the producer, a float write and read, and a quantization kernel). The
question is asked with the rows the consumer will see: after the last layer's
output_rows selection, its MLP may run on few enough rows not to.

Subclasses swap the feed-forward block per layer (``make_mlp``, e.g. Qwen3-MoE's
experts) and extend the checkpoint name mapping (``map_hf_name``, ``expected_loads``).

Build on the meta device, then ``materialize(device)``: 8B shapes are allocated once,
never initialised on the CPU first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagoda.model import cpu_fused_decode
from pagoda.model.arch_config import ArchConfig
from pagoda.model.layers.attention import Attention, load_kv_scale
from pagoda.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.model.layers.layernorm import RMSNorm
from pagoda.model.layers.linear import (
    QKVParallelLinear,
    RowParallelLinear,
    ShardId,
    default_weight_loader,
    materialize_module,
)
from pagoda.model.layers.mlp import LlamaMLP
from pagoda.model.layers.rotary import (
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_tables,
    rotary_tables,
)
from pagoda.model.parallel import SINGLE_RANK, TensorParallel
from pagoda.model.quant.base import module_takes_fp8_input

# (merged param, checkpoint projection, shard id): HF names folded into merged params.
_STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
# Checkpoint entries that are not weights (old HF checkpoints saved rotary buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LlamaAttention(nn.Module):
    """Self-attention with this rank's share of the heads (all of them at tp_size 1)."""

    def __init__(self, arch: ArchConfig, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size,
            arch.head_dim,
            arch.num_attention_heads,
            arch.num_key_value_heads,
            bias=arch.attention_bias,
            tp_rank=tp.rank,
            tp_size=tp.size,
        )
        # Per rank: the QKV projection decided the split (kv heads replicate when fewer
        # than ranks).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            arch.q_size, arch.hidden_size, bias=False, tp_rank=tp.rank, tp_size=tp.size
        )
        self.qk_norm = arch.qk_norm
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.attn = Attention(
            layer_idx,
            self.num_heads,
            self.num_kv_heads,
            arch.head_dim,
            scale=arch.softmax_scale,
            sliding_window=arch.layer_sliding_window(layer_idx),
        )

    def takes_fp8_input(self, num_rows: int) -> bool:
        """Whether forward wants hidden as an Fp8Activation (its qkv_proj's choice)."""
        return self.qkv_proj.takes_fp8_input(num_rows)

    def forward(
        self, hidden, cos: torch.Tensor, sin: torch.Tensor, output_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[T, hidden] (a tensor, or an Fp8Activation where takes_fp8_input) -> [T,
        hidden], or [len(output_rows), hidden] for those rows only (attention still
        runs, and stores K/V, for every row). cos/sin: what LlamaModel.rotary gives:
        [T, D/2] each, or rotary_tables' [T, 1, D] tables."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        rotate = apply_rotary_tables if cos.dim() == 3 else apply_rotary
        q = self._fused_qk_rope_store(qkv, cos, sin) if cos.dim() == 2 else None
        if q is not None:  # k/v already in the cache
            out = self.attn.forward_stored(q)
        elif not qkv.is_cuda and not self.qk_norm:
            out = self.attn(*self._rotate_qk_together(qkv, rotate, cos, sin))
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(num_tokens, self.num_heads, self.head_dim)
            k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q = rotate(q, cos, sin).reshape(num_tokens, self.q_size)
            k = rotate(k, cos, sin).reshape(num_tokens, self.kv_size)
            out = self.attn(q, k, v)
        if output_rows is not None:
            out = out.index_select(0, output_rows)
        return self.o_proj(out)

    def _fused_qk_rope_store(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor | None:
        """q [T, q_size], normed and rotated, with k and v normed, rotated and stored by
        one kernel (kernels/qk_rope_store.py, the same roundings as the unfused
        path); None where that kernel does not stand in: the pool does not store this
        layer with its Triton kernel (CPU, torch stores), PAGODA_FUSED_OPS=0, or norm
        weights in another dtype than qkv (then the unfused path runs)."""
        target = self.attn.kv_store_target()
        if target is None:  # also the CPU: no triton imported below
            return None
        from pagoda.kernels.attention import qk_rope_store
        from pagoda.kernels.norm import fused_ops  # imports triton

        if not fused_ops.FUSED_OPS_ENABLED:
            return None
        q_weight = k_weight = None
        eps = 0.0
        if self.qk_norm:
            q_weight, k_weight, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
            if q_weight.dtype != qkv.dtype or k_weight.dtype != qkv.dtype or self.k_norm.eps != eps:
                return None
        return qk_rope_store.qk_norm_rope_store(
            qkv,
            cos,
            sin,
            q_weight,
            k_weight,
            eps,
            target.cache,
            target.slot_mapping,
            target.kv_scales,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )

    def _rotate_qk_together(
        self, qkv: torch.Tensor, rotate: Callable, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """CPU: the q and k heads sit side by side in each row of qkv, so one rotary call
        covers both (half the small torch calls per layer; elementwise, so the values are
        the same). q and k come back as column views of the rotated [T, q+kv] block."""
        num_tokens, qk_size = qkv.shape[0], self.q_size + self.kv_size
        heads = qkv[:, :qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = rotate(heads, cos, sin).view(num_tokens, qk_size)
        return qk[:, : self.q_size], qk[:, self.q_size :], qkv[:, qk_size:]


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, arch: ArchConfig, layer_idx: int, tp: TensorParallel, mlp: nn.Module | None = None
    ) -> None:
        """mlp: the feed-forward block [T, H] -> [T, H] (all-reduced) replacing the dense
        LlamaMLP (e.g. a mixture of experts)."""
        super().__init__()
        self.self_attn = LlamaAttention(arch, layer_idx, tp)
        self.mlp = mlp if mlp is not None else LlamaMLP(arch, tp)
        # A block that can take the post-attention norm into its own launches (decided
        # once here: a missed attribute lookup on a module costs ~1.6 us a layer-step).
        self.mlp_fuses_norm = hasattr(self.mlp, "forward_after_norm")
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream before it): the next norm adds them.
        With output_rows, both hold those rows only (see the module docstring). Each
        norm quantizes its output to FP8 where its consumer asks for that."""
        fp8 = module_takes_fp8_input(self.self_attn, hidden.shape[0])
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden, fp8_out=fp8)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, fp8_out=fp8)
        hidden = self.self_attn(hidden, cos, sin, output_rows)
        if output_rows is not None:
            residual = residual.index_select(0, output_rows)
        fp8 = module_takes_fp8_input(self.mlp, hidden.shape[0])  # after the selection
        if self.mlp_fuses_norm and not fp8:
            fused = self.mlp.forward_after_norm(hidden, residual, self.post_attention_layernorm)
            if fused is not None:
                return fused
        hidden, residual = self.post_attention_layernorm(hidden, residual, fp8_out=fp8)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        arch: ArchConfig,
        tp: TensorParallel,
        make_mlp: Callable[[int], nn.Module | None] | None = None,
    ) -> None:
        """make_mlp(layer_idx): that layer's feed-forward block, or None for LlamaMLP."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            arch.vocab_size, arch.hidden_size, tp_rank=tp.rank, tp_size=tp.size
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, i, tp, make_mlp(i) if make_mlp is not None else None)
            for i in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.windowed = arch.sliding_window is not None
        # Shared by every layer: cos/sin are looked up once per forward.
        self.rotary_emb = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What every layer's attention rotates q and k with, looked up once per forward:
        (cos, sin) [T, D/2]; on the CPU, rotary_tables' full-width tables (fewer torch
        calls per layer, same bits)."""
        cos, sin = self.rotary_emb(positions)
        if positions.device.type == "cpu":
            return rotary_tables(cos, sin)
        return cos, sin

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # A CPU decode step of a block-quantized model: every layer in one C call.
        hidden = None if self.windowed else cpu_fused_decode.decode_step(self, input_ids, positions)
        if hidden is not None:
            return hidden if output_rows is None else hidden.index_select(0, output_rows)
        cos, sin = self.rotary(positions)
        hidden, residual = self.embed_tokens(input_ids), None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, cos, sin, output_rows if i == last else None)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ArchConfig, tp: TensorParallel = SINGLE_RANK) -> None:
        """tp: this rank's place in the tensor-parallel group; every sharded layer takes
        its share of heads, intermediate columns and vocabulary rows from it."""
        super().__init__()
        self.arch = arch
        self.tp = tp
        self.model = self.make_model(arch, tp)
        self.lm_head = ParallelLMHead(
            arch.vocab_size, arch.hidden_size, tp_rank=tp.rank, tp_size=tp.size
        )
        self.tie_weights()

    def make_model(self, arch: ArchConfig, tp: TensorParallel) -> nn.Module:
        """Subclasses' hook: the decoder stack (embedding, layers, final norm)."""
        return LlamaModel(arch, tp, self.make_mlp)

    def make_mlp(self, layer_idx: int) -> nn.Module | None:
        """Subclasses' hook: layer layer_idx's feed-forward block (None: LlamaMLP)."""
        return None

    def tie_weights(self) -> None:
        """Shares the embedding with the LM head when the architecture ties them."""
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def materialize(
        self, device: torch.device | str, dtype: torch.dtype | None = None
    ) -> LlamaForCausalLM:
        """Gives a model built on the meta device uninitialised storage on device (weights
        in dtype), keeping weight loaders and tying, and computes the rotary cache."""
        materialize_module(self, device, dtype)
        for module in self.modules():  # every rotary table the decoder stack holds
            if isinstance(module, RotaryEmbedding):
                module.reset_cache()
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden [T, hidden_size] (final norm applied);
        with output_rows (int64 [N] on the device): hidden [N, hidden_size] of those rows."""
        return self.model(input_ids, positions, output_rows)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in float32 (float32=False:
        in the head's dtype, for a sampler that widens them only where it needs to), the
        full vocabulary on every tensor-parallel rank (the LM head all-gathers its shards)."""
        logits = self.lm_head(hidden)
        return logits.float() if float32 else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads (HF name, full tensor) pairs; raises on unknown names and, at the end, on
        parameters no checkpoint tensor reached. Returns the loaded parameter names."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if hf_name.endswith(_IGNORED_SUFFIXES):
                continue
            if hf_name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue  # some tied checkpoints store the head too; the embedding wins
            if load_kv_scale(self, hf_name, tensor):  # self_attn.k_scale / v_scale
                continue
            name, shard_id = self.map_hf_name(hf_name)
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} matches no parameter of "
                    f"{self.arch.architecture}"
                )
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"loading {hf_name!r}: {e}") from e
            loaded.add(name if shard_id is None else f"{name}[{shard_id}]")
        self._check_complete(params, loaded)
        return loaded

    def map_hf_name(self, hf_name: str) -> tuple[str, ShardId]:
        """HF checkpoint name -> (parameter name, shard id or None); subclasses extend it."""
        return _map_hf_name(hf_name)

    def expected_loads(self, name: str) -> list[str]:
        """What load_weights records for parameter name once a checkpoint filled it:
        name[shard] for each shard of a merged parameter, else name."""
        merged = [shard for merged, _, shard in _STACKED_PARAMS if f".{merged}." in name]
        return [f"{name}[{s}]" for s in merged] or [name]

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for name in params:
            missing += [e for e in self.expected_loads(name) if e not in loaded]
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint lacks {len(missing)} weights: {shown}")


def _map_hf_name(hf_name: str) -> tuple[str, ShardId]:
    """HF checkpoint name -> (parameter name, shard id or None)."""
    for merged, proj, shard_id in _STACKED_PARAMS:
        if f".{proj}." in hf_name:
            return hf_name.replace(f".{proj}.", f".{merged}."), shard_id
    return hf_name, None
