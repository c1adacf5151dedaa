"""The CPU (torch) copy_and_expand_dflash_inputs against the Triton kernel.

The Triton kernel is taken from the installed vllm/v1/spec_decode/utils.py
and run under the Triton interpreter (TRITON_INTERPRET=1, on CPU tensors),
bypassing vllm.triton_utils' placeholder in this test only. A plain-python
per-element reference checks both independently.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import random
import sys
from pathlib import Path

import pytest
import torch

SENTINEL = -7


def _case(rng: random.Random):
    num_reqs = rng.randint(1, 5)
    nst = rng.choice([1, 2, 3, 7, 15])
    nq = 1 + nst
    block_size = rng.choice([16, 32, 128])
    has_rej = rng.random() < 0.5
    num_ctx = [rng.randint(1, 40) for _ in range(num_reqs)]
    rejected = [rng.randint(0, min(n - 1, nst)) if has_rej else 0 for n in num_ctx]
    qsl = [0]
    for n in num_ctx:
        qsl.append(qsl[-1] + n)
    total = qsl[-1]
    positions = []
    for n in num_ctx:
        start = rng.randint(0, 600)
        positions += list(range(start, start + n))
    max_blocks = (max(positions) + nq) // block_size + 1 + rng.randint(0, 3)
    stride = max_blocks + rng.randint(0, 2)
    block_table = torch.randint(
        0,
        5000,
        (num_reqs + rng.randint(0, 2), stride),
        dtype=torch.int32,
        generator=torch.Generator().manual_seed(rng.randint(0, 10**6)),
    )
    max_query = num_reqs * nq
    return dict(
        inputs=dict(
            next_token_ids_ptr=torch.tensor([rng.randint(0, 1000) for _ in range(num_reqs)], dtype=torch.int32),
            target_positions_ptr=torch.tensor(positions, dtype=torch.int64),
            block_table_ptr=block_table,
            block_table_stride=block_table.stride(0),
            query_start_loc_ptr=torch.tensor(qsl, dtype=torch.int32),
            num_rejected_tokens_ptr=torch.tensor(rejected, dtype=torch.int32) if has_rej else 0,
            parallel_drafting_token_id=1234,
            block_size=block_size,
            num_query_per_req=nq,
            num_speculative_tokens=nst,
            total_input_tokens=total,
            HAS_NUM_REJECTED=has_rej,
        ),
        outputs=dict(
            out_input_ids_ptr=torch.full((max_query + 3,), SENTINEL, dtype=torch.int32),
            out_context_positions_ptr=torch.full((total + 3,), SENTINEL, dtype=torch.int64),
            out_query_positions_ptr=torch.full((max_query + 3,), SENTINEL, dtype=torch.int64),
            out_context_slot_mapping_ptr=torch.full((total + 3,), SENTINEL, dtype=torch.int64),
            out_query_slot_mapping_ptr=torch.full((max_query + 3,), SENTINEL, dtype=torch.int64),
            out_token_indices_ptr=torch.full((num_reqs * nst + 2,), SENTINEL, dtype=torch.int32),
        ),
        num_reqs=num_reqs,
        max_tokens_per_req=max(num_ctx) + nq,
    )


def _clone_outputs(case):
    return {k: v.clone() for k, v in case["outputs"].items()}


def _python_reference(case, out):
    a = case["inputs"]
    bt, bs, nq, nst = a["block_table_ptr"], a["block_size"], a["num_query_per_req"], a["num_speculative_tokens"]
    qsl = a["query_start_loc_ptr"].tolist()
    tp = a["target_positions_ptr"].tolist()

    def slot(r, pos):
        return int(bt[r, min(pos // bs, a["block_table_stride"] - 1)]) * bs + pos % bs

    for r in range(case["num_reqs"]):
        start, end = qsl[r], qsl[r + 1]
        for i in range(start, end):
            pos = tp[min(i, a["total_input_tokens"] - 1)]
            out["out_context_positions_ptr"][i] = pos
            out["out_context_slot_mapping_ptr"][i] = slot(r, pos)
        valid_end = end - (int(a["num_rejected_tokens_ptr"][r]) if a["HAS_NUM_REJECTED"] else 0)
        last = tp[valid_end - 1]
        for q in range(nq):
            pos = last + 1 + q
            o = r * nq + q
            out["out_query_positions_ptr"][o] = pos
            out["out_query_slot_mapping_ptr"][o] = slot(r, pos)
            out["out_input_ids_ptr"][o] = int(a["next_token_ids_ptr"][r]) if q == 0 else a["parallel_drafting_token_id"]
            if q > 0:
                out["out_token_indices_ptr"][r * nst + q - 1] = o


def _run_cpu(case, out):
    from vllm.v1.spec_decode.dflash_cpu_inputs import copy_and_expand_dflash_inputs_cpu

    copy_and_expand_dflash_inputs_cpu[(case["num_reqs"], 1)](
        **case["inputs"], **out, BLOCK_SIZE=case["max_tokens_per_req"]
    )


def _assert_same(got, want, what):
    for k in want:
        assert torch.equal(got[k], want[k]), f"{what}: {k}\n got  {got[k].tolist()}\n want {want[k].tolist()}"


CASES = [_case(random.Random(1000 + i)) for i in range(60)]


def test_cpu_expand_matches_python_reference():
    for i, case in enumerate(CASES):
        got, want = _clone_outputs(case), _clone_outputs(case)
        _run_cpu(case, got)
        _python_reference(case, want)
        _assert_same(got, want, f"case {i}")
    print(f"\n[e2e] torch copy_and_expand_dflash_inputs == python reference on {len(CASES)} random cases")


@pytest.fixture(scope="module")
def triton_kernel(tmp_path_factory):
    """The installed Triton kernel, jitted by real Triton in interpreter mode."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: cannot run the kernel under TRITON_INTERPRET")
    import vllm.v1.spec_decode.utils as su

    src_path = Path(su.__file__)
    tree = ast.parse(src_path.read_text())
    fn = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "copy_and_expand_dflash_inputs_kernel"
    )
    lines = src_path.read_text().splitlines(keepends=True)
    start = min(d.lineno for d in fn.decorator_list) - 1
    src = "".join(lines[start : fn.end_lineno])
    mod_dir = tmp_path_factory.mktemp("triton_kernel")
    (mod_dir / "dflash_kernel_interp.py").write_text("import triton\nimport triton.language as tl\n\n" + src)
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401

        spec = importlib.util.spec_from_file_location("dflash_kernel_interp", mod_dir / "dflash_kernel_interp.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["dflash_kernel_interp"] = mod
        spec.loader.exec_module(mod)
        yield mod.copy_and_expand_dflash_inputs_kernel
    finally:
        sys.modules.pop("dflash_kernel_interp", None)
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def test_cpu_expand_matches_triton_kernel_interpreted(triton_kernel):
    import triton

    for i, case in enumerate(CASES):
        got, want = _clone_outputs(case), _clone_outputs(case)
        _run_cpu(case, got)
        block = min(256, triton.next_power_of_2(case["max_tokens_per_req"]))
        grid = (case["num_reqs"], triton.cdiv(case["max_tokens_per_req"], block))
        triton_kernel[grid](**case["inputs"], **want, BLOCK_SIZE=block)
        _assert_same(got, want, f"case {i}")
    print(f"\n[e2e] torch copy_and_expand_dflash_inputs == Triton kernel (interpreter) on {len(CASES)} random cases")


def _with_mrope_positions(case):
    """The case as an M-RoPE target (Qwen3.5/3.6, Qwen-VL) passes it: positions
    as rows (temporal, height, width) of the runner's ``[3, max_tokens]``
    buffer, sliced to the batch's tokens (not contiguous). Text tokens have
    equal rows; the other rows differ here so that reading the wrong row shows."""
    flat = case["inputs"]["target_positions_ptr"]
    buffer = torch.full((3, flat.numel() + 5), -1, dtype=flat.dtype)
    buffer[0, : flat.numel()] = flat
    buffer[1, : flat.numel()] = flat + 1000
    buffer[2, : flat.numel()] = flat + 2000
    return {**case, "inputs": {**case["inputs"], "target_positions_ptr": buffer[:, : flat.numel()]}}


@pytest.mark.needs_patch("0004")
def test_cpu_expand_reads_the_temporal_row_of_mrope_positions():
    """M-RoPE targets: the drafter's positions are the temporal row, which is
    what the Triton kernel reads (the first elements of the positions buffer)."""
    for i, case in enumerate(CASES[:20]):
        got, want = _clone_outputs(case), _clone_outputs(case)
        _run_cpu(_with_mrope_positions(case), got)
        _python_reference(case, want)
        _assert_same(got, want, f"M-RoPE case {i}")
