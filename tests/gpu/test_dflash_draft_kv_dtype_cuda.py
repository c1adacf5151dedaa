"""The drafter's own KV cache dtype on CUDA (speculative_config.kv_cache_dtype).

Target --kv-cache-dtype T with drafter kv_cache_dtype D, on the text pair
(vllm.fork.tiny_pairs, whose target answers in words with clear margins),
bfloat16:

- fp8 + auto and auto + fp8 (the quick matrix);
- turboquant_4bit_nc and turboquant_k8v4 targets with an auto and an fp8
  drafter, nvfp4 targets likewise (the full matrix);

each where this GPU serves both sides -- vLLM's own backend selection
answers (vllm.fork.kv_support), and the case skips with its reason
otherwise (nvfp4 below Blackwell). The engine starts; every target layer
holds a T cache and every draft layer a D cache; greedy output equals
target-only output with a T cache up to bf16 near-ties (each token in the
other's top-k, tests/support/lossless.py); the mean acceptance length is
above 1.5.

The same on CPU, every pair over {auto, fp8, fp8_e5m2, bfloat16}:
tests/cpu_e2e/test_dflash_draft_kv_dtype.py.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    import gpu_e2e

    pytest.skip(gpu_e2e.CUDA_SKIP_REASON, allow_module_level=True)

import dflash_settings
import gpu_e2e
import greedy_runs
import offline_engine
import worker_probes
from draft_counts import DraftCounts

QUICK = (("fp8", "auto"), ("auto", "fp8"))
FULL = QUICK + tuple((t, d) for t in ("turboquant_4bit_nc", "turboquant_k8v4", "nvfp4") for d in ("auto", "fp8"))
MAX_TOKENS = 64
MIN_ACCEPTANCE_LENGTH = 1.5
ENGINE = {"dtype": "bfloat16", "gpu_memory_utilization": 0.3}


def _combinations():
    return [
        pytest.param(c, id=f"target-{c[0]}-draft-{c[1]}") for c in (FULL if gpu_e2e.matrix_mode() == "full" else QUICK)
    ]


@pytest.fixture(scope="module", params=_combinations())
def combination(request):
    from vllm.fork import kv_support

    target_dtype, draft_dtype = request.param
    for side in (
        kv_support.backend_for(target_dtype, non_causal=False),
        kv_support.backend_for(draft_dtype, non_causal=True),
    ):
        if not side.backend:
            pytest.skip(f"this GPU: {side.reason}")
    return request.param


_references: dict[str, dict] = {}


def reference(pair, target_dtype: str) -> dict:
    if target_dtype not in _references:
        llm = offline_engine.start_llm(
            ("cuda-text-target", target_dtype), model=pair[0], kv_cache_dtype=target_dtype, **ENGINE
        )
        ids, logprobs = greedy_runs.generate_with_logprobs(llm, greedy_runs.text_line_prompts(), MAX_TOKENS)
        _references[target_dtype] = {"ids": ids, "logprobs": logprobs}
        offline_engine.shutdown_llm()
    return _references[target_dtype]


@pytest.fixture(scope="module")
def mixed(combination, text_pair):
    target_dtype, draft_dtype = combination
    llm = offline_engine.start_llm(
        ("cuda-text-mixed", target_dtype, draft_dtype),
        model=text_pair[0],
        kv_cache_dtype=target_dtype,
        **ENGINE,
        speculative_config=dflash_settings.dflash_spec_config(text_pair[1], kv_cache_dtype=draft_dtype),
    )
    ids, logprobs = greedy_runs.generate_with_logprobs(llm, greedy_runs.text_line_prompts(), MAX_TOKENS)
    out = {
        "ids": ids,
        "logprobs": logprobs,
        "metrics": offline_engine.spec_metrics(llm),
        "state": llm.collective_rpc(worker_probes.worker_kv_state)[0],
    }
    offline_engine.shutdown_llm()
    return out


def test_each_layer_holds_its_asked_dtype_cuda(combination, mixed):
    target_dtype, draft_dtype = combination
    for name, s in sorted(mixed["state"]["layers"].items()):
        want = target_dtype if s["role"] == "target" else draft_dtype
        assert s["kv_cache_dtype"] == s["impl_kv_cache_dtype"] == want, (name, s)


def test_greedy_output_and_acceptance_cuda(combination, mixed, text_pair, measurements):
    target_dtype, draft_dtype = combination
    report = greedy_runs.near_tie_report(mixed, reference(text_pair, target_dtype))
    counts = DraftCounts.read(mixed["metrics"])
    measurements[f"cuda target {target_dtype} + drafter {draft_dtype} (bf16)"] = {
        **report.summary(),
        "mean acceptance length": round(counts.mean_acceptance_length, 3),
    }
    assert report.ok, report.explain()
    assert counts.mean_acceptance_length > MIN_ACCEPTANCE_LENGTH, counts
