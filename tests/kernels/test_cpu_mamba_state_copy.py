"""Mamba state blocks are copied on CPU, where there is no Triton.

With prefix caching, a hybrid target's state cache runs in vLLM's "align"
mode: the model runner copies a request's state between blocks of its state
cache before and after every step (``v1/worker/mamba_utils.py``), through one
batched copy of (source address, destination address, byte count) entries.
On CPU those addresses are host memory. The copy is called here as the runner
calls it, on slices of one state cache, including a source and a destination
in the same block row (a speculative step's accepted token).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.needs_patch("0026")


def _entries(pairs):
    src = torch.tensor([s.data_ptr() for s, _ in pairs], dtype=torch.int64)
    dst = torch.tensor([d.data_ptr() for _, d in pairs], dtype=torch.int64)
    sizes = torch.tensor([s.numel() * s.element_size() for s, _ in pairs], dtype=torch.int32)
    return src, dst, sizes


def test_batch_memcpy_copies_each_entry_on_cpu():
    from vllm.v1.worker.mamba_utils import batch_memcpy

    g = torch.Generator().manual_seed(0)
    ssm = torch.randn(6, 4, 8, 8, generator=g)  # blocks x heads x k x v, float32
    conv = torch.randn(6, 3, 40, generator=g).to(torch.bfloat16)
    before_ssm, before_conv = ssm.clone(), conv.clone()
    pairs = [(ssm[1], ssm[4]), (conv[2], conv[5]), (conv[0, 1:], conv[3, :2])]
    batch_memcpy(*_entries(pairs))

    assert torch.equal(ssm[4], before_ssm[1])
    assert torch.equal(conv[5], before_conv[2])
    assert torch.equal(conv[3, :2], before_conv[0, 1:])
    untouched = [b for b in range(6) if b != 4]
    assert torch.equal(ssm[untouched], before_ssm[untouched])
    assert torch.equal(conv[3, 2:], before_conv[3, 2:])
    assert torch.equal(conv[[0, 1, 2, 4]], before_conv[[0, 1, 2, 4]])


def test_batch_memcpy_of_nothing_is_a_no_op():
    from vllm.v1.worker.mamba_utils import batch_memcpy

    empty = torch.empty(0, dtype=torch.int64)
    batch_memcpy(empty, empty, empty.to(torch.int32))
