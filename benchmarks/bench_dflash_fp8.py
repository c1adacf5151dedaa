#!/usr/bin/env python3
"""DFlash + fp8 KV cache through `vllm serve`, measured with `vllm bench serve`.

    python benchmarks/bench_dflash_fp8.py [--out DIR] [--concurrency 1,2,4,...]
        [--target MODEL --draft DRAFT] [--pair partial|trained|full|text|none]
        [--input-len N] [--output-len N] [--kv-cache-gib G] [--num-spec-tokens K]

For {no spec, DFlash} x {kv auto, fp8}, and DFlash with an fp8 target cache
and an unquantized drafter cache (``dflash-fp8-draftauto``: speculative_config
``kv_cache_dtype: auto``), one server at a time (same memory for the KV cache
in all), it records:

* KV capacity in tokens: ``num_gpu_blocks x block_size`` from the server's
  ``vllm:cache_config_info`` metric;
* output throughput, TPOT (mean/median/p99), TTFT across a concurrency sweep
  from 1 up to saturation (the sweep stops once output throughput grows less
  than ``--saturation-gain`` from one level to the next), each level one
  ``vllm bench serve --dataset-name random --max-concurrency C --ignore-eos``;
* DFlash acceptance length and per-position acceptance rates (vllm bench
  serve's own before/after reading of the ``vllm:spec_decode_*`` counters).

Writes ``DIR/bench_dflash_fp8.json`` (plus each raw `vllm bench serve`
result under ``DIR/raw/``) and ``DIR/bench_dflash_fp8.png`` when matplotlib
imports (benchmarks/requirements.txt), and prints the ratios measured side
by side in this one run: fp8/auto KV capacity, DFlash/no-spec and fp8/auto
throughput and TPOT, and for the drafter's cache dtype (target fp8) auto/fp8
KV capacity, acceptance length and throughput. By default the target/drafter
are a generated tiny pair (vllm.fork.tiny_pairs, offline); ``--target/--draft`` take real models.
Works on CUDA (``--kv-cache-memory-bytes``) and on CPU (the same flag; the
legacy VLLM_CPU_KVCACHE_SPACE is dropped from the environment so it does not
override it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The `vllm serve` harness the suite uses too (tools/lib: code both run).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "lib"))

from prometheus_text import info_labels
from vllm_server import VllmServer, vllm_cli

# (speculation, target KV cache dtype, drafter KV cache dtype: None = the target's)
CONFIGS = [
    ("nospec", "auto", None),
    ("nospec", "fp8", None),
    ("dflash", "auto", None),
    ("dflash", "fp8", None),
    ("dflash", "fp8", "auto"),
]


def config_label(spec: str, kv: str, draft_kv: str | None) -> str:
    return f"{spec}-{kv}" + (f"-draft{draft_kv}" if draft_kv else "")


KEEP = [
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_itl_ms",
    "p99_itl_ms",
    "spec_decode_acceptance_length",
    "spec_decode_acceptance_rate",
    "spec_decode_num_drafts",
    "spec_decode_draft_tokens",
    "spec_decode_accepted_tokens",
    "spec_decode_per_position_acceptance_rates",
]


def kv_capacity(srv: VllmServer) -> dict:
    status, text = srv.get("/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    labels = info_labels(text, "vllm:cache_config_info")
    blocks = int(labels["num_gpu_blocks"]) if labels.get("num_gpu_blocks", "None") != "None" else None
    block_size = int(labels["block_size"]) if labels.get("block_size") else None
    return {
        "num_gpu_blocks": blocks,
        "block_size": block_size,
        "tokens": blocks * block_size if blocks and block_size else None,
        "cache_dtype": labels.get("cache_dtype"),
        "kv_cache_memory_bytes": labels.get("kv_cache_memory_bytes"),
    }


def server_args(spec: str, kv: str, args, draft: str | None, draft_kv: str | None = None) -> list[str]:
    out = [
        "--kv-cache-dtype",
        kv,
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(max(args.concurrency)),
        "--seed",
        "0",
        "--dtype",
        "bfloat16",
    ]
    if args.kv_cache_gib:
        out += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * (1 << 30)))]
    if args.enforce_eager:
        out += ["--enforce-eager"]
    if spec == "dflash":
        cfg = {"method": "dflash", "model": draft, "num_speculative_tokens": args.num_spec_tokens}
        if args.attention_backend:
            cfg["attention_backend"] = args.attention_backend
        if draft_kv:
            cfg["kv_cache_dtype"] = draft_kv
        out += ["--speculative-config", json.dumps(cfg)]
    return out + list(args.serve_arg)


def bench_level(srv: VllmServer, model: str, tokenizer: str, concurrency: int, args, raw_dir: Path, label: str) -> dict:
    num_prompts = min(args.max_prompts, max(args.min_prompts, args.prompts_per_level * concurrency))
    name = f"{label}-c{concurrency}.json"
    cmd = vllm_cli() + [
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        srv.base,
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(concurrency),
        # Greedy, as DFlash is evaluated: vllm bench serve no longer defaults to it.
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        "0",
        "--disable-tqdm",
        "--num-warmups",
        str(min(concurrency, args.warmups)),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(raw_dir),
        "--result-filename",
        name,
        "--label",
        label,
    ]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.level_timeout)
    log = raw_dir / f"{label}-c{concurrency}.log"
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not (raw_dir / name).exists():
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}), see {log}:\n{proc.stderr[-2000:]}")
    raw = json.loads((raw_dir / name).read_text())
    out = {k: raw.get(k) for k in KEEP if k in raw}
    out.update(concurrency=concurrency, num_prompts=num_prompts, wall_s=round(time.monotonic() - t0, 1))
    return out


def run_config(spec: str, kv: str, draft_kv: str | None, target: str, draft: str | None, args, workdir: Path) -> dict:
    label = config_label(spec, kv, draft_kv)
    env = {}
    srv = VllmServer(target, server_args(spec, kv, args, draft, draft_kv), workdir / f"server-{label}.log", env=env)
    result: dict = {"spec": spec, "kv_cache_dtype": kv, "draft_kv_cache_dtype": draft_kv or kv, "levels": []}
    with srv:
        result["server_start_s"] = round(srv.start_s, 1)
        result["kv_capacity"] = kv_capacity(srv)
        model = srv.model_id()
        prev = None
        for c in args.concurrency:
            level = bench_level(srv, model, target, c, args, workdir / "raw", label)
            result["levels"].append(level)
            tput = level.get("output_throughput") or 0.0
            print(
                f"[bench] {label:<20} c={c:<4} out tok/s {tput:9.1f}  TPOT mean "
                f"{level.get('mean_tpot_ms') or 0:8.2f} ms  accept len "
                f"{level.get('spec_decode_acceptance_length') or '-'}",
                flush=True,
            )
            if args.stop_at_saturation and prev and tput < prev * (1 + args.saturation_gain):
                result["saturated_at"] = c
                break
            prev = tput
    return result


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def ratios(results: dict) -> dict:
    """fp8/auto capacity; DFlash/no-spec and fp8/auto throughput and TPOT per level and at peak."""

    def level(label, c):
        return next((lv for lv in results[label]["levels"] if lv["concurrency"] == c), None)

    def peak(label):
        return max((lv.get("output_throughput") or 0 for lv in results[label]["levels"]), default=None)

    out: dict = {
        "kv_capacity_fp8_over_auto": {},
        "throughput": {},
        "tpot": {},
        "peak_throughput": {},
        "drafter_auto_over_fp8": {},
    }
    for spec in ("nospec", "dflash"):
        a, f = f"{spec}-auto", f"{spec}-fp8"
        if a in results and f in results:
            out["kv_capacity_fp8_over_auto"][spec] = _ratio(
                results[f]["kv_capacity"]["tokens"], results[a]["kv_capacity"]["tokens"]
            )
    mixed, same = "dflash-fp8-draftauto", "dflash-fp8"
    if mixed in results and same in results:

        def first_acceptance(label):
            levels = results[label]["levels"]
            return levels[0].get("spec_decode_acceptance_length") if levels else None

        out["drafter_auto_over_fp8"] = {
            "kv_capacity": _ratio(results[mixed]["kv_capacity"]["tokens"], results[same]["kv_capacity"]["tokens"]),
            "acceptance_length_first_level": _ratio(first_acceptance(mixed), first_acceptance(same)),
        }
    pairs = {
        "dflash/nospec kv=auto": ("dflash-auto", "nospec-auto"),
        "dflash/nospec kv=fp8": ("dflash-fp8", "nospec-fp8"),
        "fp8/auto nospec": ("nospec-fp8", "nospec-auto"),
        "fp8/auto dflash": ("dflash-fp8", "dflash-auto"),
        "drafter auto/fp8": (mixed, same),
    }
    for name, (num, den) in pairs.items():
        if num not in results or den not in results:
            continue
        levels = sorted(
            {lv["concurrency"] for lv in results[num]["levels"]} & {lv["concurrency"] for lv in results[den]["levels"]}
        )
        out["throughput"][name] = {
            c: _ratio(level(num, c).get("output_throughput"), level(den, c).get("output_throughput")) for c in levels
        }
        out["tpot"][name] = {
            c: _ratio(level(num, c).get("mean_tpot_ms"), level(den, c).get("mean_tpot_ms")) for c in levels
        }
        out["peak_throughput"][name] = _ratio(peak(num), peak(den))
    return out


def print_tables(results: dict, rat: dict) -> None:
    labels = list(results)
    print("\n== KV capacity at equal memory (tokens = num_gpu_blocks x block_size)")
    for lb in labels:
        cap = results[lb]["kv_capacity"]
        print(f"  {lb:<20} {cap['tokens']!s:>12} tokens  ({cap['num_gpu_blocks']} blocks x {cap['block_size']})")
    for spec, r in rat["kv_capacity_fp8_over_auto"].items():
        print(f"  fp8/auto {spec}: {r:.3f}" if r else f"  fp8/auto {spec}: -")
    for name, r in rat.get("drafter_auto_over_fp8", {}).items():
        print(f"  drafter auto/fp8 (target fp8) {name}: {r:.3f}" if r else f"  drafter auto/fp8 (target fp8) {name}: -")
    levels = sorted({lv["concurrency"] for lb in labels for lv in results[lb]["levels"]})

    def cell(lb, c, key, fmt):
        lv = next((x for x in results[lb]["levels"] if x["concurrency"] == c), None)
        v = lv.get(key) if lv else None
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    for key, title, fmt in (
        ("output_throughput", "output throughput (tok/s)", ".1f"),
        ("mean_tpot_ms", "mean TPOT (ms)", ".2f"),
        ("spec_decode_acceptance_length", "acceptance length", ".3f"),
    ):
        print(f"\n== {title}")
        print("  " + f"{'concurrency':<13}" + "".join(f"{lb:>21}" for lb in labels))
        for c in levels:
            print("  " + f"{c:<13}" + "".join(f"{cell(lb, c, key, fmt):>21}" for lb in labels))
    print("\n== per-position acceptance rate (DFlash, first level and last level)")
    for lb in labels:
        if results[lb]["spec"] != "dflash" or not results[lb]["levels"]:
            continue
        for lv in (results[lb]["levels"][0], results[lb]["levels"][-1]):
            rates = lv.get("spec_decode_per_position_acceptance_rates") or []
            print(f"  {lb:<20} c={lv['concurrency']:<4} " + " ".join(f"{r:.3f}" for r in rates))
    print("\n== ratios measured in this run")
    for group in ("throughput", "tpot"):
        for name, per in rat[group].items():
            vals = "  ".join(f"c={c}: {r:.3f}" if r else f"c={c}: -" for c, r in per.items())
            print(f"  {group:<10} {name:<22} {vals}")
    for name, r in rat["peak_throughput"].items():
        print(f"  peak tput  {name:<22} {r:.3f}" if r else f"  peak tput  {name:<22} -")


def plot(results: dict, path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            f"[bench] matplotlib is not installed: no plot (pip install -r benchmarks/requirements.txt); "
            f"the numbers are in {path.with_suffix('.json').name}"
        )
        return False
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    (ax_t, ax_p), (ax_c, ax_a) = axes
    for lb, r in results.items():
        cs = [lv["concurrency"] for lv in r["levels"]]
        style = "-" if r["spec"] == "dflash" else "--"
        ax_t.plot(cs, [lv.get("output_throughput") or 0 for lv in r["levels"]], style, marker="o", label=lb)
        ax_p.plot(cs, [lv.get("mean_tpot_ms") or 0 for lv in r["levels"]], style, marker="o", label=lb)
        if r["spec"] == "dflash" and r["levels"]:
            rates = r["levels"][0].get("spec_decode_per_position_acceptance_rates") or []
            ax_a.plot(
                range(1, len(rates) + 1),
                rates,
                marker="o",
                label=f"{lb} (c={r['levels'][0]['concurrency']}, "
                f"len {r['levels'][0].get('spec_decode_acceptance_length') or 0:.2f})",
            )
    levels = sorted({lv["concurrency"] for r in results.values() for lv in r["levels"]})
    for ax, ylabel in ((ax_t, "output tokens/s"), (ax_p, "mean TPOT (ms)")):
        ax.set_xscale("log", base=2)
        if levels:
            ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    labels = list(results)
    ax_c.bar(labels, [results[lb]["kv_capacity"]["tokens"] or 0 for lb in labels])
    ax_c.set_ylabel("KV capacity (tokens) at equal memory")
    ax_c.tick_params(axis="x", rotation=20)
    ax_a.set_xlabel("draft position")
    ax_a.xaxis.get_major_locator().set_params(integer=True)
    ax_a.set_ylabel("acceptance rate")
    ax_a.set_ylim(0, 1.05)
    ax_a.grid(True, alpha=0.3)
    if ax_a.lines:
        ax_a.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"[bench] plot: {path}")
    return True


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except Exception:  # pragma: no cover
        pass
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def document(args, results: dict, wall_s: float) -> dict:
    import vllm

    return {
        "device": device_name(),
        "vllm": vllm.__version__,
        "models": {
            "target": args.target or f"tiny pair ({args.pair})",
            "draft": args.draft or f"tiny pair ({args.pair})",
        },
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "replot")},
        "wall_s": round(wall_s, 1),
        "results": results,
        "ratios": ratios(results),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench-dflash-fp8"), help="output directory")
    p.add_argument("--target", help="target model (default: a generated tiny pair)")
    p.add_argument("--draft", help="DFlash drafter for --target")
    # full: every draft is accepted, so the run shows DFlash's best case next to its cost;
    # partial/none accept almost nothing on random prompts and show the drafting overhead.
    p.add_argument(
        "--pair",
        default="full",
        choices=["none", "partial", "full", "trained", "text"],
        help="acceptance of the generated tiny pair (default full)",
    )
    p.add_argument(
        "--pair-attention",
        default=(4, 2, 64),
        type=lambda s: tuple(int(x) for x in s.split(",")),
        metavar="HEADS,KV_HEADS,HEAD_DIM",
        help="the generated pair's attention sizes (default 4,2,64; 32,8,128 is Qwen3-8B's, "
        "for runs where attention should be what a decode step spends its time on)",
    )
    p.add_argument(
        "--configs",
        default=",".join(config_label(*c) for c in CONFIGS),
        help="subset of nospec-auto,nospec-fp8,dflash-auto,dflash-fp8",
    )
    p.add_argument(
        "--concurrency",
        default="1,2,4,8,16,32,64",
        type=lambda s: [int(x) for x in s.split(",")],
        help="sweep levels (ascending)",
    )
    p.add_argument(
        "--no-stop-at-saturation",
        dest="stop_at_saturation",
        action="store_false",
        help="run every level even after throughput stops growing",
    )
    p.add_argument(
        "--saturation-gain",
        type=float,
        default=0.05,
        help="a level that adds less than this fraction of throughput ends the sweep",
    )
    p.add_argument("--prompts-per-level", type=int, default=4, help="prompts = this x concurrency")
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--max-prompts", type=int, default=256)
    p.add_argument("--warmups", type=int, default=2)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--num-spec-tokens",
        type=int,
        default=None,
        help="default: 3 for the tiny pair, 15 for real models (b16 drafters)",
    )
    p.add_argument("--attention-backend", help="drafter backend (speculative config attention_backend)")
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="KV cache memory for every server (default: 1 for the tiny pair; real "
        "models: vLLM's default, i.e. the same --gpu-memory-utilization)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / torch.compile")
    p.add_argument("--level-timeout", type=float, default=900)
    p.add_argument("--serve-arg", action="append", default=[], help="extra `vllm serve` argument")
    p.add_argument(
        "--replot", type=Path, metavar="JSON", help="only print the tables and draw the plot of an earlier run's JSON"
    )
    args = p.parse_args(argv)
    if args.replot:
        doc = json.loads(args.replot.read_text())
        print_tables(doc["results"], doc["ratios"])
        plot(
            doc["results"],
            args.replot.with_suffix(".png"),
            f"DFlash x fp8 KV - {doc['models']['target']} - {doc['device']}",
        )
        return 0
    if bool(args.target) != bool(args.draft):
        p.error("--target and --draft go together")
    args.num_spec_tokens = args.num_spec_tokens or (15 if args.target else 3)
    if args.kv_cache_gib is None and not args.target:
        args.kv_cache_gib = 1.0
    args.max_model_len = args.max_model_len or (args.input_len + args.output_len + 64)
    if args.kv_cache_gib:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes on CPU
    wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
    configs = [c for c in CONFIGS if config_label(*c) in wanted]
    if not configs:
        p.error(f"no known config in --configs {args.configs}")

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "raw").mkdir(exist_ok=True)
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-dflash-fp8-") as tmp:
        if args.target:
            target, draft = args.target, args.draft
        else:
            from vllm.fork.tiny_pairs import attention_shape, generate_pair

            with attention_shape(*args.pair_attention):
                target, draft = generate_pair(Path(tmp) / "pair", args.pair, seed=0)
        results: dict = {}
        json_path = args.out / "bench_dflash_fp8.json"
        for spec, kv, draft_kv in configs:
            label = config_label(spec, kv, draft_kv)
            try:
                results[label] = run_config(spec, kv, draft_kv, target, draft, args, args.out)
            except Exception as e:
                print(f"[bench] {label} failed: {e}", file=sys.stderr)
                results[label] = {
                    "spec": spec,
                    "kv_cache_dtype": kv,
                    "draft_kv_cache_dtype": draft_kv or kv,
                    "levels": [],
                    "kv_capacity": {"tokens": None, "num_gpu_blocks": None, "block_size": None},
                    "error": str(e)[-3000:],
                }
            # Written after every config, so a run cut short keeps what it measured.
            doc = document(args, results, time.monotonic() - t_start)
            json_path.write_text(json.dumps(doc, indent=2, default=str))
    rat = doc["ratios"]
    print_tables(results, rat)
    print(f"\n[bench] {doc['device']}, vllm {doc['vllm']}, {doc['wall_s']} s; results: {json_path}")
    plot(results, args.out / "bench_dflash_fp8.png", f"DFlash x fp8 KV - {doc['models']['target']} - {doc['device']}")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
