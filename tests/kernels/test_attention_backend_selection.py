"""Which attention backend a DFlash drafter with an fp8 KV cache gets on CUDA.

The drafter asks for non-causal attention. vLLM's own CUDA selector runs here
with the GPU generation faked, so CI proves the rule without a GPU: FA3
(Hopper) keeps FLASH_ATTN; everywhere else TRITON_ATTN (patch 0009) is the
backend that works, and a rejected explicit choice names it (patch 0010).
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

GPUS = {
    "A100": ((8, 0), False),
    "L40S": ((8, 9), False),
    "H100": ((9, 0), True),  # FA3: flash_attn_supports_fp8()
    "B200": ((10, 0), False),
}


@pytest.fixture
def cuda_selector(monkeypatch):
    """(CudaPlatform, AttentionSelectorConfig, AttentionBackendEnum, set_gpu)."""
    if importlib.util.find_spec("vllm._C_stable_libtorch") is None:
        # CPU build: the CUDA platform module imports these extensions only to
        # register ops; selection itself is pure Python. The CPU build's
        # vllm._C is its AVX-512 library: importing it on an AVX2-only CPU
        # aborts the process, so it is stubbed too (the CPU platform has
        # already registered the ops of the library this CPU can run).
        for name in ("vllm._C", "vllm._C_stable_libtorch"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends import flash_attn
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    def set_gpu(name: str) -> None:
        (major, minor), fa3_fp8 = GPUS[name]
        capability = DeviceCapability(major, minor)
        monkeypatch.setattr(CudaPlatform, "get_device_capability", classmethod(lambda cls, device_id=0: capability))
        monkeypatch.setattr(flash_attn, "flash_attn_supports_fp8", lambda: fa3_fp8)

    return CudaPlatform, AttentionSelectorConfig, AttentionBackendEnum, set_gpu


def _drafter_config(selector_config, kv_cache_dtype="fp8"):
    return selector_config(
        head_size=128, dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype, block_size=None, use_non_causal=True
    )


@pytest.mark.parametrize(
    "gpu, expected",
    [
        pytest.param("A100", "TritonAttentionBackend", marks=pytest.mark.needs_patch("0009")),
        pytest.param("L40S", "TritonAttentionBackend", marks=pytest.mark.needs_patch("0009")),
        pytest.param("B200", "TritonAttentionBackend", marks=pytest.mark.needs_patch("0009")),
        pytest.param("H100", "FlashAttentionBackend"),
    ],
)
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_dflash_fp8_drafter_gets_a_working_backend(cuda_selector, gpu, expected, kv_cache_dtype):
    platform, selector_config, _, set_gpu = cuda_selector
    set_gpu(gpu)
    path = platform.get_attn_backend_cls(None, _drafter_config(selector_config, kv_cache_dtype))
    assert path.rsplit(".", 1)[-1] == expected


@pytest.mark.needs_patch("0009")
def test_explicit_triton_attn_is_honoured(cuda_selector):
    platform, selector_config, backends, set_gpu = cuda_selector
    set_gpu("H100")
    path = platform.get_attn_backend_cls(backends.TRITON_ATTN, _drafter_config(selector_config))
    assert path.endswith("TritonAttentionBackend")


@pytest.mark.needs_patch("0009", "0010")
@pytest.mark.parametrize("gpu", ["A100", "B200"])
def test_impossible_explicit_choice_names_what_works(cuda_selector, gpu):
    platform, selector_config, backends, set_gpu = cuda_selector
    set_gpu(gpu)
    with pytest.raises(ValueError) as excinfo:
        platform.get_attn_backend_cls(backends.FLASH_ATTN, _drafter_config(selector_config))
    message = str(excinfo.value)
    assert "kv_cache_dtype not supported" in message
    assert "Backends that support this configuration: TRITON_ATTN" in message


@pytest.mark.needs_patch("0009", "0010")
@pytest.mark.parametrize("kv_cache_dtype", ["nvfp4", "turboquant_k8v4"])
def test_a_drafter_dtype_no_backend_serves_names_the_dtypes_that_do(cuda_selector, kv_cache_dtype):
    """A DFlash drafter's cache set (speculative_config kv_cache_dtype) to a
    dtype no backend serves for non-causal attention: the error lists the
    dtypes that one would serve, each with its backend, and the field."""
    platform, selector_config, _, set_gpu = cuda_selector
    set_gpu("B200")
    with pytest.raises(ValueError) as excinfo:
        platform.get_attn_backend_cls(None, _drafter_config(selector_config, kv_cache_dtype))
    message = str(excinfo.value)
    print(f"\n[kernel] {message[message.index('KV cache dtypes that') :]}")
    assert "No valid attention backend found" in message
    assert "(a DFlash drafter's: speculative_config kv_cache_dtype)" in message, message
    assert "auto (FLASH_ATTN)" in message and "fp8 (TRITON_ATTN)" in message, message
    assert f"{kv_cache_dtype} (" not in message, message
