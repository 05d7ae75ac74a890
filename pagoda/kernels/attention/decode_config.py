"""DecodeAttentionConfig: the decode attention kernels' tiles and graph plan on one device.

The Triton backend builds one at construction (`DecodeAttentionConfig.for_device`) and
passes it to every `paged_decode.paged_attention_decode` call; benchmarks pass variants
of it (`dataclasses.replace`). The tiles are data keyed by device capability
(DECODE_CONFIGS); a device not listed takes Hopper's. Importing this module imports no
triton (the CPU backend never loads it).

Which kernel a call runs follows from its dtypes (`tiles_for`): 16-bit queries on a
16-bit cache and float32 queries take the tile kernel (attend_kv_tile); 16-bit queries
on an FP8 cache take the word kernel (the cache read as int32 words, q.K one e4m3 dot:
paged_decode_words._decode_words_kernel), or the tile kernel on converted tiles where the
word kernel cannot read the cache (head_dim under 64 or not a power of two, rows not on
4-byte boundaries).

Note on num_stages: the K / V loads depend on the block-table load of the same loop,
and Triton 3.6 splits the stages between those two levels, so 2-4 stages give one K / V
buffer (the next tile's copy waits for the current tile's math) and 5 / 7 / 9 give 2 /
3 / 4.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pagoda.kernels.launch.capability import cuda_capability


@dataclass(frozen=True)
class DecodeTiles:
    """A decode kernel's key tile (block_n keys a loop step), launch options, and the
    fewest query rows a program pads a KV head's query heads to (min_block_h: 16 fills
    an mma tile; fewer rows mean less softmax work on padding)."""

    block_n: int
    num_warps: int
    num_stages: int
    min_block_h: int = 16

    def launch(self) -> dict:
        """The kernel's BLOCK_N constexpr and launch options."""
        return dict(BLOCK_N=self.block_n, num_warps=self.num_warps, num_stages=self.num_stages)

    def block_h(self, group: int) -> int:
        """Query rows a program holds for group query heads of one KV head: group padded
        to a power of two and to at least min_block_h."""
        return max(self.min_block_h, 1 << max(group - 1, 0).bit_length())


@dataclass(frozen=True)
class DecodeAttentionConfig:
    """The decode kernels' tiles by dtype, and the decode CUDA graphs' plan.

    e4m3_pairs_ptx: the word kernel converts V two e4m3 entries per instruction (inline
    PTX); a device property, off where the kernel runs interpreted (the CPU tests).
    short_context_tokens / short_context_splits: at small batches a second decode graph
    serves steps whose contexts are all at most short_context_tokens long, with
    short_context_splits slices (paged_decode.short_context_splits)."""

    tiles_16bit: DecodeTiles
    tiles_fp32: DecodeTiles
    tiles_fp8: DecodeTiles
    tiles_fp8_fallback: DecodeTiles
    e4m3_pairs_ptx: bool = False
    short_context_tokens: int = 512
    short_context_splits: int = 8

    @classmethod
    def for_device(cls, device: torch.device) -> DecodeAttentionConfig:
        """The config of device: for_capability of its compute capability on CUDA;
        Hopper's tiles on the CPU, whose interpreter runs the GPU's tiles, without the
        PTX conversion."""
        device = torch.device(device)
        key = (device.type, device.index)
        if key not in _BY_DEVICE:
            if device.type != "cuda":
                _BY_DEVICE[key] = cls.for_capability(HOPPER, e4m3_pairs_ptx=False)
            else:
                _BY_DEVICE[key] = cls.for_capability(cuda_capability(device))
        return _BY_DEVICE[key]

    @classmethod
    def for_capability(
        cls, capability: tuple[int, int], e4m3_pairs_ptx: bool = True
    ) -> DecodeAttentionConfig:
        """DECODE_CONFIGS' entry for a CUDA compute capability (Hopper's for one not
        listed), e.g. to compile its kernels for that device without one
        (tools/compile_sm90.py)."""
        config = DECODE_CONFIGS.get(tuple(capability), DECODE_CONFIGS[HOPPER])
        return replace(config, e4m3_pairs_ptx=e4m3_pairs_ptx)

    def tiles_for(self, q_dtype: torch.dtype, kv_fp8: bool, words: bool) -> DecodeTiles:
        """The tiles of a call with q_dtype queries on an FP8 cache (kv_fp8) or not;
        words: the word kernel reads this FP8 cache (paged_decode.words_kernel_reads)."""
        if q_dtype == torch.float32:
            return self.tiles_fp32
        if kv_fp8:
            return self.tiles_fp8 if words else self.tiles_fp8_fallback
        return self.tiles_16bit


HOPPER = (9, 0)
_BY_DEVICE: dict[tuple[str, object], DecodeAttentionConfig] = {}
# Measured on Hopper (H100, H200); other devices take these too (unmeasured).
DECODE_CONFIGS: dict[tuple[int, int], DecodeAttentionConfig] = {
    HOPPER: DecodeAttentionConfig(
        # 64-key tiles, 4 warps, 3 stages: the fastest of the tiles swept on the H200,
        # 4.27 TB/s at 64 x 8k and 256 x 2k (docs/performance.md, "Measured reasons:
        # Decode attention").
        tiles_16bit=DecodeTiles(block_n=64, num_warps=4, num_stages=3),
        # IEEE float32 dots on the CUDA cores: small tiles.
        tiles_fp32=DecodeTiles(block_n=32, num_warps=4, num_stages=2),
        # The word kernel on 128-key tiles, 4 warps, 2 stages (one K / V buffer: 36 KB
        # of shared memory, 117 registers, four programs an SM), a KV head's query rows
        # padded to 4 (Llama-8B's group) instead of 16, so the softmax works on a
        # quarter of the rows: 164 us for one Llama-8B layer at 256 x 1k where the tile
        # kernel takes 242 and a bf16 cache 264 (H200); the Llama-8B FP8-KV step at
        # batch 1 5.809 vs 5.840 ms for two K / V buffers (H100) (docs/performance.md,
        # "Measured reasons: FP8 decode").
        tiles_fp8=DecodeTiles(block_n=128, num_warps=4, num_stages=2, min_block_h=4),
        # The one fallback: the tile kernel on converted tiles, for caches the word kernel
        # cannot read (head_dim under 64 or not a power of two, rows off 4-byte bounds).
        tiles_fp8_fallback=DecodeTiles(block_n=128, num_warps=4, num_stages=4),
        # From the decode-splits benchmark on the H200 (32 layers, a copy between them),
        # Llama-3.1-8B at batch 1, us a layer, 8 / 32 slices: 5.35 / 6.36 at 128
        # tokens, 5.75 / 6.84 at 512, 7.59 / 7.14 at 768 (docs/performance.md,
        # "Measured reasons: Decode attention"): every slice, empty or not, is a
        # program, and the merge reads every slice.
        short_context_tokens=512,
        short_context_splits=8,
    ),
}
