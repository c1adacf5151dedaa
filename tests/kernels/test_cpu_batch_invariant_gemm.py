"""``VLLM_BATCH_INVARIANT=1`` on CPU: a row's product does not depend on the batch.

vLLM's batch-invariant mode promises that a request's output does not depend
on the other requests batched with it. Its base implementation covers CUDA
only; on CPU the variable changed nothing, and the GEMM libraries the CPU
backend calls (oneDNN for linear layers, torch's ``F.linear`` in the MoE
fallback) sum a row's products in an order chosen from the whole problem
shape: row 0 of five rows differs in its last bits from the same row
multiplied alone. Speculative decoding meets this at every step -- a
verification step multiplies more rows than a decode step -- and an fp8 KV
cache turns such a last-bit difference into a whole fp8 step where a value
lies at a rounding boundary, so greedy output could part from target-only
decoding.

With the variable set, the CPU backend multiplies rows in tiles of one fixed
height. These tests call the functions the model's layers call (the
unquantized linear method's CPU GEMM and the MoE layer's CPU implementation)
and compare every row of batches of several sizes, bit for bit, with the same
row computed alone.
"""

from __future__ import annotations

import pytest
import torch

BATCH_SIZES = (2, 5, 16, 17, 40)


@pytest.fixture
def batch_invariant(monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")


def _linear(in_features: int, out_features: int, bias: bool, gen: torch.Generator) -> torch.nn.Module:
    """A layer as the CPU backend prepares an unquantized linear layer."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(out_features, in_features, generator=gen), requires_grad=False)
    layer.bias = torch.nn.Parameter(torch.randn(out_features, generator=gen), requires_grad=False) if bias else None
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    return layer


def _gemm(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    from vllm.model_executor.layers.utils import cpu_unquantized_gemm

    return cpu_unquantized_gemm(layer, x, layer.weight, layer.bias)


def _rows_that_differ_from_alone(compute) -> dict[int, list[int]]:
    """``compute(rows)`` for the first m rows of the batch, against each row
    computed alone: the rows that differ, by batch size m."""
    alone = [compute(slice(i, i + 1))[0] for i in range(max(BATCH_SIZES))]
    differ = {}
    for m in BATCH_SIZES:
        out = compute(slice(0, m))
        rows = [i for i in range(m) if not torch.equal(out[i], alone[i])]
        if rows:
            differ[m] = rows
    return differ


@pytest.mark.needs_patch("0032")
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_a_linear_layer_row_is_the_same_in_every_batch(batch_invariant, bias):
    gen = torch.Generator().manual_seed(0)
    layer = _linear(256, 384, bias, gen)
    x = torch.randn(max(BATCH_SIZES), 256, generator=gen)
    differ = _rows_that_differ_from_alone(lambda rows: _gemm(layer, x[rows]))
    assert not differ, f"rows whose product differs from the row multiplied alone, by batch size: {differ}"


def test_tokens_with_leading_dimensions_keep_their_shape_and_values(batch_invariant):
    gen = torch.Generator().manual_seed(1)
    layer = _linear(64, 96, True, gen)
    x = torch.randn(3, 7, 64, generator=gen)
    out = _gemm(layer, x)
    assert out.shape == (3, 7, 96)
    assert torch.equal(out, _gemm(layer, x.reshape(21, 64)).reshape(3, 7, 96))


def test_an_empty_batch_keeps_the_layers_width(batch_invariant):
    gen = torch.Generator().manual_seed(4)
    layer = _linear(64, 96, True, gen)
    assert _gemm(layer, torch.empty(0, 64)).shape == (0, 96)


def test_without_the_variable_a_linear_layer_is_the_libraries_product(monkeypatch):
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    gen = torch.Generator().manual_seed(2)
    layer = _linear(256, 384, True, gen)
    x = torch.randn(40, 256, generator=gen)
    assert torch.equal(_gemm(layer, x), layer.cpu_linear(x, layer.weight, layer.bias))


class _MoELayer(torch.nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, gen: torch.Generator) -> None:
        super().__init__()
        self.w13_weight = torch.nn.Parameter(
            torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) * 0.2, requires_grad=False
        )
        self.w2_weight = torch.nn.Parameter(
            torch.randn(num_experts, hidden, intermediate, generator=gen) * 0.2, requires_grad=False
        )


@pytest.mark.parametrize(
    "hidden,intermediate",
    [
        # Sizes that are multiples of 32 go to the compiled grouped GEMM on
        # CPUs with AVX-512 and without AMX (measured batch-invariant on its
        # own, up to 600 tokens) and to the torch fallback elsewhere.
        pytest.param(64, 64, id="grouped-gemm-sizes"),
        # Other sizes take the torch fallback everywhere.
        pytest.param(48, 40, id="fallback-sizes", marks=pytest.mark.needs_patch("0032")),
    ],
)
def test_a_token_through_the_experts_is_the_same_in_every_batch(batch_invariant, hidden, intermediate):
    from vllm.model_executor.layers.fused_moe.cpu_fused_moe import CPUFusedMOE

    num_experts, top_k = 4, 2
    gen = torch.Generator().manual_seed(3)
    layer = _MoELayer(num_experts, hidden, intermediate, gen)
    moe = CPUFusedMOE(layer)
    x = torch.randn(max(BATCH_SIZES), hidden, generator=gen)
    logits = torch.randn(max(BATCH_SIZES), num_experts, generator=gen)

    def compute(rows: slice) -> torch.Tensor:
        return moe(
            layer,
            x[rows].clone(),
            use_grouped_topk=False,
            top_k=top_k,
            router_logits=logits[rows],
            renormalize=True,
            global_num_experts=num_experts,
        )

    differ = _rows_that_differ_from_alone(compute)
    assert not differ, f"tokens whose expert output differs from the token alone, by batch size: {differ}"
