"""DFlash drafter backends this GPU cannot run: engine start must fail clearly.

For every (KV dtype, drafter backend) that vLLM's own validation rejects for
a DFlash drafter layer here (tests/support/gpu_backends.py), starting the
engine with that backend pinned (``speculative_config.attention_backend``)
must raise a ValueError that names the rejected backend and -- with patch
0010 -- lists, after "Backends that support this configuration:", the
backends that do work: all the suite's backends that validate for this KV
dtype, and only ones that validate.

All such engines are started in one subprocess with the engine core in
process (tests/support/engine_start_errors.py), so the error reaches
``LLM(...)`` itself; they fail while loading tiny models, which is quick.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    import gpu_e2e

    pytest.skip(gpu_e2e.CUDA_SKIP_REASON, allow_module_level=True)

import dflash_settings
import engine_start_errors as ese
import gpu_backends as gb
import gpu_e2e
import offline_engine

HEAD = gpu_e2e.tiny_head_size()
CAPABILITY = gb.current_capability()
TABLE = gb.support_table(head_size=HEAD, dtype=torch.bfloat16, device_capability=CAPABILITY)
UNSUPPORTED = [(kv, b) for (b, kv), reasons in TABLE.items() if reasons and gpu_e2e.in_matrix(kv, deep=True)]


def unsupported_cases(*guards):
    marks = [pytest.mark.needs_patch(*guards)] if guards else []
    params = [pytest.param((kv, b), id=gpu_e2e.case_id(kv, b), marks=marks) for kv, b in UNSUPPORTED]
    if not params:
        params = [
            pytest.param(
                None,
                id="none",
                marks=pytest.mark.skip(
                    reason=f"every drafter backend of the suite supports every KV dtype here (sm {CAPABILITY})"
                ),
            )
        ]
    return pytest.mark.parametrize("case", params)


@pytest.fixture(scope="module")
def start_errors(partial_pair, tmp_path_factory):
    offline_engine.shutdown_llm()  # one engine at a time, also across modules
    target, draft = partial_pair
    cases = [
        {
            "id": gpu_e2e.case_id(kv, b),
            "target": target,
            "draft": draft,
            "kv_cache_dtype": kv,
            "attention_backend": b,
            "num_speculative_tokens": dflash_settings.NUM_SPEC_TOKENS,
            "enforce_eager": True,
            "dtype": "bfloat16",
            "max_model_len": dflash_settings.MAX_MODEL_LEN,
            "max_num_seqs": 8,
            "seed": 0,
            **gpu_e2e.ENGINE_KW,
        }
        for kv, b in UNSUPPORTED
    ]
    return gpu_e2e.run_start_errors(cases, tmp_path_factory.mktemp("start-errors"))


def _value_error(result: dict) -> dict:
    assert result.get("started") is False, f"the engine started (or the harness broke): {result}"
    err = ese.first_of_type(result["chain"], "ValueError")
    assert err is not None, f"no ValueError in the exception chain: {result['chain']}"
    return err


@unsupported_cases()
def test_engine_start_fails_with_value_error_naming_the_backend(case, start_errors):
    kv, backend = case
    err = _value_error(start_errors[gpu_e2e.case_id(kv, backend)])
    print(f"\n[gpu] {gpu_e2e.case_id(kv, backend)}: ValueError: {err['message'][:600]}")
    assert backend in err["message"]


@unsupported_cases("0010")
def test_error_lists_the_backends_that_work(case, start_errors, measurements):
    kv, backend = case
    err = _value_error(start_errors[gpu_e2e.case_id(kv, backend)])
    listed = gb.backend_names_in(err["message"])
    expected = gb.working_backends(kv, head_size=HEAD, dtype=torch.bfloat16, device_capability=CAPABILITY)
    measurements[f"error lists {gpu_e2e.case_id(kv, backend)}"] = listed
    print(f"\n[gpu] {gpu_e2e.case_id(kv, backend)}: lists {listed}, suite backends that work: {expected}")
    assert listed is not None, (
        f"the error does not say which backends work ({gb.SUPPORTED_BACKENDS_TEXT!r} missing): {err['message'][:1000]}"
    )
    assert set(expected) <= set(listed), (expected, listed)
    wrong = {
        n: r
        for n in listed
        if (
            r := gb.validation_reasons(
                n, head_size=HEAD, dtype=torch.bfloat16, kv_cache_dtype=kv, device_capability=CAPABILITY
            )
        )
    }
    assert not wrong, f"the error recommends backends that do not validate: {wrong}"
