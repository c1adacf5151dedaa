# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM DFlash-FP8 fork
"""fp8 KV cache for CPU_ATTN on CPUs whose attention kernels lack it.

The CPU base compiles fp8 KV-cache support (cache write and attention read)
only into its AVX-512 and AMX kernels; on x86 CPUs without AVX-512 it loads
``_C_AVX2`` and refuses ``--kv-cache-dtype fp8``. This module is the torch
implementation of the two kernel entry points that touch an fp8 cache,
``cpu_attn_reshape_and_cache`` and ``cpu_attention_with_kv_cache``, which
``vllm._custom_ops`` routes here when :func:`uses_torch_fp8_kv` is true.
Causal (target) and non-causal (DFlash draft block) attention, GQA, sliding
windows, logit soft-capping, ALiBi and attention sinks follow the kernel's
semantics; the softmax is computed in float32.

Both entry points own the cache layout: the uint8 cache of shape
``[num_blocks, num_kv_heads, block_size, head_size]`` holds each token's fp8
bytes in natural order at ``[block, head, slot % block_size, :]``. Values are
stored as ``x / scale`` rounded to the nearest fp8 value (saturating at the
format's largest finite value) and read back as ``fp8 * scale``.
"""

from __future__ import annotations

import torch

_FP8_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kernels_support_fp8_kv() -> bool:
    """Whether the loaded CPU kernels hold an fp8 KV cache themselves.

    Mirrors the base's choice of kernel library (``_C_AVX512``/``_C`` only
    with AVX-512) and of attention ISA (``amx`` needs AMX tiles)."""
    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


def uses_torch_fp8_kv(kv_cache_dtype: str) -> bool:
    """Whether a cache of this dtype goes through this module."""
    return kv_cache_dtype in _FP8_DTYPES and not kernels_support_fp8_kv()


def _fp8_dtype(kv_cache_dtype: str) -> torch.dtype:
    try:
        return _FP8_DTYPES[kv_cache_dtype]
    except KeyError:
        raise ValueError(
            f"CPU torch fp8 KV path: unsupported kv_cache_dtype "
            f"{kv_cache_dtype!r}; use one of {sorted(_FP8_DTYPES)}"
        ) from None


def quantize(x: torch.Tensor, scale: float, fp8: torch.dtype) -> torch.Tensor:
    """x / scale as fp8 (nearest value, saturating), as raw uint8 bytes."""
    limit = torch.finfo(fp8).max
    q = (x.float() / scale).clamp_(-limit, limit).to(fp8)
    return q.view(torch.uint8)


def dequantize(raw: torch.Tensor, scale: float, fp8: torch.dtype) -> torch.Tensor:
    """uint8 bytes holding fp8 values -> float32 values times scale."""
    return raw.view(fp8).float().mul_(scale)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
    kv_cache_dtype: str,
) -> None:
    """Write key/value ``[num_tokens, num_kv_heads, head_size]`` into the
    fp8 caches at ``slot_mapping`` (negative slots are padding, skipped)."""
    fp8 = _fp8_dtype(kv_cache_dtype)
    block_size = key_cache.shape[2]
    slots = slot_mapping.to(torch.int64)
    num_tokens = slots.shape[0]
    valid = slots >= 0
    slots = slots[valid]
    blocks, offsets = slots // block_size, slots % block_size
    for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        cache[blocks, :, offsets, :] = quantize(src[:num_tokens][valid], scale, fp8)


def _gather(
    cache: torch.Tensor, blocks: torch.Tensor, seq_len: int, scale: float, fp8
) -> torch.Tensor:
    """The first seq_len tokens of a request: float32 [num_kv_heads, seq_len, head_size]."""
    raw = cache[blocks]  # [n, num_kv_heads, block_size, head_size]
    n, heads, block_size, head_size = raw.shape
    raw = raw.transpose(0, 1).reshape(heads, n * block_size, head_size)[:, :seq_len]
    return dequantize(raw, scale, fp8)


def attention_with_kv_cache(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None,
    sliding_window: tuple[int, int],
    block_table: torch.Tensor,
    softcap: float,
    s_aux: torch.Tensor | None,
    k_scale: float,
    v_scale: float,
    kv_cache_dtype: str,
) -> None:
    """Attention of ``query`` ``[num_tokens, num_heads, head_size]`` over the
    fp8 paged cache, written into ``output``. A request's query tokens are
    the last ``query_len`` of its ``seq_len`` positions; key slots at or past
    ``seq_len`` are never read."""
    fp8 = _fp8_dtype(kv_cache_dtype)
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    left, right = sliding_window
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for req, seq_len in enumerate(lens):
        q_start, q_end = starts[req], starts[req + 1]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_table[req, :num_blocks].to(torch.int64)
        k = _gather(key_cache, blocks, seq_len, k_scale, fp8)
        v = _gather(value_cache, blocks, seq_len, v_scale, fp8)
        # [num_kv_heads, group, query_len, head_size]: query head h reads KV head h // group.
        q = query[q_start:q_end].float().transpose(0, 1).reshape(
            num_kv_heads, group, query_len, head_size
        )
        scores = torch.einsum("hgqd,htd->hgqt", q, k) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        if alibi_slopes is not None:
            slopes = alibi_slopes.float().view(num_kv_heads, group, 1, 1)
            scores = scores + slopes * (k_pos - q_pos)
        masked = torch.zeros(query_len, seq_len, dtype=torch.bool)
        if causal:
            masked |= k_pos > q_pos
        if left >= 0:
            masked |= k_pos < q_pos - left
        if right >= 0:
            masked |= k_pos > q_pos + right
        scores = scores.masked_fill(masked, float("-inf"))
        if s_aux is not None:
            # A sink is one more logit per head in the softmax's denominator.
            sink = s_aux.float().view(num_kv_heads, group, 1, 1).expand(-1, -1, query_len, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :seq_len]
        else:
            probs = scores.softmax(-1)
        out = torch.einsum("hgqt,htd->hgqd", probs, v)
        out = out.reshape(num_heads, query_len, head_size).transpose(0, 1)
        rows = output[q_start:q_end]
        rows.copy_(out.reshape(rows.shape))
