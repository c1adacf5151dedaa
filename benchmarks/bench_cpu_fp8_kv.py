"""CPU attention over a paged KV cache: the fork's fp8 paths for CPUs without
AVX-512 (the AVX2 kernel of patch 0034, the torch path of patch 0012) next to
the compiled base kernels, in one run on one machine.

    python benchmarks/bench_cpu_fp8_kv.py [--context N ...] [--threads N ...] [--json FILE]

Times, per configuration, the cache write (``cpu_attn_reshape_and_cache``)
and the attention read (``cpu_attention_with_kv_cache``) for a DFlash-like
batch (verification rows of a few tokens over long contexts, causal, and the
same rows non-causal as the drafter reads them):

- ``kernel auto``: the base's compiled kernel with a bf16 cache (every CPU);
- ``kernel fp8``:  the base's compiled kernel with an fp8 cache (AVX-512/AMX only);
- ``avx2 fp8``:    the AVX2 kernel CPUs without AVX-512 take (built here on
  first use; left out where it does not build);
- ``torch fp8``:   the torch path, which served those CPUs before it (and
  still does where the kernel does not build).

and prints the ratios ``avx2 fp8 / kernel auto`` (an fp8 cache against a bf16
one on a CPU without AVX-512), ``avx2 fp8 / torch fp8`` (the kernel's gain),
``torch fp8 / kernel auto`` and, where it exists, ``avx2 fp8 / kernel fp8``.
Median of repeated runs; numbers are this machine's, not a threshold.
``--context`` and ``--threads`` take several values: one run each, side by
side in one report.

To time an AVX2-only CPU's code on a machine with AVX-512, run it with
``VLLM_FORK_TEST_NO_AVX512=1 PYTHONPATH=tests/support/no_avx512
ATEN_CPU_CAPABILITY=avx2`` (vLLM loads ``_C_AVX2``; torch
uses its AVX2 code; the AVX2 kernel is AVX2 code everywhere).

"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch


def _kernel_isa(dtype, block_size, head_size, kv_dtype) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_size, kv_dtype)


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(args) -> dict:
    from vllm.platforms import current_platform  # loads the kernel library this CPU runs
    from vllm.v1.attention.backends import cpu_attn_fp8_avx2 as avx2_fp8
    from vllm.v1.attention.backends import cpu_attn_torch_fp8 as torch_fp8

    assert current_platform.is_cpu(), "a CPU build of the fork is needed"
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()  # Linux hands out AMX tiles on request only
    kernels_fp8 = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()

    gen = torch.Generator().manual_seed(0)
    dtype, bs, hd = torch.bfloat16, args.block_size, args.head_size
    heads, kv_heads = args.num_heads, args.num_kv_heads
    reqs, qlen, ctx = args.num_reqs, args.query_len, args.context
    blocks_per_req = math.ceil(ctx / bs)
    num_blocks = reqs * blocks_per_req + 1
    block_table = (torch.randperm(num_blocks - 1, generator=gen) + 1)[: reqs * blocks_per_req]
    block_table = block_table.view(reqs, blocks_per_req).to(torch.int32)
    seq_lens = torch.full((reqs,), ctx, dtype=torch.int32)
    qsl = torch.arange(0, (reqs + 1) * qlen, qlen, dtype=torch.int32)
    query = torch.randn(reqs * qlen, heads, hd, generator=gen).to(dtype)
    k_all = torch.randn(reqs * ctx, kv_heads, hd, generator=gen).to(dtype)
    v_all = torch.randn(reqs * ctx, kv_heads, hd, generator=gen).to(dtype)
    pos = torch.arange(ctx)
    slots = torch.cat([block_table[r, pos // bs].long() * bs + pos % bs for r in range(reqs)])
    new_slots = torch.cat([block_table[r, (pos[-qlen:]) // bs].long() * bs + pos[-qlen:] % bs for r in range(reqs)])
    new_k, new_v = k_all[: reqs * qlen].clone(), v_all[: reqs * qlen].clone()

    configs = [("kernel auto", "auto", "kernel")]
    if kernels_fp8:
        configs.append(("kernel fp8", "fp8", "kernel"))
    try:
        avx2_fp8.build()
        configs.append(("avx2 fp8", "fp8", "avx2"))
    except avx2_fp8.BuildError as exc:
        print(f"avx2 fp8: left out, the kernel does not build here ({exc})")
    configs.append(("torch fp8", "fp8", "torch"))
    results: dict[str, dict] = {}
    for name, kv_dtype, path in configs:
        isa = _kernel_isa(dtype, bs, hd, kv_dtype)
        cache_dtype = dtype if kv_dtype == "auto" else torch.uint8
        cache = torch.zeros(2, num_blocks, kv_heads, bs, hd, dtype=cache_dtype)
        key_cache, value_cache = cache.unbind(0)

        def write(k, v, s):
            if path == "torch":
                torch_fp8.reshape_and_cache(k, v, key_cache, value_cache, s, 1.0, 1.0, kv_dtype)
            elif path == "avx2":
                assert avx2_fp8.reshape_and_cache(k, v, key_cache, value_cache, s, 1.0, 1.0, kv_dtype)
            else:
                torch.ops._C.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, s, isa, 1.0, 1.0, kv_dtype)

        write(k_all, v_all, slots)
        row = {"isa": isa if path == "kernel" else path}
        row["write_s"] = _median_s(lambda: write(new_k, new_v, new_slots), args.repeats)
        for causal in (True, False):
            out = torch.empty_like(query)
            if path in ("torch", "avx2"):
                fp8_path = torch_fp8 if path == "torch" else avx2_fp8

                def read():
                    fp8_path.attention_with_kv_cache(
                        query,
                        key_cache,
                        value_cache,
                        out,
                        qsl,
                        seq_lens,
                        1 / math.sqrt(hd),
                        causal,
                        None,
                        (-1, -1),
                        block_table,
                        0.0,
                        None,
                        1.0,
                        1.0,
                        kv_dtype,
                    )
            else:
                meta = torch.ops._C.get_scheduler_metadata(
                    reqs, heads, kv_heads, hd, seq_lens, dtype, qsl, causal, -1, isa, False
                )

                def read():
                    torch.ops._C.cpu_attention_with_kv_cache(
                        query,
                        key_cache,
                        value_cache,
                        out,
                        qsl,
                        seq_lens,
                        1 / math.sqrt(hd),
                        causal,
                        None,
                        -1,
                        -1,
                        block_table,
                        0.0,
                        meta,
                        None,
                        1.0,
                        1.0,
                        kv_dtype,
                    )

            row["causal_read_s" if causal else "noncausal_read_s"] = _median_s(read, args.repeats)
        results[name] = row
        print(
            f"{name:30s} isa={row['isa']:6s} write {row['write_s'] * 1e3:8.3f} ms  "
            f"causal read {row['causal_read_s'] * 1e3:8.3f} ms  "
            f"non-causal read {row['noncausal_read_s'] * 1e3:8.3f} ms"
        )

    ratios = {}
    for path, base in (
        ("avx2 fp8", "kernel auto"),
        ("avx2 fp8", "torch fp8"),
        ("avx2 fp8", "kernel fp8"),
        ("torch fp8", "kernel auto"),
        ("torch fp8", "kernel fp8"),
    ):
        if path in results and base in results:
            ratios[f"{path} / {base}"] = {
                k: round(results[path][k] / results[base][k], 3)
                for k in ("write_s", "causal_read_s", "noncausal_read_s")
            }
    for k, v in ratios.items():
        print(f"{k}: {v}")
    return {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "avx512": torch.cpu._is_avx512_supported(),
            "amx_tile": torch.cpu._is_amx_tile_supported(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "workload": {
            "num_reqs": reqs,
            "query_len": qlen,
            "context": ctx,
            "num_heads": heads,
            "num_kv_heads": kv_heads,
            "head_size": hd,
            "block_size": bs,
            "dtype": "bfloat16",
        },
        "results": results,
        "ratios": ratios,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-reqs", type=int, default=8)
    p.add_argument("--query-len", type=int, default=4, help="DFlash verification rows per request")
    p.add_argument("--context", type=int, nargs="+", default=[1024], help="one run per value")
    p.add_argument("--threads", type=int, nargs="+", help="torch threads, one run per value (default: torch's)")
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128, help="the CPU backend's default")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    runs = {}
    for threads in args.threads or [torch.get_num_threads()]:
        torch.set_num_threads(threads)
        for context in args.context:
            print(f"\n== {threads} thread(s), context {context}")
            runs[f"{threads} threads, context {context}"] = bench(
                argparse.Namespace(**{**vars(args), "context": context})
            )
    report = next(iter(runs.values())) if len(runs) == 1 else {"runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
