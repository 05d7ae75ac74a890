"""FP8 experts (W8A16) in the fused MoE kernels against the torch reference.

The weights are quantized here per expert and per gate / up half, in 128x128 blocks
(partial edge blocks: hidden 272 and intermediate 160 are no multiples of 128) or per
output channel; the reference dequantizes them and runs the float computation. Both
paths (decode GEMVs, grouped GEMMs) run under TRITON_INTERPRET=1 without CUDA, with
float32 and float16 activations, several token counts, choices of another rank's
experts (-1), and the GEMVs' chunked tiles.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
from helpers.interpreted_kernels import kernel_modules  # noqa: E402

from pagoda.kernels.moe.reference import (  # noqa: E402
    ExpertScales,
    dequantize_expert,
    fused_moe_reference,
)

DEVICE = "cuda" if ON_GPU else "cpu"
FP8 = torch.float8_e4m3fn
HIDDEN, INTER, EXPERTS = 272, 160, 4


@pytest.fixture(scope="module")
def fm():
    return kernel_modules("moe.align", "moe.fused_moe_decode", "moe.fused_moe")[2]


def _quantize(w: torch.Tensor, block: tuple[int, int] | None):
    """[N, K] float -> (fp8 [N, K], float32 scale [ceil(N/bn), ceil(K/bk)] or [N, 1])."""
    n, k = w.shape
    if block is None:
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
        return (w / scale).clamp(-448, 448).to(FP8), scale.float()
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk)
    padded[:n, :k] = w
    tiles = padded.view(nb, bn, kb, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).clamp(-448, 448).view(nb * bn, kb * bk)[:n, :k]
    return q.to(FP8), scale.float()


def _fp8_experts(w13: torch.Tensor, w2: torch.Tensor, block):
    """Stacked float experts -> (fp8 w13, fp8 w2, ExpertScales), each half of w13 on its
    own blocks (as checkpoints store gate_proj and up_proj apart)."""
    inter = w13.shape[1] // 2
    q13, s13, q2, s2 = [], [], [], []
    for e in range(w13.shape[0]):
        (qg, sg), (qu, su) = _quantize(w13[e, :inter], block), _quantize(w13[e, inter:], block)
        q13.append(torch.cat((qg, qu)))
        s13.append(torch.cat((sg, su)))
        q, s = _quantize(w2[e], block)
        q2.append(q)
        s2.append(s)
    scales = ExpertScales(torch.stack(s13), torch.stack(s2), block)
    return torch.stack(q13), torch.stack(q2), scales


def _case(tokens: int, top_k: int, dtype, block, foreign=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * HIDDEN**-0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * INTER**-0.5
    weights, ids = torch.topk(torch.rand(tokens, EXPERTS, generator=gen).softmax(-1), top_k)
    ids = ids.int()
    if foreign:
        ids[::3, 0] = -1
    q13, q2, scales = _fp8_experts(w13, w2, block)
    to = dict(device=DEVICE)
    scales = ExpertScales(scales.w13_scale.to(**to), scales.w2_scale.to(**to), block)
    return (
        x.to(dtype).to(**to),
        q13.to(**to),
        q2.to(**to),
        weights.float().to(**to),
        ids.to(**to),
        scales,
    )


def test_dequantized_expert_is_close_to_the_float_weights():
    gen = torch.Generator().manual_seed(1)
    w13 = torch.randn(2, 2 * INTER, HIDDEN, generator=gen)
    w2 = torch.randn(2, HIDDEN, INTER, generator=gen)
    for block in ((128, 128), None):
        q13, q2, scales = _fp8_experts(w13, w2, block)
        d13, d2 = dequantize_expert(q13, q2, scales, 1)
        # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 per element.
        assert (d13 - w13[1]).abs().max() <= w13[1].abs().max() / 16
        assert (d2 - w2[1]).abs().max() <= w2[1].abs().max() / 16


def test_scales_of_the_wrong_shape_are_refused():
    _, q13, q2, _, _, scales = _case(2, 2, torch.float32, (128, 128))
    bad = ExpertScales(scales.w13_scale[:, :1], scales.w2_scale, (128, 128))
    with pytest.raises(ValueError, match="w13 scale must be float32"):
        bad.check(q13, q2)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        scales.check(q13.float(), q2)


@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "channel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("path,tokens", [("gemv", 1), ("gemv", 5), ("fused", 7), ("fused", 40)])
def test_fp8_experts_match_the_dequantized_reference(fm, path, tokens, dtype, block):
    x, q13, q2, weights, ids, scales = _case(tokens, 2, dtype, block, foreign=tokens > 1)
    got = fm.fused_moe(x, q13, q2, weights, ids, path=path, scales=scales)
    want = fused_moe_reference(
        x.cpu(), q13.cpu(), q2.cpu(), weights.cpu(), ids.cpu(), scales=_on_cpu(scales)
    )
    err = (got.cpu().float() - want.float()).abs().max().item()
    # float32: summation order only; float16: a rounding or two of outputs near 1
    # (measured <= 0.00098, one float16 step at 1.0).
    tol = 1e-4 if dtype == torch.float32 else 4e-3
    assert err < tol, f"{path} {tokens} tokens {dtype} {block}: max error {err}"


def test_gemv_chunked_tiles_scale_each_chunk(fm):
    """Small GEMV tiles: both kernels loop over chunks and column blocks, each chunk's
    scales read at its own columns."""
    from dataclasses import replace

    from pagoda.kernels.moe.config import DownTiles, GateUpTiles, MoEKernelConfig

    config = replace(
        MoEKernelConfig.for_capability((9, 0)),
        gate_up=GateUpTiles(block_n=8, block_k=32, num_warps=1, num_stages=2),
        down=DownTiles(block_n=16, block_k=64, num_warps=1, loop_stages=1),
        narrow_down_max=0,
    )
    x, q13, q2, weights, ids, scales = _case(3, 2, torch.float32, (128, 128), foreign=True)
    got = fm.fused_moe(x, q13, q2, weights, ids, path="gemv", config=config, scales=scales)
    want = fused_moe_reference(
        x.cpu(), q13.cpu(), q2.cpu(), weights.cpu(), ids.cpu(), scales=_on_cpu(scales)
    )
    assert (got.cpu() - want).abs().max().item() < 1e-4


def test_fp8_experts_refuse_a_shared_mlp(fm):
    x, q13, q2, weights, ids, scales = _case(1, 2, torch.float32, (128, 128))
    shared = (
        torch.zeros(2 * INTER, HIDDEN, device=DEVICE),
        torch.zeros(HIDDEN, INTER, device=DEVICE),
    )
    with pytest.raises(ValueError, match="shared MLP"):
        fm.fused_moe(x, q13, q2, weights, ids, path="gemv", shared=shared, scales=scales)


def _on_cpu(scales: ExpertScales) -> ExpertScales:
    return ExpertScales(scales.w13_scale.cpu(), scales.w2_scale.cpu(), scales.block)
