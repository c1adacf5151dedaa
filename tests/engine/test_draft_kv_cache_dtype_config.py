"""speculative_config.kv_cache_dtype: the drafter's KV cache dtype, chosen
apart from the target's --kv-cache-dtype (same field name and meaning as
vLLM 0.26's, so a config moves between this fork and later vLLM unchanged).

Checked where the engine config is built (what `vllm serve` and `LLM(...)` do
first; no engine starts here): unset, the draft layers take the target's
dtype; set, the draft layers' cache config carries it and the target's does
not change; an unknown value or a value with another speculative method is
refused, saying what to do. What the engine then allocates and computes:
tests/cpu_e2e/test_dflash_draft_kv_dtype.py.
"""

from __future__ import annotations

import pytest
from engine_configs import config_refusal, engine_config

pytestmark = pytest.mark.needs_patch("0027")


@pytest.fixture(scope="module")
def family_pair_qwen3_5_moe():
    import pair_cache

    return pair_cache.make_family_pair("qwen3_5_moe")


def _engine_args(target: str, target_kv_cache_dtype: str = "fp8", limit_mm_per_prompt=None, **spec) -> dict:
    extra = {} if limit_mm_per_prompt is None else {"limit_mm_per_prompt": limit_mm_per_prompt}
    return dict(
        model=target,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        kv_cache_dtype=target_kv_cache_dtype,
        **extra,
        speculative_config={"num_speculative_tokens": 3, **spec},
    )


def _engine_config(target: str, *args, **spec):
    return engine_config(**_engine_args(target, *args, **spec))


def _refusal(target: str, **spec) -> str:
    return config_refusal(**_engine_args(target, **spec))


@pytest.mark.parametrize(
    "target_dtype, draft_dtype",
    [("fp8", "auto"), ("fp8", "bfloat16"), ("auto", "fp8"), ("fp8", "fp8_e5m2"), ("fp8", "fp8")],
)
def test_draft_layers_take_the_asked_dtype(trained_pair, target_dtype, draft_dtype):
    target, draft = trained_pair
    config = _engine_config(target, target_dtype, method="dflash", model=draft, kv_cache_dtype=draft_dtype)
    spec = config.speculative_config
    assert spec.kv_cache_dtype == draft_dtype
    assert spec.draft_cache_config(config.cache_config).cache_dtype == draft_dtype
    assert config.cache_config.cache_dtype == target_dtype


def test_unset_the_draft_layers_take_the_target_dtype(trained_pair):
    target, draft = trained_pair
    config = _engine_config(target, "fp8", method="dflash", model=draft)
    assert config.speculative_config.kv_cache_dtype is None
    assert config.speculative_config.draft_cache_config(config.cache_config) is config.cache_config


def test_the_dtype_is_part_of_the_config_hash(trained_pair):
    target, draft = trained_pair
    hashes = {
        d: _engine_config(
            target, "fp8", method="dflash", model=draft, **({} if d is None else {"kv_cache_dtype": d})
        ).speculative_config.compute_hash()
        for d in (None, "auto", "fp8_e5m2")
    }
    assert len(set(hashes.values())) == 3, hashes


def test_unknown_dtype_is_refused_with_the_allowed_values(trained_pair):
    target, draft = trained_pair
    message = _refusal(target, method="dflash", model=draft, kv_cache_dtype="int3")
    assert "kv_cache_dtype" in message and "'int3'" in message, message
    for allowed in ("'auto'", "'bfloat16'", "'fp8'", "'fp8_e5m2'"):
        assert allowed in message, message


def test_dtype_with_another_method_is_refused(trained_pair):
    target, _draft = trained_pair
    message = _refusal(target, method="ngram", prompt_lookup_max=3, kv_cache_dtype="auto")
    assert "kv_cache_dtype='auto' is supported with method 'dflash'" in message, message
    assert "'ngram'" in message and "remove kv_cache_dtype" in message, message


def test_unset_where_no_backend_serves_the_drafter_falls_back_with_a_warning(trained_pair, monkeypatch):
    """A platform whose attention backends serve the target's cache dtype but
    not the drafter's non-causal attention in it (as Hopper GPUs for the
    turboquant dtypes): the drafter's cache takes the model dtype, with one
    warning naming the dtype and the field. The stand-in platform refuses
    non-causal fp8 as CUDA's backend selection refuses what it cannot serve."""
    import logging

    from vllm.platforms import current_platform

    target, draft = trained_pair
    config = _engine_config(target, "fp8", method="dflash", model=draft)
    select = current_platform.get_attn_backend_cls

    def refuse_non_causal_fp8(selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_non_causal and attn_selector_config.kv_cache_dtype == "fp8":
            raise ValueError("No valid attention backend found (stand-in)")
        return select(selected_backend, attn_selector_config=attn_selector_config, num_heads=num_heads)

    class Records(logging.Handler):
        messages: list[str] = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    monkeypatch.setattr(current_platform, "get_attn_backend_cls", refuse_non_causal_fp8)
    handler = Records(level=logging.WARNING)
    vllm_logger = logging.getLogger("vllm")  # vLLM's loggers do not propagate to the root
    vllm_logger.addHandler(handler)
    try:
        draft_cache = config.speculative_config.draft_cache_config(config.cache_config)
    finally:
        vllm_logger.removeHandler(handler)
    assert draft_cache.cache_dtype == "auto" and config.cache_config.cache_dtype == "fp8"
    warning = " ".join(handler.messages)
    assert "--kv-cache-dtype fp8" in warning and "speculative_config kv_cache_dtype" in warning, warning


def test_unset_where_a_backend_serves_the_drafter_keeps_the_target_dtype(trained_pair):
    target, draft = trained_pair
    config = _engine_config(target, "fp8", method="dflash", model=draft)
    assert config.speculative_config.draft_cache_config(config.cache_config).cache_dtype == "fp8"


def test_hybrid_target_takes_a_drafter_dtype_of_another_size(family_pair_qwen3_5_moe):
    """Qwen3.5/3.6 targets (gated delta net + attention) take any drafter
    dtype, of another element size too: the KV cache layout fits the
    drafter's pages to the target's (tests/engine/test_hybrid_draft_kv_layout.py)."""
    target, draft = family_pair_qwen3_5_moe
    overrides = {"limit_mm_per_prompt": {"image": 0, "video": 0}}
    for draft_dtype in ("auto", "bfloat16", "fp8_e5m2"):
        config = _engine_config(target, "fp8", method="dflash", model=draft, kv_cache_dtype=draft_dtype, **overrides)
        assert config.speculative_config.draft_cache_config(config.cache_config).cache_dtype == draft_dtype
        assert config.cache_config.cache_dtype == "fp8"
