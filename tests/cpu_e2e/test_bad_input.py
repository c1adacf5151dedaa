"""Bad input gives a clear error (or a skip with the reason), never a hang.

Engine start-ups run in a subprocess with a hard timeout, so a hang fails the
test instead of stalling the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import dflash_settings
import pytest

START_TIMEOUT_S = 240

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM
    kw = json.loads(sys.argv[1])
    LLM(**kw)
    print("ENGINE STARTED")
    """
)


def _start_engine_subprocess(**kwargs) -> tuple[int, str, float]:
    kwargs.setdefault("dtype", "bfloat16")
    kwargs.setdefault("max_model_len", dflash_settings.MAX_MODEL_LEN)
    kwargs.setdefault("enforce_eager", True)
    t0 = time.monotonic()
    try:
        p = subprocess.run(
            [sys.executable, "-c", _SCRIPT, json.dumps(kwargs)],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:  # a hang is a failure
        pytest.fail(f"engine start did not finish within {START_TIMEOUT_S} s: {e}")
    dt = time.monotonic() - t0
    return p.returncode, p.stdout + p.stderr, dt


def test_dflash_config_without_dflash_config_is_a_clear_error(partial_pair, tmp_path):
    import shutil

    target, draft = partial_pair
    bad = tmp_path / "draft-no-dflash-config"
    shutil.copytree(draft, bad)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["dflash_config"]
    (bad / "config.json").write_text(json.dumps(cfg))
    rc, out, dt = _start_engine_subprocess(
        model=target,
        speculative_config=dflash_settings.dflash_spec_config(str(bad)),
    )
    print(f"\n[e2e] DFlash drafter without dflash_config: rc={rc} after {dt:.1f} s")
    assert rc != 0 and "ENGINE STARTED" not in out
    assert "dflash_config.mask_token_id" in out, out[-3000:]


@pytest.mark.parametrize(
    "kv_dtype, expected",
    [
        ("int3", "kv_cache_dtype"),  # not a vLLM cache dtype at all
        ("nvfp4", "nvfp4"),  # a vLLM cache dtype the CPU backend lacks
    ],
)
def test_unsupported_kv_cache_dtype_is_a_clear_error(partial_pair, kv_dtype, expected):
    target, draft = partial_pair
    rc, out, dt = _start_engine_subprocess(
        model=target,
        kv_cache_dtype=kv_dtype,
        speculative_config=dflash_settings.dflash_spec_config(draft),
    )
    tail = [ln for ln in out.splitlines() if "Error" in ln][-3:]
    print(f"\n[e2e] kv_cache_dtype={kv_dtype}: rc={rc} after {dt:.1f} s: {tail}")
    assert rc != 0 and "ENGINE STARTED" not in out
    assert expected in out, out[-3000:]
