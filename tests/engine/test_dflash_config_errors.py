"""DFlash config mistakes get errors that name the field, the value, the
limit and what to do, when the engine config is built (what `vllm serve` and
`LLM(...)` do first; no engine starts here). `vllm serve` with the target
given as the drafter: tests/serve_load/test_startup.py.

The tiny pairs' drafters are trained on blocks of 4 positions
(vllm.fork.tiny_pairs.DFLASH_BLOCK_SIZE): at most 3 speculative tokens.
"""

from __future__ import annotations

import pytest
from engine_configs import config_refusal, engine_config


def _engine_args(target: str, **spec) -> dict:
    return dict(
        model=target,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        speculative_config={"method": "dflash", **spec},
    )


def _engine_config(target: str, **spec):
    return engine_config(**_engine_args(target, **spec))


def _refusal(target: str, **spec) -> str:
    return config_refusal(**_engine_args(target, **spec))


@pytest.mark.needs_patch("0017")
def test_target_given_as_the_drafter_is_named_as_not_a_drafter(trained_pair):
    target, _draft = trained_pair
    message = _refusal(target, model=target, num_speculative_tokens=3)
    assert f"speculative_config model {target!r} is not a DFlash drafter" in message, message
    assert "['Qwen3ForCausalLM']" in message and "no dflash_config" in message, message
    assert "Supported architectures" not in message, message


@pytest.mark.needs_patch("0017")
@pytest.mark.parametrize("tokens", [4, 100])
def test_more_speculative_tokens_than_the_drafter_drafts_are_refused(trained_pair, tokens):
    from vllm.fork.tiny_pairs import DFLASH_BLOCK_SIZE

    target, draft = trained_pair
    message = _refusal(target, model=draft, num_speculative_tokens=tokens)
    assert f"num_speculative_tokens={tokens} exceeds" in message, message
    assert f"block_size={DFLASH_BLOCK_SIZE}" in message, message
    assert f"Use num_speculative_tokens <= {DFLASH_BLOCK_SIZE - 1}." in message, message


@pytest.mark.parametrize("tokens", [1, 3])
def test_speculative_tokens_within_the_block_are_taken(trained_pair, tokens):
    target, draft = trained_pair
    config = _engine_config(target, model=draft, num_speculative_tokens=tokens)
    assert config.speculative_config.num_speculative_tokens == tokens


@pytest.mark.needs_patch("0018")
@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN"])
def test_explicit_drafter_backend_cpu_cannot_run_is_refused(trained_pair, backend):
    target, draft = trained_pair
    message = _refusal(target, model=draft, num_speculative_tokens=3, attention_backend=backend)
    assert f"attention_backend={backend} cannot run on CPU" in message, message
    assert "Remove attention_backend from the speculative config" in message, message


@pytest.mark.parametrize("backend", ["CPU_ATTN", "auto"])
def test_cpu_attn_or_automatic_choice_is_taken(trained_pair, backend):
    target, draft = trained_pair
    config = _engine_config(target, model=draft, num_speculative_tokens=3, attention_backend=backend)
    assert config.speculative_config.num_speculative_tokens == 3


@pytest.mark.needs_patch("0021")
def test_pipeline_parallelism_is_refused_pointing_at_tensor_parallelism(trained_pair):
    """Refused at configuration (no engine starts), naming pipeline
    parallelism and what works instead; the base's error named neither the
    drafter nor an alternative."""
    target, draft = trained_pair
    args = _engine_args(target, model=draft, num_speculative_tokens=3)
    message = config_refusal(**args, pipeline_parallel_size=2, distributed_executor_backend="mp")
    assert "DFlash speculative decoding does not support pipeline parallelism" in message, message
    assert "pipeline_parallel_size=2" in message and "--tensor-parallel-size" in message, message
