"""The DFlash settings the CPU end-to-end tests share: the environment their
engines and servers start with (set when this module is imported), the
speculative config, `vllm serve` arguments, sizes and the KV formats they run."""

from __future__ import annotations

import json
import os

import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(fn)
# Offline engines run their engine core in the test process; the model
# (target, drafter, attention, KV cache) still runs in vLLM's worker process.
# That saves a process start (~7 s of imports on 2 cores) per engine and its
# CPU while idle. The full process layout users get is what the `vllm serve`
# tests run (tools/lib/vllm_server.py does not pass this on).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# Every KV format the CPU backend stores: "fp8_e4m3" is the format "fp8"
# names (the kernel tests in tests/kernels run every spelling), so the
# end-to-end engines, two per entry, skip that alias.
KV_DTYPES = ["auto", "fp8", "fp8_e5m2"]
NUM_SPEC_TOKENS = 3
MAX_MODEL_LEN = 1024
# Prompt + output cross the CPU default KV block size (128 tokens).
MAX_TOKENS = 160


def kv_bytes_per_elem(kv_dtype: str, model_dtype: torch.dtype) -> int:
    """Bytes a KV cache element takes: the model dtype's for "auto", an
    explicit unquantized dtype's own, one for the fp8 formats."""
    if kv_dtype == "auto":
        return model_dtype.itemsize
    if kv_dtype in ("bfloat16", "float16"):
        return getattr(torch, kv_dtype).itemsize
    return 1


def dflash_fp8_serve_args(draft_dir: str, dtype: str = "bfloat16") -> list[str]:
    """`vllm serve` arguments for the cpu_e2e servers: DFlash, fp8 KV, bf16
    unless `dtype` says otherwise."""
    return [
        "--dtype",
        dtype,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enforce-eager",
        "--seed",
        "0",
        "--kv-cache-dtype",
        "fp8",
        "--speculative-config",
        json.dumps(dflash_spec_config(draft_dir)),
    ]


def dflash_spec_config(draft_dir: str, **extra) -> dict:
    cfg = {
        "method": "dflash",
        "model": draft_dir,
        "num_speculative_tokens": NUM_SPEC_TOKENS,
    }
    cfg.update(extra)
    return cfg
