"""TRITON_ATTN non-causal attention (patch 0009), kernel and backend level.

The cases run in one fresh interpreter (triton_attention_cases.py): on a GPU
with compiled kernels, on CPU through Triton's interpreter, which vLLM's
Triton placeholder would otherwise hide. Each case compares the kernel with
an fp32 reference over a paged cache full of stale K/V; causal cases must
also be bit-for-bit what the pinned base's own kernel computes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton_attention_cases as cases
from repo_paths import TOOLS_LIB

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Largest |kernel - fp32 reference| accepted: the kernel rounds P and the
# dequantised K/V to the query dtype. A stale key leaking in moves it by ~STALE.
TOLERANCE = {"float16": 5e-3, "bfloat16": 3e-2}


def _result_id(item) -> str | None:
    """The runner's result a collected test of this module reads."""
    name, params = item.originalname, getattr(item, "callspec", None)
    if name == "test_kernel_matches_fp32_reference":
        return params.params["case"].id
    if name == "test_causal_kernel_is_bitwise_the_base_kernel":
        return "causal-equals-base"
    if name == "test_backend_carries_the_causal_flag_into_the_kernel":
        return _backend_result_id(params.params["case_id"])
    return None


def _backend_result_id(case_id: str) -> str:
    prefix, _, rest = case_id.partition("-")
    return f"{prefix}-{cases.MODEL_DTYPES[DEVICE][0]}-{rest}"


@pytest.fixture(scope="module")
def results(request) -> dict[str, dict]:
    """The runner's results for the checks of the selected tests only (a
    necessity proof selects the non-causal ones; the Triton interpreter takes
    seconds per case)."""
    pytest.importorskip("triton", reason="Triton is not installed (torch's Linux wheels bring it)")
    here = Path(request.module.__file__)
    wanted = sorted(
        {rid for item in request.session.items if Path(str(item.fspath)) == here and (rid := _result_id(item))}
    )
    proc = subprocess.run(
        [sys.executable, str(TOOLS_LIB / "triton_attention_cases.py"), "--device", DEVICE, "--only", ",".join(wanted)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    if proc.returncode != 0:
        pytest.fail(f"case runner failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return {case["id"]: case for case in json.loads(proc.stdout)["cases"]}


def _marks(case: cases.Case):
    return [] if case.causal else [pytest.mark.needs_patch("0009")]


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c.id, marks=_marks(c)) for c in cases.all_cases(DEVICE)],
)
def test_kernel_matches_fp32_reference(results, case):
    result = results[case.id]
    assert "error" not in result, result["error"] + "\n" + result.get("traceback", "")
    assert result["max_err"] < TOLERANCE[case.dtype], f"max |kernel - reference| = {result['max_err']}"


def test_causal_kernel_is_bitwise_the_base_kernel(results):
    result = results["causal-equals-base"]
    if result.get("error", "").startswith("FileNotFoundError"):
        pytest.skip(result["error"])
    assert "error" not in result, result["error"] + "\n" + result.get("traceback", "")
    differing = [case for case, equal in result["equal_per_case"].items() if not equal]
    assert result["equal_per_case"] and not differing, f"causal output changed for {differing}"


@pytest.mark.needs_patch("0009")
@pytest.mark.parametrize(
    "case_id",
    [f"backend-{c}" for c in ("fp8-noncausal-h8kv2-full", "auto-noncausal-h8kv2-sw12", "fp8_e5m2-causal-h8kv2-full")],
)
def test_backend_carries_the_causal_flag_into_the_kernel(results, case_id):
    result = results[_backend_result_id(case_id)]
    assert "error" not in result, result["error"] + "\n" + result.get("traceback", "")
    assert result["supports_non_causal"] is True
    assert result["metadata_causal"] is ("noncausal" not in case_id)
    assert result["max_err"] < TOLERANCE[cases.MODEL_DTYPES[DEVICE][0]]
