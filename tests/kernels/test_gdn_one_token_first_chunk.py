"""The gated-delta-net metadata builder sends a prompt's one-token chunk to the prefill path.

The decode path of the GDN layers (Qwen3.5/3.6, Qwen3-Next) reads the
request's recurrent and convolution state from its state block, and state
blocks are not zeroed when a finished request's block is handed to a new one.
A request whose first chunk is a single token -- a one-token prompt, or the
last token the chunked-prefill budget leaves room for -- must therefore start
from a zero state (the prefill path with no initial state), not from what the
block's previous owner left. End to end, this parted DFlash output from
target-only output behind a hybrid target once the KV cache was small enough
for blocks to be reused (tests/cpu_e2e/test_dflash_families.py).

The builder is driven here as the model runner drives it, on a reordered batch
(decodes first, then the chunks of prompts).
"""

from __future__ import annotations

import pytest
import torch

# The last two tests hold on the base too: the change must not move rows
# that were right where they were.
needs_the_split = pytest.mark.needs_patch("0025")


@pytest.fixture(scope="module")
def builder():
    from vllm.config import VllmConfig
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    spec = MambaSpec(block_size=16, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.float32, torch.float32))
    return GDNAttentionMetadataBuilder(spec, ["layers.0.linear_attn"], VllmConfig(), torch.device("cpu"))


def _batch(rows):
    """CommonAttentionMetadata for ``rows`` of (query_len, seq_len, is_prefilling)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    query_lens = torch.tensor([r[0] for r in rows], dtype=torch.int32)
    seq_lens = torch.tensor([r[1] for r in rows], dtype=torch.int32)
    qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(query_lens, 0)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens,
        num_reqs=len(rows),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.arange(1, len(rows) + 1, dtype=torch.int32)[:, None],
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        _seq_lens_cpu=seq_lens,
        _num_computed_tokens_cpu=seq_lens - query_lens,
        is_prefilling=torch.tensor([r[2] for r in rows]),
    )


def _split(md):
    """Decodes, prefills, and per row whether the prefill path starts from the
    state in the row's block."""
    has_initial = None if md.has_initial_state is None else md.has_initial_state.tolist()
    return md.num_decodes, md.num_prefills, has_initial


@needs_the_split
def test_one_token_first_chunk_starts_from_a_zero_state(builder):
    # A decode (9 tokens computed), then a one-token prompt (nothing computed).
    md = builder.build(0, _batch([(1, 10, False), (1, 1, True)]))
    assert _split(md) == (1, 1, [True, False])


@needs_the_split
def test_one_token_prompts_alone_start_from_a_zero_state(builder):
    md = builder.build(0, _batch([(1, 1, True), (1, 1, True)]))
    assert _split(md) == (0, 2, [False, False])


@needs_the_split
def test_last_one_token_chunk_of_a_prompt_keeps_its_state(builder):
    # A prompt's last chunk after 6 tokens already computed: the prefill path
    # starts from the state those 6 tokens left.
    md = builder.build(0, _batch([(1, 10, False), (1, 7, True), (5, 5, True)]))
    assert _split(md) == (1, 2, [True, True, False])


def test_decodes_stay_decodes(builder):
    md = builder.build(0, _batch([(1, 10, False), (1, 20, False)]))
    assert _split(md) == (2, 0, None)


def test_full_cuda_graphs_without_speculation_keep_the_split_by_shape(builder, monkeypatch):
    # A full CUDA graph of uniform one-token decodes is replayed for any batch
    # of one-token rows: the metadata must then be the decode metadata.
    monkeypatch.setattr(builder, "use_full_cuda_graph", True)
    md = builder.build(0, _batch([(1, 10, False), (1, 1, True)]))
    assert _split(md)[:2] == (2, 0)
