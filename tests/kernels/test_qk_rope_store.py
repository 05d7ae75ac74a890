"""kernels/qk_rope_store.py (q/k RMSNorm + rotary + KV store in one launch) against the
unfused path, and LlamaAttention's dispatch to it.

References: (1) the layers' torch code composed (RMSNorm's reference normalisation,
apply_rotary, an index_copy store; quantize_kv for FP8), (2) today's unfused kernels
on CUDA (fused_ops.rms_norm, fused_ops.rotary, store_kv). The fused kernel must equal
both bit for bit: same roundings in the same order. Without CUDA the kernels run under
TRITON_INTERPRET=1 in float16/float32 (the interpreter gets bfloat16 wrong); with CUDA
the same cases run compiled, where only (2) is held to equality.

Caches start poisoned (NaN, or the e4m3 byte 448 for FP8): every slot no real row
names must come back untouched.
"""

import os
import subprocess
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
from helpers.interpreted_kernels import kernel_modules  # noqa: E402
from helpers.kv_pool_helpers import pool_holding  # noqa: E402

from pagoda.attention.forward_context import forward_context  # noqa: E402
from pagoda.attention.kv_pool import FullAttentionLayout  # noqa: E402
from pagoda.attention.kv_quant import FP8_KV_DTYPE, as_bits, quantize_kv  # noqa: E402
from pagoda.attention.metadata import build_attention_metadata  # noqa: E402
from pagoda.attention.torch_ref import TorchRefBackend  # noqa: E402
from pagoda.core.kv_cache_spec import FullAttentionSpec  # noqa: E402
from pagoda.model.arch_config import ArchConfig  # noqa: E402
from pagoda.model.layers.layernorm import RMSNorm  # noqa: E402
from pagoda.model.layers.rotary import apply_rotary, rotary_tables  # noqa: E402
from pagoda.model.llama import LlamaAttention  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
FP8_POISON = 0x7E  # e4m3 448 (the interpreter cannot read the NaN bytes)


store_kv_module, fused_ops, qk_rope_store = kernel_modules(
    "attention.store_kv", "norm.fused_ops", "attention.qk_rope_store"
)


def _rand(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


class Case:
    """One step's qkv rows (a column slice of a wider buffer: row stride > width),
    cos/sin, norm weights, slots (some -1) and a poisoned cache."""

    def __init__(
        self,
        tokens,
        heads,
        kv_heads,
        head_dim,
        dtype,
        qk_norm,
        cache_dtype=None,
        block_size=4,
        pad_rows=(),
        seed=0,
    ):
        gen = torch.Generator().manual_seed(seed)
        self.shape = (heads, kv_heads, head_dim)
        width = (heads + 2 * kv_heads) * head_dim
        self.qkv = _rand(tokens, width + 24, dtype=dtype, gen=gen, scale=3.0)[:, :width]
        angles = torch.rand(tokens, head_dim // 2, generator=gen) * 100.0
        self.cos, self.sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
        self.q_weight = _rand(head_dim, dtype=dtype, gen=gen) if qk_norm else None
        self.k_weight = _rand(head_dim, dtype=dtype, gen=gen) if qk_norm else None
        self.eps = 1e-6
        num_blocks = -(-tokens // block_size) + 2
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
        slots[list(pad_rows)] = -1
        self.slots = slots.to(DEVICE)
        cache_dtype = cache_dtype or dtype
        self.fp8 = cache_dtype == FP8_KV_DTYPE
        self.scales = torch.tensor([0.37, 1.9], device=DEVICE) if self.fp8 else None
        self.cache = torch.empty(
            2, num_blocks, block_size, kv_heads, head_dim, dtype=cache_dtype, device=DEVICE
        )
        if self.fp8:
            self.cache.view(torch.uint8).fill_(FP8_POISON)
        else:
            self.cache.fill_(float("nan"))

    def fused(self, heads_per_program=None):
        cache = self.cache.clone()
        q = qk_rope_store.qk_norm_rope_store(
            self.qkv,
            self.cos,
            self.sin,
            self.q_weight,
            self.k_weight,
            self.eps,
            cache,
            self.slots,
            self.scales,
            *self.shape,
            heads_per_program=heads_per_program,
        )
        return q, cache

    def _split(self):
        heads, kv_heads, head_dim = self.shape
        tokens = self.qkv.shape[0]
        q, k, v = self.qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        return (
            q.reshape(tokens, heads, head_dim),
            k.reshape(tokens, kv_heads, head_dim),
            v.reshape(tokens, kv_heads, head_dim),
        )

    def torch_reference(self):
        """The layers' torch code: RMSNorm's reference normalisation, apply_rotary, then
        an index_copy of the real rows (quantize_kv for FP8)."""
        q, k, v = self._split()
        old, fused_ops.FUSED_OPS_ENABLED = fused_ops.FUSED_OPS_ENABLED, False
        try:
            if self.q_weight is not None:
                q, k = (self._norm(x, w) for x, w in ((q, self.q_weight), (k, self.k_weight)))
            q, k = apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)
        finally:
            fused_ops.FUSED_OPS_ENABLED = old
        cache = self.cache.clone()
        real = self.slots >= 0
        k, v, slots = k[real], v[real], self.slots[real]
        if self.fp8:
            k, v = quantize_kv(k, self.scales[0]), quantize_kv(v, self.scales[1])
        flat = as_bits(cache).view(2, -1, *cache.shape[3:])
        flat[0].index_copy_(0, slots, as_bits(k.to(cache.dtype)))
        flat[1].index_copy_(0, slots, as_bits(v.to(cache.dtype)))
        return q.reshape(q.shape[0], -1), cache

    def _norm(self, x, weight):
        norm = RMSNorm(x.shape[-1], self.eps).to(DEVICE)
        norm.weight.data = weight
        return norm._normalize_reference(x)

    def unfused_kernels(self):
        """Today's CUDA path: two rms_norm, two rotary and one store_kv launch."""
        q, k, v = self._split()
        if self.q_weight is not None:
            q = fused_ops.rms_norm(q, self.q_weight, self.eps)
            k = fused_ops.rms_norm(k, self.k_weight, self.eps)
        q, k = fused_ops.rotary(q, self.cos, self.sin), fused_ops.rotary(k, self.cos, self.sin)
        cache = self.cache.clone()
        store_kv_module.store_kv(k, v, cache, self.slots, self.scales)
        return q.reshape(q.shape[0], -1), cache


def _assert_matches_torch(case, q, cache):
    """Equal to the torch composition bit for bit, except float32 rows with qk_norm:
    torch's mean and the kernels' sum add the squares in different orders, so the
    inverse rms may differ by an ulp, and then q and k by a few ulps of their
    largest value (rotary adds two products)."""
    torch_q, torch_cache = case.torch_reference()
    if case.q_weight is None or case.qkv.dtype != torch.float32:
        assert _same(q, torch_q) and _same(cache, torch_cache)
        return
    atol = 4 * torch.finfo(torch.float32).eps * torch_q.abs().max().item()
    torch.testing.assert_close(q, torch_q, atol=atol, rtol=0)
    if case.fp8:  # v exact; k may round to the neighbouring e4m3 value (step 2^-3)
        assert _same(cache[1], torch_cache[1])
        torch.testing.assert_close(cache[0].float(), torch_cache[0].float(), atol=2**-9, rtol=2**-3)
    else:
        torch.testing.assert_close(cache, torch_cache, atol=atol, rtol=0, equal_nan=True)


def _agree(a, b):
    """Interpreted: the same bits. Compiled (GPU), each kernel contracts its own float32
    multiply-adds into FMAs, so a normalised value may round to its neighbour in the
    output dtype, and rotary (x1 cos - x2 sin) carries that difference, one unit in the
    last place of its inputs, into outputs that cancel to far smaller values: within
    one ulp of the value plus two ulps of the largest value (one e4m3 step for an FP8
    cache). Seen on the H200: float32 q off by 9.5e-7 where |q| <= ~10."""
    if not ON_GPU:
        assert _same(a, b)
        return
    fp8 = a.dtype == FP8_KV_DTYPE
    if fp8:  # the fp32 rows agree far inside one e4m3 step of the stored value
        eps, atol = 2**-3, 2**-9
    else:
        eps = torch.finfo(a.dtype).eps
        atol = 2 * eps * b.float().nan_to_num(0.0).abs().max().item()
    torch.testing.assert_close(a.float(), b.float(), rtol=eps, atol=atol, equal_nan=True)


def _same(a, b):
    """Bit equality, NaN poison included (float8 compared as bytes)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    return torch.equal(as_bits(a).view(torch.uint8), as_bits(b).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim,per_program",
    [
        (5, 4, 2, 64, None),  # GQA 2, the default grouping
        (3, 6, 3, 96, 4),  # head counts no power of two; head_dim 96 (halves of 48)
        (2, 5, 1, 32, 2),  # q tail group of one head; one kv head in a group of two
    ],
)
def test_matches_unfused_path_bit_for_bit(
    dtype, qk_norm, tokens, heads, kv_heads, head_dim, per_program
):
    case = Case(tokens, heads, kv_heads, head_dim, dtype, qk_norm, pad_rows=(1,))
    q, cache = case.fused(per_program)
    ref_q, ref_cache = case.unfused_kernels()
    _agree(q, ref_q)
    _agree(cache, ref_cache)
    assert q.is_contiguous() and q.shape == (tokens, heads * head_dim)
    if not ON_GPU:  # compiled, the kernels' float32 reduction order is their own
        _assert_matches_torch(case, q, cache)
    # The padding row still has its q; its k/v went nowhere (that slot stays NaN).
    assert not q[1].isnan().any()
    assert cache.isnan().sum() == case.cache.numel() - 2 * (tokens - 1) * kv_heads * head_dim


@pytest.mark.parametrize("per_program", [1, 2, 8])
def test_every_grouping_gives_the_same_bits(per_program):
    case = Case(4, 8, 2, 64, torch.float16, qk_norm=True, pad_rows=(0, 3))
    q, cache = case.fused(per_program)
    ref_q, ref_cache = case.fused(4)
    _agree(q, ref_q)
    _agree(cache, ref_cache)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_fp8_cache_bytes_equal_store_kv_and_quantize_kv(qk_norm):
    case = Case(
        6, 4, 2, 32, torch.float32, qk_norm, cache_dtype=FP8_KV_DTYPE, pad_rows=(2,), seed=3
    )
    q, cache = case.fused()
    ref_q, ref_cache = case.unfused_kernels()
    _agree(q, ref_q)
    _agree(cache, ref_cache)
    if not ON_GPU:
        _assert_matches_torch(case, q, cache)
    untouched = (cache.view(torch.uint8) == FP8_POISON).all(-1).all(-1)  # [2, blocks, bs]
    assert untouched.sum() == 2 * (cache.shape[1] * cache.shape[2] - 5)


def test_store_into_a_cache_of_another_dtype():
    # float32 rows into a float16 cache: rounded like store_kv's cast.
    case = Case(3, 2, 2, 16, torch.float32, qk_norm=True)
    case.cache = case.cache.half()
    q, cache = case.fused()
    ref_q, ref_cache = case.unfused_kernels()
    _agree(q, ref_q)
    _agree(cache, ref_cache)


def test_no_rows():
    case = Case(1, 2, 1, 16, torch.float32, qk_norm=True)
    empty = case.qkv[:0]
    q = qk_rope_store.qk_norm_rope_store(
        empty,
        case.cos[:0],
        case.sin[:0],
        case.q_weight,
        case.k_weight,
        1e-6,
        case.cache,
        case.slots,
        None,
        2,
        1,
        16,
    )
    assert q.shape == (0, 32)


def test_rejects_bad_inputs():
    case = Case(2, 2, 1, 16, torch.float32, qk_norm=True)
    args = dict(
        qkv=case.qkv,
        cos=case.cos,
        sin=case.sin,
        q_norm_weight=case.q_weight,
        k_norm_weight=case.k_weight,
        eps=1e-6,
        kv_cache=case.cache,
        slot_mapping=case.slots,
        kv_scales=None,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
    )
    bad = [
        (dict(num_heads=3), r"qkv must be \[T, 80\]"),
        (dict(cos=case.cos[:, :4]), r"cos must be \[2, 8\]"),
        (dict(k_norm_weight=None), "both or neither"),
        (dict(q_norm_weight=case.q_weight.half()), "qkv's dtype"),
        (dict(kv_cache=case.cache[0]), "kv_cache must be"),
        (dict(slot_mapping=case.slots[:1]), "at least 2"),
        (dict(kv_cache=case.cache.to(FP8_KV_DTYPE)), "needs kv_scales"),
        (dict(heads_per_program=3), "power of two"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            qk_rope_store.qk_norm_rope_store(**{**args, **change})


# ---- LlamaAttention's dispatch -------------------------------------------------------


def _attention_layer(qk_norm: bool, dtype) -> LlamaAttention:
    arch = ArchConfig(
        "Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM",
        hidden_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        vocab_size=32,
        qk_norm=qk_norm,
    )
    layer = LlamaAttention(arch, 0, _single_rank()).to(DEVICE)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return layer.to(dtype)


def _single_rank():
    from pagoda.model.parallel import SINGLE_RANK

    return SINGLE_RANK


def _run_layer(layer, hidden, cos, sin, md, cache, use_triton, monkeypatch):
    calls = []
    real = qk_rope_store.qk_norm_rope_store

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(qk_rope_store, "qk_norm_rope_store", spy)
    pool = pool_holding([cache], {FullAttentionSpec: FullAttentionLayout(use_triton)})
    backend = TorchRefBackend(4, 2, 16, 0.25)
    with forward_context(backend, backend.build_metadata(md), pool):
        out = layer(hidden, cos, sin)
    return out, pool.cache(0), calls


@pytest.mark.parametrize("qk_norm", [True, False])
def test_llama_attention_takes_the_fused_kernel_where_the_pool_uses_triton(qk_norm, monkeypatch):
    dtype = torch.float32
    layer = _attention_layer(qk_norm, dtype)
    gen = torch.Generator().manual_seed(1)
    # A prefill of 5 tokens after 3 cached ones, and a decode; one padding row.
    md = build_attention_metadata([5, 1], [8, 4], [[2, 0], [1]], 4, DEVICE, pad_to=7)
    hidden = _rand(7, 48, dtype=dtype, gen=gen)
    positions = torch.tensor([3, 4, 5, 6, 7, 3, 0])
    angles = torch.outer(positions.float(), torch.rand(8, generator=gen))
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    cache = _rand(2, 3, 4, 2, 16, dtype=dtype, gen=gen)
    fused_out, fused_cache, calls = _run_layer(
        layer, hidden, cos, sin, md, cache, True, monkeypatch
    )
    assert calls == [7]
    ref_out, ref_cache, calls = _run_layer(layer, hidden, cos, sin, md, cache, False, monkeypatch)
    assert calls == []  # torch stores: the unfused path
    torch.testing.assert_close(fused_cache, ref_cache, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fused_out[:6], ref_out[:6], atol=1e-5, rtol=1e-5)
    # CPU-style full-width tables, and the kernels switched off: the unfused path.
    tables = rotary_tables(cos, sin)
    assert _run_layer(layer, hidden, *tables, md, cache, True, monkeypatch)[2] == []
    monkeypatch.setattr(fused_ops, "FUSED_OPS_ENABLED", False)
    off_out, off_cache, calls = _run_layer(layer, hidden, cos, sin, md, cache, True, monkeypatch)
    assert calls == []
    torch.testing.assert_close(off_cache, fused_cache, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(ON_GPU, reason="CPU tensors through the interpreter")
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_tiny_model_on_the_fused_path_matches_transformers(kind, tmp_path, monkeypatch):
    # A whole tiny checkpoint, prefilled in two chunks (the second reads the first's
    # K/V back), with every layer's q/k/v through the fused kernel.
    from helpers.hf_compare import PROMPT, PagedRunner, hf_logits, make_hf

    from pagoda.attention.kv_pool import KVCachePool
    from pagoda.model.loader import load_model

    hf = make_hf(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model, arch = load_model(str(tmp_path), dtype="float32")
    # cos/sin [T, D/2] as on CUDA (on the CPU the model builds full-width tables, which
    # never take the fused kernel).
    monkeypatch.setattr(model.model, "rotary", lambda positions: model.model.rotary_emb(positions))
    calls = []
    real = qk_rope_store.qk_norm_rope_store
    monkeypatch.setattr(
        qk_rope_store,
        "qk_norm_rope_store",
        lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw),
    )
    runner = PagedRunner(model, arch)
    runner.kv_pool = KVCachePool(
        runner.kv_pool.config, "cpu", {FullAttentionSpec: FullAttentionLayout(use_triton=True)}
    )
    logits = torch.cat([runner.step({"r": PROMPT[:12]})["r"], runner.step({"r": PROMPT[12:]})["r"]])
    layers = arch.num_hidden_layers
    assert calls == [12] * layers + [8] * layers
    assert (logits - hf_logits(hf, PROMPT)).abs().max().item() < 1e-4


def test_cpu_attention_never_imports_triton():
    # A fresh interpreter: a CPU layer with a CPU pool (torch stores), even given
    # [T, D/2] cos/sin, asks the pool and stays on the unfused path without triton.
    script = (
        "import sys, torch\n"
        "from pagoda.attention.forward_context import forward_context\n"
        "from pagoda.attention.metadata import build_attention_metadata\n"
        "from pagoda.attention.torch_ref import TorchRefBackend\n"
        "from pagoda.core.kv_cache_spec import KVCacheConfig\n"
        "from pagoda.model.arch_config import ArchConfig\n"
        "from pagoda.model.layers.attention import kv_cache_specs\n"
        "from pagoda.model.llama import LlamaAttention\n"
        "from pagoda.model.parallel import SINGLE_RANK\n"
        "from pagoda.attention.kv_pool import KVCachePool\n"
        "arch = ArchConfig('Qwen3ForCausalLM', 32, 1, 2, 1, 16, 64, 32, qk_norm=True)\n"
        "layer = LlamaAttention(arch, 0, SINGLE_RANK)\n"
        "pool = KVCachePool(KVCacheConfig(2, kv_cache_specs(layer, 4, torch.float32)), 'cpu')\n"
        "backend = TorchRefBackend(2, 1, 16, 0.25)\n"
        "md = build_attention_metadata([3], [3], [[1]], 4, 'cpu')\n"
        "with forward_context(backend, backend.build_metadata(md), pool):\n"
        "    layer(torch.randn(3, 32), torch.ones(3, 8), torch.zeros(3, 8))\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert result.returncode == 0, result.stderr


# ---- CUDA only -----------------------------------------------------------------------

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("heads,kv_heads,qk_norm", [(32, 4, True), (32, 8, False)])
@pytest.mark.parametrize("tokens", [1, 8, 256])
def test_bf16_model_shapes_match_unfused_kernels(heads, kv_heads, qk_norm, tokens):
    # Qwen3-30B-A3B's and Llama-3.1-8B's attention (compiled: within one ulp, _agree).
    case = Case(tokens, heads, kv_heads, 128, torch.bfloat16, qk_norm, block_size=16, pad_rows=(0,))
    q, cache = case.fused()
    ref_q, ref_cache = case.unfused_kernels()
    _agree(q, ref_q)
    _agree(cache, ref_cache)


@gpu
def test_cuda_graph_capture_and_replay():
    case = Case(8, 32, 4, 128, torch.bfloat16, qk_norm=True, block_size=16, pad_rows=(5,))
    cache = case.cache.clone()

    def step():
        return qk_rope_store.qk_norm_rope_store(
            case.qkv,
            case.cos,
            case.sin,
            case.q_weight,
            case.k_weight,
            case.eps,
            cache,
            case.slots,
            None,
            32,
            4,
            128,
        )

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = step()
    for seed in (10, 11):  # new inputs copied in place, then replayed
        fresh = Case(8, 32, 4, 128, torch.bfloat16, qk_norm=True, block_size=16, seed=seed)
        case.qkv.copy_(fresh.qkv)
        case.cos.copy_(fresh.cos)
        case.sin.copy_(fresh.sin)
        cache.copy_(case.cache)
        graph.replay()
        ref_q, ref_cache = case.unfused_kernels()
        _agree(q, ref_q)
    _agree(cache, ref_cache)
