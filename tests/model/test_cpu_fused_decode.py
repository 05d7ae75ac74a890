"""The fused CPU decode step (pagoda/model/cpu_fused_decode.py, quant/cpu_layer.c)
against the model's own layers (PAGODA_CPU_FUSED_DECODE=0).

Both run the same decode step on copies of one KV pool holding random contexts: the
final hidden states must agree to float32 rounding (1e-4), the new K/V must land in the
same slots with the same values, and no other cache byte may change. Covered: batch 1
(the 8-bit activation matmuls) and several rows whose contexts cross block boundaries
at different lengths, positions > 0, Q4_1 and Q8_0 weights (and a mix per matrix),
GQA, head sizes taking each attention code path, steps mixed with unfused ones (the
torch_ref decode workspace must not carry stale contexts), and the cases that must
fall back. Last, the embedded SmolLM2 with --quantization gguf: greedy tokens with the
fused step equal those without it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagoda.attention.forward_context import forward_context
from pagoda.attention.kv_pool import KVCachePool
from pagoda.attention.metadata import build_attention_metadata
from pagoda.attention.torch_ref import TorchRefBackend
from pagoda.core.kv_cache_spec import KVCacheConfig
from pagoda.model import cpu_fused_decode
from pagoda.model.arch_config import ArchConfig
from pagoda.model.kernel_configs import KernelConfigs
from pagoda.model.layers.attention import kv_cache_specs
from pagoda.model.loader import build_model
from pagoda.model.quant.cpu_int import CpuBlockConfig, OnlineBlockMethod, block_ready
from pagoda.model.quant.cpu_kernels import CpuBlocksConfig, native_status
from pagoda.model.quant.registry import process_loaded_weights

pytestmark = pytest.mark.skipif(
    native_status() != "native", reason=f"no native CPU kernel here: {native_status()}"
)

BLOCK, NUM_BLOCKS = 16, 40


class _Kinds(CpuBlockConfig):
    """Online block quantization with one kind per layer name suffix (a mixed model)."""

    name = "test-kinds"

    def __init__(self, kinds: dict[str, str]) -> None:
        self.kinds = kinds

    def linear_method(self, prefix, layer):
        if not block_ready(layer):
            return None
        return OnlineBlockMethod(self.kinds[prefix.rpartition(".")[2]])


def _arch(head_dim: int, heads: int = 4, kv_heads: int = 2, **overrides) -> ArchConfig:
    fields = dict(
        architecture="LlamaForCausalLM",
        hidden_size=320,
        num_hidden_layers=3,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=288,
        vocab_size=300,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        torch_dtype="float32",
    )
    fields.update(overrides)
    return ArchConfig(**fields)


def _model(arch: ArchConfig, quant, seed: int = 0):
    model = build_model(arch, torch.float32, "cpu", quant_config=quant)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=gen))
    process_loaded_weights(model)
    return model


def _kinds(qkv="q4_1", o="q4_1", gate_up="q4_1", down="q4_1") -> _Kinds:
    return _Kinds({"qkv_proj": qkv, "o_proj": o, "gate_up_proj": gate_up, "down_proj": down})


def _pool(model, seed: int) -> KVCachePool:
    pool = KVCachePool(
        KVCacheConfig(NUM_BLOCKS, kv_cache_specs(model, BLOCK, torch.float32)), "cpu"
    )
    gen = torch.Generator().manual_seed(seed)
    for cache in pool.caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return pool


def _tables(lengths: list[int], seed: int) -> list[list[int]]:
    """Each request's blocks, scattered over the pool (not in order)."""
    order = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = []
    for n in lengths:
        count = -(-n // BLOCK)
        tables.append(order[:count])
        order = order[count:]
    return tables


def _decode(model, arch, pool, backend, lengths, tables, ids, fused: bool, monkeypatch):
    """One decode step (row i: a request with lengths[i] tokens, its newest one ids[i])."""
    monkeypatch.setenv(cpu_fused_decode.ENV_SWITCH, "1" if fused else "0")
    md = build_attention_metadata([1] * len(lengths), lengths, tables, BLOCK, "cpu")
    positions = torch.tensor([n - 1 for n in lengths])
    with torch.inference_mode(), forward_context(backend, backend.build_metadata(md), pool):
        return model(ids, positions)


def _backend(arch) -> TorchRefBackend:
    return TorchRefBackend(
        arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, arch.head_dim**-0.5
    )


def _close(got, want, loose: bool) -> None:
    if loose:  # 8-bit activations: relative error of the whole tensor (see below)
        assert ((got - want).norm() / want.norm()).item() < LOOSE_REL
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# Batch 1 can multiply 8-bit activations (CpuBlocksConfig.quantize_activations, off by
# default), in both paths. Their rounding is discontinuous: where a value sits at a rounding boundary,
# a one-ulp difference in a norm's output moves it a whole step, and on these models a
# one-ulp change of the embedding alone moves the unfused output by up to 2e-2 (relative
# L2, measured; most cases 4e-7). So batch 1 is compared twice: tightly with float
# activations, and loosely (a wrong block or scale gives errors of order 1) with 8-bit.
LOOSE_REL = 5e-2


def _with_blocks_config(configs: KernelConfigs, quantize_activations: bool) -> KernelConfigs:
    return dataclasses.replace(configs, cpu_blocks=CpuBlocksConfig(quantize_activations))


def _install_blocks_config(model, quantize_activations: bool) -> None:
    """The CPU's kernel configs with this block-kernel variant on model's layers, as the
    model runner installs them."""
    configs = KernelConfigs.for_device(torch.device("cpu"))
    _with_blocks_config(configs, quantize_activations).install(model)


def _compare(model, arch, lengths, monkeypatch, seed=0):
    if len(lengths) == 1:
        _install_blocks_config(model, quantize_activations=False)
        _compare_once(model, arch, lengths, monkeypatch, seed, loose=False)
        _install_blocks_config(model, quantize_activations=True)
    return _compare_once(model, arch, lengths, monkeypatch, seed, loose=len(lengths) == 1)


def _compare_once(model, arch, lengths, monkeypatch, seed: int, loose: bool):
    ids = torch.randint(
        0, arch.vocab_size, (len(lengths),), generator=torch.Generator().manual_seed(seed)
    )
    tables = _tables(lengths, seed)
    fused_pool, ref_pool = _pool(model, seed), _pool(model, seed)
    before = [c.clone() for c in ref_pool.caches]
    got = _decode(model, arch, fused_pool, _backend(arch), lengths, tables, ids, True, monkeypatch)
    want = _decode(model, arch, ref_pool, _backend(arch), lengths, tables, ids, False, monkeypatch)
    _close(got, want, loose)
    slots = torch.tensor(
        [t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, lengths)]
    )
    for mine, ref, old in zip(fused_pool.caches, ref_pool.caches, before):
        flat, ref_flat, old_flat = (c.view(2, -1, *c.shape[3:]) for c in (mine, ref, old))
        _close(flat[:, slots], ref_flat[:, slots], loose)
        assert not torch.equal(flat[:, slots], old_flat[:, slots])  # really written
        keep = torch.ones(flat.shape[1], dtype=torch.bool)
        keep[slots] = False
        assert torch.equal(flat[:, keep], ref_flat[:, keep])  # nothing else touched
    return got


@pytest.mark.parametrize("lengths", [[1], [7], [40], [1, 17, 16, 33], [5, 64, 9]])
@pytest.mark.parametrize(
    "kinds",
    [_kinds(), _kinds("q8_0", "q8_0", "q8_0", "q8_0"), _kinds("q8_0", "q4_1", "q4_1", "q8_0")],
    ids=["q4_1", "q8_0", "mixed"],
)
def test_fused_step_matches_the_layers(lengths, kinds, monkeypatch):
    arch = _arch(head_dim=64)
    model = _model(arch, kinds)
    assert cpu_fused_decode.fused_decode_status(model.model) == "on"
    _compare(model, arch, lengths, monkeypatch)


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(32, 4, 1), (128, 2, 2), (48, 6, 3)])
def test_fused_step_head_geometries(head_dim, heads, kv_heads, monkeypatch):
    """head_dim 64 and 128 have their own attention code, others the generic loop; GQA
    groups of 4, 1 and 2."""
    arch = _arch(head_dim=head_dim, heads=heads, kv_heads=kv_heads)
    model = _model(arch, _kinds("q4_1", "q8_0", "q4_1", "q4_1"), seed=head_dim)
    for lengths in ([3], [2, 31, 18]):
        _compare(model, arch, lengths, monkeypatch, seed=len(lengths))


def test_fused_steps_between_unfused_ones(monkeypatch):
    """Steps alternate between the fused kernel and the layers: torch_ref's decode
    workspace (which carries contexts from step to step) must not reuse what the fused
    steps never copied into it. Both runs see the same sequence of steps."""
    arch = _arch(head_dim=64)
    model = _model(arch, _kinds())
    tables = _tables([48, 48], 3)
    ids = torch.tensor([5, 9])
    runs = {}
    for pattern in ("mixed", "layers"):
        pool, backend = _pool(model, 3), _backend(arch)
        outs = []
        for step in range(5):
            fused = pattern == "mixed" and step % 2 == 1
            lengths = [20 + step, 30 + step]
            outs.append(
                _decode(model, arch, pool, backend, lengths, tables, ids, fused, monkeypatch)
            )
        runs[pattern] = outs
    for got, want in zip(runs["mixed"], runs["layers"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_output_rows_and_prefill_steps(monkeypatch):
    arch = _arch(head_dim=64)
    model = _model(arch, _kinds())
    monkeypatch.setenv(cpu_fused_decode.ENV_SWITCH, "1")
    pool, backend = _pool(model, 1), _backend(arch)
    # A prefill step (a request of 3 query tokens) is not decode-only: the layers run.
    md = build_attention_metadata([3], [3], [[0]], BLOCK, "cpu")
    with torch.inference_mode(), forward_context(backend, backend.build_metadata(md), pool):
        assert (
            cpu_fused_decode.decode_step(model.model, torch.tensor([1, 2, 3]), torch.arange(3))
            is None
        )
    lengths, tables = [4, 9], _tables([4, 9], 1)
    md = build_attention_metadata([1, 1], lengths, tables, BLOCK, "cpu")
    ids, positions = torch.tensor([7, 8]), torch.tensor([3, 8])
    with torch.inference_mode():
        with forward_context(backend, backend.build_metadata(md), _pool(model, 1)):
            full = model(ids, positions)
        with forward_context(backend, backend.build_metadata(md), _pool(model, 1)):
            part = model(ids, positions, torch.tensor([1]))
    assert torch.equal(part, full[1:])


def test_where_it_does_not_apply(monkeypatch):
    float_model = _model(_arch(head_dim=64), None)
    assert "not Q4_1/Q8_0 blocks" in cpu_fused_decode.fused_decode_status(float_model.model)
    qk_norm = _model(_arch(head_dim=64, architecture="Qwen3ForCausalLM", qk_norm=True), _kinds())
    assert "qk_norm" in cpu_fused_decode.fused_decode_status(qk_norm.model)
    bias = _model(
        _arch(head_dim=64, architecture="Qwen2ForCausalLM", attention_bias=True), _kinds()
    )
    assert "bias" in cpu_fused_decode.fused_decode_status(bias.model)
    monkeypatch.setenv(cpu_fused_decode.ENV_SWITCH, "0")
    model = _model(_arch(head_dim=64), _kinds())
    assert cpu_fused_decode.fused_decode_status(model.model).startswith("off (")
    # Outside a forward context it stands aside (the layers raise the error).
    monkeypatch.setenv(cpu_fused_decode.ENV_SWITCH, "1")
    assert cpu_fused_decode.decode_step(model.model, torch.tensor([1]), torch.tensor([0])) is None


def test_fp8_cache_falls_back(monkeypatch):
    arch = _arch(head_dim=64)
    model = _model(arch, _kinds())
    monkeypatch.setenv(cpu_fused_decode.ENV_SWITCH, "1")
    pool = KVCachePool(
        KVCacheConfig(NUM_BLOCKS, kv_cache_specs(model, BLOCK, torch.float8_e4m3fn)), "cpu"
    )
    backend = _backend(arch)
    md = build_attention_metadata([1], [5], [[2]], BLOCK, "cpu")
    with torch.inference_mode(), forward_context(backend, backend.build_metadata(md), pool):
        assert (
            cpu_fused_decode.decode_step(model.model, torch.tensor([3]), torch.tensor([4])) is None
        )


# The embedded SmolLM2 end to end: its greedy tokens with and without the fused step.
# Batch 1 runs with float activations here (CpuBlocksConfig.quantize_activations off, the
# default, which both paths follow): 8-bit activation rounding is discontinuous, and on
# this model a one-ulp change of the embedding table alone moves the unfused path's
# greedy tokens (first difference after 4 to 26 of 32 tokens on 4 of 6 prompts,
# measured), as much as the fused step's rounding does. Rows of a batch use the float
# tiles in both paths.
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]
NEW_TOKENS = 16


def _greedy(path, fused: bool, monkeypatch) -> list[list[int]]:
    from pagoda.entrypoints.llm import LLM
    from pagoda.sampling_params import SamplingParams

    monkeypatch.setenv(cpu_fused_decode.ENV_SWITCH, "1" if fused else "0")
    llm = LLM(str(path), quantization="gguf", device="cpu")
    model = llm.llm_engine.executor.runner.model.model
    assert (cpu_fused_decode.fused_decode_status(model) == "on") == fused
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batched = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    runner = llm.llm_engine.executor.runner
    runner.use_kernel_configs(_with_blocks_config(runner.kernel_configs, False))
    alone = [
        list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in PROMPTS[:2]
    ]
    return batched + alone


def test_embedded_smollm2_gguf_greedy_same_tokens(smollm2_gguf, monkeypatch):
    fused = _greedy(smollm2_gguf, True, monkeypatch)
    unfused = _greedy(smollm2_gguf, False, monkeypatch)
    assert fused == unfused


def test_a_plan_never_used_is_skipped_and_expires():
    """torch_ref builds its plan lazily; a step that never used it (a fused step) counts
    as a step without decode rows, and the old plan cannot be built out of order."""
    arch = _arch(head_dim=64)
    backend = _backend(arch)
    first = backend.build_metadata(build_attention_metadata([1], [5], [[2]], BLOCK, "cpu"))
    second = backend.build_metadata(build_attention_metadata([1], [6], [[2]], BLOCK, "cpu"))
    with pytest.raises(RuntimeError, match="after the next step"):
        first.plan()
    assert second.decode.assignment.carried == [False]


def test_engine_preemption_prefix_cache_async_same_tokens(monkeypatch):
    """Through the engine with a pool too small for the batch (preemption, recompute),
    prefix caching (prompts sharing a prefix) and async scheduling, the fused steps give
    the tokens the layers give, and every block comes back. Float activations at batch 1
    (see PROMPTS above): the batch shrinks to one row at times."""
    from helpers.engine_checks import assert_all_blocks_free, make_prompts

    from pagoda import LLM, SamplingParams

    fused_steps = []
    run = cpu_fused_decode.FusedDecode.run

    def counted(self, *args):
        out = run(self, *args)
        fused_steps.append(out is not None)
        return out

    monkeypatch.setattr(cpu_fused_decode.FusedDecode, "run", counted)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    results = {}
    for fused in (True, False):
        monkeypatch.setenv(cpu_fused_decode.ENV_SWITCH, "1" if fused else "0")
        llm = LLM(
            quantization="gguf",
            device="cpu",
            max_model_len=256,
            max_num_batched_tokens=64,
            max_num_seqs=16,
            num_gpu_blocks_override=12,
            enable_prefix_caching=True,
            async_scheduling=True,
        )
        runner = llm.llm_engine.executor.runner
        runner.use_kernel_configs(_with_blocks_config(runner.kernel_configs, False))
        prompts = make_prompts(llm.get_tokenizer(), 10)
        prompts = prompts + [prompts[5] + [11, 12, 13], prompts[9][:20]]  # shared prefixes
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.llm_engine.get_stats().num_preemptions > 0
        assert_all_blocks_free(llm)
        results[fused] = [list(o.outputs[0].token_ids) for o in outs]
    assert sum(fused_steps) > 20  # the fused kernel took the decode steps
    assert results[True] == results[False]
