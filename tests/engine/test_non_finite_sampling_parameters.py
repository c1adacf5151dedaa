"""Non-finite sampling parameters are refused, not sampled with.

NaN passes every range check of SamplingParams (each comparison with NaN is
False): a request with "temperature": NaN was accepted and answered with
token 0 over and over. JSON as Python and pydantic read it allows NaN and
Infinity literals, so clients can send them. The same through the real
server (a 400): tests/serve_load/test_faults.py.
"""

from __future__ import annotations

import math

import pytest

NON_FINITE = [math.nan, math.inf, -math.inf]


@pytest.mark.needs_patch("0016")
@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", ["temperature", "repetition_penalty"])
def test_non_finite_value_is_a_validation_error(name, value):
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    with pytest.raises(VLLMValidationError, match=f"{name} must be a finite number") as e:
        SamplingParams(**{name: value})
    assert e.value.parameter == name


@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty", "top_p", "min_p"])
def test_range_checked_parameters_refuse_non_finite_values_already(name, value):
    """The base's range checks already refuse these (NaN fails a chained
    comparison); kept here so that stays true."""
    from vllm.sampling_params import SamplingParams

    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name, value", [("temperature", 0.0), ("temperature", 7.5), ("repetition_penalty", 1.3)])
def test_finite_values_still_pass(name, value):
    from vllm.sampling_params import SamplingParams

    assert getattr(SamplingParams(**{name: value}), name) == value
