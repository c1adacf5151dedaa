"""The drafter's KV cache in a dtype of its own (speculative_config.kv_cache_dtype).

On the text pair (a target trained to continue a text, whose greedy choices
have clear margins, and a drafter trained on it), in float32, for a target
--kv-cache-dtype T and a drafter kv_cache_dtype D with D != T:

- the engine starts; every target layer holds a T cache and every draft
  layer a D cache;
- at equal VLLM_CPU_KVCACHE_SPACE, the cache holds the tokens that the
  per-layer bytes give (target layers at T's size, draft layers at D's),
  within 2 %; the all-T and all-D figures of the same formula are reported
  beside it;
- with prefix caching on, the prompts run twice; both passes equal
  target-only output with a T cache and no prefix caching, token for token,
  the second pass finds each prompt's first block in the cache, and its mean
  acceptance length stays that of the first (a hit that lost the drafter's
  context would collapse it) and above 1.5.

Target fp8 + drafter auto runs in every commit's suite; the rest of the
matrix over {auto, fp8, fp8_e5m2, bfloat16} in the extended job (each
combination is an engine of its own, and each target dtype's reference
another). Every combination's config: tests/engine/test_draft_kv_cache_dtype_config.py.
"""

from __future__ import annotations

import os

import dflash_settings
import greedy_runs
import lossless
import offline_engine
import pytest
import torch
import worker_probes
from draft_counts import DraftCounts

# Not a guard of the patch for the necessity proofs: the config tests are
# (tests/engine/test_draft_kv_cache_dtype_config.py), and need no trained pair.

DTYPES = ("auto", "fp8", "fp8_e5m2", "bfloat16")
PER_COMMIT = (("fp8", "auto"),)
MAX_TOKENS = 64
PROMPT_LEN = 80
# A multiple of 32: the compiled kernels of CPUs with AVX-512 store an fp8
# cache only in the layouts of 32-token blocks ("FP8 KV cache is only
# supported on x86 (AMX/VEC) ISA" with 16).
BLOCK_SIZE = 32
MIN_ACCEPTANCE_LENGTH = 1.5


def _combinations():
    return [
        pytest.param((t, d), id=f"target-{t}-draft-{d}", marks=() if (t, d) in PER_COMMIT else pytest.mark.extended)
        for t in DTYPES
        for d in DTYPES
        if t != d
    ]


def prompts() -> list:
    """Lines of the text the pair learned, PROMPT_LEN tokens each, so that a
    prompt fills a BLOCK_SIZE-token block and a prefix-cache hit takes it."""
    return greedy_runs.text_line_prompts(PROMPT_LEN)


_references: dict[str, list] = {}


def reference(pair, target_dtype: str) -> list:
    """Target-only greedy ids with a ``target_dtype`` cache, no prefix caching."""
    if target_dtype not in _references:
        llm = offline_engine.start_llm(
            ("text-target", target_dtype), model=pair[0], dtype="float32", kv_cache_dtype=target_dtype
        )
        _references[target_dtype], _ = greedy_runs.generate_ids(llm, prompts(), MAX_TOKENS)
        offline_engine.shutdown_llm()
    return _references[target_dtype]


@pytest.fixture(scope="module", params=_combinations())
def combination(request):
    return request.param


@pytest.fixture(scope="module")
def mixed(combination, text_pair):
    """DFlash with the target's and the drafter's cache dtypes apart, prefix
    caching on: the layers' caches, the capacity, and two passes of the
    prompts (counters per pass)."""
    target_dtype, draft_dtype = combination
    target, draft = text_pair
    llm = offline_engine.start_llm(
        ("text-mixed", target_dtype, draft_dtype),
        model=target,
        dtype="float32",
        kv_cache_dtype=target_dtype,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
        speculative_config=dflash_settings.dflash_spec_config(draft, kv_cache_dtype=draft_dtype),
    )
    names = {"hits": "vllm:prefix_cache_hits", "queries": "vllm:prefix_cache_queries"}
    passes = []
    for _ in range(2):
        before = offline_engine.spec_metrics(llm), {k: offline_engine.engine_counter(llm, n) for k, n in names.items()}
        ids, _ = greedy_runs.generate_ids(llm, prompts(), MAX_TOKENS)
        after = offline_engine.spec_metrics(llm), {k: offline_engine.engine_counter(llm, n) for k, n in names.items()}
        counts = DraftCounts.between(before[0], after[0])
        passes.append(
            {
                "ids": ids,
                "drafts": counts.drafts,
                "accepted": counts.accepted,
                "mean acceptance length": round(counts.mean_acceptance_length, 3),
                **{k: int(after[1][k] - before[1][k]) for k in names},
            }
        )
    state = llm.collective_rpc(worker_probes.worker_kv_state)[0]
    offline_engine.shutdown_llm()
    return {"passes": passes, "state": state}


def test_each_layer_holds_its_asked_dtype(combination, mixed):
    target_dtype, draft_dtype = combination
    layers = mixed["state"]["layers"]
    roles = {}
    for name, s in sorted(layers.items()):
        want = target_dtype if s["role"] == "target" else draft_dtype
        roles.setdefault(s["role"], set()).add((s["kv_cache_dtype"], s["tensor_dtype"]))
        assert s["kv_cache_dtype"] == s["impl_kv_cache_dtype"] == want, (name, s)
    print(f"\n[e2e] target {target_dtype}, drafter {draft_dtype}: {roles}")
    assert set(roles) == {"target", "draft"}, sorted(layers)


def test_capacity_is_what_the_per_layer_bytes_give(combination, mixed, measurements):
    target_dtype, draft_dtype = combination
    state = mixed["state"]
    space = int(float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * (1 << 30))

    def tokens(dtype_of) -> int:
        per_token = 0
        for s in state["layers"].values():
            _two, _blocks, kv_heads, _block_size, head = s["tensor_shape"]
            per_token += 2 * kv_heads * head * dflash_settings.kv_bytes_per_elem(dtype_of(s["role"]), torch.float32)
        return space // per_token

    expected = tokens(lambda role: target_dtype if role == "target" else draft_dtype)
    measured = state["num_blocks"] * state["block_size"]
    figures = {
        f"all {target_dtype}": tokens(lambda role: target_dtype),
        f"target {target_dtype} + drafter {draft_dtype} (measured)": measured,
        f"target {target_dtype} + drafter {draft_dtype} (per-layer bytes)": expected,
        f"all {draft_dtype}": tokens(lambda role: draft_dtype),
    }
    measurements[
        f"KV tokens at {os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB, target {target_dtype}, drafter {draft_dtype}"
    ] = figures
    print(f"\n[e2e] KV capacity in tokens: {figures}")
    assert abs(measured - expected) <= expected * 0.02, figures


def test_prefix_cache_hits_keep_output_and_acceptance(combination, mixed, text_pair, measurements):
    target_dtype, draft_dtype = combination
    want = reference(text_pair, target_dtype)
    first, second = mixed["passes"]
    summary = [{k: v for k, v in p.items() if k != "ids"} for p in mixed["passes"]]
    measurements[f"target {target_dtype} + drafter {draft_dtype}, float32, prefix caching"] = summary
    print(f"\n[e2e] target {target_dtype}, drafter {draft_dtype}: {summary}")
    for i, run in enumerate(mixed["passes"]):
        report = lossless.compare_all(
            [f"pass {i + 1} prompt {j}" for j in range(len(want))], run["ids"], want, dtype="float32"
        )
        assert report.ok and len(report.exact) == len(want), report.explain()
    # A prompt spans two full blocks. With a drafter, vLLM computes the last
    # block of a hit again (the drafter needs the target's hidden states
    # there), so the cache serves one block of each prompt.
    assert first["hits"] == 0 and second["hits"] >= BLOCK_SIZE * len(want), summary
    assert first["mean acceptance length"] > MIN_ACCEPTANCE_LENGTH, summary
    assert second["mean acceptance length"] >= first["mean acceptance length"] - 0.05, summary


@pytest.mark.extended
def test_preemption_and_chunked_prefill_keep_the_output(text_pair, measurements):
    """Target fp8 + drafter auto with a KV cache for about two of the
    requests and a token budget smaller than a prompt: prompts are prefilled
    in chunks, running requests are preempted and recomputed, and the output
    still equals target-only output token for token (float32)."""
    target, draft = text_pair
    want = reference(text_pair, "fp8")
    llm = offline_engine.start_llm(
        ("text-mixed-pressure", "fp8", "auto"),
        model=target,
        dtype="float32",
        kv_cache_dtype="fp8",
        block_size=BLOCK_SIZE,
        enable_prefix_caching=False,
        num_gpu_blocks_override=16,
        max_num_batched_tokens=48,
        max_model_len=256,
        speculative_config=dflash_settings.dflash_spec_config(draft, kv_cache_dtype="auto"),
    )
    ids, _ = greedy_runs.generate_ids(llm, prompts(), MAX_TOKENS)
    preemptions = offline_engine.engine_counter(llm, "vllm:num_preemptions")
    counts = DraftCounts.read(offline_engine.spec_metrics(llm))
    offline_engine.shutdown_llm()
    report = lossless.compare_all([f"prompt {j}" for j in range(len(want))], ids, want, dtype="float32")
    measurements["target fp8 + drafter auto under KV pressure, chunked prefill"] = {
        **report.summary(),
        "preemptions": int(preemptions),
        "mean acceptance length": round(counts.mean_acceptance_length, 3),
    }
    assert report.ok and len(report.exact) == len(want), report.explain()
    assert preemptions > 0
