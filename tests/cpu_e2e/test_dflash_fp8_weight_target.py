"""DFlash behind a target with FP8 weights (the format of Qwen3.6-35B-A3B-FP8).

The target (vllm.fork.tiny_families, ``fp8_weights``) stores its attention and
MLP projections in FP8 with 128x128 block scales; its DFlash drafter is an
unquantized checkpoint. The drafter must get its own quantization config
(none), not the target's, and the ``--kv-cache-dtype`` cache.

vLLM 0.21.0 serves block-FP8 weights on CPU only with AMX ("CPUFp8BlockScaledMMKernel
requires AMX tile support"), and FP8 weights only in bf16/fp16. So on every
CPU the configuration is checked without running the weights: the engine
configuration vLLM builds for ``vllm serve TARGET --kv-cache-dtype fp8
--speculative-config '{"method": "dflash", ...}'`` quantizes the target and
not the drafter. Where the CPU has AMX, the engine runs too: the draft
layers' linear methods are unquantized and their caches fp8, and greedy
DFlash equals target-only (bf16: vLLM's near-tie rule).
"""

from __future__ import annotations

import dflash_settings
import greedy_runs
import offline_engine
import pair_cache
import pytest
import torch
import worker_probes

AMX_FAMILY = "llama"
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def fp8_pair():
    return pair_cache.make_family_pair(AMX_FAMILY, fp8_weights=True)


@pytest.fixture(scope="module")
def fp8_config_pair(tmp_path_factory):
    """The hybrid MoE pair of every commit's suite (Qwen3.6-35B-A3B's layout)
    with the target's config declaring the FP8 checkpoint's quantization:
    building the engine configuration reads no weights."""
    import json
    import os
    from pathlib import Path

    from vllm.fork import tiny_families

    target, draft = pair_cache.make_family_pair("qwen3_5_moe")
    copy = tmp_path_factory.mktemp("fp8-config") / "target"
    copy.mkdir()
    for f in Path(target).iterdir():
        os.symlink(f, copy / f.name)
    config = json.loads(Path(target, "config.json").read_text())
    config["quantization_config"] = tiny_families.FP8_WEIGHT_QUANTIZATION
    (copy / "config.json").unlink()
    (copy / "config.json").write_text(json.dumps(config))
    return str(copy), draft


def test_engine_config_quantizes_the_target_and_not_the_drafter(fp8_config_pair):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.fork.tiny_families import serve_overrides
    from vllm.model_executor.models.utils import get_draft_quant_config

    target, draft = fp8_config_pair
    config = EngineArgs(
        model=target,
        dtype="bfloat16",
        kv_cache_dtype="fp8",
        max_model_len=1024,
        speculative_config=dflash_settings.dflash_spec_config(draft),
        **serve_overrides("qwen3_5_moe"),
    ).create_engine_config()
    quant = config.quant_config
    print(
        f"\n[e2e] target quantization: {type(quant).__name__} block {getattr(quant, 'weight_block_size', None)}; "
        f"drafter: {get_draft_quant_config(config)}; cache dtype {config.cache_config.cache_dtype}"
    )
    assert quant is not None and quant.get_name() == "fp8" and quant.weight_block_size == [128, 128]
    assert config.speculative_config.draft_model_config.quantization is None
    assert get_draft_quant_config(config) is None
    assert config.cache_config.cache_dtype == "fp8"


def _worker_draft_linear_methods(worker) -> dict:
    from vllm.model_executor.layers.linear import LinearBase

    return {
        name: type(m.quant_method).__name__
        for name, m in worker.model_runner.drafter.model.named_modules()
        if isinstance(m, LinearBase)
    }


@pytest.mark.skipif(
    not torch.cpu._is_amx_tile_supported(),
    reason="vLLM 0.21.0 runs block-FP8 weights on CPU only with AMX; this CPU has none",
)
def test_dflash_runs_behind_the_fp8_weight_target_on_amx(fp8_pair, measurements):
    target, draft = fp8_pair
    prompts = greedy_runs.PROMPTS
    llm = offline_engine.start_llm(("fp8-weights", "target"), model=target, kv_cache_dtype="fp8")
    want_ids, want_logprobs = greedy_runs.generate_with_logprobs(llm, prompts, MAX_TOKENS)
    llm = offline_engine.start_llm(
        ("fp8-weights", "dflash"),
        model=target,
        kv_cache_dtype="fp8",
        speculative_config=dflash_settings.dflash_spec_config(draft),
    )
    got_ids, got_logprobs = greedy_runs.generate_with_logprobs(llm, prompts, MAX_TOKENS)
    methods = llm.collective_rpc(_worker_draft_linear_methods)[0]
    state = llm.collective_rpc(worker_probes.worker_kv_state)[0]
    offline_engine.shutdown_llm()
    assert methods and set(methods.values()) == {"UnquantizedLinearMethod"}, methods
    draft_layers = {n: s for n, s in state["layers"].items() if s["role"] == "draft"}
    assert draft_layers and all(s["kv_cache_dtype"] == "fp8" for s in draft_layers.values()), draft_layers
    report = greedy_runs.near_tie_report(
        {"ids": got_ids, "logprobs": got_logprobs}, {"ids": want_ids, "logprobs": want_logprobs}
    )
    measurements["fp8-weight target (AMX)"] = report.summary()
    assert report.ok, report.explain()
