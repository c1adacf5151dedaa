"""Attention sinks on CPU in every model dtype (patch 0030).

gpt-oss gives each attention head a sink: a learned logit that joins the
softmax and takes part of the weight without contributing a value. Its
sinks are created in the model dtype; the base's CPU attention kernels read
them as bfloat16 only, so a float32 or float16 gpt-oss failed at its first
forward ("expected scalar type BFloat16 but found Float"). These tests run
``ops.cpu_attention_with_kv_cache`` (the entry point the CPU backend calls)
with sinks in each dtype, on the compiled kernels of this machine, and check
the output against float64 attention with the sinks.
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

HEAD_SIZE = 64
NUM_HEADS = 4
NUM_KV_HEADS = 2
BLOCK_SIZE = 32
# (query_len, seq_len): decode rows and a verification block.
BATCH = [(1, 40), (4, 23), (1, 7)]
# Sinks a real head could learn: one dominant, one negligible, one at par.
SINKS = torch.tensor([2.5, -4.0, 0.5, 0.0])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _paged(dtype: torch.dtype, isa: str, gen: torch.Generator):
    """A paged "auto" cache holding each request's keys and values (written by
    the kernels' own cache write, whose layout is theirs), blocks in shuffled order."""
    blocks_per_req = [math.ceil(s / BLOCK_SIZE) for _, s in BATCH]
    num_blocks = sum(blocks_per_req) + 1
    cache = torch.zeros(2, num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE, dtype=dtype)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(BATCH), max(blocks_per_req), dtype=torch.int32)
    keys, values = [], []
    for i, ((_, seq_len), n) in enumerate(zip(BATCH, blocks_per_req)):
        table[i, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
        pos = torch.arange(seq_len)
        slots = table[i, pos // BLOCK_SIZE].to(torch.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        ops.cpu_attn_reshape_and_cache(k, v, cache[0], cache[1], slots, isa)
        keys.append(k.double())
        values.append(v.double())
    return cache, table, keys, values


def _reference(query, keys, values, sinks) -> torch.Tensor:
    out, start, group = [], 0, NUM_HEADS // NUM_KV_HEADS
    for (query_len, seq_len), k, v in zip(BATCH, keys, values):
        q = query[start : start + query_len].double()
        start += query_len
        scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1)) / math.sqrt(HEAD_SIZE)
        q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        with_sink = torch.cat([scores, sinks.double()[:, None, None].expand(-1, query_len, 1)], -1)
        weights = with_sink.softmax(-1)[..., :seq_len]
        out.append(torch.einsum("hqk,khd->qhd", weights, v.repeat_interleave(group, 1)))
    return torch.cat(out)


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(torch.float32, marks=pytest.mark.needs_patch("0030")),
        pytest.param(torch.float16, marks=pytest.mark.needs_patch("0030")),
        torch.bfloat16,  # the dtype the kernels always took: holds on the base too
    ],
    ids=str,
)
def test_sinks_in_the_model_dtype_are_applied(dtype):
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(sum(q for q, _ in BATCH), NUM_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor([q for q, _ in BATCH]).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([s for _, s in BATCH], dtype=torch.int32)
    isa = _get_attn_isa(dtype, BLOCK_SIZE, HEAD_SIZE, "auto")
    if isa == "amx" and not torch.cpu._init_amx():
        pytest.skip("Linux refused this process AMX tile-data permission: the amx kernel would die with SIGILL")
    cache, table, keys, values = _paged(dtype, isa, gen)
    try:
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(BATCH),
            num_heads=NUM_HEADS,
            num_kv_heads=NUM_KV_HEADS,
            head_dim=HEAD_SIZE,
            seq_lens=seq_lens,
            dtype=dtype,
            query_start_loc=query_start_loc,
            causal=True,
            sliding_window_size=-1,
            isa=isa,
            enable_kv_split=False,
        )
    except RuntimeError as e:
        pytest.skip(f"the CPU attention kernels of this build do not serve {dtype} (isa {isa}): {e}")
    sinks = SINKS.to(dtype)
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=cache[0],
        value_cache=cache[1],
        output=out,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        scale=1 / math.sqrt(HEAD_SIZE),
        causal=True,
        alibi_slopes=None,
        sliding_window=(-1, -1),
        block_table=table,
        softcap=0.0,
        scheduler_metadata=metadata,
        s_aux=sinks,
    )
    want = _reference(query, keys, values, sinks)
    without_sinks = _reference(query, keys, values, torch.full_like(SINKS, float("-inf")))
    err = (out.double() - want).abs().max().item()
    sink_effect = (without_sinks - want).abs().max().item()
    print(f"\n[kernel] isa={isa} {dtype}: max |out - ref| = {err:.2e}, sinks move the output by {sink_effect:.2f}")
    # Sinks this large must show in the output (outputs are ~1), or the check proves nothing.
    assert sink_effect > 0.1
    assert err < TOLERANCE[dtype] * max(1.0, want.abs().max().item())
