"""Speculative decoding in the CPU gated-delta-net attention op.

Runs ``cpu_gdn_attention_core`` on a small fake GDN layer, with metadata from
the real ``GDNAttentionMetadataBuilder`` and a real ``ForwardContext``, and
compares a speculative (verification) step against decoding the same tokens
one at a time through the plain decode path, in float32: the per-token
outputs, the SSM state kept for every token, the conv window, the step after
that from the last accepted token, and mixed batches (prefill, plain decode
and spec requests together).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm.config import CUDAGraphMode
from vllm.forward_context import ForwardContext, override_forward_context
from vllm.model_executor.layers.mamba import mamba_utils
from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as gdn
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import MambaSpec

pytestmark = pytest.mark.needs_patch("0023")

PREFIX = "model.layers.0.linear_attn"
NUM_K_HEADS, NUM_V_HEADS, HEAD_K_DIM, HEAD_V_DIM = 2, 4, 8, 8
KEY_DIM, VALUE_DIM = NUM_K_HEADS * HEAD_K_DIM, NUM_V_HEADS * HEAD_V_DIM
CONV_DIM = 2 * KEY_DIM + VALUE_DIM
CONV_KERNEL = 4
NUM_SPEC = 3
NUM_SLOTS = 40
# Same math as the sequential decode; only the last bit may differ, because
# torch's elementwise CPU kernels (exp, softplus, ...) take a vectorized or a
# scalar path depending on a tensor's size, and the batches differ in size.
EXACT = dict(rtol=1e-6, atol=1e-6)
# The chunked prefill kernel and the recurrent decode kernel differ in the
# order of float operations.
CLOSE = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(autouse=True, params=["SD", "DS"])
def conv_layout(request, monkeypatch):
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", request.param)
    mamba_utils.get_conv_state_layout.cache_clear()
    yield request.param
    mamba_utils.get_conv_state_layout.cache_clear()


class FakeGDNLayer(torch.nn.Module):
    """What the op reads from a GatedDeltaNetAttention layer."""

    def __init__(self, num_spec: int, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.prefix = PREFIX
        self.activation = "silu"
        self.conv1d = torch.nn.Conv1d(CONV_DIM, CONV_DIM, CONV_KERNEL, groups=CONV_DIM, bias=True)
        with torch.no_grad():
            self.conv1d.weight.copy_(torch.randn(self.conv1d.weight.shape, generator=gen) * 0.5)
            self.conv1d.bias.copy_(torch.randn(CONV_DIM, generator=gen) * 0.1)
        self.A_log = torch.randn(NUM_V_HEADS, generator=gen) * 0.5
        self.dt_bias = torch.randn(NUM_V_HEADS, generator=gen) * 0.5
        state_len = CONV_KERNEL - 1 + num_spec
        if mamba_utils.is_conv_state_dim_first():
            conv_state = torch.randn(NUM_SLOTS, CONV_DIM, state_len, generator=gen)
        else:
            conv_state = torch.randn(NUM_SLOTS, state_len, CONV_DIM, generator=gen)
        ssm_state = torch.randn(NUM_SLOTS, NUM_V_HEADS, HEAD_V_DIM, HEAD_K_DIM, generator=gen)
        self.kv_cache = [conv_state, ssm_state * 0.3]

    def rearrange_mixed_qkv(self, mixed_qkv):
        seq_len = mixed_qkv.shape[0]
        query, key, value = torch.split(mixed_qkv, [KEY_DIM, KEY_DIM, VALUE_DIM], -1)
        return (
            query.reshape(1, seq_len, -1, HEAD_K_DIM).contiguous(),
            key.reshape(1, seq_len, -1, HEAD_K_DIM).contiguous(),
            value.reshape(1, seq_len, -1, HEAD_V_DIM).contiguous(),
        )

    def conv_state(self) -> torch.Tensor:
        """[num_slots, conv_dim, state_len] view, whatever the layout."""
        conv_state = self.kv_cache[0]
        if mamba_utils.is_conv_state_dim_first():
            return conv_state
        return conv_state.transpose(-1, -2)

    def ssm_state(self) -> torch.Tensor:
        return self.kv_cache[1]


def make_builder(num_spec: int) -> GDNAttentionMetadataBuilder:
    vllm_config = SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.NONE, max_cudagraph_capture_size=None),
        speculative_config=(
            SimpleNamespace(num_speculative_tokens=num_spec, parallel_drafting=False) if num_spec else None
        ),
        scheduler_config=SimpleNamespace(max_num_seqs=16),
        cache_config=SimpleNamespace(mamba_cache_mode="none"),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
    )
    kv_cache_spec = MambaSpec(
        block_size=16,
        shapes=((CONV_KERNEL - 1 + num_spec, CONV_DIM), (NUM_V_HEADS, 8, 8)),
        dtypes=(torch.float32, torch.float32),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        num_speculative_blocks=num_spec,
    )
    return GDNAttentionMetadataBuilder(kv_cache_spec, [PREFIX], vllm_config, torch.device("cpu"))


def build_metadata(
    builder,
    query_lens,
    num_computed,
    block_table,
    num_decode_draft_tokens=None,
    num_accepted_tokens=None,
):
    """Metadata the model runner would build. Without num_decode_draft_tokens
    (no request has drafts this step) there are no spec requests."""
    query_lens = torch.tensor(query_lens, dtype=torch.int32)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    seq_lens = torch.tensor(num_computed, dtype=torch.int32) + query_lens
    num_tokens = int(query_lens.sum())
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=seq_lens,
        num_reqs=len(query_lens),
        num_actual_tokens=num_tokens,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.tensor(block_table, dtype=torch.int32),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
    )
    kwargs = {}
    if num_decode_draft_tokens is not None:
        kwargs = dict(
            num_accepted_tokens=torch.tensor(num_accepted_tokens, dtype=torch.int32),
            num_decode_draft_tokens_cpu=torch.tensor(num_decode_draft_tokens, dtype=torch.int32),
        )
    return builder.build(0, common, **kwargs)


def run_op(module, layer, metadata, mixed_qkv, b, a) -> torch.Tensor:
    out = torch.zeros(mixed_qkv.shape[0], NUM_V_HEADS, HEAD_V_DIM)
    context = ForwardContext(
        no_compile_layers={PREFIX: layer},
        attn_metadata={PREFIX: metadata},
        slot_mapping={},
    )
    with override_forward_context(context):
        module.cpu_gdn_attention_core(mixed_qkv.clone(), b.clone(), a.clone(), out, PREFIX)
    return out


def random_tokens(gen, num_tokens):
    return (
        torch.randn(num_tokens, CONV_DIM, generator=gen),
        torch.randn(num_tokens, NUM_V_HEADS, generator=gen),
        torch.randn(num_tokens, NUM_V_HEADS, generator=gen),
    )


def block_tables(num_reqs, num_spec=NUM_SPEC):
    # Slot 0 is the null block.
    return [[1 + r * (num_spec + 1) + j for j in range(num_spec + 1)] for r in range(num_reqs)]


def sequential_reference(module, layer, slots, token_seqs):
    """Decode each request's tokens one at a time through the plain decode
    path of a non-speculative model (conv state kernel - 1 wide, one slot
    per request), starting from `layer`'s states at `slots`.

    Returns, per request and token: (output, ssm state, conv window after it).
    """
    ref = FakeGDNLayer(num_spec=0)
    ref.conv1d, ref.A_log, ref.dt_bias = layer.conv1d, layer.A_log, layer.dt_bias
    ref_slots = list(range(1, len(slots) + 1))
    for slot, ref_slot in zip(slots, ref_slots):
        ref.conv_state()[ref_slot] = layer.conv_state()[slot, :, : CONV_KERNEL - 1]
        ref.ssm_state()[ref_slot] = layer.ssm_state()[slot]
    builder = make_builder(num_spec=0)
    results = [[] for _ in slots]
    for t in range(max(len(seq[0]) for seq in token_seqs)):
        live = [r for r, seq in enumerate(token_seqs) if len(seq[0]) > t]
        metadata = build_metadata(
            builder,
            query_lens=[1] * len(live),
            num_computed=[100] * len(live),
            block_table=[[ref_slots[r]] for r in live],
        )
        assert metadata.num_decodes == len(live) and metadata.num_prefills == 0
        x, b, a = (torch.stack([token_seqs[r][i][t] for r in live]) for i in range(3))
        out = run_op(module, ref, metadata, x, b, a)
        for i, r in enumerate(live):
            results[r].append(
                (
                    out[i].clone(),
                    ref.ssm_state()[ref_slots[r]].clone(),
                    ref.conv_state()[ref_slots[r]].clone(),
                )
            )
    return results


class SpecRun:
    """Speculative steps of a few requests on one layer, checked against the
    sequential reference that was only fed the accepted tokens."""

    def __init__(self, module, num_reqs, seed=0):
        self.module = module
        self.layer = FakeGDNLayer(num_spec=NUM_SPEC, seed=seed)
        self.initial = FakeGDNLayer(num_spec=NUM_SPEC, seed=seed)
        self.builder = make_builder(NUM_SPEC)
        self.block_table = block_tables(num_reqs)
        self.accepted = [([], [], []) for _ in range(num_reqs)]
        self.num_accepted = [1] * num_reqs
        self.gen = torch.Generator().manual_seed(seed + 1)

    def step(self, query_lens, num_accepted_next):
        tokens = [random_tokens(self.gen, n) for n in query_lens]
        x, b, a = (torch.cat([t[i] for t in tokens]) for i in range(3))
        metadata = build_metadata(
            self.builder,
            query_lens=query_lens,
            num_computed=[50] * len(query_lens),
            block_table=self.block_table,
            num_decode_draft_tokens=[n - 1 for n in query_lens],
            num_accepted_tokens=self.num_accepted,
        )
        assert metadata.num_spec_decodes == len(query_lens)
        assert metadata.num_prefills == 0 and metadata.num_decodes == 0
        out = run_op(self.module, self.layer, metadata, x, b, a)

        reference = sequential_reference(
            self.module,
            self.initial,
            [row[0] for row in self.block_table],
            [tuple(acc + list(new) for acc, new in zip(hist, tok)) for hist, tok in zip(self.accepted, tokens)],
        )
        start = 0
        for r, n in enumerate(query_lens):
            history = len(self.accepted[r][0])
            slot0 = self.block_table[r][0]
            for t in range(n):
                ref_out, ref_ssm, ref_conv = reference[r][history + t]
                torch.testing.assert_close(out[start + t], ref_out, **EXACT)
                # The state after token t is in the slot of column t ...
                torch.testing.assert_close(self.layer.ssm_state()[self.block_table[r][t]], ref_ssm, **EXACT)
                # ... and the conv window ending with token t starts at
                # column t of the column-0 slot.
                torch.testing.assert_close(
                    self.layer.conv_state()[slot0, :, t : t + CONV_KERNEL - 1],
                    ref_conv,
                    **EXACT,
                )
            start += n

        for r, n in enumerate(num_accepted_next):
            assert 1 <= n <= query_lens[r]
            for i in range(3):
                self.accepted[r][i].extend(tokens[r][i][:n])
        self.num_accepted = list(num_accepted_next)
        return out


def test_verification_step_matches_sequential_decode():
    """(a) One verification step: outputs and per-token states."""
    run = SpecRun(gdn, num_reqs=3)
    run.step(query_lens=[NUM_SPEC + 1, 2, NUM_SPEC + 1], num_accepted_next=[1, 1, 1])


def test_next_steps_resume_from_last_accepted_token():
    """(b) Steps after a verification step start from the state after the
    last accepted token, for every possible number of accepted tokens."""
    full = NUM_SPEC + 1
    run = SpecRun(gdn, num_reqs=4, seed=3)
    run.step(query_lens=[full] * 4, num_accepted_next=[1, 2, 3, 4])
    run.step(query_lens=[full, full, 2, full], num_accepted_next=[4, 3, 2, 1])
    # A request without drafts still runs as a spec request (one token).
    run.step(query_lens=[full, 1, full, full], num_accepted_next=[2, 1, 4, 3])
    run.step(query_lens=[full] * 4, num_accepted_next=[1] * 4)


def test_mixed_batch_matches_separate_runs():
    """(c) Spec decodes, a one-token non-spec request and a new prefill in
    one batch give what each of them gives alone."""
    gen = torch.Generator().manual_seed(7)
    mixed = FakeGDNLayer(num_spec=NUM_SPEC, seed=5)
    alone = FakeGDNLayer(num_spec=NUM_SPEC, seed=5)
    builder = make_builder(NUM_SPEC)
    table = block_tables(4)
    # [spec (4 tokens), non-spec (1 token), spec (2 tokens), prefill (6)]
    query_lens = [4, 1, 2, 6]
    num_computed = [30, 12, 40, 0]
    draft_tokens = [3, -1, 1, -1]
    num_accepted = [2, 1, 3, 1]
    x, b, a = random_tokens(gen, sum(query_lens))
    metadata = build_metadata(builder, query_lens, num_computed, table, draft_tokens, num_accepted)
    assert metadata.num_spec_decodes == 2
    # The non-spec one-token request is classified as a prefill.
    assert metadata.num_prefills == 2 and metadata.num_decodes == 0
    out = run_op(gdn, mixed, metadata, x, b, a)

    bounds = [0, 4, 5, 7, 13]
    rows = lambda *reqs: torch.cat(  # noqa: E731
        [torch.arange(bounds[r], bounds[r + 1]) for r in reqs]
    )
    expected = torch.zeros_like(out)
    spec_rows = rows(0, 2)
    spec_md = build_metadata(
        builder,
        [4, 2],
        [30, 40],
        [table[0], table[2]],
        [3, 1],
        [2, 3],
    )
    expected[spec_rows] = run_op(gdn, alone, spec_md, x[spec_rows], b[spec_rows], a[spec_rows])
    for r in (1, 3):
        r_rows = rows(r)
        md = build_metadata(builder, [query_lens[r]], [num_computed[r]], [table[r]])
        assert (md.num_decodes, md.num_prefills) == ((1, 0) if r == 1 else (0, 1))
        expected[r_rows] = run_op(gdn, alone, md, x[r_rows], b[r_rows], a[r_rows])

    torch.testing.assert_close(out[spec_rows], expected[spec_rows], **EXACT)
    torch.testing.assert_close(out, expected, **CLOSE)
    torch.testing.assert_close(mixed.ssm_state(), alone.ssm_state(), **CLOSE)
    torch.testing.assert_close(mixed.conv_state(), alone.conv_state(), **CLOSE)


def test_plain_decode_with_spec_sized_conv_state():
    """With speculative decoding on, a step where no request has drafts runs
    the plain decode path on the wider conv state; it must keep the window
    in the columns where prefill wrote it and a spec step reads it."""
    gen = torch.Generator().manual_seed(11)
    layer = FakeGDNLayer(num_spec=NUM_SPEC, seed=9)
    builder = make_builder(NUM_SPEC)
    table = block_tables(2)
    prompt_lens = [5, 3]
    prompt = random_tokens(gen, sum(prompt_lens))
    decode = random_tokens(gen, 2)
    spec = random_tokens(gen, 2 * (NUM_SPEC + 1))

    # Reference: every token one at a time, from zero states.
    initial = FakeGDNLayer(num_spec=NUM_SPEC, seed=9)
    seqs = []
    for r, (p0, p1) in enumerate([(0, 5), (5, 8)]):
        initial.conv_state()[table[r][0]] = 0
        initial.ssm_state()[table[r][0]] = 0
        s0, s1 = r * (NUM_SPEC + 1), (r + 1) * (NUM_SPEC + 1)
        seqs.append(tuple(torch.cat([prompt[i][p0:p1], decode[i][r : r + 1], spec[i][s0:s1]]) for i in range(3)))
    reference = sequential_reference(gdn, initial, [row[0] for row in table], seqs)

    md = build_metadata(builder, prompt_lens, [0, 0], table)
    assert md.num_prefills == 2
    run_op(gdn, layer, md, *prompt)

    md = build_metadata(builder, [1, 1], prompt_lens, table)
    assert md.num_decodes == 2 and md.spec_sequence_masks is None
    out = run_op(gdn, layer, md, *decode)
    for r, plen in enumerate(prompt_lens):
        torch.testing.assert_close(out[r], reference[r][plen][0], **CLOSE)

    md = build_metadata(
        builder,
        [NUM_SPEC + 1] * 2,
        [n + 1 for n in prompt_lens],
        table,
        [NUM_SPEC] * 2,
        [1, 1],
    )
    out = run_op(gdn, layer, md, *spec)
    for r, plen in enumerate(prompt_lens):
        for t in range(NUM_SPEC + 1):
            torch.testing.assert_close(out[r * (NUM_SPEC + 1) + t], reference[r][plen + 1 + t][0], **CLOSE)
