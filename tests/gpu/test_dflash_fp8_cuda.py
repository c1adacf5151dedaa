"""DFlash with auto/fp8 KV caches on CUDA, per drafter attention backend.

The matrix is KV dtype {auto, fp8, fp8_e4m3, fp8_e5m2} x drafter backend
{FLASH_ATTN, TRITON_ATTN, FLASHINFER}, the backend pinned with the
speculative config's ``attention_backend``. Whether a combination is
supported is vLLM's own answer (tests/support/gpu_backends.py) for this GPU:

* supported: the draft layers' KV cache follows the KV dtype (patch 0001),
  KV capacity at equal memory (and fp8/auto ~ 2), int32 drafter inputs,
  greedy DFlash == target-only token for token up to bf16 near-ties
  (tests/support/lossless.py), the full-acceptance pair
  accepts every draft (mean acceptance length k+1); CUDA graphs on and off;
* not supported: tests/gpu/test_dflash_backend_errors_cuda.py.

VLLM_FORK_GPU_MATRIX=quick trims the matrix (tests/support/gpu_e2e.py).

Tiny generated pairs only (vllm.fork.tiny_pairs); nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    import gpu_e2e

    pytest.skip(gpu_e2e.CUDA_SKIP_REASON, allow_module_level=True)

import dflash_settings
import gpu_backends as gb
import gpu_e2e
import greedy_runs

HEAD = gpu_e2e.tiny_head_size()
CAPABILITY = gb.current_capability()
TABLE = gb.support_table(head_size=HEAD, dtype=torch.bfloat16, device_capability=CAPABILITY)


@pytest.fixture(scope="module", autouse=True)
def _record_support_table(measurements):
    measurements["gpu"] = f"{torch.cuda.get_device_name()} (sm {CAPABILITY.as_version_str()})"
    measurements["drafter backend support (head 64, bf16)"] = {
        f"{b}/{kv}": reasons or "supported" for (b, kv), reasons in TABLE.items()
    }
    measurements["matrix mode"] = gpu_e2e.matrix_mode()


def _gap(kv: str, backend: str) -> str | None:
    """A known runtime gap of the drafter's or the target's backend."""
    target_backend = gb.target_backend(kv, head_size=HEAD, dtype=torch.bfloat16)
    return gb.runtime_gap(backend, kv) or (target_backend and gb.runtime_gap(target_backend, kv))


def supported_cases(
    guard_fp8: tuple[str, ...] = (), eager_only: bool = False, quantized_only: bool = False, deep: bool = False
):
    params = []
    for (backend, kv), reasons in TABLE.items():
        if reasons or (quantized_only and kv == "auto") or not gpu_e2e.in_matrix(kv, deep):
            continue
        for eager in (True,) if eager_only else gpu_e2e.eager_modes(kv):
            marks = []
            if guard_fp8 and kv == "fp8" and eager:
                marks.append(pytest.mark.needs_patch(*guard_fp8))
            if gap := _gap(kv, backend):
                marks.append(pytest.mark.xfail(reason=f"vLLM 0.21.0: {gap}", strict=False))
            params.append(pytest.param((kv, backend, eager), marks=marks, id=gpu_e2e.case_id(kv, backend, eager)))
    if not params:
        params.append(
            pytest.param(
                None,
                marks=pytest.mark.skip(
                    reason=f"no drafter backend supports DFlash on this GPU (sm {CAPABILITY}): "
                    + "; ".join(f"{b}/{kv}: {r}" for (b, kv), r in TABLE.items())
                ),
                id="none",
            )
        )
    return pytest.mark.parametrize("case", params)


@supported_cases(guard_fp8=("0001",))
def test_draft_layers_follow_kv_cache_dtype(case, matrix):
    kv, backend, eager = case
    layers = matrix.dflash(kv, backend, eager)["state"]["layers"]
    draft = {n: s for n, s in layers.items() if s["role"] == "draft"}
    target = {n: s for n, s in layers.items() if s["role"] == "target"}
    print(
        f"\n[gpu] {gpu_e2e.case_id(*case)} draft layers: "
        + ", ".join(f"{n}: {s['kv_cache_dtype']}/{s['tensor_dtype']}" for n, s in sorted(draft.items()))
    )
    assert len(draft) == 2 and len(target) == 4, sorted(layers)
    for name, s in sorted(layers.items()):
        assert s["kv_cache_dtype"] == kv, (name, s)
        assert s["impl_kv_cache_dtype"] == kv, (name, s)
        itemsize = getattr(torch, s["tensor_dtype"].removeprefix("torch.")).itemsize
        assert itemsize == dflash_settings.kv_bytes_per_elem(kv, torch.bfloat16), (name, s)
        if kv == "auto":
            assert s["tensor_dtype"] == "torch.bfloat16", (name, s)


@supported_cases(guard_fp8=("0001",))
def test_kv_capacity_follows_kv_dtype(case, matrix, partial_pair, measurements):
    """At equal kv_cache_memory_bytes, blocks = memory / bytes per block over
    the 4 target + 2 draft layers (fp8: 1 byte per element)."""
    kv, backend, eager = case
    state = matrix.dflash(kv, backend, eager)["state"]
    memory = state["kv_cache_memory_bytes"]
    from vllm.platforms import current_platform

    if current_platform.is_cuda():  # (the CPU backend lets VLLM_CPU_KVCACHE_SPACE win)
        assert memory == gpu_e2e.KV_MEMORY_BYTES, memory
    expected, per_block = gpu_e2e.expected_blocks(gpu_e2e.pair_config(partial_pair), kv, state["block_size"], memory)
    measured = state["num_blocks"]
    measurements[f"kv blocks {gpu_e2e.case_id(*case)}"] = measured
    measurements[f"kv tokens {gpu_e2e.case_id(*case)}"] = measured * state["block_size"]
    print(
        f"\n[gpu] {gpu_e2e.case_id(*case)}: {measured} blocks of {state['block_size']} tokens "
        f"(expected {expected}: {per_block} B/block in {memory} B)"
    )
    assert abs(measured - expected) <= max(2, expected // 100)


@supported_cases(quantized_only=True, eager_only=gpu_e2e.matrix_mode() == "quick")
def test_kv_capacity_ratio_fp8_over_auto(case, matrix, measurements):
    kv, backend, eager = case
    if TABLE[(backend, "auto")]:
        pytest.skip(f"{backend} does not take an auto KV cache here: {TABLE[(backend, 'auto')]}")
    fp8 = matrix.dflash(kv, backend, eager)["state"]["num_blocks"]
    auto = matrix.dflash("auto", backend, eager)["state"]["num_blocks"]
    ratio = fp8 / auto
    measurements[f"kv capacity ratio {gpu_e2e.case_id(*case)}/auto"] = round(ratio, 4)
    print(f"\n[gpu] {gpu_e2e.case_id(*case)}: {fp8} / {auto} blocks = {ratio:.3f}")
    assert 1.95 <= ratio <= 2.05


@supported_cases(guard_fp8=("0001",))
def test_drafter_query_start_loc_is_int32(case, matrix):
    kv, backend, eager = case
    qsl = matrix.dflash(kv, backend, eager)["qsl"]
    assert qsl["token_arange_np"] == "int32"
    assert qsl["calls"], "the drafter never ran"
    for cpu_dtype, dev_dtype, _ in qsl["calls"]:
        assert cpu_dtype == "torch.int32"
        assert dev_dtype == "torch.int32"


@supported_cases(deep=True)
def test_greedy_dflash_is_lossless(case, matrix, measurements):
    kv, backend, eager = case
    run = matrix.dflash(kv, backend, eager)
    ref = matrix.reference(kv, eager)
    mal, drafts, accepted = gpu_e2e.mean_acceptance(run["metrics"])
    measurements[f"mean acceptance length partial {gpu_e2e.case_id(*case)}"] = round(mal, 3)
    print(
        f"\n[gpu] {gpu_e2e.case_id(*case)}: drafts {drafts}, accepted {accepted}, mean acceptance "
        f"length {mal:.3f}, per position {run['metrics'].get('vllm:spec_decode_num_accepted_tokens_per_pos')}"
    )
    assert drafts > 0 and 0 < accepted < drafts * dflash_settings.NUM_SPEC_TOKENS, run["metrics"]
    assert all(len(got) == dflash_settings.MAX_TOKENS for got in run["ids"])
    # bf16: equal, or parted at a near-tie (tests/support/lossless.py).
    report = greedy_runs.near_tie_report(run, ref)
    measurements[f"lossless {gpu_e2e.case_id(*case)}"] = report.summary()
    print(f"[gpu] {gpu_e2e.case_id(*case)}: {report.explain()}")
    assert report.ok, report.explain()
    # A near-tie may part one prompt; every prompt parting means something else.
    assert report.exact, report.explain()


@supported_cases(deep=True, eager_only=gpu_e2e.matrix_mode() == "quick")
def test_full_acceptance_pair_accepts_every_draft(case, matrix, measurements):
    from vllm.fork.tiny_pairs import FULL_TOKEN

    kv, backend, eager = case
    run = matrix.full(kv, backend, eager)
    m = run["metrics"]
    mal, drafts, accepted = gpu_e2e.mean_acceptance(m)
    draft_tokens = m["vllm:spec_decode_num_draft_tokens"]
    measurements[f"mean acceptance length full {gpu_e2e.case_id(*case)}"] = mal
    print(
        f"\n[gpu] {gpu_e2e.case_id(*case)} full pair: drafts {drafts}, accepted {accepted}, "
        f"per position {m.get('vllm:spec_decode_num_accepted_tokens_per_pos')}, mean "
        f"acceptance length {mal:.3f} (k + 1 = {dflash_settings.NUM_SPEC_TOKENS + 1})"
    )
    assert all(t == [FULL_TOKEN] * dflash_settings.MAX_TOKENS for t in run["ids"])
    assert drafts > 0
    assert accepted == draft_tokens == drafts * dflash_settings.NUM_SPEC_TOKENS
    assert mal == dflash_settings.NUM_SPEC_TOKENS + 1
