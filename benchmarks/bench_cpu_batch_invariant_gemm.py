"""The cost of ``VLLM_BATCH_INVARIANT=1`` in a CPU linear layer (patch 0032),
side by side with the plain product, in one run on one machine.

    python benchmarks/bench_cpu_batch_invariant_gemm.py [--shape N K ...] [--rows M ...] [--json FILE]

A linear layer prepared as vLLM's CPU backend prepares it (oneDNN where the
build has it) multiplies M rows of activations: plainly, and in
batch-invariant mode (tiles of 16 rows, the last padded). M = 1 is a decode
step, 4-16 a speculative verification step, hundreds a prefill chunk.
Prints, per shape and M, the median time of each and their ratio
(invariant / plain). The model also runs eagerly in that mode; that part of
the cost is the compiled model's gain, not measured here. Numbers are this
machine's, not thresholds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import timeit

import torch

# Qwen3-8B's attention output projection and the up half of its MLP.
DEFAULT_SHAPES = [(4096, 4096), (12288, 4096)]
DEFAULT_ROWS = [1, 4, 16, 17, 64, 512]


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(timeit.repeat(fn, repeat=repeats, number=1))


def _layer(out_features: int, in_features: int, dtype: torch.dtype) -> torch.nn.Module:
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(out_features, in_features, dtype=dtype), requires_grad=False)
    layer.bias = None
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    return layer


def run(shapes, rows, dtype: torch.dtype, repeats: int) -> list[dict]:
    from vllm.model_executor.layers.utils import cpu_unquantized_gemm

    results = []
    for out_features, in_features in shapes:
        layer = _layer(out_features, in_features, dtype)
        for m in rows:
            x = torch.randn(m, in_features, dtype=dtype)

            def gemm(layer=layer, x=x):
                return cpu_unquantized_gemm(layer, x, layer.weight, layer.bias)

            os.environ.pop("VLLM_BATCH_INVARIANT", None)
            plain = _median_s(gemm, repeats)
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
            invariant = _median_s(gemm, repeats)
            os.environ.pop("VLLM_BATCH_INVARIANT", None)
            row = {
                "out_features": out_features,
                "in_features": in_features,
                "rows": m,
                "plain_ms": round(plain * 1e3, 3),
                "invariant_ms": round(invariant * 1e3, 3),
                "invariant / plain": round(invariant / plain, 2),
            }
            print(
                f"{out_features}x{in_features} M={m:4d}: plain {row['plain_ms']:9.3f} ms, "
                f"invariant {row['invariant_ms']:9.3f} ms, ratio {row['invariant / plain']:.2f}",
                flush=True,
            )
            results.append(row)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=2, action="append", metavar=("N", "K"), help="out, in features")
    ap.add_argument("--rows", type=int, nargs="+", default=DEFAULT_ROWS)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", help="write the results there")
    args = ap.parse_args(argv)
    if any(m < 1 for m in args.rows) or args.repeats < 1:
        ap.error("--rows and --repeats take positive numbers")
    results = run(args.shape or DEFAULT_SHAPES, args.rows, getattr(torch, args.dtype), args.repeats)
    if args.json:
        report = {
            "machine": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "dtype": args.dtype,
            "results": results,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
