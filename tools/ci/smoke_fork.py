"""Smoke run of an installed fork: DFlash + fp8 KV cache, a few tokens.

    python tools/ci/smoke_fork.py            # with the interpreter of the venv to check

Generates the embedded tiny target + DFlash drafter pair (vllm.fork.tiny_pairs,
offline, seconds), starts one engine with the drafter and an fp8 KV cache,
greedily generates a few tokens and checks that they equal the target-only
engine's (the pair is float32, where speculative decoding is exact). Prints
the interpreter, the fork version and what it measured; exits non-zero with
the reason on any failure. CI runs it on every supported Python.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MAX_TOKENS = 12
PROMPT = "def fib(n):"


def generate(**engine) -> list[int]:
    from vllm import LLM, SamplingParams

    llm = LLM(dtype="float32", max_model_len=256, enforce_eager=True, seed=0, **engine)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        return list(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids)
    finally:
        llm.llm_engine.engine_core.shutdown()


def main() -> int:
    import vllm
    from vllm.fork.tiny_pairs import generate_pair

    print(f"python {platform.python_version()}, vllm {vllm.__version__}", flush=True)
    with tempfile.TemporaryDirectory(prefix="vllm-fork-smoke-") as tmp:
        target, draft = generate_pair(tmp, "trained", seed=0)
        spec = {"method": "dflash", "model": draft, "num_speculative_tokens": 3}
        dflash = generate(model=target, kv_cache_dtype="fp8", speculative_config=spec)
        plain = generate(model=target, kv_cache_dtype="fp8")
    print(f"DFlash + fp8 KV: {dflash}\ntarget only:     {plain}", flush=True)
    if len(dflash) != MAX_TOKENS:
        print(f"FAILED: {len(dflash)} tokens, expected {MAX_TOKENS}", file=sys.stderr)
        return 1
    if dflash != plain:
        print("FAILED: DFlash changed the greedy float32 output", file=sys.stderr)
        return 1
    print("smoke run passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
