"""fp8 KV cache on CPUs without AVX-512: the AVX2 kernel (patch 0034) and
the torch path (patch 0012).

The base's fp8 cache write and read exist only in its AVX-512/AMX kernels.
The fork routes ``ops.cpu_attn_reshape_and_cache`` and
``ops.cpu_attention_with_kv_cache`` to ``cpu_attn_fp8_avx2`` (compiled on
first use) or, where it does not build, to ``cpu_attn_torch_fp8`` when the
loaded kernels lack fp8. These tests make the ISA probe report neither
AVX-512 nor AMX (what an AVX2-only CPU reports), run every check on each of
the two paths (``[avx2]``, ``[torch]``), and check them through the public
``ops`` entry points against a float64 reference over a paged cache full of
loud stale K/V: causal (target) and non-causal (DFlash draft block) rows,
GQA, k/v scales, sliding window, soft-capping, sinks and ALiBi.
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm import _custom_ops as ops
from vllm.v1.attention.backends import cpu_attn

HEAD_SIZE = 64
NUM_HEADS = 4
NUM_KV_HEADS = 2
BLOCK_SIZE = 16
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# (query_len, seq_len): decode rows, DFlash-sized blocks, block boundaries.
BATCH = [(4, 37), (1, 32), (4, 70), (3, 3), (1, 95)]
# Relative error against float64 attention over the stored values: float32
# outputs are exact up to summation order, bf16 outputs up to their rounding
# (2^-8); a single leaked stale slot moves an output by > 1.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def no_fp8_kernels(monkeypatch):
    """The CPU reports neither AVX-512 nor AMX, as an AVX2-only host does."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)


@pytest.fixture(params=["avx2", "torch"])
def fp8_path(request, monkeypatch):
    """Which path serves fp8 caches here: the AVX2 kernel, or torch."""
    try:
        from vllm.v1.attention.backends import cpu_attn_fp8_avx2
    except ImportError:  # a build without the kernel: the torch path only
        if request.param == "avx2":
            pytest.skip("this build has no AVX2 fp8 kernel")
        return request.param
    if request.param == "torch":
        monkeypatch.setattr(cpu_attn_fp8_avx2, "kernels", lambda: None)
    else:
        try:
            cpu_attn_fp8_avx2.build()
        except cpu_attn_fp8_avx2.BuildError as exc:
            pytest.skip(f"the AVX2 fp8 kernel does not build here: {exc}")
    return request.param


def _stored(x: torch.Tensor, kv_dtype: str, scale: float) -> torch.Tensor:
    """What an fp8 cache holds for x (nearest fp8 value of x / scale), in float64."""
    fp8 = FP8[kv_dtype]
    limit = torch.finfo(fp8).max
    return (x.double() / scale).clamp(-limit, limit).float().to(fp8).double() * scale


class Case:
    def __init__(self, kv_dtype, *, dtype=torch.bfloat16, k_scale=1.0, v_scale=1.0, seed=0, batch=BATCH):
        gen = torch.Generator().manual_seed(seed)
        self.kv_dtype, self.dtype = kv_dtype, dtype
        self.k_scale, self.v_scale = k_scale, v_scale
        # The ISA is what the metadata builder would pick; with the base's
        # refusal gone it is an ordinary one (the torch path ignores it).
        self.isa = cpu_attn._get_attn_isa(dtype, BLOCK_SIZE, HEAD_SIZE, kv_dtype)
        blocks_per_req = [math.ceil(s / BLOCK_SIZE) + 1 for _, s in batch]
        num_blocks = sum(blocks_per_req) + 1
        self.kv_cache = torch.zeros(2, num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE, dtype=torch.uint8)
        order = torch.randperm(num_blocks - 1, generator=gen) + 1
        self.block_table = torch.zeros(len(batch), max(blocks_per_req), dtype=torch.int32)
        start = 0
        for i, n in enumerate(blocks_per_req):
            self.block_table[i, :n] = order[start : start + n]
            start += n
        all_slots = torch.arange(num_blocks * BLOCK_SIZE)
        stale = torch.full((all_slots.numel(), NUM_KV_HEADS, HEAD_SIZE), 4.0, dtype=dtype)
        self._write(stale, stale * 2, all_slots)
        self.keys, self.values, queries = [], [], []
        for i, (query_len, seq_len) in enumerate(batch):
            k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
            v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
            # Padding slots (-1) in the mapping are skipped, as by the kernel.
            slots = torch.cat([self._slots(i, seq_len), torch.tensor([-1])])
            self._write(torch.cat([k, k[:1]]), torch.cat([v, v[:1]]), slots)
            self.keys.append(_stored(k, kv_dtype, k_scale))
            self.values.append(_stored(v, kv_dtype, v_scale))
            queries.append((torch.randn(query_len, NUM_HEADS, HEAD_SIZE, generator=gen) + 1.0).to(dtype))
        self.query = torch.cat(queries)
        lens = torch.tensor([q for q, _ in batch], dtype=torch.int32)
        self.query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
        self.seq_lens = torch.tensor([s for _, s in batch], dtype=torch.int32)

    def _slots(self, req, seq_len):
        pos = torch.arange(seq_len)
        return self.block_table[req, pos // BLOCK_SIZE].to(torch.int64) * BLOCK_SIZE + pos % BLOCK_SIZE

    def _write(self, k, v, slots):
        key_cache, value_cache = self.kv_cache.unbind(0)
        ops.cpu_attn_reshape_and_cache(
            k,
            v,
            key_cache,
            value_cache,
            slots,
            self.isa,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            kv_cache_dtype=self.kv_dtype,
        )

    def attend(
        self,
        query,
        query_start_loc,
        seq_lens,
        block_table,
        causal,
        *,
        sliding_window=(-1, -1),
        softcap=0.0,
        sinks=None,
        alibi=None,
    ):
        """``ops.cpu_attention_with_kv_cache`` of ``query`` over this cache."""
        out = torch.empty_like(query)
        key_cache, value_cache = self.kv_cache.unbind(0)
        ops.cpu_attention_with_kv_cache(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            output=out,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            scale=1 / math.sqrt(HEAD_SIZE),
            causal=causal,
            alibi_slopes=alibi,
            sliding_window=sliding_window,
            block_table=block_table,
            softcap=softcap,
            scheduler_metadata=None,
            s_aux=sinks,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            kv_cache_dtype=self.kv_dtype,
        )
        return out

    def run(self, causal, **features):
        """The whole BATCH, in float64."""
        return self.attend(
            self.query, self.query_start_loc, self.seq_lens, self.block_table, causal, **features
        ).double()

    def reference(self, causal, *, sliding_window=(-1, -1), softcap=0.0, sinks=None, alibi=None):
        """float64 attention over exactly the first seq_len stored keys."""
        out, start, group = [], 0, NUM_HEADS // NUM_KV_HEADS
        for i, (query_len, seq_len) in enumerate(BATCH):
            q = self.query[start : start + query_len].double()
            start += query_len
            k = self.keys[i].repeat_interleave(group, dim=1)
            v = self.values[i].repeat_interleave(group, dim=1)
            s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_SIZE)
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
            k_pos = torch.arange(seq_len)[None, :]
            if alibi is not None:
                s = s + alibi.double()[:, None, None] * (k_pos - q_pos)
            hide = torch.zeros(query_len, seq_len, dtype=torch.bool)
            if causal:
                hide |= k_pos > q_pos
            if sliding_window[0] >= 0:
                hide |= k_pos < q_pos - sliding_window[0]
            s = s.masked_fill(hide, float("-inf"))
            if sinks is not None:
                s = torch.cat([s, sinks.double()[:, None, None].expand(-1, query_len, 1)], -1)
                p = s.softmax(-1)[..., :seq_len]
            else:
                p = s.softmax(-1)
            out.append(torch.einsum("hqk,khd->qhd", p, v))
        return torch.cat(out)


def _err(case, causal, **kw):
    # Output rounding to the model dtype is the only other difference.
    got, want = case.run(causal, **kw), case.reference(causal, **kw)
    return ((got - want).abs() / (1 + want.abs())).max().item()


@pytest.mark.needs_patch("0012", no_avx512_pass=True)
@pytest.mark.parametrize("kv_dtype", list(FP8))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fp8_read_matches_reference(kv_dtype, causal, dtype, fp8_path):
    case = Case(kv_dtype, dtype=dtype, k_scale=0.5, v_scale=2.0)
    err = _err(case, causal)
    print(f"\n[kernel] {fp8_path} fp8 kv={kv_dtype} causal={causal} {dtype}: max rel err {err:.2e}")
    assert err < TOLERANCE[dtype], f"the {fp8_path} fp8 path differs from the reference ({err:.3f})"


@pytest.mark.parametrize(
    "feature",
    [
        {"sliding_window": (20, 0)},
        {"softcap": 5.0},
        {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])},
        {"alibi": torch.tensor([0.1, 0.05, 0.02, 0.01])},
    ],
    ids=["sliding_window", "softcap", "sinks", "alibi"],
)
def test_fp8_read_attention_features(feature, fp8_path):
    case = Case("fp8", dtype=torch.float32)
    assert _err(case, True, **feature) < TOLERANCE[torch.float32]


@pytest.mark.needs_patch("0012")
def test_fp8_isa_is_not_refused_without_avx512_or_amx():
    """The base refuses fp8 here ("requires x86 with AVX-512 or AMX")."""
    assert cpu_attn._get_attn_isa(torch.bfloat16, 128, 64, "fp8") in ("vec", "vec16", "neon", "vxe", "vsx")


def test_cache_holds_fp8_bytes_of_value_over_scale(fp8_path):
    """The cache layout the torch path owns: byte-exact fp8 of x / scale at
    [block, head, slot % block_size]."""
    case = Case("fp8_e5m2", dtype=torch.float32, k_scale=0.25)
    req, pos = 2, 40
    block = int(case.block_table[req, pos // BLOCK_SIZE])
    raw = case.kv_cache[0, block, :, pos % BLOCK_SIZE]
    assert torch.equal(raw.view(torch.float8_e5m2).double() * 0.25, case.keys[req][pos])


@pytest.mark.needs_patch("0012", no_avx512_pass=True)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_every_fp8_byte_reads_back_as_torch_converts_it(fp8):
    """The read converts fp8 bytes by moving their bits into float32s, not
    through torch's conversion: every one of the 256 bytes (subnormals,
    zeros of both signs, NaN and, in e5m2, infinities included) times a
    scale gives torch's value, bit for bit."""
    from vllm.v1.attention.backends.cpu_attn_torch_fp8 import dequantize

    every_byte = torch.arange(256, dtype=torch.uint8)
    for scale in (1.0, 0.37, 3.0e-3, 17.0):
        got = dequantize(every_byte, scale, fp8)
        want = every_byte.view(fp8).float() * scale
        same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
        assert same.all(), (scale, every_byte[~same].tolist(), got[~same].tolist(), want[~same].tolist())


_CHILD = """
import torch
from vllm.platforms import current_platform
from vllm.v1.attention.backends.cpu_attn_torch_fp8 import uses_torch_fp8_kv
current_platform.import_kernels()
libs = sorted({line.rsplit("/", 1)[-1].strip() for line in open("/proc/self/maps") if "/vllm/_C" in line})
print(torch.cpu._is_avx512_supported(), torch.cpu._is_amx_tile_supported(), uses_torch_fp8_kv("fp8"), libs)
"""


def test_no_avx512_mode_reaches_child_processes():
    """VLLM_FORK_TEST_NO_AVX512=1 (tests/support/no_avx512) holds in every
    process of a run: a fresh interpreter sees no AVX-512/AMX, loads the AVX2
    kernel library and sends fp8 caches to the torch path."""
    import os
    import subprocess
    import sys

    from repo_paths import SUPPORT

    override = SUPPORT / "no_avx512"
    env = {
        **os.environ,
        "VLLM_FORK_TEST_NO_AVX512": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(override), os.environ.get("PYTHONPATH")])),
    }
    p = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stderr[-3000:]}"
    line = p.stdout.strip().splitlines()[-1]
    print(f"\n[kernel] child under VLLM_FORK_TEST_NO_AVX512=1: {line}")
    assert line == "False False True ['_C_AVX2.abi3.so']", line


@pytest.mark.needs_patch("0012", no_avx512_pass=True)
def test_a_verified_token_is_computed_as_the_same_token_decoded_alone(fp8_path):
    """Speculative decoding is lossless only if the target computes a token
    verified among k + 1 positions exactly as it computes that token decoded
    alone: a last-bit difference, rounded into the fp8 cache with the next
    keys and values, can grow until greedy outputs part. (Behind a gpt-oss
    target served with DFlash, outputs still parted on this path after this
    was fixed: the linear layers' products depend on the batch's shape too.)"""
    case = Case("fp8", dtype=torch.float32)
    query_len, seq_len = BATCH[0]
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    verified = case.attend(case.query, case.query_start_loc, case.seq_lens, case.block_table, True, sinks=sinks)
    verified = verified[:query_len]
    for i in range(query_len):
        alone = case.attend(
            case.query[i : i + 1],
            torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([seq_len - query_len + 1 + i], dtype=torch.int32),
            case.block_table[:1],
            True,
            sinks=sinks,
        )
        assert torch.equal(verified[i], alone[0]), f"row {i}: max diff {(verified[i] - alone[0]).abs().max():.3g}"


@pytest.mark.parametrize(
    "cut",
    [
        # The last 4 positions after a hit on 7 cached 128-token blocks: a
        # decode-sized chunk, which the base computes row by row.
        pytest.param(896, id="prefix-cache-hit", marks=pytest.mark.needs_patch("0032")),
        pytest.param(450, id="two-chunks"),
    ],
)
def test_in_batch_invariant_mode_a_prompt_computed_in_chunks_is_computed_as_whole(monkeypatch, cut, fp8_path):
    """With ``VLLM_BATCH_INVARIANT=1`` a request's output must not depend on
    how the scheduler cut its prompt: whole, in chunks beside other requests,
    or after a prefix-cache hit. Rows of a long prefill chunk are then
    computed one position at a time too, as decode rows are (a product over
    900 keys is summed in another order than one over fewer)."""
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    prompt_len = 900
    case = Case("fp8", dtype=torch.float32, batch=[(prompt_len, prompt_len)])

    def attend(first: int, last: int) -> torch.Tensor:
        """The prompt's positions first..last-1, over the keys up to last - 1."""
        return case.attend(
            case.query[first:last],
            torch.tensor([0, last - first], dtype=torch.int32),
            torch.tensor([last], dtype=torch.int32),
            case.block_table,
            True,
        )

    whole = attend(0, prompt_len)
    chunked = torch.cat([attend(0, cut), attend(cut, prompt_len)])
    differ = (whole != chunked).any(-1).any(-1).nonzero().flatten().tolist()
    assert not differ, f"positions computed otherwise in chunks: {differ[:10]}... ({len(differ)})"
