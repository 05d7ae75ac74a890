"""MXFP4 expert weights (gpt-oss checkpoints as released): the format and its torch
dequantization, done once while loading.

Format (OCP microscaling, as transformers' mxfp4 integration reads it): a weight of
``out`` rows and ``in`` columns is stored as
- ``<name>_blocks`` uint8 [..., out, in / 32, 16]: 32 e2m1 values per block, two per
  byte, the low nibble first (column 2j of the block in bits 0-3, 2j + 1 in bits 4-7);
  e2m1 is sign, 2 exponent bits and 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and
  their negatives;
- ``<name>_scales`` uint8 [..., out, in / 32]: one e8m0 scale per block, the power of
  two 2^(scale - 127).
gpt-oss names its experts' ``gate_up_proj`` (out = 2 * intermediate, interleaved gate /
up columns, in = hidden) and ``down_proj`` (out = hidden, in = intermediate) this way,
and its float layout is transposed: [experts, in, out] (``x @ w``). ``expert_weight``
turns a pair into that layout in the model's dtype.

Values are computed in float32 (every e2m1 value times a power of two is exact there
down to 2^-126) and then rounded to the dtype once.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per scale
# e2m1 code (4 bits: sign, exponent, mantissa) -> value.
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
E8M0_BIAS = 127
SUFFIXES = ("_blocks", "_scales")


def check_pair(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """blocks [..., out, in / 32, 16] and scales [..., out, in / 32], both uint8."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.dim() < 3 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks [..., out, in/32, 16] and scales [..., out, in/32] disagree: "
            f"{tuple(blocks.shape)} and {tuple(scales.shape)}"
        )


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., out, G, 16], scales [..., out, G] -> [..., out, G * 32] in dtype."""
    check_pair(blocks, scales)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).int()  # low nibble first
    values = table[codes].flatten(-2)  # [..., out, G, 32]
    exponents = scales.to(torch.int32) - E8M0_BIAS
    values = torch.ldexp(values, exponents.unsqueeze(-1).to(torch.float32))
    return values.flatten(-2).to(dtype)


def expert_weight(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An expert stack's MXFP4 pair [E, out, G, 16] / [E, out, G] -> its float layout
    [E, in = G * 32, out] in dtype (gpt-oss's ``x @ w`` parameters). One expert at a
    time: the float32 and index temporaries stay one expert's size (a gpt-oss-20b
    gate_up_proj expert: 16.6M values)."""
    if blocks.dim() != 4:
        raise ValueError(
            f"MXFP4 expert blocks must be [E, out, in/32, 16], got {tuple(blocks.shape)}"
        )
    check_pair(blocks, scales)
    num_experts, rows, groups, _ = blocks.shape
    out = torch.empty(num_experts, groups * BLOCK, rows, dtype=dtype, device=blocks.device)
    for e in range(num_experts):
        out[e] = dequantize(blocks[e], scales[e], dtype).t()
    return out


def quantize_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] float -> (blocks, scales) whose dequantization is close to weight:
    each block's scale the power of two bringing its largest |value| to at most 6, each
    value rounded to the nearest e2m1 code. For tests and synthetic checkpoints."""
    out_rows, cols = weight.shape[-2:]
    if cols % BLOCK:
        raise ValueError(f"MXFP4 rows need a multiple of {BLOCK} columns, got {cols}")
    w = weight.float().reshape(*weight.shape[:-1], cols // BLOCK, BLOCK)
    top = w.abs().amax(-1, keepdim=True).clamp_min(2.0**-126)
    exponent = torch.ceil(torch.log2(top / 6.0)).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = torch.ldexp(w, -exponent)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=weight.device)
    codes = (scaled.unsqueeze(-1) - table).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponent.squeeze(-1) + E8M0_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()
