"""Which KV cache dtypes serve a DFlash target and its drafter on this machine.

For every value of ``--kv-cache-dtype`` (and of the drafter's
``speculative_config`` ``kv_cache_dtype``), asks this platform what vLLM asks
when it builds an engine: the platform's own check of the cache dtype, then
its attention backend selection -- causal attention for the target's layers,
non-causal attention for the DFlash drafter's block -- and reports the
backend each side gets, or the reason it gets none. Nothing is listed here
by hand: a dtype this build learns to serve shows up by itself.

    python -m vllm.fork.info --kv
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

# The target's and the drafter's attention as they ask for a backend (a
# Qwen3-8B-like head; the dtype vLLM's CPU and CUDA builds default to).
HEAD_SIZE = 128
MODEL_DTYPE = "bfloat16"


@dataclass(frozen=True)
class Side:
    """The backend one side's layers get with a cache dtype, or why none."""

    backend: str | None
    reason: str | None = None


def cache_dtypes() -> list[str]:
    from vllm.config.cache import CacheDType

    return list(get_args(CacheDType))


def option_name(non_causal: bool) -> str:
    """The option that sets the cache dtype of the target's (causal) or the
    drafter's (non-causal) layers."""
    return "speculative_config kv_cache_dtype" if non_causal else "--kv-cache-dtype"


def backend_for(cache_dtype: str, non_causal: bool) -> Side:
    """What this platform gives attention layers with ``cache_dtype``."""
    import torch

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    option = option_name(non_causal)
    check = getattr(current_platform, "_check_kv_cache_dtype", None)
    try:
        if check is not None:
            check(option, cache_dtype)
        selector = AttentionSelectorConfig(
            head_size=HEAD_SIZE,
            dtype=getattr(torch, MODEL_DTYPE),
            kv_cache_dtype=cache_dtype,
            block_size=None,
            use_non_causal=non_causal,
        )
        with set_current_vllm_config(VllmConfig()):
            path = current_platform.get_attn_backend_cls(None, attn_selector_config=selector)
    except Exception as e:  # the platform's own refusal is the answer
        return Side(None, " ".join(str(e).split()))
    if not path:
        return Side(None, f"{current_platform.device_name} has no attention backend for it")
    return Side(path.rsplit(".", 1)[-1].removesuffix("Backend") or path)


def sides() -> tuple[dict[str, Side], dict[str, Side]]:
    """Per cache dtype, what the target's layers get and what the drafter's get."""
    dtypes = cache_dtypes()
    return ({d: backend_for(d, non_causal=False) for d in dtypes}, {d: backend_for(d, non_causal=True) for d in dtypes})


def table() -> list[tuple[str, str, Side, Side]]:
    """(target dtype, drafter dtype, target side, drafter side) for every pair."""
    target, draft = sides()
    return [(t, d, target[t], draft[d]) for t in target for d in draft]


def describe() -> str:
    from vllm.platforms import current_platform

    dtypes = cache_dtypes()
    target, draft = sides()
    # A reason names its option and dtype; the same reason for several
    # dtypes and both sides is listed once.
    reasons: dict[str, list[str]] = {}

    def cell(side: Side, dtype: str, option: str) -> str:
        if side.backend:
            return side.backend
        key = side.reason.replace(f"{option} {dtype!r} ", "")
        reasons.setdefault(key, [])
        if dtype not in reasons[key]:
            reasons[key].append(dtype)
        return f"no ({list(reasons).index(key) + 1})"

    lines = [
        f"KV cache dtypes on this machine ({current_platform.device_name}), "
        f"{MODEL_DTYPE} model, head size {HEAD_SIZE}:",
        "",
        f"  {'dtype':<22}{'target (causal)':<20}drafter (DFlash, non-causal)",
    ]
    for d in dtypes:
        lines.append(f"  {d:<22}{cell(target[d], d, option_name(False)):<20}{cell(draft[d], d, option_name(True))}")
    drafters = [d for d in dtypes if draft[d].backend]
    lines += [
        "",
        "Pairs that start (--kv-cache-dtype T; speculative_config kv_cache_dtype D, unset = T):",
        f"  T in {{{', '.join(d for d in dtypes if target[d].backend)}}}",
        f"  D in {{{', '.join(drafters)}}}, with any such T",
    ]
    if reasons:
        lines += ["", "Why not:"] + [f"  ({i}) {', '.join(ds)}: {r}" for i, (r, ds) in enumerate(reasons.items(), 1)]
    return "\n".join(lines)
