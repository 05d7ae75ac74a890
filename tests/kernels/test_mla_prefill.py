"""The MLA prefill kernel (pagoda/kernels/attention/mla_prefill.py) against the reference
(pagoda.attention.mla_backend.prefill_attention on q/k/v assembled as the torch backend
assembles them).

Without CUDA the kernel runs under TRITON_INTERPRET=1 (set before Triton is imported,
by conftest or here) on small shapes in float16 and float32. Inputs are laid out as the
layer holds them: q_nope / q_rope split from one [T, H, Dn + Dr] tensor, k_nope / v
split from kv_b_proj's [C, H, Dn + Dv] output, k_rope the tail of [C, kv_lora_rank +
Dr] latent entries. Rows of out that are not prefill rows, and context rows between
chunks, hold NaN: a kernel writing or reading them would show it.
"""

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
from helpers.interpreted_kernels import kernel_modules  # noqa: E402

from pagoda.attention.mla_backend import (  # noqa: E402
    PrefillChunk,
    assemble_prefill_qk,
    plan_eager,
    prefill_attention,
)

DEVICE = "cuda" if ON_GPU else "cpu"
(MLA_PREFILL,) = kernel_modules("attention.mla_prefill")
KV_LORA_RANK = 12  # the width before k_rope in a latent entry: makes k_rope's stride odd
GAP = 3  # NaN context rows after each chunk's context


def _small_prefill_tiles(block_m=16, block_n=16, num_warps=None):
    """The default MLA config with the prefill tiles block_m x block_n (and num_warps)
    for both dtypes, their stages as the default's."""
    from dataclasses import replace

    from pagoda.kernels.attention.mla_config import MLAKernelConfig

    config = MLAKernelConfig.for_capability((9, 0))
    tiles = {
        name: replace(
            getattr(config, name),
            block_m=block_m,
            block_n=block_n,
            num_warps=num_warps or getattr(config, name).num_warps,
        )
        for name in ("prefill_16bit", "prefill_fp32")
    }
    return replace(config, **tiles)


class PrefillCase:
    """Chunks given as (query rows, context rows), their step rows scattered among rows
    no chunk uses, and inputs strided like the layer's."""

    def __init__(self, layout, dn, dr, dv, dtype, num_heads=3, seed=0):
        gen = torch.Generator().manual_seed(seed)
        num_prefill = sum(q for q, _ in layout)
        num_rows = num_prefill + 5  # 5 rows of the step that no chunk owns
        self.q_rows = torch.randperm(num_rows, generator=gen)[:num_prefill]
        self.chunks, row, ctx = [], 0, 0
        for qlen, klen in layout:
            self.chunks.append(PrefillChunk(row, row + qlen, ctx, ctx + klen))
            row, ctx = row + qlen, ctx + klen + GAP
        q = torch.randn(num_rows, num_heads, dn + dr, generator=gen).to(dtype)
        self.q_nope, self.q_rope = q.split([dn, dr], dim=-1)
        entries = torch.randn(ctx, KV_LORA_RANK + dr, generator=gen).to(dtype)
        kv = torch.randn(ctx, num_heads * (dn + dv), generator=gen).to(dtype)
        for c in self.chunks:  # the gap after each chunk
            entries[c.ctx_end : c.ctx_end + GAP] = float("nan")
            kv[c.ctx_end : c.ctx_end + GAP] = float("nan")
        self.k_rope = entries[:, KV_LORA_RANK:]
        self.k_nope, self.v = kv.view(ctx, num_heads, dn + dv).split([dn, dv], dim=-1)
        self.scale = (dn + dr) ** -0.5

    def reference(self) -> torch.Tensor:
        """[P, H, Dv] float32: the torch backend's assembly, then SDPA in float32."""
        q, k = assemble_prefill_qk(
            self.q_nope[self.q_rows], self.q_rope[self.q_rows], self.k_nope, self.k_rope
        )
        return prefill_attention(
            q.float(), k.float(), self.v.float(), self.chunks, self.scale, upcast=True
        )

    def run(self, tile_rows, config) -> torch.Tensor:
        """The kernel's out [T, H, Dv], started as NaN, on the CPU."""
        table = MLA_PREFILL.prefill_tile_table(
            [(c.row_start, c.row_end, c.ctx_start, c.ctx_end) for c in self.chunks], tile_rows
        )
        tiles = torch.tensor(table, dtype=torch.int32, device=DEVICE)
        dev = [
            t.to(DEVICE)
            for t in (self.q_nope, self.q_rope, self.k_nope, self.k_rope, self.v, self.q_rows)
        ]
        q_nope, q_rope, k_nope, k_rope, v, q_rows = dev
        out = torch.full(
            (q_nope.shape[0], q_nope.shape[1], v.shape[-1]),
            float("nan"),
            dtype=q_nope.dtype,
            device=DEVICE,
        )
        MLA_PREFILL.mla_prefill_attention(
            out,
            q_nope,
            q_rope,
            k_nope,
            k_rope,
            v,
            q_rows,
            tiles,
            tile_rows,
            self.scale,
            config=config,
        )
        return out.cpu()


LAYOUTS = {
    "one_chunk": [(37, 37)],
    "several_chunks": [(5, 5), (33, 33), (16, 16), (1, 1)],
    # Tiles whose first position is 14 or 30 (BLOCK_N 16): their diagonal key tile
    # starts right after that position.
    "cached_prefix": [(7, 30), (20, 52), (10, 24), (16, 16), (1, 31)],
}
# (tile rows, kernel config): tiles filling BLOCK_M, tiles shorter than BLOCK_M, and a
# diagonal wider than one key tile.
TILINGS = [
    (16, dict(block_m=16, block_n=16)),
    (8, dict(block_m=16, block_n=16)),
    (32, dict(block_m=32, block_n=16, num_warps=4)),
]


def _check(case, tile_rows, config, dtype):
    out = case.run(tile_rows, _small_prefill_tiles(**config))
    expected = case.reference()
    written = torch.zeros(out.shape[0], dtype=torch.bool)
    written[case.q_rows] = True
    assert out[~written].isnan().all()  # rows that are not prefill rows untouched
    got = out[case.q_rows].float()
    assert not got.isnan().any()  # every prefill row written
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tiling", range(len(TILINGS)))
def test_prefill_kernel_matches_reference(dtype, layout, tiling):
    tile_rows, config = TILINGS[tiling]
    case = PrefillCase(LAYOUTS[layout], 32, 16, 16, dtype, seed=tiling)
    _check(case, tile_rows, config, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_kernel_pads_narrow_widths(dtype):
    """Dr 8 (padded to tl.dot's 16) and Dv wider than Dn."""
    case = PrefillCase(LAYOUTS["cached_prefix"], 16, 8, 32, dtype, num_heads=2, seed=7)
    _check(case, 16, dict(block_m=16, block_n=16), dtype)


def test_tile_table_covers_every_row_once_longest_first():
    chunks = [(0, 5, 0, 5), (5, 38, 8, 50), (38, 39, 50, 60)]
    table = MLA_PREFILL.prefill_tile_table(chunks, 16)
    rows = sorted(r for q_start, q_end, _, _ in table for r in range(q_start, q_end))
    assert rows == list(range(39))
    assert all(0 < q_end - q_start <= 16 for q_start, q_end, _, _ in table)
    ends = [first_pos + q_end - q_start for q_start, q_end, _, first_pos in table]
    assert ends == sorted(ends, reverse=True)
    # The second chunk (33 rows after 9 cached) tiles at rows 5, 21, 37; the third
    # chunk's one row sits at position 9 of 10.
    for tile in ([5, 21, 8, 9], [21, 37, 8, 25], [37, 38, 8, 41], [38, 39, 50, 9]):
        assert tile in table
    with pytest.raises(ValueError, match="query rows <= context rows"):
        MLA_PREFILL.prefill_tile_table([(0, 5, 0, 4)], 16)


def test_prefill_kernel_rejects_mismatched_inputs():
    case = PrefillCase([(4, 4)], 16, 16, 16, torch.float32)
    tiles = torch.tensor([[0, 4, 0, 0]], dtype=torch.int32)
    out = torch.empty(case.q_nope.shape[0], 3, 16)
    args = (case.q_nope, case.q_rope, case.k_nope, case.k_rope, case.v, case.q_rows)
    with pytest.raises(ValueError, match="do not fit BLOCK_M"):
        MLA_PREFILL.mla_prefill_attention(
            out, *args, tiles, 32, 1.0, config=_small_prefill_tiles(block_m=16)
        )
    with pytest.raises(ValueError, match="one block_m for every dtype"):
        from dataclasses import replace

        config = _small_prefill_tiles()
        replace(config, prefill_fp32=replace(config.prefill_fp32, block_m=32))
    with pytest.raises(ValueError, match="share one of"):
        MLA_PREFILL.mla_prefill_attention(out.half(), *args, tiles, 16, 1.0)


@pytest.mark.parametrize("dn", [16, 24])  # 24: not a power of two, SDPA's fallback
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_backend_prefill_matches_the_torch_backend(dtype, dn):
    """A step's plan (a decode, a fresh prompt, a chunk after a cached prefix) through
    MLATritonBackend.build_metadata and forward_prefill (tiles of 16 rows) writes the
    prefill rows as MLATorchBackend does and leaves the decode row alone."""
    from pagoda.attention.metadata import build_attention_metadata
    from pagoda.attention.mla_backend import MLATorchBackend
    from pagoda.attention.mla_triton import MLATritonBackend

    query_lens, seq_lens = [1, 21, 18], [6, 21, 40]
    tables = [[0, 1], [2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
    md = build_attention_metadata(query_lens, seq_lens, tables, 4, DEVICE)
    args = (3, KV_LORA_RANK, 8, 0.3)
    triton_backend = MLATritonBackend(*args, config=_small_prefill_tiles())
    plan = triton_backend.build_metadata(md)
    assert plan.prefill_tile_rows == 16 and plan.prefill_tiles.shape == (4, 4)
    case = PrefillCase([(21, 21), (18, 40)], dn, 8, 16, dtype)
    num_rows = sum(query_lens)
    q_nope, q_rope = case.q_nope[:num_rows].to(DEVICE), case.q_rope[:num_rows].to(DEVICE)
    ctx = torch.cat([torch.arange(21), torch.arange(24, 64)])  # the contexts, less the gap
    k_nope, k_rope, v = (t[ctx].to(DEVICE) for t in (case.k_nope, case.k_rope, case.v))
    outs = []
    for backend, p in ((MLATorchBackend(*args), plan_eager(md, "decode")), (triton_backend, plan)):
        out = torch.full((num_rows, 3, 16), float("nan"), dtype=dtype, device=DEVICE)
        backend.forward_prefill(out, q_nope, q_rope, k_nope, k_rope, v, p)
        outs.append(out.cpu())
    assert outs[1][0].isnan().all() and not outs[1][1:].isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(outs[1][1:].float(), outs[0][1:].float(), rtol=tol, atol=tol)
