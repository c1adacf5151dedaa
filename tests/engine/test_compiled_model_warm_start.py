"""A warm start loads the compiled model it saved instead of compiling again.

An engine started without ``--enforce-eager`` saves its compiled model (the
target and the drafter) in vLLM's compile cache; the next start of the same
model and configuration loads it. In the CPU platform's default mode the
saved function is a plain one, with no artifacts to finalize, and vLLM
0.21.0 failed every such load ("Compiling model again due to a load failure
...: 'function' object has no attribute 'finalize_loading'").

The unit check runs vLLM's loader on a saved function of that kind; the
extended check starts the text pair twice on one cache directory, as a user
restarting ``vllm serve`` does: the second start loads both models (vLLM's
own counter), logs no load failure and answers the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest

pytestmark = pytest.mark.needs_patch("0024")


def test_a_saved_plain_function_loads_without_compiling_again(monkeypatch, tmp_path):
    import torch

    from vllm.compilation import decorators
    from vllm.compilation.counter import compilation_counter
    from vllm.config import VllmConfig

    def plain(*args):
        return args

    loaded = types.SimpleNamespace(
        _artifacts=types.SimpleNamespace(compiled_fn=plain),
        source_info=lambda: None,
        disable_guard_check=lambda: None,
    )
    monkeypatch.setattr(torch.compiler, "load_compiled_function", lambda f, f_globals: loaded)
    monkeypatch.setattr(decorators, "_verify_source_unchanged", lambda info, config: None)
    config = VllmConfig()
    model = types.SimpleNamespace(
        vllm_config=config,
        compilation_config=config.compilation_config,
        _is_encoder=False,
        forward=types.SimpleNamespace(__globals__={}),
    )
    saved = tmp_path / "model"
    saved.write_bytes(b"saved")
    before = compilation_counter.num_aot_artifacts_loaded
    assert decorators._try_load_aot_compiled_fn(model, str(saved)) is loaded
    assert compilation_counter.num_aot_artifacts_loaded == before + 1


START = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {support!r})
    import dflash_settings
    from vllm import LLM, SamplingParams

    def counters(worker):
        from vllm.compilation.counter import compilation_counter as c
        return [c.num_aot_artifacts_loaded, c.num_aot_artifacts_saved]

    if __name__ == "__main__":
        target, draft = {pair!r}
        llm = LLM(model=target, kv_cache_dtype="fp8", max_model_len=512, max_num_seqs=4, seed=0,
                  speculative_config=dflash_settings.dflash_spec_config(draft))
        out = llm.generate(["Beautiful is better than"], SamplingParams(temperature=0, max_tokens=32))
        print("RESULT " + json.dumps({{"text": out[0].outputs[0].text,
                                      "counters": llm.collective_rpc(counters)[0]}}))
""")


@pytest.mark.extended
def test_second_start_loads_the_compiled_target_and_drafter(text_pair, tmp_path):
    from repo_paths import SUPPORT

    script = tmp_path / "start.py"
    script.write_text(START.format(support=str(SUPPORT), pair=tuple(text_pair)))
    env = {
        **os.environ,
        "VLLM_CACHE_ROOT": str(tmp_path / "cache"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"exit {proc.returncode}\n{log[-6000:]}"
        result = json.loads(log.rsplit("RESULT ", 1)[1].splitlines()[0])
        runs.append({**result, "recompiled": "Compiling model again" in log})
    print(
        f"\n[warm start] compiled models [loaded, saved]: first start {runs[0]['counters']}, "
        f"second {runs[1]['counters']}"
    )
    first, second = runs
    assert first["counters"] == [0, 2], first
    assert second["counters"] == [2, 0] and not second["recompiled"], second
    assert second["text"] == first["text"]
