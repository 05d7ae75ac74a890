"""Torch references of the gated delta rule and the causal depthwise conv1d that
hybrid linear-attention layers run (Qwen3-Next GatedDeltaNet, Kimi Delta Attention).

These are the golden functions the Triton kernels are tested against, and the path the
engine takes on the CPU. All math is float32; outputs come back in the input's dtype,
states in float32.

Layout (the engine flattens requests, so sequences are concatenated):
- q, k: [T, Hk, Dk]; v: [T, Hv, Dv], Hv a multiple of Hk (value head h reads key head
  h // (Hv // Hk)).
- g: the log decay (<= 0), [T, Hv] for one gate per head (GatedDeltaNet) or [T, Hv, Dk]
  for one per key channel (KDA); beta: [T, Hv].
- cu_seqlens: [N + 1] int offsets of the N sequences in T (None: one sequence).
- state: [N, Hv, Dk, Dv], one per sequence. Per token t of a sequence:
    S <- diag(exp(g_t)) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (scale q_t)
  with scale = Dk ** -0.5 by default and q, k optionally L2-normalised first.

The chunked form computes the same thing a chunk (64 tokens) at a time: inside a chunk
the delta-rule updates form a unit lower-triangular system (the WY / UT form) whose
solution turns the chunk into a few matrix products against the carried state.

The conv state holds a sequence's last K-1 inputs, oldest first: [N, K-1, C] with the
channels contiguous, the weight is [C, K] (a depthwise conv1d's weight squeezed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension, as the models normalise q and k."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _spans(cu_seqlens: torch.Tensor | None, total: int) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, total)]
    offsets = [int(x) for x in cu_seqlens.tolist()]
    return list(zip(offsets[:-1], offsets[1:], strict=True))


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    """Float32 copies with k and q expanded to the value heads, q scaled, g per channel."""
    num_k_heads, dk = k.shape[1], k.shape[2]
    num_v_heads = v.shape[1]
    if num_v_heads % num_k_heads:
        raise ValueError(
            f"value heads ({num_v_heads}) must be a multiple of key heads ({num_k_heads})"
        )
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    group = num_v_heads // num_k_heads
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    q = q * (dk**-0.5 if scale is None else scale)
    if g.dim() == 2:
        g = g.unsqueeze(-1).expand(-1, -1, dk)
    return q, k, v, g, beta


def _initial(initial_state, num_seqs, heads, dk, dv, device) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros(num_seqs, heads, dk, dv, dtype=torch.float32, device=device)
    if initial_state.shape != (num_seqs, heads, dk, dv):
        raise ValueError(
            f"initial_state {tuple(initial_state.shape)} != {(num_seqs, heads, dk, dv)}"
        )
    return initial_state.float()


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time: (o [T, Hv, Dv] in q's dtype, final
    state [N, Hv, Dk, Dv] float32). Layout in the module docstring."""
    spans = _spans(cu_seqlens, q.shape[0])
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    heads, dk, dv = vf.shape[1], kf.shape[2], vf.shape[2]
    states = _initial(initial_state, len(spans), heads, dk, dv, q.device).clone()
    out = torch.zeros(q.shape[0], heads, dv, dtype=torch.float32, device=q.device)
    for n, (bos, eos) in enumerate(spans):
        s = states[n]
        for t in range(bos, eos):
            s = s * gf[t].exp().unsqueeze(-1)
            predicted = (s * kf[t].unsqueeze(-1)).sum(dim=-2)
            delta = (vf[t] - predicted) * bf[t].unsqueeze(-1)
            s = s + kf[t].unsqueeze(-1) * delta.unsqueeze(-2)
            out[t] = (s * qf[t].unsqueeze(-1)).sum(dim=-2)
        states[n] = s
    return out.to(q.dtype), states


def _chunk_step(s, q, k, v, g, beta):
    """One chunk of one sequence, all heads: q, k [H, C, Dk] (q scaled), v [H, C, Dv],
    g [H, C, Dk] (per-token log decay), beta [H, C]; s [H, Dk, Dv]. Returns (o, s')."""
    c = q.shape[1]
    cum = g.cumsum(dim=1)  # log decay from the chunk's start through each position
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # decay[h, i, j, d] = exp(cum_i - cum_j) for j <= i: at most 1, so no overflow.
    diff = (cum.unsqueeze(2) - cum.unsqueeze(1)).masked_fill(~lower[..., None], float("-inf"))
    decay = diff.exp()
    kk = torch.einsum("hid,hjd,hijd->hij", k, k, decay)
    qk = torch.einsum("hid,hjd,hijd->hij", q, k, decay)
    # (I + A) U = beta (V - (K * exp(cum)) S), A strictly lower: the chunk's updates.
    system = (beta.unsqueeze(-1) * kk).masked_fill(~lower.tril(-1), 0.0)
    system = system + torch.eye(c, device=q.device)
    rhs_v = beta.unsqueeze(-1) * v
    rhs_k = beta.unsqueeze(-1) * k * cum.exp()
    w_v = torch.linalg.solve_triangular(system, rhs_v, upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(system, rhs_k, upper=False, unitriangular=True)
    u = w_v - w_k @ s
    o = (q * cum.exp()) @ s + qk @ u
    last = cum[:, -1:, :]
    s = s * last.transpose(1, 2).exp() + (k * (last - cum).exp()).transpose(1, 2) @ u
    return o, s


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule a chunk at a time (equal to the recurrent form up to float
    rounding); same arguments and results as ``gated_delta_rule_recurrent``."""
    spans = _spans(cu_seqlens, q.shape[0])
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    heads, dk, dv = vf.shape[1], kf.shape[2], vf.shape[2]
    states = _initial(initial_state, len(spans), heads, dk, dv, q.device).clone()
    out = torch.zeros(q.shape[0], heads, dv, dtype=torch.float32, device=q.device)
    for n, (bos, eos) in enumerate(spans):
        s = states[n]
        for start in range(bos, eos, chunk):
            end = min(start + chunk, eos)
            # Padding a short chunk with zero k, v, beta and g changes nothing: no update, no decay.
            pad = chunk - (end - start)
            parts = [x[start:end].transpose(0, 1) for x in (qf, kf, vf, gf)]
            q_c, k_c, v_c, g_c = (F.pad(x, (0, 0, 0, pad)) for x in parts)
            b_c = F.pad(bf[start:end].transpose(0, 1), (0, pad))
            o, s = _chunk_step(s, q_c, k_c, v_c, g_c, b_c)
            out[start:end] = o[:, : end - start].transpose(0, 1)
        states[n] = s
    return out.to(q.dtype), states


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"unsupported conv activation {activation!r} (silu or None)")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv1d over concatenated sequences: x [T, C], weight [C, K],
    conv_state [N, K-1, C] (each sequence's preceding inputs; None: zeros). Returns
    (out [T, C] in x's dtype, the new state [N, K-1, C] in float32: the last K-1 inputs
    of each sequence, its old state filling in where it has fewer tokens)."""
    spans = _spans(cu_seqlens, x.shape[0])
    channels, width = weight.shape
    if conv_state is None:
        conv_state = torch.zeros(len(spans), width - 1, channels, device=x.device)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    new_state = torch.empty(conv_state.shape, dtype=torch.float32, device=x.device)
    w = weight.float()
    for n, (bos, eos) in enumerate(spans):
        window = torch.cat([conv_state[n].float(), x[bos:eos].float()], dim=0)
        for t in range(eos - bos):
            out[bos + t] = (window[t : t + width] * w.t()).sum(dim=0)
        new_state[n] = window[window.shape[0] - (width - 1) :]
    if bias is not None:
        out = out + bias.float()
    return _activate(out, activation).to(x.dtype), new_state


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: x [N, C], conv_state [N, K-1, C]. Returns (out [N, C],
    the new state [N, K-1, C] float32)."""
    window = torch.cat([conv_state.float(), x.float().unsqueeze(1)], dim=1)  # [N, K, C]
    out = (window * weight.float().t()).sum(dim=1)
    if bias is not None:
        out = out + bias.float()
    return _activate(out, activation).to(x.dtype), window[:, 1:].contiguous()
