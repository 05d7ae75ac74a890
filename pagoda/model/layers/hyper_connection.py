"""Manifold-constrained hyper-connections (mHC): DeepSeek V4's residual of hc_mult streams.

A V4 decoder keeps every token as ``hc_mult`` residual streams ([T, n, hidden] rows; the
embedding is copied into each stream, ``expand_streams``). Around each block (attention,
then MoE) a ``HyperConnection`` computes, from the token's n streams:

- ``pre`` [T, n]: how the streams collapse into the block's input (sigmoid + eps);
- ``post`` [T, n]: how the block's output spreads back over the streams (2 * sigmoid);
- ``comb`` [T, n, n]: how the old streams mix into the new ones, projected onto the
  doubly-stochastic matrices by Sinkhorn-Knopp (``sinkhorn_project``), so that the
  residual's norm does not grow with depth.

All three come from one small projection of the RMS-normalised flattened streams
(``fn`` [(2 + n) * n, n * hidden], then per-output ``scale`` and ``base``), in float32
whatever the model's dtype. ``HyperHead`` collapses the streams of the last layer into
one hidden row before the final norm. Parameter names follow the Hugging Face modules
(``attn_hc.fn`` / ``.base`` / ``.scale``, ``hc_head.hc_fn`` / ``.hc_base`` / ``.hc_scale``);
every parameter is float32, replicated on every tensor-parallel rank.

The torch code here runs on CPU and GPU; on the GPU the whole mixing (norm, projection,
sigmoids, Sinkhorn, collapse) is a candidate for one fused kernel per site.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.layers.linear import default_weight_loader


def _fp32_param(*shape: int) -> nn.Parameter:
    """A replicated float32 parameter that keeps float32 when the model is materialised
    in bf16: the mixing weights feed sigmoids and a Sinkhorn iteration, which bf16
    rounding visibly moves."""
    param = nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)
    param.weight_loader = default_weight_loader
    param.keep_dtype = True
    return param


def _rms_scale(flat: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / rms of each row of flat (float32) -> [T, 1]."""
    return torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def sinkhorn_project(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Positive [..., n, n] -> (approximately) doubly stochastic: columns normalised
    first, then iters - 1 rounds of rows then columns, each sum floored by eps."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def expand_streams(hidden: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """The model's entry: [T, hidden] -> [T, hc_mult, hidden], a copy in every stream."""
    return hidden.unsqueeze(1).expand(-1, hc_mult, -1).contiguous()


class HyperMix(NamedTuple):
    """What a HyperConnection gives one block: its input and the two mixing weights."""

    collapsed: torch.Tensor  # [T, hidden] in the streams' dtype: the block's input
    post: torch.Tensor  # [T, n] float32
    comb: torch.Tensor  # [T, n, n] float32, doubly stochastic


class HyperConnection(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        hc_mult: int,
        sinkhorn_iters: int,
        hc_eps: float,
        norm_eps: float,
    ) -> None:
        """hc_eps floors the pre weights and the Sinkhorn sums; norm_eps is the RMS
        norm's (config.rms_norm_eps)."""
        super().__init__()
        if hc_mult < 1 or sinkhorn_iters < 1:
            raise ValueError(
                f"hc_mult ({hc_mult}) and hc_sinkhorn_iters ({sinkhorn_iters}) must be >= 1"
            )
        self.hidden_size, self.hc_mult = hidden_size, hc_mult
        self.sinkhorn_iters, self.hc_eps, self.norm_eps = sinkhorn_iters, hc_eps, norm_eps
        self.fn = _fp32_param((2 + hc_mult) * hc_mult, hc_mult * hidden_size)
        self.base = _fp32_param((2 + hc_mult) * hc_mult)
        self.scale = _fp32_param(3)

    def forward(self, streams: torch.Tensor) -> HyperMix:
        """streams [T, n, hidden] -> HyperMix (the collapsed block input, post, comb)."""
        num_tokens, n = streams.shape[0], self.hc_mult
        if streams.dim() != 3 or streams.shape[1:] != (n, self.hidden_size):
            raise ValueError(
                f"streams must be [T, {n}, {self.hidden_size}], got {tuple(streams.shape)}"
            )
        flat = streams.reshape(num_tokens, n * self.hidden_size).float()
        # The norm's per-row factor commutes with the projection: scaling the [T, (2 + n) n]
        # product spares a normalised float32 copy of the [T, n * hidden] rows.
        mixes = F.linear(flat, self.fn) * _rms_scale(flat, self.norm_eps)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb_logits = comb_w.view(num_tokens, n, n) * self.scale[2] + comb_b.view(n, n)
        comb = torch.softmax(comb_logits, dim=-1) + self.hc_eps
        comb = sinkhorn_project(comb, self.sinkhorn_iters, self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return HyperMix(collapsed, post, comb)

    @staticmethod
    def merge(
        block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """The new streams [T, n, hidden]: post spreads block_out [T, hidden] over the
        streams, plus comb^T mixing the old streams (new_k = sum_j comb[j, k] * old_j),
        in the streams' dtype."""
        dtype = streams.dtype
        spread = post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(1)
        return spread + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The last collapse: [T, n, hidden] -> [T, hidden], weighted by sigmoid(...) + eps of
    a projection of the RMS-normalised flattened streams (no Sinkhorn, no post)."""

    def __init__(self, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hidden_size, self.hc_mult = hidden_size, hc_mult
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = _fp32_param(hc_mult, hc_mult * hidden_size)
        self.hc_base = _fp32_param(hc_mult)
        self.hc_scale = _fp32_param(1)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        if streams.dim() != 3 or streams.shape[1:] != (self.hc_mult, self.hidden_size):
            raise ValueError(
                f"streams must be [T, {self.hc_mult}, {self.hidden_size}], "
                f"got {tuple(streams.shape)}"
            )
        flat = streams.reshape(streams.shape[0], self.hc_mult * self.hidden_size).float()
        mixes = F.linear(flat, self.hc_fn) * _rms_scale(flat, self.norm_eps)
        pre = torch.sigmoid(mixes * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
