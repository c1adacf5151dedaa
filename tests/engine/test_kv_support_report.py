"""`python -m vllm.fork.info --kv`: which KV cache dtypes serve a DFlash
target and drafter on this machine, from the platform's own checks and
attention backend selection (vllm.fork.kv_support). On CPU: the unquantized
and fp8 dtypes on both sides (every pair of them starts and is lossless:
tests/cpu_e2e/test_dflash_draft_kv_dtype.py), the others refused with the
platform's reason.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

ON_CPU = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


@pytest.mark.needs_patch("0028")
def test_table_follows_what_the_cpu_platform_serves():
    from vllm.fork import kv_support

    rows = kv_support.table()
    dtypes = kv_support.cache_dtypes()
    assert len(rows) == len(dtypes) ** 2 and "nvfp4" in dtypes
    for target, draft, target_side, draft_side in rows:
        assert bool(target_side.backend) == (target in ON_CPU), (target, target_side)
        assert bool(draft_side.backend) == (draft in ON_CPU), (draft, draft_side)
        if target not in ON_CPU:
            assert f"--kv-cache-dtype {target!r} is not supported on CPU" in target_side.reason
        if draft not in ON_CPU:
            assert f"speculative_config kv_cache_dtype {draft!r} is not supported on CPU" in draft_side.reason


def test_info_prints_the_report():
    out = subprocess.run([sys.executable, "-m", "vllm.fork.info", "--kv"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    print(out.stdout)
    lines = out.stdout.splitlines()
    assert any(line.split()[:3] == ["fp8", "CPUAttention", "CPUAttention"] for line in lines), out.stdout
    assert any(line.startswith("  T in {") and "fp8" in line for line in lines), out.stdout
