"""The offline engines (vllm.LLM) of the CPU end-to-end tests.

Engines are expensive on 2 cores (~35 s start, ~4 GiB), so at most one is
alive at a time: :func:`start_llm` shuts down the previous one first, and
reuses the live one when its key matches.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time

from dflash_settings import MAX_MODEL_LEN, dflash_spec_config

_current: dict = {"llm": None, "key": None}


def shutdown_llm() -> None:
    llm = _current["llm"]
    _current["llm"] = _current["key"] = None
    if llm is None:
        return
    client = llm.llm_engine.engine_core
    try:
        client.shutdown()
    except Exception as e:  # pragma: no cover - best effort
        print(f"[e2e] engine shutdown raised {e!r}")
    # After an engine died mid-request its client's sockets can still hold
    # unsent messages; collecting the client's ZeroMQ context would then wait
    # for them forever (Context.term), hanging the session's teardown.
    ctx = getattr(client, "ctx", None)
    if ctx is not None:
        ctx.destroy(linger=0)
    del llm, client
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception as e:  # pragma: no cover - best effort
        print(f"[e2e] cleanup_dist_env_and_memory raised {e!r}")


@contextlib.contextmanager
def _no_dynamo_if_eager(enforce_eager: bool):
    """TORCHDYNAMO_DISABLE=1 for the processes an eager engine spawns.

    An eager engine still compiles a few helpers with Inductor, the random
    sampler first (the start-up's dummy sampler run calls it), and on CPU the
    first compile of a process costs about 10 s: Inductor checks that each
    vector ISA loads by importing torch in a Python subprocess per ISA
    variant. That was half of an engine's start here, and the suite starts
    dozens. The helpers run eagerly instead: greedy decoding never samples
    at random, and a test's DFlash engine and its target-only reference run
    the same code either way. vllm serve tests, the compiled-model tests and
    non-eager engines keep vLLM's default."""
    if not enforce_eager or "TORCHDYNAMO_DISABLE" in os.environ:
        yield
        return
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        yield
    finally:
        del os.environ["TORCHDYNAMO_DISABLE"]


def start_llm(key, **kwargs):
    """Start an engine (reusing the live one if ``key`` matches)."""
    if _current["key"] == key and _current["llm"] is not None:
        return _current["llm"]
    shutdown_llm()
    from vllm import LLM

    kwargs.setdefault("dtype", "bfloat16")
    kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    kwargs.setdefault("max_num_seqs", 8)
    kwargs.setdefault("seed", 0)
    kwargs.setdefault("enforce_eager", True)
    kwargs.setdefault("disable_log_stats", False)
    t0 = time.monotonic()
    with _no_dynamo_if_eager(kwargs["enforce_eager"]):
        llm = LLM(**kwargs)
    print(f"[e2e] engine {key} started in {time.monotonic() - t0:.1f} s")
    _current["llm"], _current["key"] = llm, key
    return llm


def start_dflash_fp8(name: str, pair: tuple[str, str]):
    """A DFlash engine on ``pair`` with an fp8 KV cache."""
    target, draft = pair
    return start_llm(
        (name, "fp8"),
        model=target,
        kv_cache_dtype="fp8",
        speculative_config=dflash_spec_config(draft),
    )


def start_trained_fp32(pair: tuple[str, str]):
    """DFlash on the trained pair in float32 (auto KV cache, no prefix
    caching); one key, so tests in different modules share the engine."""
    target, draft = pair
    return start_llm(
        ("dflash-trained", "fp32"),
        model=target,
        dtype="float32",
        enable_prefix_caching=False,
        speculative_config=dflash_spec_config(draft),
    )


def engine_counter(llm, name: str) -> float:
    """One counter of vLLM's metrics (LLM.get_metrics()), 0 when absent."""
    return next((m.value for m in llm.get_metrics() if m.name == name), 0)


def spec_metrics(llm) -> dict:
    """Spec-decode counters from vLLM's metrics (LLM.get_metrics())."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = m.values if hasattr(m, "values") else m.value
    return out
