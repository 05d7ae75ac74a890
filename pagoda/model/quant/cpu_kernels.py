"""CPU weight-only quantized matmul: GGUF's Q4_1 and Q8_0 block layouts, how to make
them (quantize from float, repack Q4_0), read them back (dequantize), and multiply.

Layouts (32 weights per block; one output row's blocks contiguous, so a weight is a
uint8 tensor [out, in / 32, bytes per block] that shards in whole blocks):
- Q4_1, 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles; weight j = d * q_j + m with
  q_j = byte j & 15 for j < 16 and byte (j - 16) >> 4 for j >= 16 (llama.cpp's order).
- Q8_0, 34 bytes: fp16 d, 32 int8; weight j = d * q_j.
Q4_0 (fp16 d, nibbles; weight d * (q - 8)) is Q4_1 with m = -8d, exactly.

Why a kernel of our own: torch's CPU weight-packed kernels
(``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) measured 3x to 30x *slower*
than the float32 matmul on this AVX2 machine (docs/performance.md). cpu_kernels.c
multiplies the blocks directly (AVX2/FMA/F16C, OpenMP on torch's own libgomp); it is
compiled with the system C compiler on first use and cached, in one library with
cpu_layer.c (a whole fused decode step: pagoda/model/cpu_fused_decode.py); both include
the shared building blocks of cpu_gemm.h. Without a compiler or AVX2 the same results
come from the torch reference (dequantize, then ``pagoda.model.layers.matmul.linear``),
slower; ``native_status()`` says which runs.

Numerics: the weights the kernel dequantizes are bit-identical to the reference's (and
to gguf.quants.dequantize); only float32 rounding of the sums differs (cpu_kernels.c).
The kernels' variant (8-bit activations at batch 1, off by default) is a field of ``CpuBlocksConfig``,
which the caller passes.

``rows_linear`` is what the model's float layers call: for steps of 2 to SMALL_ROWS
rows on the CPU (small batches, speculative verify steps) it takes the compiled
register-tile kernel, which reads the weight once for all rows: MKL's small-M GEMM
costs 2-3x its one-row GEMV for the same weight bytes (docs/performance.md). Those
steps are then not bit-identical to F.linear (another summation order); one-row
steps, and larger ones, stay exactly F.linear's (``pagoda.model.layers.matmul.linear``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from pagoda.model.layers.matmul import linear

QK = 32  # weights per block
Q4_1_BYTES = 20
Q4_0_BYTES = 18
Q8_0_BYTES = 34
BLOCK_BYTES = {"q4_1": Q4_1_BYTES, "q8_0": Q8_0_BYTES}

# From this many activation rows on (prefill-sized steps), the weight is dequantized
# once and the float matmul runs: its MKL kernel outgrows the register tiles as M grows.
# A guess to tune (the crossover was not measured: the 2-core machine was shared).
LARGE_M = 64


@dataclass(frozen=True)
class CpuBlocksConfig:
    """The block kernels' variant, passed in by the layer that multiplies (each linear
    layer's `cpu_blocks_config`, set by the model runner's KernelConfigs) and followed
    by the fused decode step (pagoda/model/cpu_fused_decode.py).

    quantize_activations: batch 1 (one activation row) quantizes the activation to 8
    bits per block of 32 and multiplies on 8-bit integers, as llama.cpp does (fewer
    instructions per weight than converting each weight to float). Results then equal
    reference_gemv_q8, not reference_mm, up to float32 rounding. More rows keep the
    float register tiles: an 8-bit version of those measured 2x slower at 32 rows
    (docs/performance.md). Off by default: one row then multiplies the float
    activation as several rows do, so a request's tokens do not depend on what it is
    batched with, nor on speculative decoding's verify rows; on, batch 1 decodes 1.5x
    faster (docs/performance.md#measured-reasons)."""

    quantize_activations: bool = False

    @classmethod
    def for_device(cls, device: torch.device) -> CpuBlocksConfig:
        """The config for device: the block kernels run on the CPU only, so every
        device gets the defaults."""
        return cls()


DEFAULT_BLOCKS_CONFIG = CpuBlocksConfig()

_HERE = Path(__file__).parent
# Compiled together into one library; the header is part of the cache key.
_SOURCES = [_HERE / "cpu_kernels.c", _HERE / "cpu_layer.c"]
_HEADERS = [_HERE / "cpu_gemm.h"]
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]


def _check_blocks(blocks: torch.Tensor, kind: str) -> None:
    if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[2] != BLOCK_BYTES[kind]:
        raise ValueError(
            f"{kind} weight must be uint8 [out, in/{QK}, {BLOCK_BYTES[kind]}], got "
            f"{blocks.dtype} {tuple(blocks.shape)}"
        )


def _fp16_bytes(values: torch.Tensor, what: str) -> torch.Tensor:
    """float [...] -> uint8 [..., 2] (little-endian fp16); refuses values fp16 cannot hold."""
    half = values.to(torch.float16)
    if not torch.isfinite(half).all():
        raise ValueError(
            f"{what} overflows float16 (|value| > 65504): cannot store the "
            f"weight in GGUF-style blocks"
        )
    return half.view(torch.uint8).view(*values.shape, 2)


def _fp16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _blocks_of(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    if k % QK:
        raise ValueError(f"in_features {k} is not a multiple of {QK} (the block size)")
    return weight.detach().float().reshape(n, k // QK, QK)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, and 0 where d is 0 (a block of equal weights quantizes to q = 0)."""
    return torch.where(d > 0, 1.0 / d.clamp_min(torch.finfo(torch.float32).tiny), 0.0)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """float [N, K] -> Q8_0 blocks uint8 [N, K/32, 34]: symmetric, d = amax / 127 per
    block. q is computed with the stored (fp16-rounded) d, so a Q8_0 tensor that was
    dequantized (its blocks' largest |q| being 127) quantizes back to the same blocks.
    (Written for few passes over the weight: the whole model goes through it at load.)"""
    w = _blocks_of(weight)
    d = (w.abs().amax(-1) / 127).to(torch.float16)
    out = torch.empty(*w.shape[:2], Q8_0_BYTES, dtype=torch.uint8)
    out[..., :2] = _fp16_bytes(d, "a Q8_0 scale")
    q = (w * _inverse(d.float()).unsqueeze(-1)).round_().clamp_(-127, 127)
    out[..., 2:] = q.to(torch.int8).view(torch.uint8)
    return out


def quantize_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """float [N, K] -> Q4_1 blocks uint8 [N, K/32, 20]: asymmetric, d = (max - min) / 15,
    m = min per block; q = round((w - m) / d) in 0..15 with the stored fp16 d and m."""
    w = _blocks_of(weight)
    lo, hi = w.aminmax(dim=-1)
    d, m = ((hi - lo) / 15).to(torch.float16), lo.to(torch.float16)
    out = torch.empty(*w.shape[:2], Q4_1_BYTES, dtype=torch.uint8)
    out[..., :2] = _fp16_bytes(d, "a Q4_1 scale")
    out[..., 2:4] = _fp16_bytes(m, "a Q4_1 minimum")
    q = (w - m.float().unsqueeze(-1)) * _inverse(d.float()).unsqueeze(-1)
    q = q.round_().clamp_(0, 15).to(torch.uint8)
    out[..., 4:] = q[..., : QK // 2] | (q[..., QK // 2 :] << 4)
    return out


def q4_0_to_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0 blocks [..., 18] -> Q4_1 blocks [..., 20] holding the same weights exactly:
    d (q - 8) = d q + m with m = -8 d (a power-of-two multiple: exact in fp16)."""
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != Q4_0_BYTES:
        raise ValueError(
            f"Q4_0 blocks must be uint8 [..., {Q4_0_BYTES}], got {blocks.dtype} "
            f"{tuple(blocks.shape)}"
        )
    d = _fp16_field(blocks, 0)
    m = _fp16_bytes(-8 * d, "a Q4_0 scale times 8")
    return torch.cat([blocks[..., :2], m, blocks[..., 2:]], dim=-1).contiguous()


def dequantize(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """Blocks [N, K/32, bytes] -> float32 [N, K] (the reference for the kernel)."""
    _check_blocks(blocks, kind)
    n, nb, _ = blocks.shape
    d = _fp16_field(blocks, 0).unsqueeze(-1)
    if kind == "q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(n, nb * QK)
    m = _fp16_field(blocks, 2).unsqueeze(-1)
    nib = blocks[..., 4:]
    q = torch.cat([nib & 15, nib >> 4], dim=-1).float()
    return (d * q + m).reshape(n, nb * QK)


def reference_mm(x: torch.Tensor, blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """x [M, K] float32 @ dequantize(blocks).T -> [M, N] (dequantize, then the float matmul)."""
    return linear(x, dequantize(blocks, kind))


def quantize_activation_q8(x: torch.Tensor) -> torch.Tensor:
    """What the batch-1 kernel multiplies instead of x [1, K]: each block of 32 scaled by
    d = amax / 127, rounded half-to-even to int8, times d again (float32)."""
    blocks = x.float().reshape(x.shape[0], -1, QK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, 1.0)), 0.0)
    return (q * d).reshape(x.shape)


def reference_gemv_q8(x: torch.Tensor, blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """The batch-1 kernel's result up to float32 rounding: the activation quantized to
    8 bits per block (quantize_activation_q8), then dequantize-then-matmul."""
    return reference_mm(quantize_activation_q8(x), blocks, kind)


# --- the native kernel -------------------------------------------------------------

_lock = threading.Lock()
_native: ctypes.CDLL | None = None
_native_error: str | None = None
_loaded = False


def _cache_dir() -> Path:
    root = os.environ.get("PAGODA_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagoda"
    )
    return Path(root) / "cpu_kernels"


def _build() -> ctypes.CDLL:
    """Compiles the kernel sources once per source/flags/compiler (cached by hash) and
    loads the library."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise RuntimeError(
            f"the CPU lacks AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
        )
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc, or $CC) to build the kernel")
    source = b"".join(path.read_bytes() for path in _SOURCES + _HEADERS)
    key = hashlib.sha256(source + " ".join([cc] + _FLAGS).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"cpu_kernels-{key}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        try:
            proc = subprocess.run(
                [cc, *_FLAGS, *map(str, _SOURCES), "-o", tmp], capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed to build the kernel: {proc.stderr[-2000:]}")
            os.replace(tmp, lib)  # atomic: concurrent builders never load a partial file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    so = ctypes.CDLL(str(lib))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in ("pagoda_q4_1_mm", "pagoda_q8_0_mm", "pagoda_f32_mm"):
        fn = getattr(so, name)
        fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
        fn.restype = ctypes.c_int
    for name in ("pagoda_q4_1_gemv_q8", "pagoda_q8_0_gemv_q8"):
        fn = getattr(so, name)
        fn.argtypes = [ptr, i64, ptr, i64, ptr, ctypes.c_int]
        fn.restype = ctypes.c_int
    for name in ("pagoda_q4_1_dequant", "pagoda_q8_0_dequant"):
        fn = getattr(so, name)
        fn.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
        fn.restype = None
    return so


def native_kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None when it cannot be built here (see native_status)."""
    global _native, _native_error, _loaded
    if not _loaded:
        with _lock:
            if not _loaded:
                if os.environ.get("PAGODA_CPU_QUANT_KERNEL", "native") == "reference":
                    _native_error = "PAGODA_CPU_QUANT_KERNEL=reference"
                else:
                    try:
                        _native = _build()
                    except (RuntimeError, OSError) as e:
                        _native_error = str(e)
                _loaded = True
    return _native


def native_status() -> str:
    """'native' or 'reference (<why>)': which path blocks_mm takes."""
    return "native" if native_kernel() is not None else f"reference ({_native_error})"


def native_dequantize(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """dequantize() through the kernel (same values), or the reference without one."""
    _check_blocks(blocks, kind)
    so = native_kernel()
    if so is None or not blocks.is_contiguous():
        return dequantize(blocks, kind)
    n, nb, _ = blocks.shape
    out = torch.empty(n, nb * QK, dtype=torch.float32)
    getattr(so, f"pagoda_{kind}_dequant")(
        blocks.data_ptr(), n, nb * QK, out.data_ptr(), torch.get_num_threads()
    )
    return out


def blocks_mm(
    x: torch.Tensor, blocks: torch.Tensor, kind: str, config: CpuBlocksConfig | None = None
) -> torch.Tensor:
    """x [M, K] float32 on the CPU @ the blocks' weight [N, K].T -> float32 [M, N], as
    config says (None: the defaults, DEFAULT_BLOCKS_CONFIG)."""
    config = config or DEFAULT_BLOCKS_CONFIG
    so = native_kernel()
    n, nb, _ = blocks.shape
    if x.dim() != 2 or x.shape[1] != nb * QK:
        raise ValueError(f"x {tuple(x.shape)} does not match a weight of {nb * QK} columns")
    if so is None or x.dtype != torch.float32 or x.device.type != "cpu":
        return reference_mm(x.float(), blocks, kind).to(x.dtype)
    if x.shape[0] >= LARGE_M:
        return linear(x, native_dequantize(blocks, kind))
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    if x.shape[0] == 1 and config.quantize_activations:
        fn = so.pagoda_q4_1_gemv_q8 if kind == "q4_1" else so.pagoda_q8_0_gemv_q8
        if (
            fn(
                x.data_ptr(),
                x.shape[1],
                blocks.data_ptr(),
                n,
                y.data_ptr(),
                torch.get_num_threads(),
            )
            != 0
        ):
            raise MemoryError("the quantized matmul kernel could not allocate its activation")
        return y

    fn = so.pagoda_q4_1_mm if kind == "q4_1" else so.pagoda_q8_0_mm
    if (
        fn(
            x.data_ptr(),
            x.shape[0],
            x.shape[1],
            blocks.data_ptr(),
            n,
            y.data_ptr(),
            torch.get_num_threads(),
        )
        != 0
    ):
        raise MemoryError("the quantized matmul kernel could not allocate its tile buffer")
    return y


def float_small_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] @ weight [N, K].T for float32 CPU tensors through the kernel's register
    tiles (one pass over the weight), or None where the kernel does not apply (no
    native kernel, K not a multiple of 8, another dtype or device). Not bit-identical to
    F.linear: the sums run in another order (float32 rounding)."""
    so = native_kernel()
    if (
        so is None
        or x.dim() != 2
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or not weight.is_contiguous()
        or weight.shape[1] != x.shape[1]
        or x.shape[1] % 8
    ):
        return None
    x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    so.pagoda_f32_mm(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        weight.data_ptr(),
        weight.shape[0],
        y.data_ptr(),
        torch.get_num_threads(),
    )
    return y


# rows_linear's register-tile kernel runs for 2 to this many rows (it measured 1.1-3x
# faster than MKL from 1 to 32 rows on the 2-core AVX2 machine, mixed at 64:
# docs/performance.md).
SMALL_ROWS = 32


def rows_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """linear(), except that 2 to SMALL_ROWS float32 rows on the CPU go through the
    register-tile kernel when it is available (see the module docstring)."""
    if x.device.type == "cpu" and x.dim() == 2 and 2 <= x.shape[0] <= SMALL_ROWS:
        y = float_small_mm(x, weight)
        if y is not None:
            return y if bias is None else y.add_(bias)
    return linear(x, weight, bias)
