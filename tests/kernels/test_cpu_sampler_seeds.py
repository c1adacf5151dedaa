"""A seeded request keeps its seed on CPU whatever it is batched with.

TopKTopPSampler.forward_cpu samples a batch; requests with a seed bring a
torch.Generator each. The seeded request's token must come from its own
generator whether the other rows of the batch are seeded or not: the same
seed, the same token, alone or next to unseeded requests (vLLM's serving
mixes them freely). The vocabulary is wide and flat, so a token drawn from
the global generator instead matches by chance with probability 1/VOCAB.
"""

from __future__ import annotations

import pytest
import torch

VOCAB = 4096
SEEDS = (0, 1, 2, 3, 4)


def _sample(logits: torch.Tensor, generators: dict[int, torch.Generator]) -> list[int]:
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    tokens, _ = TopKTopPSampler().forward_cpu(logits.clone(), generators, None, None)
    return tokens.tolist()


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.needs_patch("0020")
def test_seeded_row_keeps_its_seed_next_to_unseeded_rows():
    logits = torch.zeros(3, VOCAB)
    alone, mixed = [], []
    for seed in SEEDS:
        alone.append(_sample(logits[:1], {0: _generator(seed)})[0])
        torch.manual_seed(1000 + seed)  # the global generator differs from the request's
        mixed.append(_sample(logits, {0: _generator(seed)})[0])
    assert mixed == alone, f"seeded row next to unseeded ones: {mixed}, alone: {alone}"


def test_fully_seeded_batch_uses_every_generator():
    logits = torch.zeros(2, VOCAB)
    first = _sample(logits, {0: _generator(7), 1: _generator(8)})
    again = _sample(logits, {0: _generator(7), 1: _generator(8)})
    assert first == again
    assert first == [_sample(logits[:1], {0: _generator(7)})[0], _sample(logits[:1], {0: _generator(8)})[0]]
