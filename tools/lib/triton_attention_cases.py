"""TRITON_ATTN's unified attention kernel against an fp32 reference (patch 0009).

Run by tests/kernels/test_triton_noncausal_attention.py in a fresh interpreter:

    python tools/lib/triton_attention_cases.py --device cpu   # Triton interpreter
    python tools/lib/triton_attention_cases.py --device cuda  # compiled kernels

prints one JSON object: {"cases": [{"id", "check", "max_err", "error"}, ...]}.

Without a GPU, vLLM replaces Triton by a placeholder (vllm.triton_utils) and
Triton's interpreter is never reached. This script is the only place that
lifts that: before vLLM is imported it turns TRITON_INTERPRET on and lets one
Triton backend report an active driver. Nothing in the fork changes for it.

Every case fills the paged KV cache with loud stale K/V first and writes the
real K/V of positions [0, seq_len) on top, so a key read past seq_len (or a
future key in a causal row) moves the output far beyond tolerance.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import sys
import tempfile
import traceback
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
KERNEL_FILES = (
    "vllm/v1/attention/ops/triton_attention_helpers.py",
    "vllm/v1/attention/ops/triton_unified_attention.py",
)


def enable_triton_interpreter() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.backends

    drivers = [b.driver for b in triton.backends.backends.values() if b.driver is not None]
    if not drivers:
        raise RuntimeError("this Triton install has no backend to interpret with")
    for driver in drivers:
        driver.is_active = staticmethod(lambda: False)
    drivers[0].is_active = staticmethod(lambda: True)


# Cases ---------------------------------------------------------------------

HEAD_SIZE = 64
BLOCK_SIZE = 16
STALE = 8.0
# (context_len, query_len) per request: a prefill, DFlash-sized blocks (16) whose
# context ends inside a block, exactly on a block boundary and a block later,
# a decode, and a short block.
MIXED_BATCH = [(0, 19), (21, 16), (32, 16), (5, 1), (47, 16), (3, 4)]
DECODE_BATCH = [(40, 1), (7, 1), (64, 1)]


@dataclass(frozen=True)
class Case:
    kv_dtype: str
    causal: bool
    num_heads: int = 8
    num_kv_heads: int = 2
    sliding_window: int | None = None
    batch: tuple = tuple(MIXED_BATCH)
    decode_3d: bool = False
    dtype: str = "float16"
    head_size: int = HEAD_SIZE

    @property
    def id(self) -> str:
        parts = [
            self.dtype,
            self.kv_dtype,
            "causal" if self.causal else "noncausal",
            f"h{self.num_heads}kv{self.num_kv_heads}",
            f"sw{self.sliding_window}" if self.sliding_window else "full",
        ]
        if self.decode_3d:
            parts.append("decode3d")
        return "-".join(parts)


KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# Triton 3.6's interpreter mangles bfloat16 (outputs ~1e8 for a correct
# kernel), so the CPU run uses float16 queries; on a GPU both are checked.
MODEL_DTYPES = {"cpu": ("float16",), "cuda": ("bfloat16", "float16")}


def all_cases(device: str) -> list[Case]:
    cases = []
    for dtype in MODEL_DTYPES[device]:
        for kv_dtype in KV_DTYPES:
            for causal in (True, False):
                cases.append(Case(kv_dtype, causal, dtype=dtype))
                cases.append(Case(kv_dtype, causal, sliding_window=12, dtype=dtype))
        for causal in (True, False):
            cases.append(Case("auto", causal, num_heads=4, num_kv_heads=4, dtype=dtype))
            cases.append(Case("fp8", causal, batch=tuple(DECODE_BATCH), decode_3d=True, dtype=dtype))
    return cases


class Inputs:
    """One batch over a paged cache in TRITON_ATTN's layout."""

    def __init__(self, case: Case, device: str, seed: int = 0, *, fp8_storage=None):
        import torch

        gen = torch.Generator().manual_seed(seed)
        self.case = case
        self.device = device
        self.dtype = getattr(torch, case.dtype)
        batch = case.batch
        self.seq_lens = [ctx + q for ctx, q in batch]
        self.query_lens = [q for _, q in batch]
        fp8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
        self.cache_dtype = fp8.get(case.kv_dtype, self.dtype)
        if fp8_storage is not None and case.kv_dtype != "auto":
            self.cache_dtype = fp8_storage
        # Per-tensor scales other than 1 check that dequantisation happens.
        self.k_scale, self.v_scale = (0.5, 0.25) if case.kv_dtype != "auto" else (1.0, 1.0)

        blocks_per_req = [math.ceil(s / BLOCK_SIZE) + 1 for s in self.seq_lens]
        num_blocks = sum(blocks_per_req) + 1
        order = torch.randperm(num_blocks - 1, generator=gen) + 1
        self.block_table = torch.zeros(len(batch), max(blocks_per_req), dtype=torch.int32)
        start = 0
        for i, n in enumerate(blocks_per_req):
            self.block_table[i, :n] = order[start : start + n]
            start += n

        shape = (num_blocks, BLOCK_SIZE, case.num_kv_heads, case.head_size)
        key = torch.full(shape, STALE / self.k_scale, dtype=torch.float32)
        value = torch.full(shape, -STALE / self.v_scale, dtype=torch.float32)
        self.k_true, self.v_true = [], []
        for i, seq_len in enumerate(self.seq_lens):
            k = torch.randn(seq_len, case.num_kv_heads, case.head_size, generator=gen)
            v = torch.randn(seq_len, case.num_kv_heads, case.head_size, generator=gen)
            pos = torch.arange(seq_len)
            blocks = self.block_table[i, pos // BLOCK_SIZE].long()
            key[blocks, pos % BLOCK_SIZE] = k / self.k_scale
            value[blocks, pos % BLOCK_SIZE] = v / self.v_scale
        key, value = key.to(self.cache_dtype), value.to(self.cache_dtype)
        # What the kernel reads back, dequantised: the reference uses exactly this.
        self.k_true = [self._gather(key, i).float() * self.k_scale for i in range(len(batch))]
        self.v_true = [self._gather(value, i).float() * self.v_scale for i in range(len(batch))]
        # TRITON_ATTN's cache: [num_blocks, 2, block_size, kv_heads, head_size].
        self.kv_cache = torch.stack([key, value], dim=1).to(device)

        self.query = torch.randn(sum(self.query_lens), case.num_heads, case.head_size, generator=gen).to(self.dtype)
        self.cu_seqlens_q = torch.tensor([0, *torch.tensor(self.query_lens).cumsum(0).tolist()], dtype=torch.int32)
        self.query = self.query.to(device)
        self.scale = 1.0 / math.sqrt(case.head_size)

    def _gather(self, cache, i):
        import torch

        pos = torch.arange(self.seq_lens[i])
        return cache[self.block_table[i, pos // BLOCK_SIZE].long(), pos % BLOCK_SIZE]

    def reference(self):
        """fp32 attention over the dequantised cache, masked per the fork's rule."""
        import torch

        case = self.case
        group = case.num_heads // case.num_kv_heads
        out = []
        for i, ((ctx, qlen), seq_len) in enumerate(zip(case.batch, self.seq_lens)):
            q = self.query[self.cu_seqlens_q[i] : self.cu_seqlens_q[i + 1]].float().cpu()
            k = self.k_true[i].repeat_interleave(group, dim=1)
            v = self.v_true[i].repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            q_pos = ctx + torch.arange(qlen)[:, None]
            k_pos = torch.arange(seq_len)[None, :]
            allowed = (k_pos <= q_pos) if case.causal else (k_pos < seq_len).repeat(qlen, 1)
            if case.sliding_window:
                allowed &= (q_pos - k_pos) < case.sliding_window
            scores = scores.masked_fill(~allowed, float("-inf"))
            out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        return torch.cat(out)

    def run_kernel(self, unified_attention):
        return self.launch(unified_attention).float().cpu()

    def launch(self, unified_attention):
        """One kernel call; the output stays on the device."""
        import torch

        from vllm.v1.kv_cache_interface import get_kv_quant_mode

        case = self.case
        key_cache, value_cache = self.kv_cache.unbind(1)
        out = torch.empty_like(self.query)
        num_seqs = len(case.batch)
        window = (case.sliding_window - 1, 0) if case.sliding_window else (-1, -1)
        descale = lambda s: torch.full((num_seqs, case.num_kv_heads), s, dtype=torch.float32, device=self.device)  # noqa: E731
        segments = {}
        if case.decode_3d:
            n_seg = 4
            segments = dict(
                seq_threshold_3D=num_seqs,
                num_par_softmax_segments=n_seg,
                softmax_segm_output=torch.empty(num_seqs, case.num_heads, n_seg, case.head_size, device=self.device),
                softmax_segm_max=torch.empty(num_seqs, case.num_heads, n_seg, device=self.device),
                softmax_segm_expsum=torch.empty(num_seqs, case.num_heads, n_seg, device=self.device),
            )
        unified_attention(
            q=self.query,
            k=key_cache,
            v=value_cache,
            out=out,
            cu_seqlens_q=self.cu_seqlens_q.to(self.device),
            max_seqlen_q=max(self.query_lens),
            seqused_k=torch.tensor(self.seq_lens, dtype=torch.int32, device=self.device),
            max_seqlen_k=max(self.seq_lens),
            softmax_scale=self.scale,
            causal=case.causal,
            window_size=window,
            block_table=self.block_table.to(self.device),
            softcap=0,
            q_descale=None,
            k_descale=descale(self.k_scale),
            v_descale=descale(self.v_scale),
            kv_quant_mode=get_kv_quant_mode(case.kv_dtype),
            **segments,
        )
        return out


# The pinned base's kernel, for the "causal unchanged" check ----------------


@contextlib.contextmanager
def pristine_kernel_module():
    """The base wheel's unified attention module, loaded next to the fork's."""
    sys.path.append(str(REPO_ROOT))
    from forkbuild.base import cache_dir  # stdlib-only build code of this repo
    from vllm.fork.info import provenance

    base = provenance()["base"]
    wheel = cache_dir() / base["sha256"] / base["filename"]
    if not wheel.is_file():
        raise FileNotFoundError(f"pinned base {base['filename']} is not in {cache_dir()}: build the fork once")
    helpers_name = "vllm.v1.attention.ops.triton_attention_helpers"
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as zf:
        paths = []
        for member in KERNEL_FILES:
            path = Path(tmp) / ("pristine_" + Path(member).name)
            path.write_bytes(zf.read(member))
            paths.append(path)
        forks_helpers = sys.modules[helpers_name]
        try:
            helpers = _load(paths[0], "pristine_triton_attention_helpers")
            # The kernel imports its helpers by absolute name: hand it the base's.
            sys.modules[helpers_name] = helpers
            yield _load(paths[1], "pristine_triton_unified_attention")
        finally:
            sys.modules[helpers_name] = forks_helpers


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# TRITON_ATTN backend: metadata carries the flag into the kernel -------------


def run_backend(case: Case, device: str):
    """TritonAttentionMetadataBuilder.build + TritonAttentionImpl.forward."""
    from types import SimpleNamespace

    import torch

    from vllm.platforms import current_platform
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.triton_attn import (
        TritonAttentionBackend,
        TritonAttentionImpl,
        TritonAttentionMetadataBuilder,
    )

    # TRITON_ATTN stores every fp8 variant in the platform's fp8 dtype.
    inputs = Inputs(case, device, fp8_storage=current_platform.fp8_dtype())
    n = len(case.batch)
    cad = CommonAttentionMetadata(
        query_start_loc=inputs.cu_seqlens_q.to(device),
        query_start_loc_cpu=inputs.cu_seqlens_q,
        seq_lens=torch.tensor(inputs.seq_lens, dtype=torch.int32, device=device),
        num_reqs=n,
        num_actual_tokens=inputs.query.shape[0],
        max_query_len=max(inputs.query_lens),
        max_seq_len=max(inputs.seq_lens),
        block_table_tensor=inputs.block_table.to(device),
        slot_mapping=torch.zeros(inputs.query.shape[0], dtype=torch.int64, device=device),
        causal=case.causal,
    )
    # Only the fields build() reads; a real builder needs a whole VllmConfig.
    builder = SimpleNamespace(
        device=torch.device(device),
        seq_threshold_3D=0,
        num_par_softmax_segments=0,
        softmax_segm_output=None,
        softmax_segm_max=None,
        softmax_segm_expsum=None,
    )
    metadata = TritonAttentionMetadataBuilder.build(builder, 0, cad)
    impl = TritonAttentionImpl(
        num_heads=case.num_heads,
        head_size=case.head_size,
        scale=inputs.scale,
        num_kv_heads=case.num_kv_heads,
        alibi_slopes=None,
        sliding_window=case.sliding_window,
        kv_cache_dtype=case.kv_dtype,
    )
    scale = lambda s: torch.tensor(s, dtype=torch.float32, device=device)  # noqa: E731
    layer = SimpleNamespace(_k_scale=scale(inputs.k_scale), _v_scale=scale(inputs.v_scale), _q_scale_float=1.0)
    kv_cache = inputs.kv_cache
    if case.kv_dtype != "auto":
        kv_cache = kv_cache.view(torch.uint8)  # how the engine allocates fp8 caches
    out = torch.empty(inputs.query.shape[0], case.num_heads * case.head_size, dtype=inputs.dtype, device=device)
    impl.forward(layer, inputs.query, None, None, kv_cache, metadata, out.view_as(inputs.query))
    err = (out.view_as(inputs.query).float().cpu() - inputs.reference()).abs().max().item()
    return {
        "metadata_causal": getattr(metadata, "causal", None),
        "supports_non_causal": TritonAttentionBackend.supports_non_causal(),
        "max_err": err,
    }


# Driver ----------------------------------------------------------------------


def _guarded(result: dict, fn) -> dict:
    try:
        result.update(fn())
    except Exception as exc:  # reported per case; the test decides
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc(limit=4)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--only", metavar="ID,ID,...", help="run only the checks with these result ids (default: all)")
    args = parser.parse_args()
    wanted = set(args.only.split(",")) if args.only else None

    def selected(result_id: str) -> bool:
        return wanted is None or result_id in wanted

    if args.device == "cpu":
        enable_triton_interpreter()

    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    results = []
    for case in all_cases(args.device):
        if not selected(case.id):
            continue
        inputs = Inputs(case, args.device)
        results.append(
            _guarded(
                {"id": case.id, "check": "reference", "causal": case.causal},
                lambda inputs=inputs: {
                    "max_err": (inputs.run_kernel(unified_attention) - inputs.reference()).abs().max().item()
                },
            )
        )

    def bitwise_vs_base():
        import torch

        out = {}
        with pristine_kernel_module() as base:
            for case in all_cases(args.device):
                if case.causal:
                    inputs = Inputs(case, args.device)
                    ours, theirs = inputs.run_kernel(unified_attention), inputs.run_kernel(base.unified_attention)
                    out[case.id] = bool(torch.equal(ours, theirs))
        return {"equal_per_case": out}

    if selected("causal-equals-base"):
        results.append(_guarded({"id": "causal-equals-base", "check": "bitwise"}, bitwise_vs_base))
    dtype = MODEL_DTYPES[args.device][0]
    backend_cases = (
        Case("fp8", False, dtype=dtype),
        Case("auto", False, sliding_window=12, dtype=dtype),
        Case("fp8_e5m2", True, dtype=dtype),
    )
    for case in backend_cases:
        if not selected(f"backend-{case.id}"):
            continue
        results.append(
            _guarded(
                {"id": f"backend-{case.id}", "check": "backend", "causal": case.causal},
                lambda case=case: run_backend(case, args.device),
            )
        )
    json.dump({"device": args.device, "cases": results}, sys.stdout)


if __name__ == "__main__":
    main()
