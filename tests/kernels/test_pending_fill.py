"""The one-launch pending-token fill (pagoda.kernels.sample.pending_fill) against its torch
reference: compiled on CUDA, under the Triton interpreter on CPU tensors elsewhere."""

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
from helpers.interpreted_kernels import kernel_modules  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture(scope="module")
def pf():
    return kernel_modules("sample.pending_fill")[0]


@pytest.mark.parametrize("rows", [1, 3, 261])  # 261: two programs, the last partial
def test_kernel_equals_reference(pf, rows):
    gen = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, 1000, (rows * 3,), generator=gen)
    tokens = torch.randint(0, 50000, (rows + 7,), generator=gen)
    dst = torch.randperm(ids.numel(), generator=gen)[:rows]  # distinct rows
    src = torch.randint(0, tokens.numel(), (rows,), generator=gen)
    ids, tokens, dst, src = (t.to(DEVICE) for t in (ids, tokens, dst, src))
    index = torch.stack([dst, src])
    expected = ids.clone()
    pf.fill_pending_ref(expected, index, tokens)
    got = ids.clone()
    pf.fill_pending(got, index, tokens, use_kernel=True)
    assert torch.equal(got, expected)
    assert torch.equal(got[dst], tokens[src])  # and the reference does what it says
    untouched = torch.ones(ids.numel(), dtype=torch.bool, device=DEVICE)
    untouched[dst] = False
    assert torch.equal(got[untouched], ids[untouched])


def test_no_rows_and_bad_index(pf):
    ids = torch.arange(4, device=DEVICE)
    pf.fill_pending(
        ids,
        torch.zeros(2, 0, dtype=torch.long, device=DEVICE),
        torch.arange(3, device=DEVICE),
        use_kernel=True,
    )
    assert torch.equal(ids.cpu(), torch.arange(4))
    with pytest.raises(ValueError, match=r"int64 \[2, k\]"):
        pf.fill_pending(ids, torch.zeros(3, 1, dtype=torch.long), torch.arange(3))
    with pytest.raises(ValueError, match=r"int64 \[2, k\]"):
        pf.fill_pending(ids, torch.zeros(2, 1, dtype=torch.int32), torch.arange(3))
