# SPDX-License-Identifier: Apache-2.0
# vLLM DFlash-FP8 fork: overlay file (not part of upstream vLLM).
"""Torch implementation of DFlash's first-pass input expansion for CPU.

On GPU, ``DFlashProposer.set_inputs_first_pass`` launches the Triton kernel
``copy_and_expand_dflash_inputs_kernel`` (vllm/v1/spec_decode/utils.py).
Triton is only a placeholder on the CPU backend, so the CPU path calls
:data:`copy_and_expand_dflash_inputs_cpu` instead. It is indexed with the
launch grid exactly like the kernel (``fn[grid](**kernel_kwargs)``) and
writes the same values into the same output buffers:

* context positions (copied from the target positions) and their slots,
* query positions ``last_accepted_pos + 1 + i`` and their slots,
* query input ids ``[next_token, mask, mask, ...]`` per request,
* the indices of the mask (speculative) tokens to sample.
"""

from __future__ import annotations

import functools

import torch


def _lookup_slots(
    positions: torch.Tensor,  # int64, any shape
    req_idx: torch.Tensor,  # int64, same shape
    block_table: torch.Tensor,
    block_table_stride: int,
    block_size: int,
) -> torch.Tensor:
    # The kernel clamps the block number to the row length (stride - 1).
    max_block = min(block_table_stride, block_table.shape[1]) - 1
    block_num = torch.clamp(positions // block_size, max=max_block)
    block_id = block_table[req_idx, block_num].to(torch.int64)
    return block_id * block_size + positions % block_size


def _copy_and_expand_dflash_inputs(
    num_reqs: int,
    *,
    next_token_ids_ptr: torch.Tensor,
    target_positions_ptr: torch.Tensor,
    out_input_ids_ptr: torch.Tensor,
    out_context_positions_ptr: torch.Tensor,
    out_query_positions_ptr: torch.Tensor,
    out_context_slot_mapping_ptr: torch.Tensor,
    out_query_slot_mapping_ptr: torch.Tensor,
    out_token_indices_ptr: torch.Tensor,
    block_table_ptr: torch.Tensor,
    block_table_stride: int,
    query_start_loc_ptr: torch.Tensor,
    num_rejected_tokens_ptr: torch.Tensor | int,
    parallel_drafting_token_id: int,
    block_size: int,
    num_query_per_req: int,
    num_speculative_tokens: int,
    total_input_tokens: int,
    BLOCK_SIZE: int | None = None,  # tiling of the Triton kernel; unused
    HAS_NUM_REJECTED: bool = False,
) -> None:
    device = target_positions_ptr.device
    target_positions = target_positions_ptr.to(torch.int64)
    qsl = query_start_loc_ptr[: num_reqs + 1].to(torch.int64)
    ctx_start, ctx_end = qsl[:-1], qsl[1:]
    reqs = torch.arange(num_reqs, dtype=torch.int64, device=device)

    # --- Context tokens: positions and slots ---
    num_ctx = ctx_end - ctx_start
    ctx_req = torch.repeat_interleave(reqs, num_ctx)
    ctx_out = (
        torch.arange(ctx_req.numel(), dtype=torch.int64, device=device)
        - torch.repeat_interleave(torch.cumsum(num_ctx, 0) - num_ctx, num_ctx)
        + ctx_start[ctx_req]
    )
    if ctx_out.numel() > 0:
        ctx_pos = target_positions[torch.clamp(ctx_out, max=total_input_tokens - 1)]
        out_context_positions_ptr[ctx_out] = ctx_pos.to(
            out_context_positions_ptr.dtype
        )
        ctx_slots = _lookup_slots(
            ctx_pos, ctx_req, block_table_ptr, block_table_stride, block_size
        )
        out_context_slot_mapping_ptr[ctx_out] = ctx_slots.to(
            out_context_slot_mapping_ptr.dtype
        )

    # --- Query tokens: bonus token + mask tokens after the last valid pos ---
    valid_ctx_end = ctx_end
    if HAS_NUM_REJECTED:
        assert isinstance(num_rejected_tokens_ptr, torch.Tensor)
        valid_ctx_end = ctx_end - num_rejected_tokens_ptr[:num_reqs].to(torch.int64)
    last_pos = target_positions[valid_ctx_end - 1]
    offsets = torch.arange(num_query_per_req, dtype=torch.int64, device=device)
    query_pos = last_pos[:, None] + 1 + offsets[None, :]  # [num_reqs, nq]
    num_query_total = num_reqs * num_query_per_req
    out_query_positions_ptr[:num_query_total] = query_pos.reshape(-1).to(
        out_query_positions_ptr.dtype
    )
    query_req = reqs[:, None].expand(num_reqs, num_query_per_req)
    query_slots = _lookup_slots(
        query_pos, query_req, block_table_ptr, block_table_stride, block_size
    )
    out_query_slot_mapping_ptr[:num_query_total] = query_slots.reshape(-1).to(
        out_query_slot_mapping_ptr.dtype
    )

    input_ids = torch.full(
        (num_reqs, num_query_per_req),
        parallel_drafting_token_id,
        dtype=out_input_ids_ptr.dtype,
        device=device,
    )
    input_ids[:, 0] = next_token_ids_ptr[:num_reqs].to(out_input_ids_ptr.dtype)
    out_input_ids_ptr[:num_query_total] = input_ids.reshape(-1)

    # --- Indices of the mask tokens to sample (skip the bonus token) ---
    query_out = torch.arange(num_query_total, dtype=torch.int64, device=device)
    sample_idx = query_out.view(num_reqs, num_query_per_req)[:, 1:].reshape(-1)
    out_token_indices_ptr[: num_reqs * num_speculative_tokens] = sample_idx.to(
        out_token_indices_ptr.dtype
    )


class _GridLaunch:
    """``fn[grid](**kwargs)`` like a Triton kernel; grid[0] is num_reqs."""

    def __getitem__(self, grid: tuple[int, ...]):
        return functools.partial(_copy_and_expand_dflash_inputs, int(grid[0]))


copy_and_expand_dflash_inputs_cpu = _GridLaunch()
