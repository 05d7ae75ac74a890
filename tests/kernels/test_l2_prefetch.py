"""pagoda.kernels.launch.l2_prefetch: which launches prefetch, how a range is shared among a
kernel's programs, and (on a Hopper GPU) that the tiny Qwen3-MoE decodes the same tokens and
logprobs with the prefetch on as with it off: a prefetch is a hint to the
memory system and may change timing only.

The prefetch instruction itself is inline PTX, which the interpreter cannot run; CI
compiles the kernels that issue it for sm_90 (tests/kernels/test_sm90_compile.py, the pdl group).
"""

import pytest
import torch
import triton
import triton.language as tl
from helpers.tiny_models import greedy_dummy_run

from pagoda.kernels.launch import l2_prefetch

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_nothing_is_prefetched_on_the_cpu_or_for_large_steps(monkeypatch):
    weight = torch.empty(64, 40, dtype=torch.bfloat16)
    cpu = torch.device("cpu")
    assert not l2_prefetch.available(cpu)
    assert l2_prefetch.prefetch_bytes(weight, 1, cpu) == 0
    assert l2_prefetch.prefetch_bytes(None, 1, cpu) == 0
    # On a device that can, the rule is the rows and the tensor's layout.
    monkeypatch.setattr(l2_prefetch, "available", lambda device: True)
    assert l2_prefetch.prefetch_bytes(weight, 1, cpu) == 64 * 40 * 2
    assert l2_prefetch.prefetch_bytes(weight, l2_prefetch.MAX_ROWS, cpu) == 64 * 40 * 2
    assert l2_prefetch.prefetch_bytes(weight, l2_prefetch.MAX_ROWS + 1, cpu) == 0
    assert l2_prefetch.prefetch_bytes(weight.t(), 1, cpu) == 0  # not one byte range
    odd = torch.empty(3, 7, dtype=torch.bfloat16)  # 42 bytes -> the 32 of whole units
    assert l2_prefetch.prefetch_bytes(odd, 1, cpu) == 32
    assert l2_prefetch.prefetch_bytes(odd.view(-1)[1:], 1, cpu) == 0  # 2 bytes past a boundary


def test_weight_of_a_linear_layer():
    layer = torch.nn.Linear(8, 4, bias=False)
    assert l2_prefetch.weight_of(layer) is layer.weight
    assert l2_prefetch.weight_of(torch.nn.ReLU()) is None


@triton.jit
def _bounds_kernel(out_ptr, nbytes, parts):
    part = tl.program_id(0)
    start, end = l2_prefetch.share_bounds(nbytes, part, parts)
    tl.store(out_ptr + 2 * part, start)
    tl.store(out_ptr + 2 * part + 1, end)


@pytest.mark.parametrize(
    "nbytes, parts",
    [(16, 1), (16, 5), (4096, 3), (16 * 97, 8), (2048 * 768 * 2, 96), (4096 * 2048 * 2, 40)],
)
def test_shares_tile_the_range_in_whole_units(nbytes, parts):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # else interpreted (conftest)
    out = torch.empty(2 * parts, dtype=torch.int64, device=device)
    _bounds_kernel[(parts,)](out, nbytes, parts)
    bounds = out.view(parts, 2).tolist()
    covered = [(start, end) for start, end in bounds if end > start]
    assert covered[0][0] == 0 and covered[-1][1] == nbytes
    for (_, end), (start, _) in zip(covered, covered[1:]):
        assert start == end  # adjacent, no overlap, no gap
    assert all(start % 16 == 0 and end % 16 == 0 for start, end in covered)
    largest = max(end - start for start, end in covered)
    assert largest == -(-nbytes // 16 // parts) * 16  # equal shares but the last ones


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="bulk L2 prefetch needs a CUDA GPU of compute capability 9.0+")
def test_qwen3_moe_unchanged_with_prefetch(monkeypatch):
    preset = "tiny-qwen3-moe"  # the model whose MoE blocks prefetch
    on = greedy_dummy_run(preset)
    monkeypatch.setattr(l2_prefetch, "available", lambda device: False)  # no prefetch
    assert greedy_dummy_run(preset) == on


def test_qwen3_moe_blocks_know_the_next_layers_qkv():
    """The wiring the prefetch uses: every MoE block holds the next layer's qkv
    projection (the last layer's none), and not as a submodule (no extra parameters)."""
    from pagoda.model.presets import get_preset
    from pagoda.model.qwen3_moe import Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(get_preset("tiny-qwen3-moe"))
    layers = list(model.model.layers)
    sparse = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")]
    assert sparse  # the preset has MoE layers
    for i in sparse:
        expected = (layers[i + 1].self_attn.qkv_proj,) if i + 1 < len(layers) else ()
        assert layers[i].mlp.experts._next_linear == expected
    names = [name for name, _ in model.named_parameters()]
    assert len(names) == len(set(names)) and not any("next_linear" in n for n in names)
