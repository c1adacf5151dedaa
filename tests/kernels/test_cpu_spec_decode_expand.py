"""The rejection sampler's per-request parameters on CPU, expanded to draft tokens.

With speculative decoding, each request's temperature, top_k and top_p are
repeated once per draft token (expand_batch_to_tokens) before the target's
probabilities are computed. On CPU the model runner swaps in the kernels of
vllm/utils/cpu_triton_utils.py; these tests install them the same way and
check the expansion for the dtypes the sampler uses (float32 temperature and
top_p, int32 top_k) and int64. A wrong expansion scales the target's logits by
whatever the output memory held: NaN or uniform probabilities, and a seeded
sampled request that returns something else on every run.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def cpu_rejection_kernels():
    """The CPU runner's kernel swap, undone after the test."""
    import vllm.v1.sample.rejection_sampler as rejection_sampler
    import vllm.v1.spec_decode.llm_base_proposer as proposer
    import vllm.v1.spec_decode.utils as spec_utils
    import vllm.v1.worker.block_table as block_table
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    modules = (rejection_sampler, proposer, spec_utils, block_table)
    saved = [dict(vars(m)) for m in modules]
    CPUModelRunner._postprocess_triton(None)  # uses no instance state
    assert rejection_sampler.expand_kernel.__class__.__module__ == "vllm.utils.cpu_triton_utils"
    yield rejection_sampler
    for module, before in zip(modules, saved):
        for name in set(vars(module)) - set(before):
            delattr(module, name)
        for name, value in before.items():
            setattr(module, name, value)


# Requests with 2, 0 and 3 draft tokens (a request without drafts expands to nothing).
CU_NUM_TOKENS = [2, 2, 5]


def _expected(values, replace_from, replace_to):
    counts = [b - a for a, b in zip([0, *CU_NUM_TOKENS], CU_NUM_TOKENS)]
    out = []
    for value, count in zip(values, counts):
        out += [replace_to if value == replace_from else value] * count
    return out


@pytest.mark.parametrize(
    "what, dtype, values, replace_from, replace_to",
    [
        pytest.param(
            "temperature",
            torch.float32,
            [0.9, 0.7, 0.0],
            0,
            1,
            id="temperature-float32",
            marks=pytest.mark.needs_patch("0019"),
        ),
        pytest.param(
            "top_p", torch.float32, [0.5, 1.0, 0.25], 0, 0, id="top_p-float32", marks=pytest.mark.needs_patch("0019")
        ),
        pytest.param("top_k", torch.int32, [5, 3, 7], 0, 0, id="top_k-int32", marks=pytest.mark.needs_patch("0019")),
        pytest.param("ids", torch.int64, [11, 12, 0], 0, 13, id="int64"),
    ],
)
def test_expand_batch_to_tokens_on_cpu(cpu_rejection_kernels, what, dtype, values, replace_from, replace_to):
    x = torch.tensor(values, dtype=dtype)
    cu = torch.tensor(CU_NUM_TOKENS, dtype=torch.int32)
    got = cpu_rejection_kernels.expand_batch_to_tokens(
        x, cu, CU_NUM_TOKENS[-1], replace_from=replace_from, replace_to=replace_to
    )
    want = torch.tensor(_expected(values, replace_from, replace_to), dtype=dtype)
    assert got.dtype == dtype
    assert torch.equal(got, want), f"{what}: got {got.tolist()}, want {want.tolist()}"
