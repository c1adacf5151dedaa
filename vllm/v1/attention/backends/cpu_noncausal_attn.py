# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM DFlash-FP8 fork
"""Non-causal (bidirectional) attention over the paged cache for CPU_ATTN.

``torch.ops._C.cpu_attention_with_kv_cache`` called with ``causal=False``
does not mask the key tiles of the last block: every key slot up to the
next multiple of the kernel's tile (32 tokens) takes part in the softmax,
including slots at or past ``seq_len`` that hold stale K/V (for DFlash: the
K/V of rejected draft tokens). The causal path masks those slots correctly.

A non-causal request with ``q`` query tokens and ``seq_len`` keys is the
same computation as ``q`` independent one-token requests, each of which
attends to all ``seq_len`` keys. With one query token, causal masking only
hides keys at positions ``>= seq_len``, which is exactly the masking needed.
So the fix splits every query token into its own request (same block table
row, same ``seq_len``) and runs the unchanged C++ kernel with
``causal=True``. The kernel itself still reads the cache, which keeps the
ISA specific cache layouts (vec/vec16/amx), the FP8 dequantisation
(e4m3/e5m2 with k/v scales), GQA, logit soft-capping, attention sinks and
ALiBi (a per-row constant shift of the ALiBi bias cancels in the softmax)
exactly as the kernel implements them.

Sliding windows are rejected: the window is relative to each query's
position, which the split moves to ``seq_len - 1``.
"""

from typing import TYPE_CHECKING

import torch

from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends import cpu_attn_torch_fp8

if TYPE_CHECKING:
    from vllm.v1.attention.backend import AttentionLayer
    from vllm.v1.attention.backends.cpu_attn import (
        CPUAttentionBackendImpl,
        CPUAttentionMetadata,
    )

# Attribute of CPUAttentionMetadata that caches the per-token split for the
# layers sharing one metadata object (all layers of a KV cache group).
_CACHE_ATTR = "_noncausal_split_cache"


def _split_per_token(
    impl: "CPUAttentionBackendImpl",
    attn_metadata: "CPUAttentionMetadata",
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (query_start_loc, seq_lens, block_table, scheduler_metadata)
    of the batch in which every query token is a one-token request."""
    key = (impl.num_heads, impl.num_kv_heads, impl.head_size, dtype)
    cache = getattr(attn_metadata, _CACHE_ATTR, None)
    if cache is None:
        cache = {}
        setattr(attn_metadata, _CACHE_ATTR, cache)
    if key in cache:
        return cache[key]

    query_start_loc = attn_metadata.query_start_loc
    seq_lens = attn_metadata.seq_lens
    num_reqs = seq_lens.shape[0]
    query_lens = (query_start_loc[1 : num_reqs + 1] - query_start_loc[:num_reqs]).to(
        torch.int64
    )
    num_tokens = int(query_start_loc[num_reqs])
    req_of_token = torch.repeat_interleave(
        torch.arange(num_reqs, device=seq_lens.device),
        query_lens,
        output_size=num_tokens,
    )
    split_seq_lens = seq_lens[req_of_token].contiguous()
    split_block_table = attn_metadata.block_table[req_of_token].contiguous()
    split_query_start_loc = torch.arange(
        num_tokens + 1, dtype=query_start_loc.dtype, device=query_start_loc.device
    )
    scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=num_tokens,
        num_heads=impl.num_heads,
        num_kv_heads=impl.num_kv_heads,
        head_dim=impl.head_size,
        seq_lens=split_seq_lens,
        dtype=dtype,
        query_start_loc=split_query_start_loc,
        causal=True,
        sliding_window_size=-1,
        isa=attn_metadata.isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
    )
    result = (
        split_query_start_loc,
        split_seq_lens,
        split_block_table,
        scheduler_metadata,
    )
    cache[key] = result
    return result


def cpu_noncausal_attention_with_kv_cache(
    impl: "CPUAttentionBackendImpl",
    layer: "AttentionLayer",
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    attn_metadata: "CPUAttentionMetadata",
) -> None:
    """Non-causal replacement of ops.cpu_attention_with_kv_cache(...,
    causal=False, ...) for CPUAttentionBackendImpl.forward: writes the
    attention of query[:N] (N = query_start_loc[num_reqs]) into output."""
    if impl.sliding_window != (-1, -1):
        raise NotImplementedError(
            "CPU_ATTN: non-causal attention with a sliding window is not "
            "supported (the C++ kernel reads K/V past seq_len when "
            "causal=False, see cpu_noncausal_attn.py)"
        )
    if cpu_attn_torch_fp8.uses_torch_fp8_kv(impl.kv_cache_dtype):
        # The torch fp8 path masks by seq_len itself: no split needed.
        cpu_attn_torch_fp8.attention_with_kv_cache(
            query, key_cache, value_cache, output,
            attn_metadata.query_start_loc, attn_metadata.seq_lens, impl.scale,
            False, impl.alibi_slopes, impl.sliding_window, attn_metadata.block_table,
            impl.logits_soft_cap, impl.sinks, layer._k_scale_float,
            layer._v_scale_float, impl.kv_cache_dtype,
        )
        return
    query_start_loc, seq_lens, block_table, scheduler_metadata = _split_per_token(
        impl, attn_metadata, query.dtype
    )
    num_tokens = query_start_loc.shape[0] - 1
    if num_tokens == 0:
        return
    if num_tokens > query.shape[0]:
        raise ValueError(
            f"CPU_ATTN: query_start_loc covers {num_tokens} tokens but only "
            f"{query.shape[0]} query tokens were given"
        )
    ops.cpu_attention_with_kv_cache(
        query=query[:num_tokens],
        key_cache=key_cache,
        value_cache=value_cache,
        output=output[:num_tokens],
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        scale=impl.scale,
        causal=True,
        alibi_slopes=impl.alibi_slopes,  # type: ignore[arg-type]
        sliding_window=impl.sliding_window,
        block_table=block_table,
        softcap=impl.logits_soft_cap,
        scheduler_metadata=scheduler_metadata,
        s_aux=impl.sinks,
        k_scale=layer._k_scale_float,
        v_scale=layer._v_scale_float,
        kv_cache_dtype=impl.kv_cache_dtype,
    )
