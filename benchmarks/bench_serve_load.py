#!/usr/bin/env python3
"""DFlash under load through `vllm serve`: auto vs fp8 KV cache, side by side.

    python benchmarks/bench_serve_load.py [--requests 32] [--concurrency 12] [--json out.json]

Starts one server per KV dtype (one at a time) with the suite's settings
(tests/support/serve_load.py: tiny pair, small KV cache that forces
preemption), sends the same mixed streaming/non-streaming completions and
chat load to each, and prints requests/s, p50/p99 latency and acceptance
length per dtype plus the fp8/auto ratios. Run it on an idle machine: the
ratios come from one run, the absolute numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

import dflash_e2e as e2e  # noqa: E402
import serve_load as sl  # noqa: E402
from vllm_server import VllmServer  # noqa: E402


def measure(kv_dtype: str, pair: tuple[str, str], jobs, concurrency: int, workdir: Path) -> dict:
    target, draft = pair
    # bf16 as a deployment runs (the suite's float32 is for exact comparisons;
    # with it an auto KV cache would be float32, 4x the fp8 bytes, not 2x).
    args = sl.server_args(e2e.dflash_spec_config(draft), kv_dtype=kv_dtype, dtype="bfloat16")
    with VllmServer(target, args, workdir / f"server-{kv_dtype}.log", env=sl.SERVER_ENV) as srv:
        model = srv.model_id()
        sl.run_jobs(srv.base, model, jobs[:2], concurrency=2)  # warm-up, not counted
        before = srv.metrics()
        outs, wall = sl.run_jobs(srv.base, model, jobs, concurrency=concurrency)
        after = sl.wait_idle(srv)
    completed = [o for o in outs if o.ok]
    return {
        "kv_dtype": kv_dtype,
        "sent": len(jobs),
        "completed": len(completed),
        "failed": len(outs) - len(completed),
        "req_per_s": len(completed) / wall,
        **sl.latency_summary(completed),
        "acceptance_length": sl.acceptance_length(before, after),
        "preemptions": sl.delta(before, after, "vllm:num_preemptions_total"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=sl.LOAD_REQUESTS)
    parser.add_argument("--concurrency", type=int, default=sl.LOAD_CONCURRENCY)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    from vllm.fork.tiny_pairs import generate_pair

    jobs = sl.mixed_jobs(args.requests, seed=0, max_tokens=sl.LOAD_MAX_TOKENS,
                         prompt_len=sl.LOAD_PROMPT_LEN)
    with tempfile.TemporaryDirectory(prefix="bench-serve-load-") as tmp:
        workdir = Path(tmp)
        pair = generate_pair(workdir / "pair", "partial", seed=0)
        results = {d: measure(d, pair, jobs, args.concurrency, workdir) for d in ("auto", "fp8")}

    keys = [k for k in results["auto"] if k != "kv_dtype"]
    print(f"{'metric':<20}{'auto':>12}{'fp8':>12}{'fp8/auto':>10}")
    ratios = {}
    for k in keys:
        a, f = results["auto"][k], results["fp8"][k]
        ratio = f / a if isinstance(a, (int, float)) and isinstance(f, (int, float)) and a else None
        ratios[k] = ratio
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"{k:<20}{fmt(a):>12}{fmt(f):>12}{fmt(ratio):>10}")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "ratios_fp8_over_auto": ratios}, indent=2))
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
