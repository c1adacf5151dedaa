"""Helpers for the CUDA DFlash suite (tests/gpu), on top of the CPU e2e helpers (offline_engine, greedy_runs, worker_probes).

One engine is alive at a time (offline_engine.start_llm shuts the previous one
down). :class:`Matrix` computes what each (kv dtype, drafter backend, CUDA
graphs) case needs once -- target-only reference, DFlash engine on the
partial pair, DFlash engine on the full-acceptance pair -- keeps the results
as plain data and shuts the engine down, so every test of a case reads the
same measurements and no engine is started twice. The engines run in bf16:
target-only and DFlash outputs compare by the near-tie rule of
tests/support/lossless.py (both generate with top-k logprobs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import dflash_settings
import greedy_runs
import offline_engine
import torch
import worker_probes
from draft_counts import DraftCounts
from repo_paths import SUPPORT

CUDA_SKIP_REASON = (
    "no CUDA device: torch.cuda.is_available() is False. tests/gpu runs DFlash with "
    "fp8 KV caches on an NVIDIA GPU; run it there with `bash tools/run_gpu_checks.sh "
    "REPORT_DIR` (installs the CUDA build, runs tests/gpu and a short benchmark)"
)

# Equal KV memory for every engine, so block counts compare directly.
KV_MEMORY_BYTES = 256 << 20
ENGINE_KW = {
    "kv_cache_memory_bytes": KV_MEMORY_BYTES,
    "gpu_memory_utilization": 0.5,
}
# full (default): every check for every supported case, CUDA graphs on and
# off. quick (what tools/run_gpu_checks.sh runs, to fit its 8 minutes): CUDA
# graphs on for fp8 only; losslessness and the full-acceptance pair for auto
# and fp8 only (fp8_e4m3 is fp8 on CUDA; e5m2 still gets the KV dtype,
# capacity and int32 checks); the backend errors for auto and fp8 only.
MATRIX_ENV = "VLLM_FORK_GPU_MATRIX"
QUICK_KV_DTYPES = ("auto", "fp8")
REPORT_DIR_ENV = "VLLM_FORK_GPU_REPORT_DIR"


def cuda_skip_reason() -> str | None:
    return None if torch.cuda.is_available() else CUDA_SKIP_REASON


def matrix_mode() -> str:
    mode = os.environ.get(MATRIX_ENV, "full")
    if mode not in ("full", "quick"):
        raise ValueError(f"{MATRIX_ENV}={mode!r}: use full or quick")
    return mode


def eager_modes(kv_dtype: str) -> tuple[bool, ...]:
    if matrix_mode() == "quick" and kv_dtype != "fp8":
        return (True,)
    return (True, False)


def in_matrix(kv_dtype: str, deep: bool) -> bool:
    """Whether a check that needs extra engines (``deep``) runs for this KV dtype."""
    return not deep or matrix_mode() == "full" or kv_dtype in QUICK_KV_DTYPES


def case_id(kv_dtype: str, backend: str, eager: bool | None = None) -> str:
    tail = "" if eager is None else ("-eager" if eager else "-graphs")
    return f"{backend}-{kv_dtype}{tail}"


def tiny_head_size() -> int:
    from vllm.fork import tiny_pairs

    return tiny_pairs.HEAD_DIM


def expected_blocks(
    pair_config: dict, kv_dtype: str, block_size: int, memory_bytes: int = KV_MEMORY_BYTES
) -> tuple[int, int]:
    """(blocks, bytes per block over all attention layers) at ``memory_bytes``:
    every target and draft layer keeps K and V for ``block_size`` tokens."""
    elem = dflash_settings.kv_bytes_per_elem(kv_dtype, torch.bfloat16)
    per_block = 0
    for cfg in pair_config.values():
        head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        per_block += cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * block_size * head * elem
    return memory_bytes // per_block, per_block


def pair_config(pair: tuple[str, str]) -> dict:
    target, draft = pair
    return {
        role: json.loads((Path(d) / "config.json").read_text()) for role, d in (("target", target), ("draft", draft))
    }


def mean_acceptance(metrics: dict) -> tuple[float, float, float]:
    counts = DraftCounts.read(metrics)
    return counts.mean_acceptance_length, counts.drafts, counts.accepted


class Matrix:
    """Per-case engine results, computed on first use and cached (errors too)."""

    def __init__(self, partial_pair, full_pair, measurements: dict):
        self.partial_pair = partial_pair
        self.full_pair = full_pair
        self.measurements = measurements
        self._cache: dict = {}

    def _cached(self, key, fn):
        if key not in self._cache:
            try:
                self._cache[key] = (True, fn())
            except Exception as e:
                self._cache[key] = (False, e)
                offline_engine.shutdown_llm()
                raise
        ok, value = self._cache[key]
        if not ok:
            raise RuntimeError(f"{key} failed earlier in this session: {value!r}") from value
        return value

    def _engine_kw(self, kv_dtype: str, eager: bool) -> dict:
        return {"kv_cache_dtype": kv_dtype, "enforce_eager": eager, **ENGINE_KW}

    def reference(self, kv_dtype: str, eager: bool) -> dict:
        def run():
            target, _ = self.partial_pair
            llm = offline_engine.start_llm(
                ("gpu-target", kv_dtype, eager), model=target, **self._engine_kw(kv_dtype, eager)
            )
            ids, logprobs = greedy_runs.generate_with_logprobs(llm)
            state = llm.collective_rpc(worker_probes.worker_kv_state)[0]
            offline_engine.shutdown_llm()
            self.measurements[f"blocks target-only kv={kv_dtype} eager={eager}"] = state["num_blocks"]
            return {"ids": ids, "logprobs": logprobs, "state": state}

        return self._cached(("reference", kv_dtype, eager), run)

    def dflash(self, kv_dtype: str, backend: str, eager: bool) -> dict:
        def run():
            target, draft = self.partial_pair
            t0 = time.monotonic()
            llm = offline_engine.start_llm(
                ("gpu-dflash-partial", kv_dtype, backend, eager),
                model=target,
                speculative_config=dflash_settings.dflash_spec_config(draft, attention_backend=backend),
                **self._engine_kw(kv_dtype, eager),
            )
            start_s = time.monotonic() - t0
            llm.collective_rpc(worker_probes.worker_install_qsl_probe)
            ids, logprobs = greedy_runs.generate_with_logprobs(llm)
            out = {
                "ids": ids,
                "logprobs": logprobs,
                "state": llm.collective_rpc(worker_probes.worker_kv_state)[0],
                "qsl": llm.collective_rpc(worker_probes.worker_read_qsl_probe)[0],
                "metrics": offline_engine.spec_metrics(llm),
                "start_s": start_s,
            }
            offline_engine.shutdown_llm()
            return out

        return self._cached(("dflash", kv_dtype, backend, eager), run)

    def full(self, kv_dtype: str, backend: str, eager: bool) -> dict:
        def run():
            target, draft = self.full_pair
            llm = offline_engine.start_llm(
                ("gpu-dflash-full", kv_dtype, backend, eager),
                model=target,
                speculative_config=dflash_settings.dflash_spec_config(draft, attention_backend=backend),
                **self._engine_kw(kv_dtype, eager),
            )
            ids, _ = greedy_runs.generate_ids(llm)
            out = {"ids": ids, "metrics": offline_engine.spec_metrics(llm)}
            offline_engine.shutdown_llm()
            return out

        return self._cached(("full", kv_dtype, backend, eager), run)


def run_start_errors(cases: list[dict], workdir: Path, timeout: float = 900) -> dict:
    """Run tests/support/engine_start_errors.py on ``cases`` in a subprocess."""
    workdir.mkdir(parents=True, exist_ok=True)
    cases_path, results_path = workdir / "cases.json", workdir / "results.json"
    cases_path.write_text(json.dumps(cases, indent=2))
    log = workdir / "engine_start_errors.log"
    script = SUPPORT / "engine_start_errors.py"
    with open(log, "w") as logf:
        proc = subprocess.run(
            [sys.executable, str(script), str(cases_path), str(results_path)],
            stdout=logf,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    tail = log.read_text(errors="replace")[-3000:]
    for case in cases:
        results.setdefault(
            case["id"], {"started": None, "chain": [], "harness": f"exit {proc.returncode}; log tail:\n{tail}"}
        )
    return results
