"""Draft attention time in TRITON_ATTN: causal vs non-causal, fp8 vs bf16 KV.

    python benchmarks/bench_triton_noncausal.py                 # GPU if present
    python benchmarks/bench_triton_noncausal.py --device cpu    # Triton interpreter

Times kernel_unified_attention on DFlash-shaped batches (each request: a
context already in the paged cache plus one draft block of queries) for every
(kv dtype, causal) pair in one run, and prints the ratios side by side:
non-causal/causal (what patch 0009 costs a draft step) and fp8/auto.

On CPU the kernel runs in Triton's interpreter (numpy): the shapes shrink and
the times say nothing about a GPU; that run only shows the benchmark works.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

# The suite's paged-attention cases (tools/lib: code the tests and benchmarks both run).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "lib"))
import triton_attention_cases as cases


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--batch", type=int, help="requests per step (default: 64 on GPU, 2 on CPU)")
    parser.add_argument("--context", type=int, help="context tokens per request (default: 2048 GPU, 48 CPU)")
    parser.add_argument("--block", type=int, default=16, help="draft block (num_speculative_tokens + 1)")
    parser.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("Q", "KV"))
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--iters", type=int, help="timed calls per point (default: 50 GPU, 1 CPU)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device == "cuda"
    if not gpu:
        cases.enable_triton_interpreter()
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    batch = args.batch or (64 if gpu else 2)
    context = args.context or (2048 if gpu else 48)
    iters = args.iters or (50 if gpu else 1)
    head_size = args.head_size if gpu else 64
    dtype = "bfloat16" if gpu else "float16"  # the interpreter mangles bfloat16

    rows = []
    for kv_dtype in ("auto", "fp8"):
        for causal in (True, False):
            case = cases.Case(
                kv_dtype,
                causal,
                num_heads=args.heads[0],
                num_kv_heads=args.heads[1],
                batch=((context, args.block),) * batch,
                dtype=dtype,
                head_size=head_size,
            )
            inputs = cases.Inputs(case, device)
            inputs.launch(unified_attention)  # compile / warm up
            times = []
            for _ in range(iters):
                if gpu:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                inputs.launch(unified_attention)
                if gpu:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            rows.append({"kv_dtype": kv_dtype, "causal": causal, "median_us": statistics.median(times) * 1e6})

    by = {(r["kv_dtype"], r["causal"]): r["median_us"] for r in rows}
    ratios = {
        "noncausal/causal (auto)": by[("auto", False)] / by[("auto", True)],
        "noncausal/causal (fp8)": by[("fp8", False)] / by[("fp8", True)],
        "fp8/auto (non-causal)": by[("fp8", False)] / by[("auto", False)],
        "fp8/auto (causal)": by[("fp8", True)] / by[("auto", True)],
    }
    where = torch.cuda.get_device_name() if gpu else "CPU, Triton interpreter (not a speed measurement)"
    print(f"device: {where}")
    print(
        f"shape: {batch} requests x ({context} context + {args.block} draft), "
        f"heads {args.heads[0]}/{args.heads[1]}, head_size {head_size}, {dtype}, {iters} iters"
    )
    print(f"{'kv dtype':<10}{'causal':<8}{'median us':>12}")
    for r in rows:
        print(f"{r['kv_dtype']:<10}{str(r['causal']):<8}{r['median_us']:>12.1f}")
    for name, value in ratios.items():
        print(f"{name:<26}{value:>8.3f}")
    if args.json:
        args.json.write_text(json.dumps({"device": where, "rows": rows, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
