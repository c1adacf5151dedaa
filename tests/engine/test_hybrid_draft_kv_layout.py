"""The KV cache layout of a hybrid target (gated delta net + attention) with a
DFlash drafter whose attention pages differ from the target's.

A hybrid target lays every KV cache page out at one size: the attention block
is made large enough that its page holds a layer's recurrent state, and the
state page is padded to it. A drafter's attention page differs from that
whenever its cache dtype does (fp8 target + bf16 drafter, the usual choice
behind Qwen3.6-35B-A3B-FP8) or its head shape does (a z-lab drafter is a
Qwen3-style model of its own). On 0.21.0 such a layout fails at engine start
(``assert new_spec.page_size_bytes == max_page_size`` in
unify_kv_cache_spec_page_size: vllm-project/vllm#43626, #46480), or splits
the drafter's layers over several KV cache groups ("All drafting layers
should belong to the same kv cache group").

Checked here on the layout functions the engine calls, with the specs a
Qwen3.6-35B-A3B-shaped target and a tiny test family give (no engine starts):
a larger drafter page gets blocks of fewer tokens where that is a multiple
of 16, so the target's layout stays what it is without a drafter (else the
state pages are padded to the drafter's page); a smaller one gets blocks of
more tokens; the drafter's layers share one group; and prefix caching hashes at a
granularity every group's block divides. Served end to end (outputs, prefix
cache hits): tests/cpu_e2e/test_dflash_families.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

# Each test marked with the patch fails without it; the others hold on both.
needs_layout_patch = pytest.mark.needs_patch("0029")

FP8 = torch.uint8  # how vLLM stores an fp8 KV cache


def _kv_utils():
    import vllm.v1.core.kv_cache_utils as kv_cache_utils

    return kv_cache_utils


def _attention(block_size: int, kv_heads: int, head: int, dtype: torch.dtype):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads, head_size=head, dtype=dtype)


def _state(page: int, block_size: int, padded: int | None, mode: str = "none"):
    from vllm.v1.kv_cache_interface import MambaSpec

    # A gated-delta-net layer's state: a conv state and a recurrent state.
    conv = page // 8
    return MambaSpec(
        shapes=((conv,), ((page - conv * 2) // 4,)),
        dtypes=(torch.bfloat16, torch.float32),
        block_size=block_size,
        page_size_padded=padded,
        mamba_cache_mode=mode,
    )


def _hybrid(
    num_target_layers: int,
    attention_every: int,
    target_attn,
    state_page: int,
    *,
    draft_layers: int,
    draft_attn,
    mode: str = "none",
) -> tuple[dict, int]:
    """Specs named as vLLM names a Qwen3.5/3.6 target's layers and a DFlash
    drafter's (numbered after the target's), with the state page padded to
    the target's attention page as the platform pads it."""
    assert target_attn.page_size_bytes >= state_page
    specs = {}
    for i in range(num_target_layers):
        if (i + 1) % attention_every == 0:
            specs[f"language_model.model.layers.{i}.self_attn.attn"] = target_attn
        else:
            specs[f"language_model.model.layers.{i}.linear_attn"] = _state(
                state_page, target_attn.block_size if mode == "align" else 4096, target_attn.page_size_bytes, mode
            )
    for i in range(draft_layers):
        specs[f"model.layers.{num_target_layers + i}.self_attn.attn"] = draft_attn
    return specs, num_target_layers


def _groups(specs: dict, num_target_layers: int, *, speculative: bool = True):
    vllm_config = SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        speculative_config=SimpleNamespace(use_eagle=lambda: True) if speculative else None,
        model_config=SimpleNamespace(get_total_num_hidden_layers=lambda: num_target_layers),
    )
    return _kv_utils().get_kv_cache_groups(vllm_config, specs)


def _draft_groups(groups) -> set[int]:
    return {i for i, g in enumerate(groups) for name in g.layer_names if name.startswith("model.layers.")}


def _spec_of(groups, prefix: str):
    return next(g.kv_cache_spec for g in groups for n in g.layer_names if n.startswith(prefix) and "self_attn" in n)


def _qwen3_6_35b_a3b(
    draft_dtype: torch.dtype, target_dtype: torch.dtype = FP8, *, draft_kv_heads: int = 4, draft_head: int = 128
):
    """Qwen3.6-35B-A3B: 40 layers, full attention every 4th (2 KV heads of
    256), gated delta net otherwise (a state of about 1.1 MB); its z-lab
    drafter: 6 layers, served as full attention by 0.21.0, Qwen3-style heads
    (4 of 128 assumed: 1024 elements per token, as the target's)."""
    state_page = 8192 * 3 * 2 + 32 * 128 * 128 * 2
    per_token = 2 * 2 * 256 * torch.empty(0, dtype=target_dtype).element_size()
    block = 16 * -(-state_page // (16 * per_token))
    return _hybrid(
        40,
        4,
        _attention(block, 2, 256, target_dtype),
        state_page,
        draft_layers=6,
        draft_attn=_attention(block, draft_kv_heads, draft_head, draft_dtype),
    )


@needs_layout_patch
@pytest.mark.parametrize(
    "draft_dtype, draft_kv_heads",
    [
        (torch.bfloat16, 4),  # fp8 target + bf16 drafter: the usual choice
        (FP8, 8),  # fp8 both, a drafter with twice the target's elements per token (#46480)
    ],
)
def test_qwen3_6_35b_a3b_with_a_larger_drafter_page(draft_dtype, draft_kv_heads):
    """Every page one size, the drafter's layers in one group. Here the
    target's attention block (1072 tokens) halved is no multiple of 16, so
    the drafter's blocks cannot shrink to fit: the state pages are padded to
    the drafter's page and the target's attention blocks take twice the
    tokens (what vLLM does after vllm-project/vllm#45207)."""
    specs, n = _qwen3_6_35b_a3b(draft_dtype, draft_kv_heads=draft_kv_heads)
    target_before = specs["language_model.model.layers.3.self_attn.attn"]
    groups = _groups(specs, n)
    pages = {g.kv_cache_spec.page_size_bytes for g in groups}
    draft, target = _spec_of(groups, "model.layers."), _spec_of(groups, "language_model.")
    print(
        f"\n[layout] {len(groups)} groups; target attention block {target_before.block_size} -> "
        f"{target.block_size}, drafter block {draft.block_size}, pages {pages}"
    )
    assert len(pages) == 1
    assert len(_draft_groups(groups)) == 1
    assert draft.page_size_bytes == 2 * target_before.page_size_bytes
    assert target.block_size == 2 * target_before.block_size


@needs_layout_patch
@pytest.mark.parametrize(
    "target_dtype, draft_dtype, draft_block",
    [
        (FP8, torch.float32, 32),  # drafter pages 4x the target's: blocks of a quarter
        (torch.float32, FP8, 512),  # a quarter: blocks of 4x the tokens
    ],
)
def test_tiny_family_layouts(target_dtype, draft_dtype, draft_block):
    """The hybrid test families (tiny_families qwen3_5, qwen3_5_moe): 3 gated
    delta net layers and 1 attention layer, 2 drafter layers, heads as the
    target's, 128-token blocks, float32 model. A larger drafter page gets
    blocks of fewer tokens (a multiple of 16: every attention backend has a
    kernel for it), so the target's layout stays as without a drafter and
    the state pages are not padded further; a smaller one, blocks of more."""
    specs, n = _hybrid(
        4,
        4,
        _attention(128, 2, 64, target_dtype),
        20000,
        draft_layers=2,
        draft_attn=_attention(128, 2, 64, draft_dtype),
    )
    groups = _groups(specs, n)
    assert len({g.kv_cache_spec.page_size_bytes for g in groups}) == 1
    assert len(_draft_groups(groups)) == 1, [g.layer_names for g in groups]
    assert _spec_of(groups, "model.layers.").block_size == draft_block
    assert _spec_of(groups, "language_model.").block_size == 128
    assert {g.kv_cache_spec.page_size_bytes for g in groups} == {
        specs["language_model.model.layers.3.self_attn.attn"].page_size_bytes
    }


@needs_layout_patch
def test_a_drafter_block_too_small_to_shrink_pads_the_state_pages_instead():
    """Where the drafter's block cannot shrink to a multiple of 16 tokens (a
    size every attention backend has a kernel for), the other pages grow to
    the drafter's: the state pages are padded, the target's attention blocks
    take more tokens."""
    specs, n = _hybrid(
        4, 4, _attention(16, 2, 64, FP8), 2000, draft_layers=2, draft_attn=_attention(16, 2, 64, torch.bfloat16)
    )
    groups = _groups(specs, n)
    draft_page = _attention(16, 2, 64, torch.bfloat16).page_size_bytes
    assert {g.kv_cache_spec.page_size_bytes for g in groups} == {draft_page}
    assert _spec_of(groups, "language_model.").block_size == 32
    assert len(_draft_groups(groups)) == 1


def test_without_a_drafter_the_layout_is_unchanged():
    specs, n = _hybrid(8, 4, _attention(128, 2, 64, FP8), 20000, draft_layers=0, draft_attn=_attention(128, 2, 64, FP8))
    groups = _groups(specs, n, speculative=False)
    assert sorted(len(g.layer_names) for g in groups) == [2, 2, 2, 2]
    assert {g.kv_cache_spec.block_size for g in groups if "self_attn" in g.layer_names[0]} == {128}


@needs_layout_patch
def test_prefix_caching_hashes_at_a_size_every_group_divides():
    """With prefix caching the state cache runs in "align" mode, its blocks
    as large as the target's attention blocks; the engine sets
    cache_config.block_size to the smallest group's, the drafter's. Block
    hashes are taken at the greatest common divisor of the groups' blocks
    (on the base, the state groups' blocks looked "not aligned" beside that
    smaller size, hashing fell back to the scheduler's block size, which the
    drafter's blocks do not divide, and the engine failed to start)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig

    specs, n = _hybrid(
        4,
        4,
        _attention(128, 2, 64, FP8),
        20000,
        draft_layers=2,
        draft_attn=_attention(128, 2, 64, torch.float32),
        mode="align",
    )
    groups = _groups(specs, n)
    config = KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=groups)
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(
            block_size=min(g.kv_cache_spec.block_size for g in groups),
            enable_prefix_caching=True,
            hash_block_size=None,
            mamba_cache_mode="align",
        ),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
        kv_transfer_config=None,
    )
    scheduler_block, hash_block = _kv_utils().resolve_kv_cache_block_sizes(config, vllm_config)
    sizes = sorted({g.kv_cache_spec.block_size for g in groups})
    print(f"\n[layout] group block sizes {sizes}: scheduler {scheduler_block}, hashes {hash_block}")
    assert (scheduler_block, hash_block) == (128, 32)
    assert all(s % hash_block == 0 for s in sizes)


def _gpt_oss(num_target_layers: int, draft_layers: int) -> tuple[dict, int]:
    """gpt-oss: sliding-window and full attention alternating, both with the
    target's heads; a DFlash drafter's full-attention layers with the same
    heads share the spec of the target's full-attention layers."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    full = _attention(16, 8, 64, FP8)
    sliding = SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=64, dtype=FP8, sliding_window=128)
    specs = {f"model.layers.{i}.attn.attn": sliding if i % 2 == 0 else full for i in range(num_target_layers)}
    for i in range(draft_layers):
        specs[f"model.layers.{num_target_layers + i}.self_attn.attn"] = full
    return specs, num_target_layers


def _drafter_group_of(groups, num_target_layers: int) -> set[int]:
    return {i for i, g in enumerate(groups) for name in g.layer_names if int(name.split(".")[2]) >= num_target_layers}


@needs_layout_patch
@pytest.mark.parametrize(
    "num_target_layers, draft_layers",
    [(4, 2), (24, 8)],
    ids=["tiny-family", "gpt-oss-20b-8-layer-drafter"],
)
def test_a_drafter_sharing_the_full_attention_spec_of_a_sliding_window_target_keeps_one_group(
    num_target_layers, draft_layers
):
    """More full-attention layers (the target's and the drafter's) than 1.5
    times the sliding-window ones: the full-attention bucket is split, and
    split with the target's layers the drafter's landed in several groups."""
    specs, n = _gpt_oss(num_target_layers, draft_layers)
    groups = _groups(specs, n)
    print(
        f"\n[layout] gpt-oss {n} layers + {draft_layers}-layer drafter: "
        + ", ".join(f"{len(g.layer_names)} {type(g.kv_cache_spec).__name__}" for g in groups)
    )
    assert len(_drafter_group_of(groups, n)) == 1
    drafter_group = groups[_drafter_group_of(groups, n).pop()]
    assert all(int(name.split(".")[2]) >= n for name in drafter_group.layer_names)


def test_an_eagle_layer_beside_gpt_oss_stays_in_the_full_attention_group():
    """12 sliding + 13 full (gpt-oss-20b with a one-layer EAGLE head): one
    group each (the sliding one padded to 13 layers), as on the base; the
    drafter's layer is not split off into a group of its own."""
    specs, n = _gpt_oss(24, 1)
    groups = _groups(specs, n)
    assert sorted(len(g.layer_names) for g in groups) == [12, 13]
