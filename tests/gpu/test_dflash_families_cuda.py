"""DFlash + fp8 KV cache behind the target families users serve, on CUDA.

The CUDA counterpart of tests/cpu_e2e/test_dflash_families.py, on the same
generated pairs (vllm.fork.tiny_families: LLaMA, Qwen3-MoE, hybrid Qwen3.5
dense and MoE): float32 engines (TRITON_ATTN serves float32, non-causal with
patch 0009), ``--kv-cache-dtype fp8``, drafter attention backend vLLM's
choice. Every attention layer's cache, the drafter's included, is fp8; greedy
DFlash equals target-only token for token; the trained drafter is accepted
(mean acceptance length > 1.5; the drafter learned the target's
continuations over an fp8 cache rounded to nearest, as CUDA rounds).

VLLM_FORK_GPU_MATRIX=full runs every family, the quick matrix the hybrid MoE
one. Tiny generated pairs only; nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    import gpu_e2e

    pytest.skip(gpu_e2e.CUDA_SKIP_REASON, allow_module_level=True)

import gpu_e2e
import greedy_runs
import lossless
from draft_counts import DraftCounts

MAX_TOKENS = 64
MIN_ACCEPTANCE_LENGTH = 1.5


def _families():
    """Every family in the full matrix; the hybrid MoE one (every new code
    path) in the quick matrix, which must fit the GPU job's minutes."""
    from vllm.fork.tiny_families import FAMILIES

    return list(FAMILIES) if gpu_e2e.matrix_mode() == "full" else ["qwen3_5_moe"]


@pytest.fixture(scope="module", params=_families())
def family(request):
    return request.param


@pytest.fixture(scope="module")
def family_reference(family, family_pair):
    return greedy_runs.family_outputs(
        family, family_pair, dflash=False, max_tokens=MAX_TOKENS, gpu_memory_utilization=0.3
    )["ids"]


@pytest.fixture(scope="module")
def family_dflash(family, family_pair):
    return greedy_runs.family_outputs(
        family, family_pair, dflash=True, max_tokens=MAX_TOKENS, gpu_memory_utilization=0.3
    )


def test_every_attention_layer_caches_fp8_cuda(family, family_dflash):
    layers = family_dflash["state"]["layers"]
    draft = [n for n, s in layers.items() if s["role"] == "draft"]
    assert len(draft) == 2 and len(layers) > 2, sorted(layers)
    for name, s in sorted(layers.items()):
        assert s["kv_cache_dtype"] == "fp8" and s["impl_kv_cache_dtype"] == "fp8", (name, s)


def test_greedy_dflash_equals_target_only_and_is_accepted_cuda(family, family_dflash, family_reference, measurements):
    got, want = family_dflash["ids"], family_reference
    report = lossless.compare_all([f"prompt {i}" for i in range(len(want))], got, want, dtype="float32")
    counts = DraftCounts.read(family_dflash["metrics"])
    measurements[f"cuda family {family} (fp8 KV, float32)"] = {
        **report.summary(),
        "mean acceptance length": round(counts.mean_acceptance_length, 3),
    }
    assert report.ok and len(report.exact) == len(want), report.explain()
    assert counts.mean_acceptance_length > MIN_ACCEPTANCE_LENGTH, counts
