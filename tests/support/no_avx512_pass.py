"""The suite as on a CPU without AVX-512 or AMX (a pytest plugin).

VLLM_FORK_TEST_NO_AVX512=1 makes every process of the run see such a CPU:
this process when this module is imported (the first plugin
tests/conftest.py names, loaded before any test module), every child through sitecustomize
(tests/support/no_avx512 on PYTHONPATH). vLLM then loads _C_AVX2 and fp8 KV
caches take the torch path. tools/run_tests.sh runs the tests this plugin
marks `no_avx512_pass` a second time in that mode on CPUs that have AVX-512
or AMX, so that path is tested on every machine.
"""

from __future__ import annotations

import os
import sys

import parallel_workers
import pytest
from repo_paths import SUPPORT

NO_AVX512_ENV = "VLLM_FORK_TEST_NO_AVX512"
_OVERRIDE = str(SUPPORT / "no_avx512")

if os.environ.get(NO_AVX512_ENV) == "1":
    if _OVERRIDE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_OVERRIDE, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, _OVERRIDE)
    import no_avx512_probes

    no_avx512_probes.apply()

# What the second pass runs: these files' tests, and the necessity proofs of
# the patches with a guard marked needs_patch(..., no_avx512_pass=True)
# (necessity_plugin.proof_marks).
NO_AVX512_PASS_FILES = (
    "kernels/test_cpu_fp8_kv_without_avx512.py",
    "kernels/test_cpu_noncausal_attention.py",
    # Without the compiled grouped GEMM (the AVX2 kernel library lacks it)
    # MoE layers take the torch path.
    "kernels/test_cpu_batch_invariant_gemm.py",
    "cpu_e2e/test_dflash_kv.py",
    "cpu_e2e/test_dflash_families.py",
    "cpu_e2e/test_batch_invariant_cpu.py",
)


def _only_auto_kv(item) -> bool:
    """A check of a bf16/float32 KV cache only: it takes none of the fp8 paths
    the pass exists for (the AVX2 kernels of such caches run in the first pass
    of AVX2-only machines)."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("kv_dtype") == "auto":
        return True
    return item.get_closest_marker("auto_kv_only") is not None


def _in_no_avx512_pass(item) -> bool:
    rel = parallel_workers.relative_path(item)
    return rel in NO_AVX512_PASS_FILES and not (rel.startswith("cpu_e2e/") and _only_auto_kv(item))


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "auto_kv_only: an end-to-end check of the model-dtype KV cache only, left out of the "
        "no-AVX-512 pass (which is about the fp8 KV paths)",
    )
    config.addinivalue_line(
        "markers",
        "no_avx512_pass: also run as on a CPU without AVX-512/AMX (set by tests/support/no_avx512_pass.py; "
        "tools/run_tests.sh runs -m no_avx512_pass with VLLM_FORK_TEST_NO_AVX512=1)",
    )


def _fp8_path_without_avx512() -> str:
    try:
        from vllm.v1.attention.backends import cpu_attn_fp8_avx2
    except ImportError:
        return "torch (cpu_attn_torch_fp8)"
    try:
        return f"AVX2 kernel (cpu_attn_fp8_avx2: {cpu_attn_fp8_avx2.build()})"
    except cpu_attn_fp8_avx2.BuildError as exc:
        return f"torch (cpu_attn_torch_fp8; the AVX2 kernel does not build here: {exc})"


def pytest_report_header(config):
    try:
        import torch
    except ImportError:  # tests/packaging runs without torch
        return "CPU as vLLM sees it: unknown (torch is not installed)"

    flags = {name: getattr(torch.cpu, f"_is_{name}_supported")() for name in ("avx2", "avx512", "amx_tile")}
    forced = f" (forced: {NO_AVX512_ENV}=1)" if os.environ.get(NO_AVX512_ENV) == "1" else ""
    fp8_path = "the base's compiled kernels" if flags["avx512"] or flags["amx_tile"] else _fp8_path_without_avx512()
    cpu = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in flags.items())
    return f"CPU as vLLM sees it: {cpu}{forced}; fp8 KV cache path: {fp8_path}"


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _in_no_avx512_pass(item):
            item.add_marker("no_avx512_pass")
