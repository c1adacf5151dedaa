"""KV cache dtypes the CPU attention backend cannot store are refused when
the engine config is built, before any weight loads, with a message naming
the option, the dtype and what CPU stores -- for the target's
--kv-cache-dtype and for the drafter's speculative_config kv_cache_dtype.
Without this, four of them failed in the worker after loading with a tensor
shape error, and two started with a cache of another format.
"""

from __future__ import annotations

import pytest
from engine_configs import config_refusal

pytestmark = pytest.mark.needs_patch("0028")

NOT_ON_CPU = (
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
    "int8_per_token_head",
    "fp8_per_token_head",
    "nvfp4",
    "fp8_inc",
    "fp8_ds_mla",
)
STORED_ON_CPU = "auto, fp8, fp8_e4m3, fp8_e5m2, bfloat16, float16"


def _refusal(target: str, draft: str, target_dtype: str, draft_dtype: str | None) -> str:
    spec = {"method": "dflash", "model": draft, "num_speculative_tokens": 3}
    if draft_dtype is not None:
        spec["kv_cache_dtype"] = draft_dtype
    return config_refusal(
        model=target,
        dtype="bfloat16",
        max_model_len=256,
        enforce_eager=True,
        kv_cache_dtype=target_dtype,
        speculative_config=spec,
    )


@pytest.mark.parametrize("cache_dtype", NOT_ON_CPU)
def test_target_dtype_cpu_cannot_store_is_refused(trained_pair, cache_dtype):
    message = _refusal(*trained_pair, cache_dtype, None)
    assert f"--kv-cache-dtype {cache_dtype!r} is not supported on CPU" in message, message
    assert STORED_ON_CPU in message, message


@pytest.mark.needs_patch("0027")
@pytest.mark.parametrize("cache_dtype", NOT_ON_CPU)
def test_drafter_dtype_cpu_cannot_store_is_refused(trained_pair, cache_dtype):
    message = _refusal(*trained_pair, "fp8", cache_dtype)
    assert f"speculative_config kv_cache_dtype {cache_dtype!r} is not supported on CPU" in message, message
    assert STORED_ON_CPU in message, message
