"""Which CUDA attention backends can run a DFlash drafter, by vLLM's own rule.

The DFlash drafter attends non-causally (vLLM sets
``attention_config.use_non_causal=True`` for its layers), so a backend serves
it only if its ``validate_configuration`` accepts that together with the KV
cache dtype on this GPU. This module asks vLLM -- nothing is hard-coded -- so
the table follows the installed build (a fork patch that teaches TRITON_ATTN
non-causal attention changes it without touching the tests).

Everything here also runs on a machine without a GPU when a
:class:`DeviceCapability` is passed in (tests/gpu/test_backend_support_table.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

# The drafter backends the GPU suite pins through the speculative config's
# ``attention_backend`` key, and the KV cache dtypes it covers.
BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER")
KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")

# The text patch 0010 puts in the ValueError of a rejected explicit backend,
# followed by the valid backend names, comma-separated.
SUPPORTED_BACKENDS_TEXT = "Backends that support this configuration:"


def current_capability():
    """This GPU's compute capability (None without a CUDA device)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None
    return current_platform.get_device_capability()


def capability(major: int, minor: int):
    from vllm.platforms.interface import DeviceCapability

    return DeviceCapability(major, minor)


def validation_reasons(
    backend: str,
    *,
    head_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    device_capability,
    use_non_causal: bool = True,
) -> list[str]:
    """vLLM's reasons why ``backend`` cannot serve a (DFlash drafter) decoder
    layer with this configuration; ``[]`` means supported. A backend whose
    module does not import (e.g. FlashInfer not installed) gives
    ``["ImportError: ..."]``, as vLLM's selector treats it."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    try:
        cls = AttentionBackendEnum[backend].get_class()
    except ImportError as e:
        return [f"ImportError: {e}"]
    return list(
        cls.validate_configuration(
            head_size=head_size,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            block_size=None,
            use_mla=False,
            has_sink=False,
            use_sparse=False,
            use_mm_prefix=False,
            use_per_head_quant_scales=False,
            device_capability=device_capability,
            attn_type="decoder",
            use_non_causal=use_non_causal,
        )
    )


def support_table(
    *,
    head_size: int,
    dtype: torch.dtype,
    device_capability,
    backends: Iterable[str] = BACKENDS,
    kv_dtypes: Iterable[str] = KV_DTYPES,
) -> dict[tuple[str, str], list[str]]:
    """``{(backend, kv_dtype): reasons}`` for a DFlash drafter; ``[]`` = supported."""
    return {
        (b, kv): validation_reasons(
            b, head_size=head_size, dtype=dtype, kv_cache_dtype=kv, device_capability=device_capability
        )
        for b in backends
        for kv in kv_dtypes
    }


def working_backends(
    kv_cache_dtype: str,
    *,
    head_size: int,
    dtype: torch.dtype,
    device_capability,
    candidates: Iterable[str] = BACKENDS,
) -> list[str]:
    """The ``candidates`` that validate for a DFlash drafter layer."""
    return [
        b
        for b in candidates
        if not validation_reasons(
            b,
            head_size=head_size,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            device_capability=device_capability,
        )
    ]


def platform_valid_backends(
    kv_cache_dtype: str | None, *, head_size: int, dtype: torch.dtype, use_non_causal: bool
) -> list[str]:
    """What the CUDA platform's own selector finds valid, best first (the
    names a helpful error can offer). CUDA only."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    cfg = AttentionSelectorConfig(
        head_size=head_size,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size=None,
        use_non_causal=use_non_causal,
    )
    valid, _invalid = current_platform.get_valid_backends(
        device_capability=current_platform.get_device_capability(),
        attn_selector_config=cfg,
    )
    # 0.21.0: [(backend, priority)]; later releases: objects with .backend/.priority.
    pairs = [(v[0], v[1]) if isinstance(v, tuple) else (v.backend, v.priority) for v in valid]
    return [b.name for b, _prio in sorted(pairs, key=lambda p: p[1])]


def target_backend(kv_cache_dtype: str, *, head_size: int, dtype: torch.dtype) -> str | None:
    """The backend vLLM auto-selects for the (causal) target layers. CUDA only."""
    names = platform_valid_backends(kv_cache_dtype, head_size=head_size, dtype=dtype, use_non_causal=False)
    return names[0] if names else None


def runtime_gap(backend: str, kv_cache_dtype: str) -> str | None:
    """A reason why ``backend`` validates ``kv_cache_dtype`` but cannot run
    it, according to the backend's own code (None if there is none known).

    vLLM 0.21.0's FLASH_ATTN validates every quantized KV dtype when FA3 fp8
    is available, yet maps only fp8/fp8_e4m3 to a kernel dtype
    (``FlashAttentionBackend.get_fp8_dtype_for_flashattn`` raises for
    fp8_e5m2), so such an engine fails once attention runs.
    """
    if kv_cache_dtype in ("auto", "float16", "bfloat16") or backend != "FLASH_ATTN":
        return None
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    try:
        cls = AttentionBackendEnum[backend].get_class()
    except ImportError:
        return None
    mapping = getattr(cls, "get_fp8_dtype_for_flashattn", None)
    if mapping is None:
        return None
    try:
        mapping(kv_cache_dtype)
    except ValueError as e:
        return (
            f"{backend} validates kv_cache_dtype={kv_cache_dtype} but has no kernel dtype for it "
            f"(get_fp8_dtype_for_flashattn: {e})"
        )
    return None


def backend_names_in(message: str) -> list[str] | None:
    """The backend names listed after :data:`SUPPORTED_BACKENDS_TEXT` in an
    error message (only real ``AttentionBackendEnum`` names, in order); None
    when the message lacks that text."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    at = message.find(SUPPORTED_BACKENDS_TEXT)
    if at < 0:
        return None
    rest = message[at + len(SUPPORTED_BACKENDS_TEXT) :]
    rest = re.split(r"[\n;]|\.(?:\s|$)", rest, maxsplit=1)[0]
    known = set(AttentionBackendEnum.__members__)
    return [tok for tok in re.findall(r"[A-Z][A-Z0-9_]+", rest) if tok in known]


def format_table(table: dict[tuple[str, str], list[str]]) -> str:
    backends = list(dict.fromkeys(b for b, _ in table))
    kvs = list(dict.fromkeys(kv for _, kv in table))
    lines = [f"{'backend':<12}" + "".join(f"{kv:>12}" for kv in kvs)]
    for b in backends:
        lines.append(f"{b:<12}" + "".join(f"{('ok' if not table[(b, kv)] else 'no'):>12}" for kv in kvs))
    reasons = sorted({f"{b}/{kv}: {', '.join(r)}" for (b, kv), r in table.items() if r})
    return "\n".join(lines + [""] + reasons)
