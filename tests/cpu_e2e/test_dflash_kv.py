"""DFlash + (fp8) KV cache on the CPU backend, end to end (tests 1-4).

For every KV dtype the CPU supports, one target-only engine produces the
reference outputs and is shut down; then one DFlash engine (target + drafter)
serves all the checks for that dtype.
"""

from __future__ import annotations

import pytest
import torch

import dflash_e2e as e2e


EXPECTED_TENSOR_DTYPE = {
    "auto": "torch.bfloat16",
    "fp8": "torch.uint8",
    "fp8_e4m3": "torch.uint8",
    "fp8_e5m2": "torch.uint8",
}


def guarded_on_fp8(*patches):
    """Parametrize a test over every KV dtype; only its fp8 case guards
    ``patches``, so the necessity proof starts two engines, not eight."""
    params = [
        pytest.param(d, marks=pytest.mark.needs_patch(*patches)) if d == "fp8" else d
        for d in e2e.KV_DTYPES
    ]
    return pytest.mark.parametrize("kv_dtype", params, indirect=True)


@pytest.fixture(scope="module", params=e2e.KV_DTYPES)
def kv_dtype(request):
    return request.param


@pytest.fixture(scope="module")
def reference(kv_dtype, partial_pair, measurements):
    """Target-only greedy outputs (and KV state) for this KV dtype."""
    target, _ = partial_pair
    llm = e2e.start_llm(("target", kv_dtype), model=target, kv_cache_dtype=kv_dtype)
    ids, _ = e2e.generate_ids(llm)
    state = llm.collective_rpc(e2e.worker_kv_state)[0]
    e2e.shutdown_llm()
    measurements[f"blocks target-only kv={kv_dtype}"] = state["num_blocks"]
    return {"ids": ids, "state": state}


@pytest.fixture(scope="module")
def dflash(kv_dtype, reference, partial_pair):
    target, draft = partial_pair
    llm = e2e.start_llm(
        ("dflash-partial", kv_dtype),
        model=target,
        kv_cache_dtype=kv_dtype,
        speculative_config=e2e.dflash_spec_config(draft),
    )
    probe = llm.collective_rpc(e2e.worker_install_qsl_probe)
    assert probe == ["installed"] or probe == ["reset"]
    ids, _ = e2e.generate_ids(llm)
    return {
        "llm": llm,
        "ids": ids,
        "state": llm.collective_rpc(e2e.worker_kv_state)[0],
        "qsl": llm.collective_rpc(e2e.worker_read_qsl_probe)[0],
        "metrics": e2e.spec_metrics(llm),
    }


# 1 -----------------------------------------------------------------------
@guarded_on_fp8("0001")
def test_draft_layers_follow_kv_cache_dtype(kv_dtype, dflash):
    layers = dflash["state"]["layers"]
    draft = {n: s for n, s in layers.items() if s["role"] == "draft"}
    target = {n: s for n, s in layers.items() if s["role"] == "target"}
    print(f"\n[e2e] kv={kv_dtype} target layers: "
          f"{sorted({(s['kv_cache_dtype'], s['tensor_dtype']) for s in target.values()})}")
    print(f"[e2e] kv={kv_dtype} draft layers:  "
          + ", ".join(f"{n}: {s['kv_cache_dtype']}/{s['tensor_dtype']}" for n, s in sorted(draft.items())))
    assert len(draft) == 2 and len(target) == 4, sorted(layers)
    expected = EXPECTED_TENSOR_DTYPE[kv_dtype]
    for name, s in sorted(layers.items()):
        assert s["kv_cache_dtype"] == kv_dtype, (name, s)
        assert s["impl_kv_cache_dtype"] == kv_dtype, (name, s)
        assert s["tensor_dtype"] == expected, (name, s)


# 2 -----------------------------------------------------------------------
@guarded_on_fp8("0001")
def test_kv_capacity_follows_kv_dtype(kv_dtype, dflash, reference, measurements):
    """At equal VLLM_CPU_KVCACHE_SPACE, num blocks = space / bytes per block
    summed over target + draft layers (fp8: half the bytes of bf16)."""
    import os

    state = dflash["state"]
    space = int(float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * (1 << 30))
    elem = e2e.kv_bytes_per_elem(kv_dtype, torch.bfloat16)
    per_block = 0
    for s in state["layers"].values():
        _two, _nb, kv_heads, block_size, head = s["tensor_shape"]
        per_block += 2 * kv_heads * block_size * head * elem
    expected = space // per_block
    measured = state["num_blocks"]
    measurements[f"blocks dflash kv={kv_dtype}"] = measured
    print(f"\n[e2e] kv={kv_dtype}: {measured} KV blocks of {state['block_size']} tokens "
          f"(expected {expected}; {per_block} B/block over {len(state['layers'])} layers; "
          f"target-only engine: {reference['state']['num_blocks']})")
    assert abs(measured - expected) <= max(2, expected // 100)


# 3 -----------------------------------------------------------------------
@guarded_on_fp8("0001")
def test_drafter_query_start_loc_is_int32(kv_dtype, dflash):
    qsl = dflash["qsl"]
    print(f"\n[e2e] kv={kv_dtype}: token_arange_np {qsl['token_arange_np']}, arange {qsl['arange']}, "
          f"{len(qsl['calls'])} drafter first passes, first: {qsl['calls'][:1]}")
    assert qsl["token_arange_np"] == "int32"
    assert qsl["calls"], "the drafter never ran"
    for cpu_dtype, dev_dtype, _ in qsl["calls"]:
        assert cpu_dtype == "torch.int32"
        assert dev_dtype == "torch.int32"


# 4 -----------------------------------------------------------------------
def test_greedy_dflash_is_lossless(kv_dtype, dflash, reference, measurements):
    m = dflash["metrics"]
    drafts = m.get("vllm:spec_decode_num_drafts", 0)
    accepted = m.get("vllm:spec_decode_num_accepted_tokens", 0)
    mal = 1 + accepted / drafts if drafts else float("nan")
    measurements[f"mean acceptance length partial kv={kv_dtype}"] = round(mal, 3)
    print(f"\n[e2e] kv={kv_dtype}: {len(e2e.PROMPTS)} prompts x {e2e.MAX_TOKENS} tokens, "
          f"drafts {drafts}, accepted {accepted}, mean acceptance length {mal:.3f}, "
          f"per position {m.get('vllm:spec_decode_num_accepted_tokens_per_pos')}")
    assert drafts > 0 and 0 < accepted < drafts * e2e.NUM_SPEC_TOKENS, m
    for i, (got, want) in enumerate(zip(dflash["ids"], reference["ids"], strict=True)):
        assert len(got) == e2e.MAX_TOKENS
        first_diff = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        assert got == want, f"prompt {i}: first difference at output token {first_diff}"
