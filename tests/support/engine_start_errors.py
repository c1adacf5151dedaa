"""Start DFlash engines that are expected to fail, and record how they fail.

    python tests/support/engine_start_errors.py CASES.json RESULTS.json

CASES.json: a list of ``{"id", "target", "draft", "kv_cache_dtype",
"attention_backend", "num_speculative_tokens", ...engine kwargs}``.
RESULTS.json: ``{id: {"started": bool, "chain": [{"type", "message"}, ...]}}``
-- the exception raised by ``LLM(...)`` and its causes/contexts, outermost first.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so the error the drafter's attention-backend selection raises reaches
``LLM(...)`` itself instead of a child's log: that is what a user of the
Python API sees, and the same text ``vllm serve`` logs before exiting. One
process serves all cases (they fail while loading tiny models), which keeps
the GPU suite short; the test process itself never touches CUDA.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def exception_chain(exc: BaseException | None) -> list[dict]:
    """``exc`` and its ``__cause__``/``__context__`` chain, outermost first."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append({"type": type(exc).__name__, "message": str(exc)})
        exc = exc.__cause__ or exc.__context__
    return chain


def first_of_type(chain: list[dict], type_name: str) -> dict | None:
    return next((e for e in chain if e["type"] == type_name), None)


def _cleanup() -> None:
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception as e:  # pragma: no cover - best effort
        print(f"[start-errors] cleanup raised {e!r}", file=sys.stderr)


def run_case(case: dict) -> dict:
    from vllm import LLM

    case = dict(case)
    case.pop("id")
    spec = {
        "method": "dflash",
        "model": case.pop("draft"),
        "num_speculative_tokens": case.pop("num_speculative_tokens"),
        "attention_backend": case.pop("attention_backend"),
    }
    kwargs = {"model": case.pop("target"), "speculative_config": spec, **case}
    try:
        llm = LLM(**kwargs)
    except BaseException as e:
        traceback.print_exc()
        result = {"started": False, "chain": exception_chain(e)}
        del e
    else:
        result = {"started": True, "chain": []}
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # pragma: no cover - best effort
            pass
        del llm
    _cleanup()
    return result


def main(argv: list[str]) -> int:
    cases_path, results_path = argv[1], argv[2]
    cases = json.load(open(cases_path))
    results = {}
    for case in cases:
        print(f"[start-errors] case {case['id']}", file=sys.stderr, flush=True)
        results[case["id"]] = run_case(case)
        with open(results_path, "w") as f:  # partial results survive a crash
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
