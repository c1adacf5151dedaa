"""The CPU fused-MoE torch fallback runs at forward time, outside model construction.

vLLM's CPU backend computes MoE layers with ``cpu_fused_moe_torch`` wherever
its grouped-GEMM kernels do not apply (CPUs without AVX-512, float32, expert
sizes that are not multiples of 32), i.e. for every tiny MoE target of this
suite and for real MoE models on AVX2 hosts. The op is called here as the
engine calls it during a forward pass: no vLLM config is set. Its output must
equal a plain per-token reference (float32): the routing weights times each
chosen expert's ``down(silu(gate(x)) * up(x))``.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.needs_patch("0022")

NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, TOKENS = 8, 2, 48, 40, 11


class _ExpertLayer(torch.nn.Module):
    """What ``init_moe_torch`` leaves on a layer: per-expert linear callables."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_linear = [lambda x, w=w: x @ w.T for w in w13]
        self.down_linear = [lambda x, w=w: x @ w.T for w in w2]


def _reference(x, w13, w2, weights, ids):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = (x[t] @ w13[e].T).chunk(2)
            out[t] += weights[t, k] * ((F.silu(gate) * up) @ w2[e].T)
    return out


def test_silu_experts_match_reference_outside_a_vllm_config():
    from vllm.model_executor.layers.fused_moe import cpu_fused_moe as moe

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) * 0.2
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * 0.2
    logits = torch.randn(TOKENS, NUM_EXPERTS, generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(TOP_K, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    layer = _ExpertLayer(w13, w2)
    moe._CPU_MOE_LAYER_CACHE[id(layer)] = weakref.ref(layer)
    try:
        out = torch.empty_like(x)
        moe.cpu_fused_moe_torch(id(layer), out, x, weights, ids.to(torch.int32), "silu", NUM_EXPERTS)
    finally:
        moe._CPU_MOE_LAYER_CACHE.pop(id(layer), None)
    torch.testing.assert_close(out, _reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
