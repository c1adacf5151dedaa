"""DFlash + (fp8) KV cache on the CPU backend, end to end: draft-layer KV dtype,
KV capacity, int32 query starts, and greedy outputs against target-only.

For every KV dtype the CPU supports, one target-only engine produces the
reference outputs and is shut down; then one DFlash engine (target + drafter)
serves all the checks for that dtype. These engines run in bf16, where
greedy DFlash may part from target-only at a numerical near-tie:
test_greedy_dflash_is_lossless compares them by vLLM's near-tie rule
(tests/support/lossless.py). Exact equality is checked in float32
(test_greedy_dflash_is_exact_in_float32_auto_kv: auto KV here; fp8 KV under
load in tests/serve_load, whose server and reference run in float32).
"""

from __future__ import annotations

import dflash_settings
import greedy_runs
import lossless
import offline_engine
import pytest
import torch
import worker_probes
from draft_counts import DraftCounts

EXPECTED_TENSOR_DTYPE = {
    "auto": "torch.bfloat16",
    "fp8": "torch.uint8",
    "fp8_e4m3": "torch.uint8",
    "fp8_e5m2": "torch.uint8",
}


# Every KV dtype the CPU supports. What patch 0001 changes in the drafter's
# layers is proven without an engine (tests/engine/test_dflash_draft_layer_configs.py).
over_kv_dtypes = pytest.mark.parametrize("kv_dtype", dflash_settings.KV_DTYPES, indirect=True)


@pytest.fixture(scope="module", params=dflash_settings.KV_DTYPES)
def kv_dtype(request):
    return request.param


@pytest.fixture(scope="module")
def reference(kv_dtype, partial_pair, measurements):
    """Target-only greedy outputs (and KV state) for this KV dtype."""
    target, _ = partial_pair
    llm = offline_engine.start_llm(("target", kv_dtype), model=target, kv_cache_dtype=kv_dtype)
    ids, logprobs = greedy_runs.generate_with_logprobs(llm)
    state = llm.collective_rpc(worker_probes.worker_kv_state)[0]
    offline_engine.shutdown_llm()
    measurements[f"blocks target-only kv={kv_dtype}"] = state["num_blocks"]
    return {"ids": ids, "logprobs": logprobs, "state": state}


@pytest.fixture(scope="module")
def dflash(kv_dtype, partial_pair):
    """The DFlash engine's outputs and state for this KV dtype. It does not
    wait for the target-only reference, so a run of the guards alone (the
    necessity proof of 0001) starts one engine, not two."""
    target, draft = partial_pair
    llm = offline_engine.start_llm(
        ("dflash-partial", kv_dtype),
        model=target,
        kv_cache_dtype=kv_dtype,
        speculative_config=dflash_settings.dflash_spec_config(draft),
    )
    probe = llm.collective_rpc(worker_probes.worker_install_qsl_probe)
    assert probe == ["installed"] or probe == ["reset"]
    ids, logprobs = greedy_runs.generate_with_logprobs(llm)
    return {
        "ids": ids,
        "logprobs": logprobs,
        "state": llm.collective_rpc(worker_probes.worker_kv_state)[0],
        "qsl": llm.collective_rpc(worker_probes.worker_read_qsl_probe)[0],
        "metrics": offline_engine.spec_metrics(llm),
    }


@over_kv_dtypes
def test_draft_layers_follow_kv_cache_dtype(kv_dtype, dflash):
    layers = dflash["state"]["layers"]
    draft = {n: s for n, s in layers.items() if s["role"] == "draft"}
    target = {n: s for n, s in layers.items() if s["role"] == "target"}
    print(
        f"\n[e2e] kv={kv_dtype} target layers: "
        f"{sorted({(s['kv_cache_dtype'], s['tensor_dtype']) for s in target.values()})}"
    )
    print(
        f"[e2e] kv={kv_dtype} draft layers:  "
        + ", ".join(f"{n}: {s['kv_cache_dtype']}/{s['tensor_dtype']}" for n, s in sorted(draft.items()))
    )
    assert len(draft) == 2 and len(target) == 4, sorted(layers)
    expected = EXPECTED_TENSOR_DTYPE[kv_dtype]
    for name, s in sorted(layers.items()):
        assert s["kv_cache_dtype"] == kv_dtype, (name, s)
        assert s["impl_kv_cache_dtype"] == kv_dtype, (name, s)
        assert s["tensor_dtype"] == expected, (name, s)


@over_kv_dtypes
def test_kv_capacity_follows_kv_dtype(kv_dtype, dflash, measurements):
    """At equal VLLM_CPU_KVCACHE_SPACE, num blocks = space / bytes per block
    summed over target + draft layers (fp8: half the bytes of bf16)."""
    import os

    state = dflash["state"]
    space = int(float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * (1 << 30))
    elem = dflash_settings.kv_bytes_per_elem(kv_dtype, torch.bfloat16)
    per_block = 0
    for s in state["layers"].values():
        _two, _nb, kv_heads, block_size, head = s["tensor_shape"]
        per_block += 2 * kv_heads * block_size * head * elem
    expected = space // per_block
    measured = state["num_blocks"]
    measurements[f"blocks dflash kv={kv_dtype}"] = measured
    print(
        f"\n[e2e] kv={kv_dtype}: {measured} KV blocks of {state['block_size']} tokens "
        f"(expected {expected}; {per_block} B/block over {len(state['layers'])} layers)"
    )
    assert abs(measured - expected) <= max(2, expected // 100)


@over_kv_dtypes
def test_drafter_query_start_loc_is_int32(kv_dtype, dflash):
    qsl = dflash["qsl"]
    print(
        f"\n[e2e] kv={kv_dtype}: token_arange_np {qsl['token_arange_np']}, arange {qsl['arange']}, "
        f"{len(qsl['calls'])} drafter first passes, first: {qsl['calls'][:1]}"
    )
    assert qsl["token_arange_np"] == "int32"
    assert qsl["calls"], "the drafter never ran"
    for cpu_dtype, dev_dtype, _ in qsl["calls"]:
        assert cpu_dtype == "torch.int32"
        assert dev_dtype == "torch.int32"


def test_greedy_dflash_is_lossless(kv_dtype, dflash, reference, measurements):
    """bf16: DFlash equals target-only, or parts at a near-tie (each token in
    the other's top-k, margin <= lossless.MARGIN_THRESHOLD nats)."""
    m = dflash["metrics"]
    counts = DraftCounts.read(m)
    drafts, accepted, mal = counts.drafts, counts.accepted, counts.mean_acceptance_length
    measurements[f"mean acceptance length partial kv={kv_dtype}"] = round(mal, 3)
    print(
        f"\n[e2e] kv={kv_dtype}: {len(greedy_runs.PROMPTS)} prompts x {dflash_settings.MAX_TOKENS} tokens, "
        f"drafts {drafts}, accepted {accepted}, mean acceptance length {mal:.3f}, "
        f"per position {m.get('vllm:spec_decode_num_accepted_tokens_per_pos')}"
    )
    assert drafts > 0 and 0 < accepted < drafts * dflash_settings.NUM_SPEC_TOKENS, m
    assert all(len(got) == dflash_settings.MAX_TOKENS for got in dflash["ids"])
    report = greedy_runs.near_tie_report(dflash, reference)
    measurements[f"lossless bf16 kv={kv_dtype}"] = report.summary()
    print(f"[e2e] kv={kv_dtype}: {report.explain()}")
    assert report.ok, report.explain()


# auto only: two more engines per KV dtype would be too many for 2 cores; fp8
# KV is checked exactly in float32 by tests/serve_load (its server against
# its target-only reference engine, under load).
@pytest.mark.auto_kv_only
def test_greedy_dflash_is_exact_in_float32_auto_kv(trained_pair, measurements):
    """float32: DFlash == target-only token for token, no near-tie allowed.
    The trained pair (a confident random target, a drafter trained on it):
    its training prompts get drafts accepted, the others mostly rejected.
    Two engines; the DFlash one is left running for test_dflash_layer_tap.py
    (same key, same settings)."""
    from vllm.fork.tiny_pairs import trained_prompts

    target, _ = trained_pair
    prompts = [*greedy_runs.PROMPTS, *({"prompt_token_ids": ids} for ids in trained_prompts()[:2])]
    keys = [f"prompt {i}" for i in range(len(prompts))]
    llm = offline_engine.start_llm(
        ("target-trained", "fp32"), model=target, dtype="float32", kv_cache_dtype="auto", enable_prefix_caching=False
    )
    want, _ = greedy_runs.generate_ids(llm, prompts)
    llm = offline_engine.start_trained_fp32(trained_pair)
    before = offline_engine.spec_metrics(llm)
    got, _ = greedy_runs.generate_ids(llm, prompts)
    after = offline_engine.spec_metrics(llm)
    counts = DraftCounts.between(before, after)
    drafts, accepted = counts.drafts, counts.accepted
    report = lossless.compare_all(keys, got, want, dtype="float32")
    measurements["lossless float32 kv=auto (trained pair)"] = {
        **report.summary(),
        "drafts": drafts,
        "accepted": accepted,
    }
    print(f"\n[e2e] float32 kv=auto: drafts {drafts}, accepted {accepted}; {report.explain()}")
    assert all(len(ids) == dflash_settings.MAX_TOKENS for ids in got)
    assert drafts > 0 and 0 < accepted < drafts * dflash_settings.NUM_SPEC_TOKENS, (drafts, accepted)
    assert report.ok and len(report.exact) == len(prompts), report.explain()
