"""GGUF loader (llama.cpp files): metadata -> ArchConfig, tensors -> HF-named weights.

Architectures: llama, qwen2, qwen3 and qwen3moe (pagoda.model.loader.gguf_arch maps
their metadata and tensor names). Every tensor, quantized (Q4_1, Q8_0, ...) or not, is
dequantized to float32 with gguf.quants.dequantize and then cast to the model dtype by
the parameter's loader -- except the tensors named in ``keep_blocks`` (those of layers
the ``gguf`` quantization scheme keeps quantized, pagoda.model.quant.gguf_quant: by
default on the CPU for dense models, see ``default_gguf_scheme``; ``--quantization none``
expands them all): they are handed over raw, as uint8 [rows, blocks per row, bytes per
block], which shards in whole blocks. A stacked expert tensor (qwen3moe's
``ffn_*_exps``, [experts, rows, cols]) is always dequantized, then handed over one
expert's slice at a time under HF's per-expert names: the experts run as float.
llama.cpp's converter permutes the rows of the Q and K projections of ``llama`` files
(it reshapes them to (n_head, 2, head_dim / 2, ...) and swaps the two middle axes,
turning HF's rotate_half layout into interleaved pairs); ``unpermute_qk`` undoes that
(on rows of blocks too: a block never spans two rows). Qwen files keep HF's rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf.quants import dequantize
from torch import nn

from pagoda.model.arch_config import ArchConfig
from pagoda.model.dtypes import resolve_dtype
from pagoda.model.loader.build import build_model, find_gguf_file
from pagoda.model.loader.gguf_arch import (
    gguf_arch_config,
    gguf_architecture,
    hf_name,
    permutes_qk,
    stacked_expert_name,
)
from pagoda.model.parallel import SINGLE_RANK, TensorParallel
from pagoda.model.quant.registry import resolve_quant_config
from pagoda.progress import progress


class FastGGUFReader(GGUFReader):
    """GGUFReader parsing a plain ndarray view of its memory map instead of the np.memmap.

    The parser slices the file into hundreds of thousands of small views (every string
    of the vocabulary and merges); np.memmap's per-view bookkeeping makes that
    several times slower. np.asarray shares the same memory (its base keeps the map alive); the
    reader is only ever opened read-only here.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = np.asarray(value)


def unpermute_qk(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's permute: rows grouped (n_head, head_dim/2, 2) -> (n_head, 2, head_dim/2)."""
    half = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def dequantized(tensor) -> np.ndarray:
    """The tensor as float32 in torch (row-major) shape: ggml lists dims fastest first."""
    # np.asarray drops the np.memmap subclass (same memory, no copy): dequantize slices
    # the array into many views, and memmap's per-view bookkeeping would dominate.
    data = dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32, copy=False)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return data.reshape(shape)


def raw_blocks(tensor) -> np.ndarray:
    """A quantized tensor's blocks as stored: uint8 [rows, blocks per row, bytes per block]."""
    block_size, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    if block_size == 1:
        raise ValueError(f"GGUF tensor {tensor.name} ({tensor.tensor_type.name}) has no blocks")
    data = np.asarray(tensor.data)
    return data.reshape(data.shape[0], -1, type_size)


def tensor_hf_names(tensor) -> list[str]:
    """The HF names a GGUF tensor stands for: one, or one per expert of a stacked
    expert tensor (ggml lists dims fastest first: the experts are the last)."""
    stacked = stacked_expert_name(tensor.name)
    if stacked is None:
        return [hf_name(tensor.name)]
    return [stacked.format(e) for e in range(int(tensor.shape[-1]))]


def gguf_tensor_types(reader: GGUFReader) -> dict[str, str]:
    """HF tensor name -> GGML type name ('Q4_1', 'Q8_0', 'F32', ...) of every tensor."""
    return {name: t.tensor_type.name for t in reader.tensors for name in tensor_hf_names(t)}


def iter_gguf_weights(
    reader: GGUFReader, arch: ArchConfig, rank: int = 0, keep_blocks: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor in the file (each expert's slice of a
    stacked expert tensor apart), Q/K rows un-permuted where the converter permuted them
    (with a progress bar on a terminal, for rank 0); the tensors named in keep_blocks
    come as raw blocks (see raw_blocks) instead."""
    permuted = permutes_qk(gguf_architecture(reader))
    tensors = progress(reader.tensors, "loading weights", len(reader.tensors), "tensor", rank)
    for tensor in tensors:
        if stacked_expert_name(tensor.name) is not None:
            experts = dequantized(tensor)
            for name, data in zip(tensor_hf_names(tensor), experts):
                yield name, torch.from_numpy(np.require(data, requirements=["C", "W"]))
            continue
        name = hf_name(tensor.name)
        data = raw_blocks(tensor) if name in keep_blocks else dequantized(tensor)
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = unpermute_qk(data, arch.num_attention_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = unpermute_qk(data, arch.num_key_value_heads)
        # Unquantized tensors come back as read-only views of the memory map: copy those.
        yield name, torch.from_numpy(np.require(data, requirements=["C", "W"]))


def read_gguf_arch_config(path: Path) -> ArchConfig:
    """The ArchConfig in the metadata of the .gguf file at path (no tensor is read)."""

    file = find_gguf_file(path)
    if file is None:
        raise ValueError(f"no .gguf file at {path}")
    return gguf_arch_config(FastGGUFReader(str(file)))


def load_gguf_model(
    path: Path,
    dtype: str | torch.dtype,
    device: str | torch.device,
    tp: TensorParallel = SINGLE_RANK,
    quantization: str | None = None,
    quantize_lm_head: bool = False,
) -> tuple[nn.Module, ArchConfig]:

    file = find_gguf_file(path)
    if file is None:
        raise ValueError(f"no .gguf file at {path}")
    reader = FastGGUFReader(str(file))
    arch = gguf_arch_config(reader)
    quant = resolve_quant_config(
        quantization, None, "gguf", reader, quantize_lm_head, arch=arch, device=device
    )
    model = build_model(arch, resolve_dtype(dtype, device, arch.torch_dtype), device, tp, quant)
    # Built first: the gguf scheme learns which layers keep their blocks as it hands
    # out their methods.
    keep = quant.raw_tensor_names() if hasattr(quant, "raw_tensor_names") else frozenset()
    model.load_weights(iter_gguf_weights(reader, arch, tp.rank, keep))
    return model, arch
