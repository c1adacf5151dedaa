"""An engine's configuration built from engine arguments without starting
the engine, as `vllm serve` builds it first: what the configuration-error
tests check."""

from __future__ import annotations

import pytest


def engine_config(**engine_args):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(**engine_args).create_engine_config()


def config_refusal(**engine_args) -> str:
    """The message vLLM refuses these engine arguments with while it builds
    the configuration (the test fails if it accepts them)."""
    with pytest.raises(Exception) as e:  # pydantic's ValidationError wraps the ValueError
        engine_config(**engine_args)
    return str(e.value)
